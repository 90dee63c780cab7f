/* gdn_server._native, the front-end link's part: an engine's decode of a request frame, and
   the thread that writes its reply frames.

   gdn_server.link's Python stays the reference and says what the frame holds; this answers
   only the common frame and leaves every other one (and every error's message) to it.

   decode_link_request(frame, work_type, heads, ring=None) -> (tag, DecodeWork) | None
       gdn_server.link.decode_request for a KIND_DECODE frame whose inputs are bf16: the tag and
       a DecodeWork made as DecodeWork.of_bf16 makes one (its __dict__ filled directly, no
       __init__), bf16_bytes as memoryview slices of `frame` (or, with FLAG_IN_RING, of `ring`,
       the link's request ring: a memoryview), input_dims from heads = (H, HV, K, V). None for
       anything else: float32 inputs, another kind, a frame whose parts do not end at its end,
       inputs in a ring that is not given or that they do not lie inside (or of a speculative
       step), session ids or strings that are not UTF-8.

   Why in C: an engine under `--frontends N` decodes every request on its one busy thread; the
   Python decode was ~5 us of the ~30 us a request costs there (CPU box, bench/engine_path.py).

   tests/test_native.py compares it with the Python decode on the same frames.

   take_link_requests(buf, start, end, work_type, heads, ring, replies, partial, out, lane=False) -> int
       The engine's reading of the complete frames at the front of a connection's read buffer
       (buf[start:end], each frame behind its 4-byte length), for as long as they are decode
       requests with their inputs in the ring that decode as above: for each, replies.expect(tag)
       and (work, partial(replies.answer, tag), partial(replies.dropped, tag)) appended to `out`,
       as EngineLink._take does; with `lane`, a plain one-row step instead becomes a record of the
       LaneRun at the end of `out` (one is added there when the last item is not one; see
       _native_lane.c), with replies.expect(tag) done in C. Returns where it stopped: the end, an
       incomplete frame, or a frame it leaves to the Python (another kind, or one that does not
       decode here). It saves the Python's per-frame steps (a copy of the frame, the generator,
       _take's dispatch).

   LinkSender(): a thread of its own (no Python, no GIL) that writes frames to sockets.
       send(batch: list[(fd, parts)]) copies each connection's parts (bytes-likes, written back
       to back) and queues them, one lock and at most one wake-up of the thread per call; the
       thread writes each connection's bytes with blocking sendmsg calls, in the order queued.
       wait_idle() returns once everything queued has been written (or failed: a worker gone,
       whose read side the engine drops); close() stops the thread after that.

   Why: with the payloads in the shared-memory rings, an engine's reply frames are small, yet
   its `sendmsg` per worker per round still took ~15% of its one thread on the H200 host (a
   send wakes the worker on another core, which costs a VM more than the copy;
   profile_frontends_v7). The thread makes that one hand-off per round. */
#include "_native.h"
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <string.h>

#ifndef MSG_NOSIGNAL /* macOS: none; Python ignores SIGPIPE anyway, so a gone peer is EPIPE */
#define MSG_NOSIGNAL 0
#endif

static PyObject *k_layer, *k_session_ids, *k_positions, *k_request_id, *k_owner, *k_speculative, *k_bf16_bytes,
    *k_f32_bytes, *k_input_dims, *k_finite_checked, *k_tokens;

/* Sets work.__dict__[key] = value, taking the reference to value; -1 with an error set. */
static int set_field(PyObject *fields, PyObject *key, PyObject *value) {
    if (value == NULL) return -1;
    int failed = PyDict_SetItem(fields, key, value);
    Py_DECREF(value);
    return failed;
}

PyObject *link_inputs(PyObject *view, Py_ssize_t offset, const Py_ssize_t *nbytes) {
    PyObject *raw = PyTuple_New(LINK_INPUTS);
    if (raw == NULL) return NULL;
    for (int i = 0; i < LINK_INPUTS; i++) {
        PyObject *piece = PySequence_GetSlice(view, offset, offset + nbytes[i]);
        if (piece == NULL) {
            Py_DECREF(raw);
            return NULL;
        }
        PyTuple_SET_ITEM(raw, i, piece);
        offset += nbytes[i];
    }
    return raw;
}

PyObject *link_work(PyObject *work_type, unsigned long layer, PyObject *ids, PyObject *positions, PyObject *request_id,
                    PyObject *owner, int speculative, int finite_checked, PyObject *raw, Py_ssize_t B, int T,
                    const Py_ssize_t *heads) {
    /* DecodeWork.of_bf16's object: object.__new__ and the fields straight into its __dict__ */
    Py_ssize_t H = heads[0], HV = heads[1], K = heads[2], V = heads[3], t = T;
    PyObject *no_args = PyTuple_New(0);
    if (no_args == NULL) return NULL;
    PyObject *work = PyBaseObject_Type.tp_new((PyTypeObject *)work_type, no_args, NULL);
    Py_DECREF(no_args);
    if (work == NULL) return NULL;
    PyObject *fields = PyObject_GenericGetDict(work, NULL);
    if (fields == NULL) {
        Py_DECREF(work);
        return NULL;
    }
    int failed = set_field(fields, k_layer, PyLong_FromUnsignedLong(layer))
        || PyDict_SetItem(fields, k_session_ids, ids) || PyDict_SetItem(fields, k_positions, positions)
        || PyDict_SetItem(fields, k_request_id, request_id) || PyDict_SetItem(fields, k_owner, owner)
        || PyDict_SetItem(fields, k_speculative, speculative ? Py_True : Py_False)
        || PyDict_SetItem(fields, k_bf16_bytes, raw) || PyDict_SetItem(fields, k_f32_bytes, Py_None)
        || set_field(fields, k_input_dims,
                     Py_BuildValue("((nnnn)(nnnn)(nnnn)(nnn)(nnn))", B, t, H, K, B, t, H, K, B, t, HV, V, B, t, HV, B, t,
                                   HV))
        /* the worker checked the inputs, or left big ones to the staging copy (FLAG_UNCHECKED) */
        || PyDict_SetItem(fields, k_finite_checked, finite_checked ? Py_True : Py_False)
        || set_field(fields, k_tokens, PyLong_FromLong(T));
    Py_DECREF(fields);
    if (failed) Py_CLEAR(work);
    return work;
}

/* The DecodeWork of the frame of `len` bytes at `base` (what decode_link_request decodes), its tag
   in *tag_out. NULL with no error set for a frame left to the Python, NULL with an error set when a
   call failed. frame_obj holds the bytes, whose slices become the inputs of a frame without
   FLAG_IN_RING; NULL leaves every such frame to the Python. */
static PyObject *decode_frame(const uint8_t *base, Py_ssize_t len, PyObject *frame_obj, PyObject *work_type,
                              const Py_ssize_t *heads, PyObject *ring, uint64_t *tag_out) {
    const uint8_t *end = base + len;
    PyObject *ids = NULL, *positions = NULL, *request_id = NULL, *identity = NULL, *view = NULL, *raw = NULL,
             *work = NULL;

    if (len < HEADER_BYTES || base[0] != KIND_DECODE) goto python;
    uint64_t tag = u64_at(base + 1);
    uint8_t flags = base[9];
    uint32_t layer = u32_at(base + 10), B = u32_at(base + 14);
    uint8_t T = base[18];
    uint16_t rid_len = u16_at(base + 19), ident_len = u16_at(base + 21);
    if (flags & FLAG_F32 || B == 0 || T == 0) goto python;
    if (frame_obj == NULL && !(flags & FLAG_IN_RING)) goto python;
    const uint8_t *p = base + HEADER_BYTES;
    const uint8_t *id_lens = p, *position_words = NULL;
    if ((uint64_t)(end - p) < 2ull * B) goto python;
    p += 2 * (size_t)B;
    if (flags & FLAG_POSITIONS) {
        if ((uint64_t)(end - p) < 8ull * B) goto python;
        position_words = p;
        p += 8 * (size_t)B;
    }

    if ((ids = PyTuple_New(B)) == NULL) goto fail;
    for (uint32_t i = 0; i < B; i++) {
        Py_ssize_t n = u16_at(id_lens + 2 * i);
        if (end - p < n) goto python;
        PyObject *sid = utf8(p, n);
        if (sid == NULL) goto python_or_error;
        PyTuple_SET_ITEM(ids, i, sid);
        p += n;
    }
    if (position_words == NULL) {
        positions = Py_None;
        Py_INCREF(positions);
    } else {
        if ((positions = PyTuple_New(B)) == NULL) goto fail;
        for (uint32_t i = 0; i < B; i++) {
            PyObject *n = PyLong_FromUnsignedLongLong(u64_at(position_words + 8 * i));
            if (n == NULL) goto fail;
            PyTuple_SET_ITEM(positions, i, n);
        }
    }
    if (end - p < (Py_ssize_t)rid_len + ident_len) goto python;
    if ((request_id = utf8(p, rid_len)) == NULL) goto python_or_error;
    p += rid_len;
    if (ident_len == 0) {
        identity = Py_None;
        Py_INCREF(identity);
    } else if ((identity = utf8(p, ident_len)) == NULL) {
        goto python_or_error;
    }
    p += ident_len;

    /* the inputs: q, k [B, T, H, K], v [B, T, HV, V], a, b [B, T, HV], each bf16, back to back */
    Py_ssize_t nbytes[LINK_INPUTS], offset = p - base, total = 0;
    link_input_bytes(heads, (Py_ssize_t)B * T, nbytes);
    for (int i = 0; i < LINK_INPUTS; i++) total += nbytes[i];
    if (flags & FLAG_IN_RING) { /* the frame ends with the inputs' monotonic offset in the ring */
        if (ring == Py_None || !PyMemoryView_Check(ring) || len - offset != 8 || flags & FLAG_SPECULATIVE)
            goto python;
        Py_ssize_t ring_len = PyObject_Length(ring);
        if (ring_len <= 0) goto python_or_error;
        uint64_t at = u64_at(p);
        offset = (Py_ssize_t)(at % (uint64_t)ring_len);
        if (offset + total > ring_len) goto python;
        view = ring;
        Py_INCREF(view);
    } else {
        if (len - offset != total) goto python;
        if ((view = PyMemoryView_FromObject(frame_obj)) == NULL) goto fail;
    }
    if ((raw = link_inputs(view, offset, nbytes)) == NULL) goto fail;
    work = link_work(work_type, layer, ids, positions, request_id, identity, flags & FLAG_SPECULATIVE,
                     !(flags & FLAG_UNCHECKED), raw, B, T, heads);
    if (work == NULL) goto fail;
    *tag_out = tag;
    goto done;

python_or_error:
    if (PyErr_Occurred()) goto fail; /* out of memory: raise it */
python:
fail:
    Py_CLEAR(work);
done:
    Py_XDECREF(ids);
    Py_XDECREF(positions);
    Py_XDECREF(request_id);
    Py_XDECREF(identity);
    Py_XDECREF(raw);
    Py_XDECREF(view);
    return work;
}

static PyObject *decode_link_request(PyObject *self, PyObject *args) {
    Py_buffer frame;
    PyObject *work_type, *ring = Py_None;
    Py_ssize_t H, HV, K, V;
    if (!PyArg_ParseTuple(args, "y*O!(nnnn)|O", &frame, &PyType_Type, &work_type, &H, &HV, &K, &V, &ring))
        return NULL;
    uint64_t tag = 0;
    PyObject *work = decode_frame(frame.buf, frame.len, frame.obj, work_type, (const Py_ssize_t[4]){H, HV, K, V}, ring,
                                  &tag);
    PyObject *result;
    if (work != NULL) {
        result = Py_BuildValue("(KO)", (unsigned long long)tag, work);
        Py_DECREF(work);
    } else if (PyErr_Occurred()) {
        result = NULL;
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&frame);
    return result;
}

/* take_link_requests: see the top of this file. */
static PyObject *take_link_requests(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 9 || nargs > 10 || !PyByteArray_Check(args[0]) || !PyType_Check(args[3]) ||
        !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != 4 || !PyList_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "take_link_requests(buf: bytearray, start: int, end: int, work_type: type, "
                                         "heads: (H, HV, K, V), ring: memoryview, replies, partial, out: list, "
                                         "lane: bool = False)");
        return NULL;
    }
    int lane = nargs == 10 ? PyObject_IsTrue(args[9]) : 0;
    if (lane < 0) return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
    if ((start == -1 || end == -1) && PyErr_Occurred()) return NULL;
    Py_ssize_t heads[4];
    for (int i = 0; i < 4; i++) {
        heads[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[4], i));
        if (heads[i] == -1 && PyErr_Occurred()) return NULL;
    }
    if (start < 0 || end < start || end > PyByteArray_GET_SIZE(args[0])) {
        PyErr_SetString(PyExc_ValueError, "take_link_requests: start and end must lie inside buf");
        return NULL;
    }
    PyObject *work_type = args[3], *ring = args[5], *replies = args[6], *partial = args[7], *out = args[8];
    PyObject *expect = PyObject_GetAttrString(replies, "expect");
    PyObject *answer = expect ? PyObject_GetAttrString(replies, "answer") : NULL;
    PyObject *dropped = answer ? PyObject_GetAttrString(replies, "dropped") : NULL;
    if (dropped == NULL) goto fail;
    /* nothing called below resizes buf (the caller's read buffer): the pointer stays valid */
    const uint8_t *buf = (const uint8_t *)PyByteArray_AS_STRING(args[0]);
    while (end - start >= 4) {
        Py_ssize_t size = (Py_ssize_t)u32_at(buf + start);
        if (end - start - 4 < size) break; /* not all there yet */
        if (lane) { /* a plain one-row step: a record of a LaneRun (_native_lane.c) */
            int taken = lane_take_frame(buf + start + 4, size, ring, replies, heads, out);
            if (taken < 0) goto fail;
            if (taken) {
                start += 4 + size;
                continue;
            }
        }
        uint64_t tag = 0;
        PyObject *work = decode_frame(buf + start + 4, size, NULL, work_type, heads, ring, &tag);
        if (work == NULL) {
            if (PyErr_Occurred()) goto fail;
            break; /* another kind, or a frame the Python decodes (or answers as malformed) */
        }
        PyObject *tag_obj = PyLong_FromUnsignedLongLong(tag);
        PyObject *expected = tag_obj ? PyObject_CallOneArg(expect, tag_obj) : NULL;
        PyObject *done = expected ? PyObject_CallFunctionObjArgs(partial, answer, tag_obj, NULL) : NULL;
        PyObject *cancelled = done ? PyObject_CallFunctionObjArgs(partial, dropped, tag_obj, NULL) : NULL;
        PyObject *request = cancelled ? PyTuple_Pack(3, work, done, cancelled) : NULL;
        int appended = request ? PyList_Append(out, request) : -1;
        Py_XDECREF(request);
        Py_XDECREF(cancelled);
        Py_XDECREF(done);
        Py_XDECREF(expected);
        Py_XDECREF(tag_obj);
        Py_DECREF(work);
        if (appended < 0) goto fail;
        start += 4 + size;
    }
    Py_DECREF(expect);
    Py_DECREF(answer);
    Py_DECREF(dropped);
    return PyLong_FromSsize_t(start);
fail:
    Py_XDECREF(expect);
    Py_XDECREF(answer);
    Py_XDECREF(dropped);
    return NULL;
}

static PyMethodDef link_methods[] = {
    {"decode_link_request", decode_link_request, METH_VARARGS,
     "decode_link_request(frame: bytes-like, work_type: type, heads: (H, HV, K, V), ring: memoryview | None = None)"
     " -> (tag, DecodeWork) | None"},
    {"take_link_requests", (PyCFunction)(void (*)(void))take_link_requests, METH_FASTCALL,
     "take_link_requests(buf: bytearray, start: int, end: int, work_type: type, heads: (H, HV, K, V), "
     "ring: memoryview, replies, partial, out: list, lane: bool = False) -> int"},
    {NULL, NULL, 0, NULL},
};

/* -- LinkSender ---------------------------------------------------------------------------- */

typedef struct Outgoing {
    struct Outgoing *next;
    int fd;
    size_t len;
    unsigned char data[];
} Outgoing;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started, stopping, busy;
    pthread_mutex_t lock;
    pthread_cond_t more; /* something queued, or stopping */
    pthread_cond_t idle; /* the queue ran empty */
    Outgoing *head, *tail;
} LinkSender;

/* Writes all of an item to its (blocking) socket; gives up on an error other than EINTR (the
   peer is gone: the engine's read side drops the connection). */
static void write_all(const Outgoing *item) {
    size_t done = 0;
    while (done < item->len) {
        ssize_t n = send(item->fd, item->data + done, item->len - done, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            return;
        }
        done += (size_t)n;
    }
}

static void *sender_main(void *arg) {
    LinkSender *self = arg;
    pthread_mutex_lock(&self->lock);
    for (;;) {
        while (self->head == NULL && !self->stopping) pthread_cond_wait(&self->more, &self->lock);
        Outgoing *item = self->head;
        if (item == NULL) break; /* stopping, and everything written */
        self->head = item->next;
        if (self->head == NULL) self->tail = NULL;
        self->busy = 1;
        pthread_mutex_unlock(&self->lock);
        write_all(item);
        free(item);
        pthread_mutex_lock(&self->lock);
        self->busy = 0;
        if (self->head == NULL) pthread_cond_broadcast(&self->idle);
    }
    pthread_mutex_unlock(&self->lock);
    return NULL;
}

static PyObject *sender_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "LinkSender() takes no arguments");
        return NULL;
    }
    LinkSender *self = (LinkSender *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->more, NULL);
    pthread_cond_init(&self->idle, NULL);
    if (pthread_create(&self->thread, NULL, sender_main, self) != 0) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_OSError, "could not start the link's sender thread");
        return NULL;
    }
    self->started = 1;
    return (PyObject *)self;
}

/* Frees a chain of items. */
static void free_chain(Outgoing *item) {
    while (item != NULL) {
        Outgoing *next = item->next;
        free(item);
        item = next;
    }
}

static PyObject *sender_send(LinkSender *self, PyObject *batch) {
    if (!PyList_Check(batch)) {
        PyErr_SetString(PyExc_TypeError, "send(batch: list[(fd, parts)])");
        return NULL;
    }
    Outgoing *first = NULL, *last = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batch); i++) {
        PyObject *entry = PyList_GET_ITEM(batch, i), *parts;
        int fd;
        if (!PyTuple_Check(entry)) {
            PyErr_SetString(PyExc_TypeError, "send(batch: list[(fd, parts)]): an entry is not a tuple");
            goto fail;
        }
        if (!PyArg_ParseTuple(entry, "iO!", &fd, &PyList_Type, &parts)) goto fail;
        Py_ssize_t count = PyList_GET_SIZE(parts);
        Py_buffer *views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
        if (views == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        size_t total = 0;
        Py_ssize_t got = 0;
        for (; got < count; got++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(parts, got), &views[got], PyBUF_C_CONTIGUOUS) < 0) break;
            total += (size_t)views[got].len;
        }
        Outgoing *item = got == count ? malloc(sizeof(Outgoing) + total) : NULL;
        if (item != NULL) {
            item->next = NULL;
            item->fd = fd;
            item->len = total;
            size_t at = 0;
            for (Py_ssize_t j = 0; j < count; j++) {
                memcpy(item->data + at, views[j].buf, (size_t)views[j].len);
                at += (size_t)views[j].len;
            }
        }
        for (Py_ssize_t j = 0; j < got; j++) PyBuffer_Release(&views[j]);
        PyMem_Free(views);
        if (item == NULL) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            goto fail;
        }
        if (last == NULL) first = item;
        else last->next = item;
        last = item;
    }
    if (first == NULL) Py_RETURN_NONE;
    pthread_mutex_lock(&self->lock);
    if (self->stopping) {
        pthread_mutex_unlock(&self->lock);
        free_chain(first);
        PyErr_SetString(PyExc_RuntimeError, "the link's sender is closed");
        return NULL;
    }
    int was_empty = self->head == NULL;
    if (was_empty) self->head = first;
    else self->tail->next = first;
    self->tail = last;
    /* a thread busy writing comes back for the queue by itself: no wake-up needed */
    if (was_empty && !self->busy) pthread_cond_signal(&self->more);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
fail:
    free_chain(first);
    return NULL;
}

static void wait_idle(LinkSender *self) {
    pthread_mutex_lock(&self->lock);
    while (self->head != NULL || self->busy) pthread_cond_wait(&self->idle, &self->lock);
    pthread_mutex_unlock(&self->lock);
}

static PyObject *sender_wait_idle(LinkSender *self, PyObject *unused) {
    if (self->started) {
        Py_BEGIN_ALLOW_THREADS
        wait_idle(self);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static void stop_thread(LinkSender *self) {
    if (!self->started) return;
    pthread_mutex_lock(&self->lock);
    self->stopping = 1;
    pthread_cond_signal(&self->more);
    pthread_mutex_unlock(&self->lock);
    pthread_join(self->thread, NULL);
    self->started = 0;
}

static PyObject *sender_close(LinkSender *self, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    stop_thread(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void sender_dealloc(LinkSender *self) {
    stop_thread(self); /* writes what is queued first */
    free_chain(self->head);
    pthread_mutex_destroy(&self->lock);
    pthread_cond_destroy(&self->more);
    pthread_cond_destroy(&self->idle);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyMethodDef sender_methods[] = {
    {"send", (PyCFunction)sender_send, METH_O,
     "send(batch: list[(fd, parts)]) -> None: queues each connection's parts, written back to back"},
    {"wait_idle", (PyCFunction)sender_wait_idle, METH_NOARGS, "wait_idle() -> None: once all queued is written"},
    {"close", (PyCFunction)sender_close, METH_NOARGS, "close() -> None: writes what is queued, stops the thread"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot sender_slots[] = {
    {Py_tp_new, sender_new},
    {Py_tp_dealloc, sender_dealloc},
    {Py_tp_methods, sender_methods},
    {Py_tp_doc, "A thread that writes link frames to sockets without the GIL (gdn_server.engine_link)."},
    {0, NULL},
};

static PyType_Spec sender_spec = {
    "gdn_server._native.LinkSender", sizeof(LinkSender), 0, Py_TPFLAGS_DEFAULT, sender_slots,
};

int add_link_functions(PyObject *module) {
    static const InternedName names[] = {
        {&k_layer, "layer"},           {&k_session_ids, "session_ids"}, {&k_positions, "positions"},
        {&k_request_id, "request_id"}, {&k_owner, "owner"},             {&k_speculative, "speculative"},
        {&k_bf16_bytes, "bf16_bytes"}, {&k_input_dims, "input_dims"},   {&k_finite_checked, "finite_checked"},
        {&k_tokens, "_tokens"},        {&k_f32_bytes, "f32_bytes"},
    };
    if (intern_names(names, sizeof(names) / sizeof(names[0])) < 0) return -1;
    if (PyModule_AddFunctions(module, link_methods) < 0) return -1;
    PyObject *sender_type = PyType_FromSpec(&sender_spec);
    if (sender_type == NULL) return -1;
    if (PyModule_AddObject(module, "LinkSender", sender_type) < 0) {
        Py_DECREF(sender_type);
        return -1;
    }
    return 0;
}
