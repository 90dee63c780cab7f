/* The front-end workers' gRPC transport in C (`gdn-server --frontends N --frontend-transport
 * native`): HTTP/2 and gRPC's message framing over libnghttp2, driven by the worker's asyncio
 * loop; every request's own work (auth, validation, the engine's link, the RPCs passed to the
 * router) stays in Python (gdn_server/frontend_native.py).
 *
 * Why: grpc.aio took ~190-240 us of CPU per streamed message on the CPU box, this transport with
 * Python answering each message ~50-70 (bench/NOTES.md, h2_floor). At 64 clients the workers'
 * gRPC was what held a served step's host CPU.
 *
 *   H2Transport(max_message_bytes)
 *   add_listener(fd)      serve a listening socket (nonblocking; the transport closes it)
 *   fileno()              an epoll fd: readable when poll() has work
 *   poll() -> events      reads every ready connection; the round's events, in order:
 *       (OPEN, handle, path, authorization | None, grpc_timeout | None)
 *       (MESSAGE, handle, bytes)
 *       (HALF_CLOSE, handle)        the client sent its last message
 *       (GONE, handle, status)      the stream ended before Python finished it: the client reset
 *                                   it or left (status 1, CANCELLED), or the transport ended it
 *                                   (8: a message over the limit; 12: a compressed message)
 *   send(handle, data) -> bool      one message (False: the stream is gone or finished)
 *   finish(handle, status, message=None) -> bool   the trailers, after the stream's messages
 *   pause(handle, paused)           stop (or go on) granting the client window on that stream
 *   flush() -> events               write what every connection has to send (GONE events of
 *                                   the streams of a connection that broke meanwhile)
 *   stop_listening() -> events      close the listeners, tell every client to go elsewhere
 *   close() -> events               drop every connection (GONE for each unfinished stream)
 *
 * And as a client (gdn-loadtest's native clients):
 *   connect(host, port) -> connection id
 *   request(connection id, path, authority) -> handle      a call; send() its requests
 *   half_close(handle) -> bool      the call's last request was sent
 *   disconnect(connection id) -> events   close that connection
 *   events: (MESSAGE, handle, bytes) for each reply, then (CLOSED, handle, status, message)
 *
 * One thread, the loop's, with the GIL held. libnghttp2 is loaded with dlopen on the first
 * H2Transport (libnghttp2.so.14, or the file GDN_LIBNGHTTP2 names), so _native loads without it
 * and the worker can say what is missing. No TLS: the worker refuses to start with it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>

#include "_nghttp2_api.h"

#define NGHTTP2_FUNCTIONS(X)                                                                                     \
    X(session_callbacks_new) X(session_callbacks_set_on_begin_headers_callback)                                  \
    X(session_callbacks_set_on_header_callback) X(session_callbacks_set_on_frame_recv_callback)                  \
    X(session_callbacks_set_on_data_chunk_recv_callback) X(session_callbacks_set_on_stream_close_callback)        \
    X(session_server_new2) X(session_del) X(session_mem_recv) X(session_mem_send) X(session_want_read)           \
    X(session_want_write) X(submit_settings) X(submit_response) X(submit_trailer) X(session_resume_data)         \
    X(session_get_stream_user_data) X(session_set_stream_user_data) X(session_set_local_window_size)             \
    X(option_new) X(option_set_no_auto_window_update) X(session_consume_connection)         \
    X(session_consume_stream) X(submit_shutdown_notice) X(session_client_new2) X(submit_request)     \
    X(session_callbacks_set_data_source_read_length_callback)

static struct {
#define H2_POINTER(name) __typeof__(nghttp2_##name) *name;
    NGHTTP2_FUNCTIONS(H2_POINTER)
#undef H2_POINTER
} h2lib;
static int h2lib_loaded;

/* 0, or -1 with OSError set: the library or one of its functions is missing. */
static int load_nghttp2(void) {
    if (h2lib_loaded) return 0;
    const char *named = getenv("GDN_LIBNGHTTP2");
    const char *path = named != NULL && *named ? named : "libnghttp2.so.14";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_OSError,
                     "the native transport needs libnghttp2 (%s: %s); install it (e.g. apt-get install "
                     "libnghttp2-14) or point GDN_LIBNGHTTP2 at the file",
                     path, dlerror());
        return -1;
    }
#define H2_LOAD(name)                                                                                      \
    if ((*(void **)&h2lib.name = dlsym(lib, "nghttp2_" #name)) == NULL) {                                  \
        PyErr_Format(PyExc_OSError, "%s has no nghttp2_" #name ": not libnghttp2 of ABI 14?", path);      \
        return -1;                                                                                         \
    }
    NGHTTP2_FUNCTIONS(H2_LOAD)
#undef H2_LOAD
    h2lib_loaded = 1;
    return 0;
}

/* From here on, libnghttp2's names call through the loaded pointers (_h2_common.h too). */
#define nghttp2_session_callbacks_new h2lib.session_callbacks_new
#define nghttp2_session_callbacks_set_on_begin_headers_callback h2lib.session_callbacks_set_on_begin_headers_callback
#define nghttp2_session_callbacks_set_on_header_callback h2lib.session_callbacks_set_on_header_callback
#define nghttp2_session_callbacks_set_on_frame_recv_callback h2lib.session_callbacks_set_on_frame_recv_callback
#define nghttp2_session_callbacks_set_on_data_chunk_recv_callback h2lib.session_callbacks_set_on_data_chunk_recv_callback
#define nghttp2_session_callbacks_set_on_stream_close_callback h2lib.session_callbacks_set_on_stream_close_callback
#define nghttp2_session_server_new2 h2lib.session_server_new2
#define nghttp2_session_del h2lib.session_del
#define nghttp2_session_mem_recv h2lib.session_mem_recv
#define nghttp2_session_mem_send h2lib.session_mem_send
#define nghttp2_session_want_read h2lib.session_want_read
#define nghttp2_session_want_write h2lib.session_want_write
#define nghttp2_submit_settings h2lib.submit_settings
#define nghttp2_submit_response h2lib.submit_response
#define nghttp2_submit_trailer h2lib.submit_trailer
#define nghttp2_session_resume_data h2lib.session_resume_data
#define nghttp2_session_get_stream_user_data h2lib.session_get_stream_user_data
#define nghttp2_session_set_stream_user_data h2lib.session_set_stream_user_data
#define nghttp2_session_set_local_window_size h2lib.session_set_local_window_size
#define nghttp2_option_new h2lib.option_new
#define nghttp2_option_set_no_auto_window_update h2lib.option_set_no_auto_window_update
#define nghttp2_session_consume_connection h2lib.session_consume_connection
#define nghttp2_session_consume_stream h2lib.session_consume_stream
#define nghttp2_submit_shutdown_notice h2lib.submit_shutdown_notice
#define nghttp2_session_client_new2 h2lib.session_client_new2
#define nghttp2_submit_request h2lib.submit_request
#define nghttp2_session_callbacks_set_data_source_read_length_callback \
    h2lib.session_callbacks_set_data_source_read_length_callback

#include "_h2_common.h"

enum { EV_OPEN = 1, EV_MESSAGE = 2, EV_HALF_CLOSE = 3, EV_GONE = 4, EV_CLOSED = 5 };
enum { STATUS_CANCELLED = 1, STATUS_RESOURCE_EXHAUSTED = 8, STATUS_UNIMPLEMENTED = 12, STATUS_UNAVAILABLE = 14 };
/* a stream whose replies wait unread past this many bytes gets no more window: a client that
   sends and never reads is stopped by flow control, not by our memory */
#define OUTBOX_PAUSE_BYTES (4u << 20)
#define READ_BYTES (256u << 10)

struct Conn;

typedef struct Stream {
    Outbox out; /* first: the data source points at the stream; out.done: finished (by Python or here) */
    Inbox in;
    struct Stream *prev, *next; /* the connection's streams */
    struct Conn *conn;
    int32_t id;
    long long handle;
    PyObject *path, *authorization, *timeout; /* str, or NULL until the header comes */
    int opened, paused;
    int client;             /* a call we made (request()), not one we serve */
    int grpc_status;        /* a client stream's status from its trailers; -1 until they come */
    PyObject *grpc_message; /* and their grpc-message (str), or NULL */
    size_t unconsumed; /* bytes received while paused, not yet granted back to the client */
} Stream;

enum { TAG_LISTENER = 1, TAG_CONN = 2 };

typedef struct {
    int tag; /* first, as in Conn: what an epoll event's pointer is */
    int fd;
} Listener;

typedef struct Conn {
    int tag;
    long long id; /* what connect() returned, for request() */
    Wire wire;
    Stream *streams;
    struct H2Transport *owner;
} Conn;

typedef struct H2Transport {
    PyObject_HEAD
    int epfd;
    size_t max_message;
    long long next_handle, next_conn_id;
    PyObject *events;  /* list, handed out by poll() */
    PyObject *handles; /* dict: handle -> Stream* (as an int), while nghttp2 has the stream */
    Conn **conns;
    size_t n_conns, cap_conns;
    Listener **listeners;
    size_t n_listeners;
    int stopping; /* stop_listening() was called: new connections get a shutdown notice at once */
} H2Transport;

static nghttp2_session_callbacks *callbacks;
static nghttp2_option *session_options;

static int emit(H2Transport *t, PyObject *event) {
    if (event == NULL) return -1;
    int rc = PyList_Append(t->events, event);
    Py_DECREF(event);
    return rc;
}

/* The stream of `handle` while Python may still answer on it; NULL when it is gone or finished
   (with an error set only if the look-up itself failed). */
static Stream *open_stream(H2Transport *t, long long handle) {
    PyObject *key = PyLong_FromLongLong(handle);
    if (key == NULL) return NULL;
    PyObject *ptr = PyDict_GetItemWithError(t->handles, key);
    Py_DECREF(key);
    Stream *s = ptr == NULL ? NULL : (Stream *)PyLong_AsVoidPtr(ptr);
    return s != NULL && !s->out.done ? s : NULL;
}

/* Grants the client the window it used on `s` once the stream is neither paused by Python nor
   holding too many unread replies. */
static void grant_window(Stream *s) {
    if (s->unconsumed == 0 || s->paused || s->out.queued > OUTBOX_PAUSE_BYTES) return;
    nghttp2_session_consume_stream(s->conn->wire.session, s->id, s->unconsumed);
    s->unconsumed = 0;
}

/* grpc-message's value: bytes outside printable ASCII, and '%', as %XX (gRPC's HTTP/2 spec). */
static char *percent_encoded(const char *text, size_t len) {
    char *out = malloc(len * 3 + 1), *w = out;
    if (out == NULL) return NULL;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if (c >= 0x20 && c <= 0x7e && c != '%') *w++ = (char)c;
        else w += sprintf(w, "%%%02X", c);
    }
    *w = 0;
    return out;
}

/* Ends `s` with trailers of `status` (and `message`); its unsent messages still go first. */
static void end_stream(Stream *s, int status, const char *message, size_t message_len) {
    s->out.done = 1;
    s->out.status = status;
    free(s->out.message);
    s->out.message = message != NULL ? percent_encoded(message, message_len) : NULL;
    s->paused = 0;
    grant_window(s);
    nghttp2_session_resume_data(s->conn->wire.session, s->id);
}

/* Frees a closed stream; Python hears GONE of one it had not finished. */
static void free_stream(Stream *s) {
    H2Transport *t = s->conn->owner;
    if (s->client) {
        int got = s->grpc_status >= 0;
        emit(t, Py_BuildValue("(iLis)", EV_CLOSED, s->handle, got ? s->grpc_status : STATUS_UNAVAILABLE,
                              got ? (s->grpc_message ? PyUnicode_AsUTF8(s->grpc_message) : "")
                                  : "the stream ended without a status (the connection closed?)"));
        Py_XDECREF(s->grpc_message);
    } else if (!s->out.done)
        emit(t, Py_BuildValue("(iLi)", EV_GONE, s->handle, STATUS_CANCELLED));
    PyObject *key = PyLong_FromLongLong(s->handle);
    if (key != NULL) {
        if (PyDict_DelItem(t->handles, key) < 0) PyErr_Clear();
        Py_DECREF(key);
    }
    if (s->prev) s->prev->next = s->next;
    else s->conn->streams = s->next;
    if (s->next) s->next->prev = s->prev;
    outbox_free(&s->out);
    Py_XDECREF(s->path);
    Py_XDECREF(s->authorization);
    Py_XDECREF(s->timeout);
    free(s->in.buf);
    free(s);
}

/* The stream's data source: its messages, then its trailers. (No RST_STREAM after trailers
   sent before the client's last message: grpc's C core takes one that comes first as the
   call's end, INTERNAL. What a client still sends is granted and dropped; it stops once it
   reads the trailers.) */
static ssize_t stream_read(nghttp2_session *session, int32_t id, uint8_t *buf, size_t length, uint32_t *flags,
                           nghttp2_data_source *source, void *user) {
    ssize_t n = outbox_read(session, id, buf, length, flags, source, user);
    if (n > 0) grant_window(source->ptr);
    return n;
}

/* How much a DATA frame we send may carry: all that the windows and the peer's frame size allow
   (up to H2_MAX_FRAME), not nghttp2's default of 16 KiB. */
static ssize_t data_length(nghttp2_session *session, uint8_t frame_type, int32_t id, int32_t session_window,
                           int32_t stream_window, uint32_t remote_max_frame, void *user) {
    ssize_t n = remote_max_frame < H2_MAX_FRAME ? (ssize_t)remote_max_frame : (ssize_t)H2_MAX_FRAME;
    if (session_window < n) n = session_window;
    if (stream_window < n) n = stream_window;
    return n > 0 ? n : 1;
}

/* Gives `s` (its id set) a handle, puts it on its connection's list and in the handles Python
   looks streams up by: 0, or -1 with an error set (the stream is on the list either way, so it is
   freed with its connection). */
static int add_stream(Conn *c, Stream *s) {
    s->conn = c;
    s->handle = ++c->owner->next_handle;
    s->next = c->streams;
    if (c->streams) c->streams->prev = s;
    c->streams = s;
    PyObject *key = PyLong_FromLongLong(s->handle), *ptr = PyLong_FromVoidPtr(s);
    int rc = key && ptr ? PyDict_SetItem(c->owner->handles, key, ptr) : -1;
    Py_XDECREF(key);
    Py_XDECREF(ptr);
    return rc;
}

static int on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    Conn *c = user;
    if (frame->hd.type != FRAME_HEADERS || nghttp2_session_get_stream_user_data(session, frame->hd.stream_id))
        return 0;
    Stream *s = calloc(1, sizeof(Stream));
    if (s == NULL) return ERR_CALLBACK_FAILURE;
    s->id = frame->hd.stream_id;
    int rc = add_stream(c, s);
    nghttp2_session_set_stream_user_data(session, s->id, s);
    return rc < 0 ? ERR_CALLBACK_FAILURE : 0;
}

static int header_is(const uint8_t *name, size_t namelen, const char *wanted) {
    return namelen == strlen(wanted) && memcmp(name, wanted, namelen) == 0;
}

static int on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name, size_t namelen,
                     const uint8_t *value, size_t valuelen, uint8_t flags, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (s != NULL && s->client) { /* a response's status, in its trailers (or trailers-only headers) */
        if (header_is(name, namelen, "grpc-status")) {
            s->grpc_status = 0;
            for (size_t i = 0; i < valuelen && value[i] >= '0' && value[i] <= '9'; i++)
                s->grpc_status = s->grpc_status * 10 + (value[i] - '0');
        } else if (header_is(name, namelen, "grpc-message") && s->grpc_message == NULL) {
            s->grpc_message = PyUnicode_DecodeLatin1((const char *)value, (Py_ssize_t)valuelen, NULL);
            if (s->grpc_message == NULL) return ERR_CALLBACK_FAILURE;
        }
        return 0;
    }
    if (s == NULL || s->opened) return 0; /* trailers from the client: nothing we read */
    PyObject **slot = header_is(name, namelen, ":path")           ? &s->path
                      : header_is(name, namelen, "authorization") ? &s->authorization
                      : header_is(name, namelen, "grpc-timeout")  ? &s->timeout
                                                                  : NULL;
    if (slot == NULL || *slot != NULL) return 0;
    *slot = PyUnicode_DecodeLatin1((const char *)value, (Py_ssize_t)valuelen, NULL);
    return *slot == NULL ? ERR_CALLBACK_FAILURE : 0;
}

static int on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (s == NULL || s->client || (frame->hd.type != FRAME_HEADERS && frame->hd.type != FRAME_DATA)) return 0;
    H2Transport *t = s->conn->owner;
    if (frame->hd.type == FRAME_HEADERS && !s->opened) {
        s->opened = 1;
        nghttp2_nv h[] = {h2_nv(":status", "200"), h2_nv("content-type", "application/grpc")};
        nghttp2_data_provider provider = {{.ptr = s}, stream_read};
        if (nghttp2_submit_response(session, s->id, h, 2, &provider) != 0) return ERR_CALLBACK_FAILURE;
        if (emit(t, Py_BuildValue("(iLOOO)", EV_OPEN, s->handle, s->path ? s->path : Py_None,
                                  s->authorization ? s->authorization : Py_None,
                                  s->timeout ? s->timeout : Py_None)) < 0)
            return ERR_CALLBACK_FAILURE;
    }
    if ((frame->hd.flags & FLAG_END_STREAM) && !s->out.done &&
        emit(t, Py_BuildValue("(iL)", EV_HALF_CLOSE, s->handle)) < 0)
        return ERR_CALLBACK_FAILURE;
    return 0;
}

/* inbox_add's callback: each whole message up to Python as an event */
static int message_up(void *ctx, const uint8_t *msg, size_t size) {
    Stream *s = ctx;
    if (s->out.done && !s->client) return 0;
    PyObject *data = PyBytes_FromStringAndSize((const char *)msg, (Py_ssize_t)size);
    return emit(s->conn->owner, data ? Py_BuildValue("(iLN)", EV_MESSAGE, s->handle, data) : NULL);
}

static int on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t id, const uint8_t *data, size_t len,
                         void *user) {
    nghttp2_session_consume_connection(session, len); /* a paused stream must not hold up the others */
    Stream *s = nghttp2_session_get_stream_user_data(session, id);
    if (s == NULL) return 0;
    s->unconsumed += len;
    grant_window(s);
    if (s->out.done && !s->client) return 0; /* finished: what the client still sends is dropped */
    int rc = inbox_add(&s->in, data, len, s->conn->owner->max_message, message_up, s);
    if (rc == INBOX_COMPRESSED || rc == INBOX_TOO_LARGE) {
        char message[160];
        int status = rc == INBOX_COMPRESSED ? STATUS_UNIMPLEMENTED : STATUS_RESOURCE_EXHAUSTED;
        if (rc == INBOX_COMPRESSED) snprintf(message, sizeof message, "compressed messages are not accepted");
        else snprintf(message, sizeof message, "a message is larger than the server's limit of %zu bytes",
                      s->conn->owner->max_message);
        s->in.len = 0;
        end_stream(s, status, message, strlen(message));
        return emit(s->conn->owner, Py_BuildValue("(iLi)", EV_GONE, s->handle, status)) < 0 ? ERR_CALLBACK_FAILURE : 0;
    }
    return rc;
}

static int on_stream_close(nghttp2_session *session, int32_t id, uint32_t error_code, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, id);
    if (s != NULL) free_stream(s);
    return 0;
}

static int flush_conn(H2Transport *t, Conn *c) { return wire_flush(&c->wire, t->epfd, c); }

static void close_conn(H2Transport *t, Conn *c) {
    epoll_ctl(t->epfd, EPOLL_CTL_DEL, c->wire.fd, NULL);
    close(c->wire.fd);
    while (c->streams) free_stream(c->streams); /* nghttp2_session_del calls no stream callbacks */
    nghttp2_session_del(c->wire.session);
    free(c->wire.pending);
    for (size_t i = 0; i < t->n_conns; i++)
        if (t->conns[i] == c) {
            t->conns[i] = t->conns[--t->n_conns];
            break;
        }
    free(c);
}

static Conn *add_conn(H2Transport *t, int fd, int client);

static void accept_all(H2Transport *t, Listener *l) {
    for (;;) {
        int fd = h2_accept(l->fd);
        if (fd < 0) return;
        Conn *c = add_conn(t, fd, 0);
        if (c == NULL) continue;
        if (t->stopping) nghttp2_submit_shutdown_notice(c->wire.session);
        if (flush_conn(t, c) < 0) close_conn(t, c);
    }
}

/* The events gathered so far, and a fresh list for the next ones; NULL on error. */
static PyObject *take_events(H2Transport *t) {
    if (PyErr_Occurred()) return NULL;
    PyObject *out = t->events;
    t->events = PyList_New(0);
    if (t->events == NULL) {
        t->events = out;
        return NULL;
    }
    return out;
}

static PyObject *transport_poll(H2Transport *t, PyObject *unused) {
    static uint8_t buf[READ_BYTES];
    struct epoll_event events[64];
    int n = epoll_wait(t->epfd, events, 64, 0);
    for (int i = 0; i < n; i++) {
        int tag = *(int *)events[i].data.ptr;
        if (tag == TAG_LISTENER) {
            accept_all(t, events[i].data.ptr);
            continue;
        }
        Conn *c = events[i].data.ptr;
        if (wire_read(&c->wire, buf, sizeof buf) < 0 || flush_conn(t, c) < 0) close_conn(t, c);
    }
    return take_events(t);
}

static PyObject *transport_send(H2Transport *t, PyObject *args) {
    long long handle;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "Ly*", &handle, &data)) return NULL;
    Stream *s = open_stream(t, handle);
    if (s == NULL) {
        PyBuffer_Release(&data);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    uint8_t *payload = outbox_message(&s->out, (size_t)data.len);
    if (payload == NULL) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    memcpy(payload, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    nghttp2_session_resume_data(s->conn->wire.session, s->id);
    Py_RETURN_TRUE;
}

static PyObject *transport_finish(H2Transport *t, PyObject *args) {
    long long handle;
    int status;
    const char *message = NULL;
    Py_ssize_t message_len = 0;
    if (!PyArg_ParseTuple(args, "Li|z#", &handle, &status, &message, &message_len)) return NULL;
    Stream *s = open_stream(t, handle);
    if (s == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    end_stream(s, status, message, (size_t)message_len);
    Py_RETURN_TRUE;
}

static PyObject *transport_pause(H2Transport *t, PyObject *args) {
    long long handle;
    int paused;
    if (!PyArg_ParseTuple(args, "Lp", &handle, &paused)) return NULL;
    Stream *s = open_stream(t, handle);
    if (s == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    s->paused = paused;
    grant_window(s);
    Py_RETURN_NONE;
}

static PyObject *transport_flush(H2Transport *t, PyObject *unused) {
    for (size_t i = 0; i < t->n_conns;) {
        Conn *c = t->conns[i];
        if (flush_conn(t, c) < 0) close_conn(t, c); /* moves the last connection into slot i */
        else i++;
    }
    return take_events(t); /* GONE of the streams of connections that broke on the write */
}

static PyObject *transport_add_listener(H2Transport *t, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    Listener **grown = realloc(t->listeners, (t->n_listeners + 1) * sizeof(Listener *));
    Listener *l = malloc(sizeof(Listener));
    if (grown == NULL || l == NULL) {
        free(l);
        if (grown != NULL) t->listeners = grown;
        return PyErr_NoMemory();
    }
    t->listeners = grown;
    l->tag = TAG_LISTENER;
    l->fd = fd;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = l};
    if (epoll_ctl(t->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        free(l);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    t->listeners[t->n_listeners++] = l;
    Py_RETURN_NONE;
}

static void close_listeners(H2Transport *t) {
    for (size_t i = 0; i < t->n_listeners; i++) {
        epoll_ctl(t->epfd, EPOLL_CTL_DEL, t->listeners[i]->fd, NULL);
        close(t->listeners[i]->fd);
        free(t->listeners[i]);
    }
    t->n_listeners = 0;
}

static PyObject *transport_stop_listening(H2Transport *t, PyObject *unused) {
    close_listeners(t);
    t->stopping = 1;
    for (size_t i = 0; i < t->n_conns; i++) nghttp2_submit_shutdown_notice(t->conns[i]->wire.session);
    return transport_flush(t, NULL);
}

static PyObject *transport_close(H2Transport *t, PyObject *unused) {
    close_listeners(t);
    while (t->n_conns) close_conn(t, t->conns[t->n_conns - 1]);
    return take_events(t);
}

/* Adds a connection on `fd` (connected, nonblocking) with its nghttp2 session; NULL when out of
   memory (the fd is then closed). */
static Conn *add_conn(H2Transport *t, int fd, int client) {
    if (t->n_conns == t->cap_conns) {
        Conn **grown = realloc(t->conns, (t->cap_conns * 2 + 8) * sizeof(Conn *));
        if (grown == NULL) {
            close(fd);
            return NULL;
        }
        t->conns = grown;
        t->cap_conns = t->cap_conns * 2 + 8;
    }
    Conn *c = calloc(1, sizeof(Conn));
    int rc = c == NULL ? -1
             : client ? nghttp2_session_client_new2(&c->wire.session, callbacks, c, session_options)
                      : nghttp2_session_server_new2(&c->wire.session, callbacks, c, session_options);
    if (rc != 0) {
        close(fd);
        free(c);
        return NULL;
    }
    t->conns[t->n_conns++] = c;
    c->tag = TAG_CONN;
    c->id = ++t->next_conn_id;
    c->wire.fd = fd;
    c->owner = t;
    h2_server_settings(c->wire.session); /* the same windows and stream limit either way */
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    epoll_ctl(t->epfd, EPOLL_CTL_ADD, fd, &ev);
    return c;
}

/* connect(host, port) -> connection id: a client connection (for gdn-loadtest's native clients). */
static PyObject *transport_connect(H2Transport *t, PyObject *args) {
    const char *host;
    int port;
    if (!PyArg_ParseTuple(args, "si", &host, &port)) return NULL;
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *found;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = getaddrinfo(host, service, &hints, &found);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_Format(PyExc_OSError, "cannot resolve %s: %s", host, gai_strerror(rc));
    int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd >= 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = connect(fd, found->ai_addr, found->ai_addrlen);
        Py_END_ALLOW_THREADS
    }
    freeaddrinfo(found);
    if (fd < 0 || rc != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (fd >= 0) close(fd);
        return NULL;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    Conn *c = add_conn(t, fd, 1);
    if (c == NULL) return PyErr_NoMemory();
    if (flush_conn(t, c) < 0) {
        close_conn(t, c);
        return PyErr_Format(PyExc_OSError, "the connection to %s:%d closed at once", host, port);
    }
    return PyLong_FromLongLong(c->id);
}

/* The open connection `conn_id` names, or NULL. */
static Conn *conn_of(H2Transport *t, long long conn_id) {
    for (size_t i = 0; i < t->n_conns; i++)
        if (t->conns[i]->id == conn_id) return t->conns[i];
    return NULL;
}

/* request(connection id, path, authority) -> handle: a call on that connection; its requests go
   with send(), half_close() ends them, and its replies come as MESSAGE events, then CLOSED. */
static PyObject *transport_request(H2Transport *t, PyObject *args) {
    long long conn_id;
    const char *path, *authority;
    if (!PyArg_ParseTuple(args, "Lss", &conn_id, &path, &authority)) return NULL;
    Conn *c = conn_of(t, conn_id);
    if (c == NULL) return PyErr_Format(PyExc_ConnectionError, "connection %lld is closed", conn_id);
    Stream *s = calloc(1, sizeof(Stream));
    if (s == NULL) return PyErr_NoMemory();
    s->client = 1;
    s->grpc_status = -1;
    nghttp2_nv h[] = {h2_nv(":method", "POST"), h2_nv(":scheme", "http"), h2_nv(":path", path),
                      h2_nv(":authority", authority), h2_nv("content-type", "application/grpc"),
                      h2_nv("te", "trailers")};
    nghttp2_data_provider provider = {{.ptr = s}, stream_read};
    int32_t id = nghttp2_submit_request(c->wire.session, NULL, h, 6, &provider, s);
    if (id < 0) {
        free(s);
        return PyErr_Format(PyExc_ConnectionError, "no new stream on connection %lld (nghttp2 error %d)", conn_id, id);
    }
    s->id = id;
    if (add_stream(c, s) < 0) return NULL; /* the stream stays nghttp2's; it is freed with its connection */
    return PyLong_FromLongLong(s->handle);
}

/* disconnect(connection id) -> events: closes a client connection (CLOSED for its open calls). */
static PyObject *transport_disconnect(H2Transport *t, PyObject *args) {
    long long conn_id;
    if (!PyArg_ParseTuple(args, "L", &conn_id)) return NULL;
    Conn *c = conn_of(t, conn_id);
    if (c != NULL) close_conn(t, c);
    return take_events(t);
}

/* half_close(handle) -> bool: a client call sends no more requests (END_STREAM after them). */
static PyObject *transport_half_close(H2Transport *t, PyObject *args) {
    long long handle;
    if (!PyArg_ParseTuple(args, "L", &handle)) return NULL;
    Stream *s = open_stream(t, handle);
    if (s == NULL || !s->client) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    s->out.done = 1;
    s->out.status = -1;
    nghttp2_session_resume_data(s->conn->wire.session, s->id);
    Py_RETURN_TRUE;
}

static PyObject *transport_fileno(H2Transport *t, PyObject *unused) { return PyLong_FromLong(t->epfd); }

static int transport_init(H2Transport *t, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"max_message_bytes", NULL};
    Py_ssize_t max_message;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n", names, &max_message)) return -1;
    if (max_message <= 0) {
        PyErr_SetString(PyExc_ValueError, "max_message_bytes must be > 0");
        return -1;
    }
    if (t->events != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "H2Transport is already initialised");
        return -1;
    }
    if (load_nghttp2() < 0) return -1;
    if (callbacks == NULL) {
        nghttp2_option *options;
        callbacks = h2_callbacks(on_begin_headers, on_header, on_frame_recv, on_data_chunk, on_stream_close);
        if (callbacks == NULL || nghttp2_option_new(&options) != 0) {
            PyErr_NoMemory();
            return -1;
        }
        nghttp2_session_callbacks_set_data_source_read_length_callback(callbacks, data_length);
        /* windows are granted as messages are taken (grant_window), not as bytes arrive */
        nghttp2_option_set_no_auto_window_update(options, 1);
        session_options = options;
    }
    t->max_message = (size_t)max_message;
    t->events = PyList_New(0);
    t->handles = PyDict_New();
    if (t->events == NULL || t->handles == NULL) return -1;
    t->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (t->epfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *transport_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    H2Transport *t = (H2Transport *)type->tp_alloc(type, 0);
    if (t != NULL) t->epfd = -1;
    return (PyObject *)t;
}

static void transport_dealloc(H2Transport *t) {
    while (t->n_conns) close_conn(t, t->conns[t->n_conns - 1]);
    free(t->conns);
    close_listeners(t);
    free(t->listeners);
    if (t->epfd >= 0) close(t->epfd);
    Py_XDECREF(t->events);
    Py_XDECREF(t->handles);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef transport_methods[] = {
    {"poll", (PyCFunction)transport_poll, METH_NOARGS, "poll() -> list of events"},
    {"send", (PyCFunction)transport_send, METH_VARARGS, "send(handle, data) -> bool"},
    {"finish", (PyCFunction)transport_finish, METH_VARARGS, "finish(handle, status, message=None) -> bool"},
    {"pause", (PyCFunction)transport_pause, METH_VARARGS, "pause(handle, paused) -> None"},
    {"flush", (PyCFunction)transport_flush, METH_NOARGS, "flush() -> list of events"},
    {"add_listener", (PyCFunction)transport_add_listener, METH_VARARGS, "add_listener(fd) -> None"},
    {"stop_listening", (PyCFunction)transport_stop_listening, METH_NOARGS, "stop_listening() -> list of events"},
    {"close", (PyCFunction)transport_close, METH_NOARGS, "close() -> list of events"},
    {"fileno", (PyCFunction)transport_fileno, METH_NOARGS, "fileno() -> int: the epoll fd to watch"},
    {"connect", (PyCFunction)transport_connect, METH_VARARGS, "connect(host, port) -> connection id (a client's)"},
    {"request", (PyCFunction)transport_request, METH_VARARGS, "request(connection id, path, authority) -> handle"},
    {"half_close", (PyCFunction)transport_half_close, METH_VARARGS, "half_close(handle) -> bool"},
    {"disconnect", (PyCFunction)transport_disconnect, METH_VARARGS, "disconnect(connection id) -> list of events"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TransportType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gdn_server._native.H2Transport",
    .tp_doc = "The front-end workers' HTTP/2 and gRPC framing (gdn_server/_native_h2.c).",
    .tp_basicsize = sizeof(H2Transport),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = transport_new,
    .tp_init = (initproc)transport_init,
    .tp_dealloc = (destructor)transport_dealloc,
    .tp_methods = transport_methods,
};

int add_h2_transport(PyObject *m) {
    if (PyType_Ready(&TransportType) < 0) return -1;
    Py_INCREF(&TransportType);
    if (PyModule_AddObject(m, "H2Transport", (PyObject *)&TransportType) < 0) {
        Py_DECREF(&TransportType);
        return -1;
    }
    return PyModule_AddIntConstant(m, "H2_OPEN", EV_OPEN) || PyModule_AddIntConstant(m, "H2_MESSAGE", EV_MESSAGE) ||
                   PyModule_AddIntConstant(m, "H2_HALF_CLOSE", EV_HALF_CLOSE) ||
                   PyModule_AddIntConstant(m, "H2_GONE", EV_GONE) || PyModule_AddIntConstant(m, "H2_CLOSED", EV_CLOSED)
               ? -1
               : 0;
}
