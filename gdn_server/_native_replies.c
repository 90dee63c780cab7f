/* gdn_server._native, the front-end link rings' copies (ring_write, and every copy below) and
   the engine's replies on one link connection (ReplyBox).

   gdn_server.engine_link.PyReplyBox is the reference: this type does the same, call for call,
   and writes the same bytes (tests/test_link_ring.py runs both through the same sequences).

   ReplyBox(ring, dirty, key, result_type, encode_reply, cancelled_error)
       ring: the connection's reply ring (a writable memoryview; None: every payload in its frame);
       dirty: a set the box adds `key` to whenever it has frames waiting (EngineLink's);
       result_type: DecodeResult, whose answers it encodes itself; encode_reply: link.encode_reply,
       called for every other answer (errors: no payload, no ring); cancelled_error: the answer to
       a request dropped because its caller gave up.
   expect(tag)        a request is queued: it is outstanding until answered
   cancel(tag)        its caller gave up (if it is still outstanding)
   dropped(tag)       the scheduler's `cancelled` check: answers a cancelled request with
                      cancelled_error and returns True (once), else False
   answer(tag, result) the reply to `tag`: a DecodeResult's output goes into the reply ring
                      (or its frame, when the ring is full), its frame into the box
   ack(read_to)       the worker has copied out every ring payload before this offset
   take()             the frames waiting (none once closed), handed over and forgotten
   close()            the connection is gone: later answers are dropped
   unanswered()       the outstanding tags (tests)

   Why in C: under `--frontends N` the engine answers every request on its one busy thread, and
   the Python answer (a bound method, the frame's encoding, the ring's copy) was ~3.3 of the ~25
   us a request costs there (CPU box, bench/engine_path.py). Called with the GIL held and never
   letting it go, each method is atomic towards the engine's other threads: no lock is needed to
   keep the ring's payloads in the order of their frames. */
#include "_native.h"
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAMING_STORES 1
#endif

#define STATUS_IN_RING 255
#define REPLY_BYTES 18 /* link.REPLY: <QBIBI (tag, status, B, T, len(message)) */

static PyObject *r_out, *r_shape, *r_positions;

typedef struct {
    PyObject_HEAD
    Py_buffer ring; /* ring.obj NULL: no reply ring (or closed) */
    unsigned long long head; /* monotonic: ring bytes ever written, padding included */
    unsigned long long acked; /* monotonic: the worker has copied out everything before it */
    int open;
    PyObject *dirty, *key, *result_type, *encode_reply, *cancelled_error;
    PyObject *outstanding; /* tag -> cancelled */
    PyObject *outbox;      /* frames (bytes-likes) not yet taken */
} ReplyBox;

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, unsigned long long v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static PyObject *box_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *ring, *dirty, *key, *result_type, *encode_reply, *cancelled_error;
    static char *kwlist[] = {"ring", "dirty", "key", "result_type", "encode_reply", "cancelled_error", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OO!OO:ReplyBox", kwlist, &ring, &PySet_Type, &dirty, &key,
                                     &PyType_Type, &result_type, &encode_reply, &cancelled_error))
        return NULL;
    ReplyBox *self = (ReplyBox *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->open = 1;
    if (ring != Py_None && PyObject_GetBuffer(ring, &self->ring, PyBUF_WRITABLE) < 0) goto fail;
    self->outstanding = PyDict_New();
    self->outbox = PyList_New(0);
    if (self->outstanding == NULL || self->outbox == NULL) goto fail;
    Py_INCREF(dirty);
    self->dirty = dirty;
    Py_INCREF(key);
    self->key = key;
    Py_INCREF(result_type);
    self->result_type = result_type;
    Py_INCREF(encode_reply);
    self->encode_reply = encode_reply;
    Py_INCREF(cancelled_error);
    self->cancelled_error = cancelled_error;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* Streaming (non-temporal) stores for a ring's payloads: the process that reads them next runs
   on another core, and the lines it last read are in that core's cache. A plain store must first
   take each line from there (a snoop across the socket per 64 bytes, which on the H200 host's VM
   made the engine's copies of a round's payloads cost several times their size's worth); a
   streaming store writes whole lines to memory without reading them, and the reader fetches them
   from memory with its prefetchers running ahead. The last sfence orders them before the socket
   write that tells the other side to look. */
void copy_for_another_core(void *dst, const void *src, size_t n) {
#ifdef HAVE_STREAMING_STORES
    uint8_t *d = dst;
    const uint8_t *s = src;
    if (n < 1024) { /* a few lines: not worth the fence */
        memcpy(d, s, n);
        return;
    }
    size_t head = (64 - ((uintptr_t)d & 63)) & 63; /* whole lines only, so no line is half cached */
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16)),
                c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

/* ring_write(ring, at, parts[, threads]) -> int: link_ring.RequestRing.put's copy of a request's
   parts (bytes-likes) back to back into `ring` (a writable buffer) from byte `at`, with
   copy_for_another_core; the bytes written. The caller has checked they fit. With threads > 1
   the copy is split over that many threads (copy_spans), without the GIL: a big request's
   megabytes, which one thread writes at a memory channel's pace. */
static PyObject *ring_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "ring_write(ring, at: int, parts: list, threads: int = 1)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[1]);
    if (at == -1 && PyErr_Occurred()) return NULL;
    long threads = nargs == 4 ? PyLong_AsLong(args[3]) : 1;
    if (threads == -1 && PyErr_Occurred()) return NULL;
    Py_buffer ring;
    if (PyObject_GetBuffer(args[0], &ring, PyBUF_WRITABLE) < 0) return NULL;
    PyObject *parts = args[2];
    Py_ssize_t n = PyList_GET_SIZE(parts), held = 0, pos = at;
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    Span *spans = PyMem_Calloc(n ? n : 1, sizeof(Span));
    PyObject *result = NULL;
    if (views == NULL || spans == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(parts, held), &views[held], PyBUF_SIMPLE) < 0) goto done;
        Py_ssize_t len = views[held].len;
        if (pos < 0 || len > ring.len - pos) {
            PyBuffer_Release(&views[held]);
            PyErr_SetString(PyExc_ValueError, "ring_write: the parts run past the ring's end");
            goto done;
        }
        spans[held] = (Span){(uint8_t *)ring.buf + pos, views[held].buf, len, SPAN_STREAM};
        pos += len;
    }
    /* copy_spans splits at even byte counts: an odd part (never a bf16 input) stays on one thread */
    int even = 1;
    for (Py_ssize_t i = 0; i < n; i++) even &= spans[i].len % 2 == 0;
    if (threads > 1 && even) {
        uint8_t *found = PyMem_Calloc(n ? n : 1, 1);
        if (found == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        copy_spans(spans, n, (int)threads, found);
        Py_END_ALLOW_THREADS
        PyMem_Free(found);
    } else {
        for (Py_ssize_t i = 0; i < n; i++) copy_for_another_core(spans[i].dst, spans[i].src, (size_t)spans[i].len);
    }
    result = PyLong_FromSsize_t(pos - at);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(spans);
    PyBuffer_Release(&ring);
    return result;
}

static PyMethodDef ring_methods[] = {
    {"ring_write", (PyCFunction)(void (*)(void))ring_write, METH_FASTCALL,
     "ring_write(ring, at: int, parts: list, threads: int = 1) -> int: parts copied back to back from `at`"},
    {NULL, NULL, 0, NULL},
};

/* Copies a payload into the ring; its monotonic offset, or -1 when it does not fit now (as
   link_ring.ReplyRing.put: never split, at most half the ring). */
static long long ring_put(ReplyBox *self, const void *data, Py_ssize_t nbytes) {
    unsigned long long capacity = (unsigned long long)self->ring.len, n = (unsigned long long)nbytes;
    if (self->ring.obj == NULL || n == 0 || n > capacity / 2) return -1;
    unsigned long long pos = self->head % capacity;
    unsigned long long start = pos + n <= capacity ? self->head : self->head + capacity - pos;
    if (start + n - self->acked > capacity) return -1;
    copy_for_another_core((uint8_t *)self->ring.buf + start % capacity, data, (size_t)n);
    self->head = start + n;
    return (long long)start;
}

/* Appends the frame of an answer with an output to the outbox (as link.encode_reply): `rows`
   positions, T = `tokens`, and the output `out` (a bytes-like) in the ring, or after the frame's
   head when the ring has no room. */
static int encode_output(ReplyBox *self, unsigned long long tag, Py_ssize_t rows, long tokens,
                         const unsigned long long *positions, PyObject *out) {
    int rc = -1;
    PyObject *frame = NULL;
    Py_buffer payload = {0};
    if (PyObject_GetBuffer(out, &payload, PyBUF_SIMPLE) < 0) goto done;
    long long at = ring_put(self, payload.buf, payload.len);
    Py_ssize_t head_bytes = 4 + REPLY_BYTES + 8 * rows;
    Py_ssize_t frame_bytes = REPLY_BYTES + 8 * rows + (at >= 0 ? 8 : payload.len);
    if (frame_bytes > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a reply too big for a link frame");
        goto done;
    }
    frame = PyBytes_FromStringAndSize(NULL, head_bytes + (at >= 0 ? 8 : 0));
    if (frame == NULL) goto done;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(frame);
    put_u32(p, (uint32_t)frame_bytes);
    put_u64(p + 4, tag);
    p[12] = at >= 0 ? STATUS_IN_RING : 0;
    put_u32(p + 13, (uint32_t)rows);
    p[17] = (uint8_t)tokens;
    put_u32(p + 18, 0);
    for (Py_ssize_t i = 0; i < rows; i++) put_u64(p + 4 + REPLY_BYTES + 8 * i, positions[i]);
    if (at >= 0) {
        put_u64(p + head_bytes, (unsigned long long)at);
        rc = PyList_Append(self->outbox, frame);
    } else { /* the ring is full (or there is none): the payload follows its head, as is */
        rc = PyList_Append(self->outbox, frame);
        if (rc == 0) rc = PyList_Append(self->outbox, out);
    }
    /* a frame that failed after its payload went into the ring (out of memory) leaves those
       bytes unread: the worker's ack of a later payload frees them */
done:
    if (payload.obj != NULL) PyBuffer_Release(&payload);
    Py_XDECREF(frame);
    return rc;
}

/* Appends the frame of a DecodeResult to the outbox (as link.encode_reply). */
static int encode_result(ReplyBox *self, unsigned long long tag, PyObject *result) {
    int rc = -1;
    PyObject *out = PyObject_GetAttr(result, r_out);
    PyObject *shape = out ? PyObject_GetAttr(result, r_shape) : NULL;
    PyObject *positions = shape ? PyObject_GetAttr(result, r_positions) : NULL;
    unsigned long long few[16], *counts = few;
    if (positions == NULL) goto done;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) < 2 || !PyTuple_Check(positions)) {
        PyErr_SetString(PyExc_TypeError, "a DecodeResult's shape and positions must be tuples");
        goto done;
    }
    Py_ssize_t rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, 0));
    long tokens = PyLong_AsLong(PyTuple_GET_ITEM(shape, 1));
    if (PyErr_Occurred()) goto done;
    if (rows < 0 || rows > UINT32_MAX || tokens < 0 || tokens > 255 || PyTuple_GET_SIZE(positions) != rows) {
        PyErr_Format(PyExc_ValueError, "a reply of %zd rows, %ld tokens and %zd positions does not fit a frame",
                     rows, tokens, PyTuple_GET_SIZE(positions));
        goto done;
    }
    if (rows > 16 && (counts = PyMem_Malloc(sizeof(*counts) * (size_t)rows)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < rows; i++) { /* each fits a u64: checked before the ring takes the payload */
        counts[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(positions, i));
        if (counts[i] == (unsigned long long)-1 && PyErr_Occurred()) goto done;
    }
    rc = encode_output(self, tag, rows, tokens, counts, out);
done:
    if (counts != few) PyMem_Free(counts);
    Py_XDECREF(out);
    Py_XDECREF(shape);
    Py_XDECREF(positions);
    return rc;
}

/* `tag` is answered: no longer outstanding. */
static int forget(ReplyBox *self, PyObject *tag) {
    if (PyDict_GetItemWithError(self->outstanding, tag) != NULL) return PyDict_DelItem(self->outstanding, tag);
    return PyErr_Occurred() ? -1 : 0;
}

static int answer(ReplyBox *self, PyObject *tag, PyObject *result) {
    unsigned long long tag_value = PyLong_AsUnsignedLongLong(tag);
    if (tag_value == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (forget(self, tag) < 0) return -1;
    if (!self->open) return 0;
    int is_result = PyObject_IsInstance(result, self->result_type);
    if (is_result < 0) return -1;
    if (is_result) {
        if (encode_result(self, tag_value, result) < 0) return -1;
    } else { /* an error: no payload, so nothing in the ring to keep in order */
        PyObject *frames = PyObject_CallFunctionObjArgs(self->encode_reply, tag, result, NULL);
        if (frames == NULL) return -1;
        int rc = PyList_Check(frames) ? PyList_SetSlice(self->outbox, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, frames) : -1;
        if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "encode_reply must return a list");
        Py_DECREF(frames);
        if (rc < 0) return -1;
    }
    return PySet_Add(self->dirty, self->key);
}

static PyObject *box_answer(ReplyBox *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "answer(tag: int, result)");
        return NULL;
    }
    if (answer(self, args[0], args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *box_expect(ReplyBox *self, PyObject *tag) {
    if (PyDict_SetItem(self->outstanding, tag, Py_False) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *box_cancel(ReplyBox *self, PyObject *tag) {
    int known = PyDict_Contains(self->outstanding, tag);
    if (known < 0 || (known && PyDict_SetItem(self->outstanding, tag, Py_True) < 0)) return NULL;
    Py_RETURN_NONE;
}

/* 1: the caller gave up, and the request is answered with cancelled_error; 0: it did not; -1: error. */
static int dropped(ReplyBox *self, PyObject *tag) {
    PyObject *cancelled = PyDict_GetItemWithError(self->outstanding, tag); /* borrowed */
    if (cancelled == NULL) return PyErr_Occurred() ? -1 : 0;
    int truth = PyObject_IsTrue(cancelled);
    if (truth <= 0) return truth;
    /* still answered: its reply is what frees its inputs in the worker's request ring */
    return answer(self, tag, self->cancelled_error) < 0 ? -1 : 1;
}

static PyObject *box_dropped(ReplyBox *self, PyObject *tag) {
    int gone = dropped(self, tag);
    if (gone < 0) return NULL;
    return PyBool_FromLong(gone);
}

static PyObject *box_ack(ReplyBox *self, PyObject *arg) {
    unsigned long long read_to = PyLong_AsUnsignedLongLong(arg);
    if (read_to == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (self->acked < read_to && read_to <= self->head) self->acked = read_to;
    Py_RETURN_NONE;
}

static PyObject *box_take(ReplyBox *self, PyObject *unused) {
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) return NULL;
    PyObject *frames = self->outbox;
    self->outbox = fresh;
    if (self->open) return frames;
    Py_DECREF(frames);
    return PyList_New(0);
}

static PyObject *box_close(ReplyBox *self, PyObject *unused) {
    self->open = 0;
    if (self->ring.obj != NULL) PyBuffer_Release(&self->ring); /* the ring's memory may be unmapped now */
    Py_RETURN_NONE;
}

static PyObject *box_unanswered(ReplyBox *self, PyObject *unused) { return PyDict_Keys(self->outstanding); }

static PyObject *box_get_open(ReplyBox *self, void *closure) { return PyBool_FromLong(self->open); }

static int box_traverse(ReplyBox *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->ring.obj);
    Py_VISIT(self->dirty);
    Py_VISIT(self->key);
    Py_VISIT(self->result_type);
    Py_VISIT(self->encode_reply);
    Py_VISIT(self->cancelled_error);
    Py_VISIT(self->outstanding);
    Py_VISIT(self->outbox);
    return 0;
}

static int box_clear(ReplyBox *self) {
    if (self->ring.obj != NULL) PyBuffer_Release(&self->ring);
    Py_CLEAR(self->dirty);
    Py_CLEAR(self->key);
    Py_CLEAR(self->result_type);
    Py_CLEAR(self->encode_reply);
    Py_CLEAR(self->cancelled_error);
    Py_CLEAR(self->outstanding);
    Py_CLEAR(self->outbox);
    return 0;
}

static void box_dealloc(ReplyBox *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    box_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyMethodDef box_methods[] = {
    {"answer", (PyCFunction)(void (*)(void))box_answer, METH_FASTCALL, "answer(tag: int, result) -> None"},
    {"expect", (PyCFunction)box_expect, METH_O, "expect(tag: int) -> None"},
    {"cancel", (PyCFunction)box_cancel, METH_O, "cancel(tag: int) -> None"},
    {"dropped", (PyCFunction)box_dropped, METH_O, "dropped(tag: int) -> bool"},
    {"ack", (PyCFunction)box_ack, METH_O, "ack(read_to: int) -> None"},
    {"take", (PyCFunction)box_take, METH_NOARGS, "take() -> list: the frames waiting"},
    {"close", (PyCFunction)box_close, METH_NOARGS, "close() -> None"},
    {"unanswered", (PyCFunction)box_unanswered, METH_NOARGS, "unanswered() -> list[int]"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef box_getset[] = {
    {"open", (getter)box_get_open, NULL, "False once closed", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot box_slots[] = {
    {Py_tp_new, box_new},
    {Py_tp_dealloc, box_dealloc},
    {Py_tp_traverse, box_traverse},
    {Py_tp_clear, box_clear},
    {Py_tp_methods, box_methods},
    {Py_tp_getset, box_getset},
    {Py_tp_doc, "One front-end link connection's replies and outstanding requests (gdn_server.engine_link)."},
    {0, NULL},
};

static PyType_Spec box_spec = {
    "gdn_server._native.ReplyBox", sizeof(ReplyBox), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, box_slots,
};

/* The lane's (_native_lane.c) way in: see _native.h. */
static PyObject *reply_box_type;

int reply_box_check(PyObject *obj) { return reply_box_type != NULL && (PyObject *)Py_TYPE(obj) == reply_box_type; }

int reply_box_expect(PyObject *box, PyObject *tag) {
    return PyDict_SetItem(((ReplyBox *)box)->outstanding, tag, Py_False);
}

int reply_box_dropped(PyObject *box, PyObject *tag) { return dropped((ReplyBox *)box, tag); }

int reply_box_answer(PyObject *box, PyObject *tag, PyObject *result) { return answer((ReplyBox *)box, tag, result); }

int reply_box_answer_output(PyObject *box, PyObject *tag, unsigned long long position, long tokens, PyObject *out) {
    ReplyBox *self = (ReplyBox *)box;
    unsigned long long tag_value = PyLong_AsUnsignedLongLong(tag);
    if (tag_value == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (forget(self, tag) < 0) return -1;
    if (!self->open) return 0;
    if (encode_output(self, tag_value, 1, tokens, &position, out) < 0) return -1;
    return PySet_Add(self->dirty, self->key);
}

int add_reply_box(PyObject *module) {
    static const InternedName names[] = {{&r_out, "out"}, {&r_shape, "shape"}, {&r_positions, "positions"}};
    if (intern_names(names, sizeof(names) / sizeof(names[0])) < 0) return -1;
    if (PyModule_AddFunctions(module, ring_methods) < 0) return -1;
    PyObject *box_type = PyType_FromSpec(&box_spec);
    if (box_type == NULL) return -1;
    Py_INCREF(box_type);
    reply_box_type = box_type; /* kept for the module's life */
    if (PyModule_AddObject(module, "ReplyBox", box_type) < 0) {
        Py_DECREF(box_type);
        return -1;
    }
    return 0;
}
