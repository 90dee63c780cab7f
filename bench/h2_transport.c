/* A gRPC server transport in C with the per-request work left to Python: the design that
 * bench/NOTES.md's checklist (twenty-seventh session) proposes for the workers, in its least
 * form, to measure what it would cost per step before it is built into them.
 *
 * HTTP/2 and gRPC's message framing run here (libnghttp2, bench/nghttp2_api.h, and what this
 * shares with bench/h2_floor.c in bench/h2_common.h); the caller's
 * event loop watches `fileno()` (an epoll fd) and calls `poll()` when it is readable, handles the
 * events in Python and answers with `send` and `finish`, then `flush()`. One thread: the loop's.
 *
 *   Transport(port) -> listens on 127.0.0.1:port (0: any free port; `.port` says which)
 *   poll() -> [(OPEN, handle, path) | (MESSAGE, handle, bytes) | (HALF_CLOSE, handle) | (GONE, handle)]
 *   send(handle, data) -> bool      a message on the stream (False: the stream is gone)
 *   finish(handle, status) -> bool  the stream's trailers, after its messages
 *   flush()                         writes what every connection has to send
 *
 * bench/h2_floor.py builds it as a Python extension and serves gdn-loadtest's echo with it. Not a
 * server for anything else: no TLS, deadlines, compression or limits beyond the message size.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "h2_common.h"

enum { EV_OPEN = 1, EV_MESSAGE = 2, EV_HALF_CLOSE = 3, EV_GONE = 4 };

struct Conn;

typedef struct Stream {
    Outbox out; /* first: nghttp2's data source points at the stream; out.done: finish() was called */
    Inbox in;
    struct Stream *prev, *next; /* the connection's streams */
    struct Conn *conn;
    int32_t id;
    long long handle;
    PyObject *path;
    int responded;
} Stream;

typedef struct Conn {
    Wire wire;
    Stream *streams;
    struct Transport *owner;
} Conn;

typedef struct Transport {
    PyObject_HEAD
    int epfd, listen_fd, port;
    long long next_handle;
    PyObject *events;  /* list, handed out by poll() */
    PyObject *handles; /* dict: handle -> Stream* (as an int) */
    Conn **conns;      /* every open connection, for flush() */
    size_t n_conns, cap_conns;
} Transport;

static nghttp2_session_callbacks *callbacks;

static int emit(Transport *t, PyObject *event) {
    if (event == NULL) return -1;
    int rc = PyList_Append(t->events, event);
    Py_DECREF(event);
    return rc;
}

static Stream *stream_of(Transport *t, long long handle) {
    PyObject *key = PyLong_FromLongLong(handle);
    if (key == NULL) return NULL;
    PyObject *ptr = PyDict_GetItemWithError(t->handles, key);
    Py_DECREF(key);
    return ptr == NULL ? NULL : (Stream *)PyLong_AsVoidPtr(ptr);
}

/* The stream of `handle` while Python may still answer on it; NULL when it is gone or finished
   (with an error set only if the look-up itself failed). */
static Stream *open_stream(Transport *t, long long handle) {
    Stream *s = stream_of(t, handle);
    return s != NULL && !s->out.done ? s : NULL;
}

/* Frees a closed stream; Python hears GONE of one it had not finished. */
static void free_stream(Stream *s) {
    Transport *t = s->conn->owner;
    if (!s->out.done) emit(t, Py_BuildValue("(iL)", EV_GONE, s->handle));
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
    free(s->in.buf);
    free(s);
}

static int on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    Conn *c = user;
    if (frame->hd.type != FRAME_HEADERS || nghttp2_session_get_stream_user_data(session, frame->hd.stream_id))
        return 0;
    Stream *s = calloc(1, sizeof(Stream));
    if (s == NULL) return ERR_CALLBACK_FAILURE;
    s->conn = c;
    s->id = frame->hd.stream_id;
    s->handle = ++c->owner->next_handle;
    s->next = c->streams;
    if (c->streams) c->streams->prev = s;
    c->streams = s;
    PyObject *key = PyLong_FromLongLong(s->handle), *ptr = PyLong_FromVoidPtr(s);
    int rc = key && ptr ? PyDict_SetItem(c->owner->handles, key, ptr) : -1;
    Py_XDECREF(key);
    Py_XDECREF(ptr);
    nghttp2_session_set_stream_user_data(session, s->id, s);
    return rc < 0 ? ERR_CALLBACK_FAILURE : 0;
}

static int on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name, size_t namelen,
                     const uint8_t *value, size_t valuelen, uint8_t flags, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (s != NULL && s->path == NULL && namelen == 5 && memcmp(name, ":path", 5) == 0) {
        s->path = PyUnicode_DecodeUTF8((const char *)value, (Py_ssize_t)valuelen, "replace");
        if (s->path == NULL) return ERR_CALLBACK_FAILURE;
    }
    return 0;
}

static int on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (s == NULL) return 0;
    Transport *t = s->conn->owner;
    if (frame->hd.type == FRAME_HEADERS && !s->responded) {
        s->responded = 1;
        nghttp2_nv h[] = {h2_nv(":status", "200"), h2_nv("content-type", "application/grpc")};
        nghttp2_data_provider provider = {{.ptr = s}, outbox_read};
        nghttp2_submit_response(session, s->id, h, 2, &provider);
        if (emit(t, Py_BuildValue("(iLO)", EV_OPEN, s->handle, s->path ? s->path : Py_None)) < 0)
            return ERR_CALLBACK_FAILURE;
    }
    if ((frame->hd.type == FRAME_DATA || frame->hd.type == FRAME_HEADERS) && (frame->hd.flags & FLAG_END_STREAM))
        if (emit(t, Py_BuildValue("(iL)", EV_HALF_CLOSE, s->handle)) < 0) return ERR_CALLBACK_FAILURE;
    return 0;
}

/* inbox_add's callback: each whole message up to Python as an event */
static int message_up(void *ctx, const uint8_t *msg, size_t size) {
    Stream *s = ctx;
    PyObject *data = PyBytes_FromStringAndSize((const char *)msg, (Py_ssize_t)size);
    return emit(s->conn->owner, data ? Py_BuildValue("(iLN)", EV_MESSAGE, s->handle, data) : NULL);
}

static int on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t id, const uint8_t *data, size_t len,
                         void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, id);
    return s == NULL ? 0 : inbox_add(&s->in, data, len, message_up, s);
}

static int on_stream_close(nghttp2_session *session, int32_t id, uint32_t error_code, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, id);
    if (s != NULL) free_stream(s);
    return 0;
}

static int flush_conn(Transport *t, Conn *c) { return wire_flush(&c->wire, t->epfd, c); }

static void close_conn(Transport *t, Conn *c) {
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

static void accept_all(Transport *t) {
    for (;;) {
        int fd = h2_accept(t->listen_fd);
        if (fd < 0) return;
        if (t->n_conns == t->cap_conns) {
            Conn **grown = realloc(t->conns, (t->cap_conns * 2 + 8) * sizeof(Conn *));
            if (grown == NULL) {
                close(fd);
                return;
            }
            t->conns = grown;
            t->cap_conns = t->cap_conns * 2 + 8;
        }
        Conn *c = calloc(1, sizeof(Conn));
        if (c == NULL || nghttp2_session_server_new(&c->wire.session, callbacks, c) != 0) {
            close(fd);
            free(c);
            return;
        }
        t->conns[t->n_conns++] = c;
        c->wire.fd = fd;
        c->owner = t;
        h2_server_settings(c->wire.session);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(t->epfd, EPOLL_CTL_ADD, fd, &ev);
        if (flush_conn(t, c) < 0) close_conn(t, c);
    }
}

static PyObject *transport_poll(Transport *t, PyObject *unused) {
    static uint8_t buf[1 << 16];
    struct epoll_event events[64];
    int n = epoll_wait(t->epfd, events, 64, 0);
    for (int i = 0; i < n; i++) {
        Conn *c = events[i].data.ptr;
        if (c == NULL) {
            accept_all(t);
            continue;
        }
        if (wire_read(&c->wire, buf, sizeof buf) < 0 || flush_conn(t, c) < 0) close_conn(t, c);
    }
    if (PyErr_Occurred()) return NULL;
    PyObject *out = t->events;
    t->events = PyList_New(0);
    if (t->events == NULL) {
        t->events = out;
        return NULL;
    }
    return out;
}

static PyObject *transport_send(Transport *t, PyObject *args) {
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

static PyObject *transport_finish(Transport *t, PyObject *args) {
    long long handle;
    int status;
    if (!PyArg_ParseTuple(args, "Li", &handle, &status)) return NULL;
    Stream *s = open_stream(t, handle);
    if (s == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    s->out.done = 1;
    s->out.status = status;
    nghttp2_session_resume_data(s->conn->wire.session, s->id);
    Py_RETURN_TRUE;
}

static PyObject *transport_flush(Transport *t, PyObject *unused) {
    for (size_t i = 0; i < t->n_conns;) {
        Conn *c = t->conns[i];
        if (flush_conn(t, c) < 0) close_conn(t, c); /* moves the last connection into slot i */
        else i++;
    }
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *transport_fileno(Transport *t, PyObject *unused) { return PyLong_FromLong(t->epfd); }

static int transport_init(Transport *t, PyObject *args, PyObject *kwargs) {
    int port = 0;
    if (!PyArg_ParseTuple(args, "|i", &port)) return -1;
    t->events = PyList_New(0);
    t->handles = PyDict_New();
    if (t->events == NULL || t->handles == NULL) return -1;
    t->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (t->epfd < 0 || (t->listen_fd = h2_listen_loopback(port, &t->port)) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->listen_fd, &ev);
    return 0;
}

static void transport_dealloc(Transport *t) {
    while (t->n_conns) close_conn(t, t->conns[t->n_conns - 1]);
    free(t->conns);
    if (t->listen_fd > 0) close(t->listen_fd);
    if (t->epfd > 0) close(t->epfd);
    Py_XDECREF(t->events);
    Py_XDECREF(t->handles);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *transport_port(Transport *t, void *unused) { return PyLong_FromLong(t->port); }

static PyMethodDef transport_methods[] = {
    {"poll", (PyCFunction)transport_poll, METH_NOARGS, "poll() -> list of events"},
    {"send", (PyCFunction)transport_send, METH_VARARGS, "send(handle, data) -> bool"},
    {"finish", (PyCFunction)transport_finish, METH_VARARGS, "finish(handle, status) -> bool"},
    {"flush", (PyCFunction)transport_flush, METH_NOARGS, "flush() -> None"},
    {"fileno", (PyCFunction)transport_fileno, METH_NOARGS, "fileno() -> int: the epoll fd to watch"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef transport_getset[] = {
    {"port", (getter)transport_port, NULL, "the port it listens on", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TransportType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "h2_transport.Transport",
    .tp_basicsize = sizeof(Transport),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)transport_init,
    .tp_dealloc = (destructor)transport_dealloc,
    .tp_methods = transport_methods,
    .tp_getset = transport_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "h2_transport", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_h2_transport(void) {
    if (PyType_Ready(&TransportType) < 0) return NULL;
    if (callbacks == NULL)
        callbacks = h2_callbacks(on_begin_headers, on_header, on_frame_recv, on_data_chunk, on_stream_close);
    if (callbacks == NULL) return PyErr_NoMemory();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&TransportType);
    if (PyModule_AddObject(m, "Transport", (PyObject *)&TransportType) < 0) {
        Py_DECREF(&TransportType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
