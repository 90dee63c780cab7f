/* What the workers' native transport (gdn_server/_native_h2.c) and bench/h2_floor.c share: a
 * gRPC stream's outgoing messages (Outbox), its incoming bytes cut into messages (Inbox), and a
 * connection's writes (Wire), over libnghttp2 (gdn_server/_nghttp2_api.h). Header-only: each
 * file is built on its own. */
#ifndef GDN_H2_COMMON_H
#define GDN_H2_COMMON_H
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "_nghttp2_api.h"

#define H2_WINDOW (16 << 20)   /* flow-control window we grant each stream and connection */
#define H2_MAX_MESSAGE (256u << 20)

static inline nghttp2_nv h2_nv(const char *name, const char *value) {
    return (nghttp2_nv){(uint8_t *)name, (uint8_t *)value, strlen(name), strlen(value), 0};
}

typedef struct Chunk {
    struct Chunk *next;
    size_t len, sent;
    uint8_t data[];
} Chunk;

/* A stream's messages on their way out, then once `done` its trailers (grpc-status `status`), or
   for a client's stream (status < 0) the end of its requests. */
typedef struct {
    Chunk *head, *tail;
    size_t queued; /* bytes not yet taken by nghttp2 */
    int done, status;
    char *message; /* grpc-message of the trailers (percent-encoded, malloc'd), or NULL */
} Outbox;

/* A new message of `size` bytes at the end of the outbox, its 5-byte gRPC prefix written; the
   caller fills the returned payload. NULL when out of memory. */
static inline uint8_t *outbox_message(Outbox *o, size_t size) {
    Chunk *c = malloc(sizeof(Chunk) + 5 + size);
    if (c == NULL) return NULL;
    c->next = NULL;
    c->len = 5 + size;
    c->sent = 0;
    c->data[0] = 0; /* not compressed */
    uint32_t be = htonl((uint32_t)size);
    memcpy(c->data + 1, &be, 4);
    if (o->tail) o->tail->next = c;
    else o->head = c;
    o->tail = c;
    o->queued += c->len;
    return c->data + 5;
}

static inline void outbox_free(Outbox *o) {
    while (o->head) {
        Chunk *c = o->head;
        o->head = c->next;
        free(c);
    }
    o->tail = NULL;
    o->queued = 0;
    free(o->message);
    o->message = NULL;
}

/* nghttp2's data source callback over an Outbox (source->ptr): its messages, then the trailers. */
static inline ssize_t outbox_read(nghttp2_session *session, int32_t id, uint8_t *buf, size_t length, uint32_t *flags,
                           nghttp2_data_source *source, void *user) {
    Outbox *o = source->ptr;
    size_t n = 0;
    while (o->head != NULL && n < length) {
        Chunk *c = o->head;
        size_t take = c->len - c->sent < length - n ? c->len - c->sent : length - n;
        memcpy(buf + n, c->data + c->sent, take);
        c->sent += take;
        n += take;
        o->queued -= take;
        if (c->sent == c->len) {
            o->head = c->next;
            if (o->head == NULL) o->tail = NULL;
            free(c);
        }
    }
    if (n > 0) return (ssize_t)n;
    if (!o->done) return ERR_DEFERRED;
    if (o->status < 0) { /* a client's half-close: END_STREAM on this DATA frame, no trailers */
        *flags |= DATA_FLAG_EOF;
        return 0;
    }
    *flags |= DATA_FLAG_EOF | DATA_FLAG_NO_END_STREAM;
    char status[16];
    snprintf(status, sizeof status, "%d", o->status);
    nghttp2_nv trailers[] = {h2_nv("grpc-status", status), h2_nv("grpc-message", o->message ? o->message : "")};
    nghttp2_submit_trailer(session, id, trailers, o->message ? 2 : 1);
    return 0;
}

/* A stream's bytes in, not yet whole messages. */
typedef struct {
    uint8_t *buf;
    size_t len, cap;
} Inbox;

enum { INBOX_COMPRESSED = 1, INBOX_TOO_LARGE = 2 };

/* Adds `len` bytes and calls on_message(ctx, message, size) for each whole message. 0;
   INBOX_COMPRESSED or INBOX_TOO_LARGE (over `max_message` bytes) for a message it cannot take;
   or ERR_CALLBACK_FAILURE (no memory, or on_message's own failure). A caller that returns a
   nonzero value to nghttp2 drops the connection. */
static inline int inbox_add(Inbox *in, const uint8_t *data, size_t len, size_t max_message,
                            int (*on_message)(void *, const uint8_t *, size_t), void *ctx) {
    if (in->len + len > in->cap) {
        size_t cap = in->cap < 65536 ? 65536 : in->cap;
        while (cap < in->len + len) cap *= 2;
        uint8_t *grown = realloc(in->buf, cap);
        if (grown == NULL) return ERR_CALLBACK_FAILURE;
        in->buf = grown;
        in->cap = cap;
    }
    memcpy(in->buf + in->len, data, len);
    in->len += len;
    size_t at = 0;
    while (in->len - at >= 5) {
        uint32_t be;
        memcpy(&be, in->buf + at + 1, 4);
        size_t size = ntohl(be);
        if (in->buf[at] != 0) return INBOX_COMPRESSED;
        if (size > max_message) return INBOX_TOO_LARGE;
        if (in->len - at - 5 < size) break;
        if (on_message(ctx, in->buf + at + 5, size) != 0) return ERR_CALLBACK_FAILURE;
        at += 5 + size;
    }
    memmove(in->buf, in->buf + at, in->len - at);
    in->len -= at;
    return 0;
}

/* A connection's socket and session, and its bytes on their way to the socket. */
typedef struct {
    int fd;
    nghttp2_session *session;
    uint8_t *pending; /* frames gathered for one send(), then what the socket did not take yet */
    size_t pending_len, pending_off, pending_cap;
    int watching_out; /* EPOLLOUT is on for the socket: it was full */
} Wire;

/* how many bytes of frames one send() takes at most: nghttp2 hands out one frame at a time, and
   a send() per frame cost a syscall per 16 KiB DATA frame of a big message, and three per unary
   reply (headers, message, trailers) */
#define WIRE_GATHER_BYTES (1u << 20)

/* Reads what the socket has into nghttp2 (its callbacks run meanwhile), through `buf`: 0 while
   the connection lives, -1 once the peer closed it or it broke. */
static inline int wire_read(Wire *w, uint8_t *buf, size_t cap) {
    for (;;) {
        ssize_t r = recv(w->fd, buf, cap, 0);
        if (r < 0 && errno == EAGAIN) return 0;
        if (r <= 0) return -1;
        if (nghttp2_session_mem_recv(w->session, buf, (size_t)r) < 0) return -1;
        if ((size_t)r < cap) return 0;
    }
}

/* Appends n bytes to w->pending: 0, or -1 when out of memory. */
static inline int wire_keep(Wire *w, const uint8_t *data, size_t n) {
    if (w->pending_len + n > w->pending_cap) {
        size_t cap = w->pending_cap < 65536 ? 65536 : w->pending_cap;
        while (cap < w->pending_len + n) cap *= 2;
        uint8_t *grown = realloc(w->pending, cap);
        if (grown == NULL) return -1;
        w->pending = grown;
        w->pending_cap = cap;
    }
    memcpy(w->pending + w->pending_len, data, n); /* nghttp2's buffer lasts until its next call */
    w->pending_len += n;
    return 0;
}

/* Gathers up to WIRE_GATHER_BYTES of nghttp2's frames into w->pending (empty on entry): 0, or -1
   on an error. A big frame with nothing gathered before it goes to the socket straight from
   nghttp2's buffer (a copy fewer); only what the socket did not take is kept. */
static inline int wire_gather(Wire *w) {
    w->pending_len = w->pending_off = 0;
    while (w->pending_len < WIRE_GATHER_BYTES) {
        const uint8_t *data;
        ssize_t n = nghttp2_session_mem_send(w->session, &data);
        if (n < 0) return -1;
        if (n == 0) break;
        if (w->pending_len == 0 && n >= 65536) {
            ssize_t sent = send(w->fd, data, (size_t)n, MSG_NOSIGNAL);
            if (sent < 0 && errno != EAGAIN) return -1;
            size_t done = sent > 0 ? (size_t)sent : 0;
            if (done == (size_t)n) continue;
            return wire_keep(w, data + done, (size_t)n - done); /* the socket is full: send the rest later */
        }
        if (wire_keep(w, data, (size_t)n) < 0) return -1;
    }
    return 0;
}

/* Writes what nghttp2 has to send, watching for EPOLLOUT (epoll data `tag`) while the socket is
   full: 0 while the connection lives, -1 once it is done or broken. */
static inline int wire_flush(Wire *w, int epfd, void *tag) {
    for (;;) {
        if (w->pending_off == w->pending_len) {
            if (wire_gather(w) < 0) return -1;
            if (w->pending_len == 0) break;
        }
        ssize_t sent = send(w->fd, w->pending + w->pending_off, w->pending_len - w->pending_off, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno != EAGAIN) return -1;
            if (!w->watching_out) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = tag};
                epoll_ctl(epfd, EPOLL_CTL_MOD, w->fd, &ev);
                w->watching_out = 1;
            }
            return 0;
        }
        w->pending_off += (size_t)sent;
    }
    if (w->watching_out) { /* all sent: readable is what we wait for again */
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = tag};
        epoll_ctl(epfd, EPOLL_CTL_MOD, w->fd, &ev);
        w->watching_out = 0;
    }
    return nghttp2_session_want_read(w->session) || nghttp2_session_want_write(w->session) ? 0 : -1;
}

/* A nonblocking socket listening on 127.0.0.1:port (0: any free port): its fd, with the port it
   got in *bound; -1 with errno set. */
static inline int h2_listen_loopback(int port, int *bound) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0) return -1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 1024) != 0 ||
        getsockname(fd, (struct sockaddr *)&addr, &len) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    *bound = ntohs(addr.sin_port);
    return fd;
}

/* The next connection waiting on listen_fd, nonblocking and without Nagle's delay (gRPC's
   messages are small and answered at once); -1 when none is waiting. */
static inline int h2_accept(int listen_fd) {
    int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC), one = 1;
    if (fd >= 0) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* A server's callbacks: a stream's headers begin and each header, a frame received, a DATA
   chunk, a stream closed. */
static inline nghttp2_session_callbacks *h2_callbacks(
    int (*begin_headers)(nghttp2_session *, const nghttp2_frame *, void *),
    int (*header)(nghttp2_session *, const nghttp2_frame *, const uint8_t *, size_t, const uint8_t *, size_t, uint8_t,
                  void *),
    int (*frame_recv)(nghttp2_session *, const nghttp2_frame *, void *),
    int (*data_chunk)(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *),
    int (*stream_close)(nghttp2_session *, int32_t, uint32_t, void *)) {
    nghttp2_session_callbacks *cbs;
    if (nghttp2_session_callbacks_new(&cbs) != 0) return NULL;
    nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(cbs, header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, stream_close);
    return cbs;
}

/* Our settings for a new session: many streams, big windows, DATA frames up to H2_MAX_FRAME (a
   big message in a few frames, not a callback per 16 KiB). */
#define H2_MAX_FRAME (1u << 20)
static inline void h2_server_settings(nghttp2_session *session) {
    nghttp2_settings_entry settings[] = {{SETTINGS_MAX_CONCURRENT_STREAMS, 1000}, {SETTINGS_INITIAL_WINDOW_SIZE, H2_WINDOW},
                                         {SETTINGS_MAX_FRAME_SIZE, H2_MAX_FRAME}};
    nghttp2_submit_settings(session, 0, settings, 3);
    nghttp2_session_set_local_window_size(session, 0, 0, H2_WINDOW); /* the connection's */
}

#endif
