/* The part of libnghttp2's C API (nghttp2.h, ABI version 14: documented and stable) that the
 * workers' native transport (gdn_server/_native_h2.c, which loads the library with dlopen) and
 * bench/h2_floor.c (linked with it) use. The system's libnghttp2 comes
 * without its header on the hosts we build on, so the declarations are written out here. */
#ifndef GDN_NGHTTP2_API_H
#define GDN_NGHTTP2_API_H
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct nghttp2_session nghttp2_session;
typedef struct nghttp2_session_callbacks nghttp2_session_callbacks;
typedef struct nghttp2_option nghttp2_option;
typedef struct {
    size_t length;
    int32_t stream_id;
    uint8_t type;
    uint8_t flags;
    uint8_t reserved;
} nghttp2_frame_hd;
typedef union {
    nghttp2_frame_hd hd; /* the first member of every frame type */
} nghttp2_frame;
typedef struct {
    uint8_t *name;
    uint8_t *value;
    size_t namelen;
    size_t valuelen;
    uint8_t flags;
} nghttp2_nv;
typedef struct {
    int32_t settings_id;
    uint32_t value;
} nghttp2_settings_entry;
typedef union {
    int fd;
    void *ptr;
} nghttp2_data_source;
typedef ssize_t (*nghttp2_data_source_read_callback)(nghttp2_session *, int32_t, uint8_t *, size_t, uint32_t *,
                                                     nghttp2_data_source *, void *);
typedef struct {
    nghttp2_data_source source;
    nghttp2_data_source_read_callback read_callback;
} nghttp2_data_provider;

int nghttp2_session_callbacks_new(nghttp2_session_callbacks **);
void nghttp2_session_callbacks_del(nghttp2_session_callbacks *);
void nghttp2_session_callbacks_set_on_begin_headers_callback(
    nghttp2_session_callbacks *, int (*)(nghttp2_session *, const nghttp2_frame *, void *));
void nghttp2_session_callbacks_set_on_header_callback(
    nghttp2_session_callbacks *, int (*)(nghttp2_session *, const nghttp2_frame *, const uint8_t *, size_t,
                                         const uint8_t *, size_t, uint8_t, void *));
void nghttp2_session_callbacks_set_on_frame_recv_callback(
    nghttp2_session_callbacks *, int (*)(nghttp2_session *, const nghttp2_frame *, void *));
void nghttp2_session_callbacks_set_on_data_chunk_recv_callback(
    nghttp2_session_callbacks *, int (*)(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *));
void nghttp2_session_callbacks_set_on_stream_close_callback(
    nghttp2_session_callbacks *, int (*)(nghttp2_session *, int32_t, uint32_t, void *));
int nghttp2_session_server_new(nghttp2_session **, const nghttp2_session_callbacks *, void *);
void nghttp2_session_del(nghttp2_session *);
ssize_t nghttp2_session_mem_recv(nghttp2_session *, const uint8_t *, size_t);
ssize_t nghttp2_session_mem_send(nghttp2_session *, const uint8_t **);
int nghttp2_session_want_read(nghttp2_session *);
int nghttp2_session_want_write(nghttp2_session *);
int nghttp2_submit_settings(nghttp2_session *, uint8_t, const nghttp2_settings_entry *, size_t);
int nghttp2_submit_response(nghttp2_session *, int32_t, const nghttp2_nv *, size_t, const nghttp2_data_provider *);
int nghttp2_submit_trailer(nghttp2_session *, int32_t, const nghttp2_nv *, size_t);
int nghttp2_session_resume_data(nghttp2_session *, int32_t);
void *nghttp2_session_get_stream_user_data(nghttp2_session *, int32_t);
int nghttp2_session_set_stream_user_data(nghttp2_session *, int32_t, void *);
int nghttp2_session_set_local_window_size(nghttp2_session *, uint8_t, int32_t, int32_t);

enum { FRAME_DATA = 0, FRAME_HEADERS = 1 };
enum { FLAG_END_STREAM = 0x01 };
enum { DATA_FLAG_EOF = 0x01, DATA_FLAG_NO_END_STREAM = 0x02 };
enum { ERR_DEFERRED = -508, ERR_CALLBACK_FAILURE = -902 };
enum { SETTINGS_MAX_CONCURRENT_STREAMS = 3, SETTINGS_INITIAL_WINDOW_SIZE = 4, SETTINGS_MAX_FRAME_SIZE = 5 };

int nghttp2_submit_rst_stream(nghttp2_session *, uint8_t, int32_t, uint32_t);
int nghttp2_option_new(nghttp2_option **);
void nghttp2_option_del(nghttp2_option *);
void nghttp2_option_set_no_auto_window_update(nghttp2_option *, int);
int nghttp2_session_server_new2(nghttp2_session **, const nghttp2_session_callbacks *, void *, const nghttp2_option *);
int nghttp2_session_consume_connection(nghttp2_session *, size_t);
int nghttp2_session_consume_stream(nghttp2_session *, int32_t, size_t);
int nghttp2_submit_shutdown_notice(nghttp2_session *);
typedef ssize_t (*nghttp2_data_source_read_length_callback)(nghttp2_session *, uint8_t, int32_t, int32_t, int32_t,
                                                            uint32_t, void *);
void nghttp2_session_callbacks_set_data_source_read_length_callback(nghttp2_session_callbacks *,
                                                                    nghttp2_data_source_read_length_callback);
int nghttp2_session_client_new2(nghttp2_session **, const nghttp2_session_callbacks *, void *, const nghttp2_option *);
/* the second argument is a const nghttp2_priority_spec *; we always pass NULL */
int32_t nghttp2_submit_request(nghttp2_session *, const void *, const nghttp2_nv *, size_t, const nghttp2_data_provider *,
                               void *);

#endif
