/* gdn_server._native: the per-request work of the decode path that Python does slowly.

   Each function serves one module's job and stands in for Python code that stays the
   reference; the first two answer only the common case and leave everything else (and every
   error's message) to that code:

   parse_decode_request(data, zero_copy_from) -> tuple | None
       gdn_server.protowire: a serialized DecodeRequest as
       (layer, session_ids, positions, request_id, speculative, (q, k, v, a, b)), each tensor
       (dtype, shape, data) or None when absent. data is bytes, or a read-only memoryview of
       `data` when the message has at least `zero_copy_from` bytes. None where protobuf's own
       parser must decide: a truncated or malformed message, a tensor field twice (protobuf
       merges them), groups, a known field with an unexpected wire type, invalid UTF-8,
       out-of-range scalars.

   check_bf16_step(parsed, limits, finite_max_bytes) -> int
       gdn_server.validation: 1 when the parsed request is a valid all-BF16 step for the model
       and its inputs hold no NaN/Inf; 2 when it is valid but its inputs (finite_max_bytes or
       more in all) were not checked for NaN/Inf; 0 otherwise (invalid, or not all BF16: the
       Python validation decides and names the problem). limits is (num_layers, H, HV, K, V,
       max_tokens_per_step, max_speculative_tokens, max_session_id_len).

   encode_decode_response(data, shape, positions, request_id) -> (bytes, int)
       gdn_server.servicer: a DecodeResponse with o = bf16 `data` of `shape`, byte for byte what
       protobuf serializes, and the offset of the output bytes in it.

   encode_decode_response(..., threads) copies an output over `threads` threads (big replies).

   fill_bf16(dst, places, works, max_piece_bytes[, threaded_from_bytes, threads]) -> list[int]
       gdn_server.backends.staging: copies each DecodeWork's bf16 inputs into the staging buffer
       `dst` (input i of the request whose first row is r at places[i][0] + r * places[i][1]);
       returns the indices of the works it left to the caller: no bf16 bytes, an input of
       max_piece_bytes or more, or inputs not yet checked for NaN/Inf (finite_checked False).
       Where the copies add up to threaded_from_bytes or more, they are split over `threads`
       threads without the GIL.

   copy_bf16_spans(dst, spans, threads) -> list[bool]
       gdn_server.backends.staging: copies each (offset, src, check) span into dst at offset,
       all of them split over `threads` threads without the GIL, and says for each span with
       `check` whether it holds a bf16 NaN or Inf (found in the same pass as the copy).

   All are pure functions of their arguments (fill_bf16 writes only into dst);
   tests/test_native.py runs each against the Python code it stands in for.

   _native_scheduler.c adds the scheduler's loops over a round's plain steps (admit_plain,
   submit_plain, finish_plain), which do change the objects they are given, _native_link.c
   an engine's decode of front-end link frames (decode_link_request) and the thread that writes
   its reply frames (LinkSender), _native_replies.c the link rings' copies (ring_write) and
   each link connection's replies (ReplyBox), and _native_lane.c an engine's plain one-row steps
   as C records from the link's frames to its replies (LaneRun). */
#include "_native.h"
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIMS 8 /* more dims than any valid tensor has: such a request goes to protobuf */
#define N_TENSORS 5
#define BF16 1

enum { WIRE_VARINT = 0, WIRE_I64 = 1, WIRE_LEN = 2, WIRE_I32 = 5 };

/* -- wire format ------------------------------------------------------------------------- */

/* A varint of at most 10 bytes that fits 64 bits; 0 on success. */
static int read_varint(const uint8_t **pos, const uint8_t *end, uint64_t *out) {
    const uint8_t *p = *pos;
    uint64_t value = 0;
    for (int shift = 0; shift < 64 && p < end; shift += 7) {
        uint8_t byte = *p++;
        if (shift == 63 && byte > 1) return -1; /* would overflow 64 bits */
        value |= (uint64_t)(byte & 0x7F) << shift;
        if (byte < 0x80) {
            *pos = p;
            *out = value;
            return 0;
        }
    }
    return -1;
}

/* The value of a length-delimited field: [*start, *start + *len) inside [p, end). */
static int read_len(const uint8_t **pos, const uint8_t *end, const uint8_t **start, Py_ssize_t *len) {
    uint64_t n;
    if (read_varint(pos, end, &n) != 0 || n > (uint64_t)(end - *pos)) return -1;
    *start = *pos;
    *len = (Py_ssize_t)n;
    *pos += n;
    return 0;
}

/* Steps over an unknown field's value (groups are left to protobuf). */
static int skip_value(const uint8_t **pos, const uint8_t *end, int wire) {
    uint64_t ignored;
    const uint8_t *start;
    Py_ssize_t len;
    switch (wire) {
    case WIRE_VARINT: return read_varint(pos, end, &ignored);
    case WIRE_I64:
        if (end - *pos < 8) return -1;
        *pos += 8;
        return 0;
    case WIRE_LEN: return read_len(pos, end, &start, &len);
    case WIRE_I32:
        if (end - *pos < 4) return -1;
        *pos += 4;
        return 0;
    default: return -1;
    }
}

typedef struct {
    int present;
    uint64_t dtype;
    int64_t shape[MAX_DIMS];
    int ndim;
    const uint8_t *data;
    Py_ssize_t nbytes;
} Tensor;

static int parse_tensor(const uint8_t *p, const uint8_t *end, Tensor *t) {
    memset(t, 0, sizeof *t);
    t->present = 1;
    t->data = p; /* any address: nbytes 0 */
    while (p < end) {
        uint64_t key, value;
        if (read_varint(&p, end, &key) != 0) return -1;
        int field = (int)(key >> 3), wire = (int)(key & 7);
        if (key >> 3 > 0x1FFFFFFF || field == 0) return -1;
        if (field == 1) { /* dtype: an enum, which protobuf keeps as an int32 (larger: its call) */
            if (wire != WIRE_VARINT || read_varint(&p, end, &value) != 0 || value > 0x7FFFFFFF) return -1;
            t->dtype = value;
        } else if (field == 2 && wire == WIRE_VARINT) { /* shape, unpacked */
            if (read_varint(&p, end, &value) != 0 || t->ndim == MAX_DIMS) return -1;
            t->shape[t->ndim++] = (int64_t)value;
        } else if (field == 2 && wire == WIRE_LEN) { /* shape, packed */
            const uint8_t *q;
            Py_ssize_t len;
            if (read_len(&p, end, &q, &len) != 0) return -1;
            const uint8_t *q_end = q + len;
            while (q < q_end) {
                if (read_varint(&q, q_end, &value) != 0 || t->ndim == MAX_DIMS) return -1;
                t->shape[t->ndim++] = (int64_t)value;
            }
        } else if (field == 2) {
            return -1;
        } else if (field == 3) { /* data: the last one wins */
            if (wire != WIRE_LEN || read_len(&p, end, &t->data, &t->nbytes) != 0) return -1;
        } else if (skip_value(&p, end, wire) != 0) {
            return -1;
        }
    }
    return 0;
}

static PyObject *tensor_tuple(const Tensor *t, PyObject *message, PyObject **view, const uint8_t *base) {
    if (!t->present) Py_RETURN_NONE;
    PyObject *shape = PyTuple_New(t->ndim);
    if (shape == NULL) return NULL;
    for (int i = 0; i < t->ndim; i++) {
        PyObject *dim = PyLong_FromLongLong(t->shape[i]);
        if (dim == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, i, dim);
    }
    PyObject *data;
    if (view != NULL) { /* a slice of the message's memoryview: no copy */
        if (*view == NULL && (*view = PyMemoryView_FromObject(message)) == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        Py_ssize_t start = t->data - base;
        data = PySequence_GetSlice(*view, start, start + t->nbytes);
    } else {
        data = PyBytes_FromStringAndSize((const char *)t->data, t->nbytes);
    }
    if (data == NULL) {
        Py_DECREF(shape);
        return NULL;
    }
    return Py_BuildValue("(KNN)", (unsigned long long)t->dtype, shape, data);
}

/* A UTF-8 string field as str (shared: _native.h). */
PyObject *utf8(const uint8_t *s, Py_ssize_t n) {
    PyObject *str = PyUnicode_DecodeUTF8((const char *)s, n, "strict");
    if (str == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return str;
}

int intern_names(const InternedName *names, size_t count) {
    for (size_t i = 0; i < count; i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].name)) == NULL) return -1;
    }
    return 0;
}

/* Appends the uint64 `value` to `list` as an int; -1 with an exception set on failure. */
static int append_u64(PyObject *list, uint64_t value) {
    PyObject *n = PyLong_FromUnsignedLongLong(value);
    int failed = n == NULL || PyList_Append(list, n) != 0;
    Py_XDECREF(n);
    return failed ? -1 : 0;
}

static PyObject *parse_decode_request(PyObject *self, PyObject *args) {
    PyObject *message;
    Py_ssize_t zero_copy_from;
    if (!PyArg_ParseTuple(args, "Sn", &message, &zero_copy_from)) return NULL;
    const uint8_t *base = (const uint8_t *)PyBytes_AS_STRING(message);
    const uint8_t *p = base, *end = base + PyBytes_GET_SIZE(message);

    uint64_t layer = 0, speculative = 0;
    const uint8_t *request_id = p;
    Py_ssize_t request_id_len = 0;
    Tensor tensors[N_TENSORS];
    memset(tensors, 0, sizeof tensors);
    PyObject *ids = PyList_New(0), *positions = PyList_New(0);
    PyObject *result = NULL, *view = NULL, *rid = NULL, *tensor_items = NULL;
    if (ids == NULL || positions == NULL) goto done;

    while (p < end) {
        uint64_t key, value;
        if (read_varint(&p, end, &key) != 0 || key >> 3 > 0x1FFFFFFF || key >> 3 == 0) goto fallback;
        int field = (int)(key >> 3), wire = (int)(key & 7);
        const uint8_t *start;
        Py_ssize_t len;
        switch (field) {
        case 1: /* layer, uint32 */
            if (wire != WIRE_VARINT || read_varint(&p, end, &value) != 0 || value > 0xFFFFFFFFu) goto fallback;
            layer = value;
            break;
        case 2: { /* session_ids */
            if (wire != WIRE_LEN || read_len(&p, end, &start, &len) != 0) goto fallback;
            PyObject *sid = utf8(start, len);
            if (sid == NULL) goto fallback_or_error;
            int failed = PyList_Append(ids, sid);
            Py_DECREF(sid);
            if (failed) goto done;
            break;
        }
        case 3: case 4: case 5: case 6: case 7: { /* q, k, v, a, b */
            Tensor *t = &tensors[field - 3];
            if (wire != WIRE_LEN || t->present || read_len(&p, end, &start, &len) != 0) goto fallback;
            if (parse_tensor(start, start + len, t) != 0) goto fallback;
            break;
        }
        case 8: /* positions, uint64: packed or not */
            if (wire == WIRE_VARINT) {
                if (read_varint(&p, end, &value) != 0) goto fallback;
                if (append_u64(positions, value) != 0) goto done;
            } else if (wire == WIRE_LEN) {
                if (read_len(&p, end, &start, &len) != 0) goto fallback;
                const uint8_t *q = start, *q_end = start + len;
                while (q < q_end) {
                    if (read_varint(&q, q_end, &value) != 0) goto fallback;
                    if (append_u64(positions, value) != 0) goto done;
                }
            } else {
                goto fallback;
            }
            break;
        case 9: /* request_id: the last one wins */
            if (wire != WIRE_LEN || read_len(&p, end, &request_id, &request_id_len) != 0) goto fallback;
            break;
        case 10: /* speculative, bool */
            if (wire != WIRE_VARINT || read_varint(&p, end, &value) != 0 || value > 1) goto fallback;
            speculative = value;
            break;
        default:
            if (skip_value(&p, end, wire) != 0) goto fallback;
        }
    }

    rid = utf8(request_id, request_id_len);
    if (rid == NULL) goto fallback_or_error;
    tensor_items = PyTuple_New(N_TENSORS);
    if (tensor_items == NULL) goto done;
    int zero_copy = PyBytes_GET_SIZE(message) >= zero_copy_from;
    for (int i = 0; i < N_TENSORS; i++) {
        PyObject *item = tensor_tuple(&tensors[i], message, zero_copy ? &view : NULL, base);
        if (item == NULL) goto done;
        PyTuple_SET_ITEM(tensor_items, i, item);
    }
    PyObject *id_tuple = PyList_AsTuple(ids), *pos_tuple = PyList_AsTuple(positions);
    if (id_tuple && pos_tuple) {
        result = Py_BuildValue("(kNNOOO)", (unsigned long)layer, id_tuple, pos_tuple, rid,
                               speculative ? Py_True : Py_False, tensor_items);
    } else {
        Py_XDECREF(id_tuple);
        Py_XDECREF(pos_tuple);
    }
    goto done;

fallback_or_error:
    if (PyErr_Occurred()) goto done; /* out of memory: raise it */
fallback:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(ids);
    Py_XDECREF(positions);
    Py_XDECREF(view);
    Py_XDECREF(rid);
    Py_XDECREF(tensor_items);
    return result;
}

/* -- validation -------------------------------------------------------------------------- */

/* 1 for a bf16 word that is NaN or Inf: its exponent bits all ones. */
static inline uint16_t nonfinite_bf16(uint16_t word) { return (uint16_t)((word & 0x7F80) == 0x7F80); }

/* 1 when some bf16 value of data[0:nbytes] is NaN or Inf. */
static int has_nonfinite_bf16(const uint8_t *data, Py_ssize_t nbytes) {
    Py_ssize_t n = nbytes / 2;
    uint16_t hit = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* no early exit: the compiler vectorizes it */
        uint16_t word;
        memcpy(&word, data + 2 * i, 2);
        hit |= nonfinite_bf16(word);
    }
    return hit != 0;
}

/* The dims `got` (a tuple of ints) equal `want`. */
static int dims_equal(PyObject *got, const long long *want, int ndim) {
    if (!PyTuple_Check(got) || PyTuple_GET_SIZE(got) != ndim) return 0;
    for (int i = 0; i < ndim; i++) {
        int overflow;
        long long d = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(got, i), &overflow);
        if (d == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (overflow || d != want[i]) return 0;
    }
    return 1;
}

static PyObject *check_bf16_step(PyObject *self, PyObject *args) {
    PyObject *parsed;
    long long L, H, HV, K, V, max_T, max_spec_T, max_id_len;
    Py_ssize_t finite_max_bytes;
    if (!PyArg_ParseTuple(args, "O!(LLLLLLLL)n", &PyTuple_Type, &parsed, &L, &H, &HV, &K, &V, &max_T,
                          &max_spec_T, &max_id_len, &finite_max_bytes))
        return NULL;
    if (PyTuple_GET_SIZE(parsed) != 6) {
        PyErr_SetString(PyExc_ValueError, "not a parse_decode_request result");
        return NULL;
    }
    PyObject *ids = PyTuple_GET_ITEM(parsed, 1), *positions = PyTuple_GET_ITEM(parsed, 2);
    PyObject *tensors = PyTuple_GET_ITEM(parsed, 5);
    long long layer = PyLong_AsLongLong(PyTuple_GET_ITEM(parsed, 0));
    if (layer == -1 && PyErr_Occurred()) return NULL;
    int speculative = PyTuple_GET_ITEM(parsed, 4) == Py_True;
    if (!PyTuple_Check(ids) || !PyTuple_Check(positions) || !PyTuple_Check(tensors) ||
        PyTuple_GET_SIZE(tensors) != N_TENSORS)
        return PyLong_FromLong(0);

    if (layer < 0 || layer >= L) return PyLong_FromLong(0);
    Py_ssize_t B = PyTuple_GET_SIZE(ids);
    if (B == 0) return PyLong_FromLong(0);
    for (Py_ssize_t i = 0; i < B; i++) {
        PyObject *sid = PyTuple_GET_ITEM(ids, i);
        if (!PyUnicode_Check(sid)) return PyLong_FromLong(0);
        Py_ssize_t n = PyUnicode_GET_LENGTH(sid);
        if (n == 0 || n > max_id_len) return PyLong_FromLong(0);
    }
    if (B > 1) { /* distinct ids */
        PyObject *distinct = PySet_New(ids);
        if (distinct == NULL) return NULL;
        Py_ssize_t n = PySet_GET_SIZE(distinct);
        Py_DECREF(distinct);
        if (n != B) return PyLong_FromLong(0);
    }
    if (PyTuple_GET_SIZE(positions) != 0 && PyTuple_GET_SIZE(positions) != B) return PyLong_FromLong(0);

    /* every tensor present and BF16; q's T decides the rest */
    PyObject *dims[N_TENSORS], *data[N_TENSORS];
    for (int i = 0; i < N_TENSORS; i++) {
        PyObject *t = PyTuple_GET_ITEM(tensors, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) return PyLong_FromLong(0);
        int overflow;
        long long dtype = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(t, 0), &overflow);
        if (overflow || dtype != BF16) return PyLong_FromLong(0);
        dims[i] = PyTuple_GET_ITEM(t, 1);
        data[i] = PyTuple_GET_ITEM(t, 2);
    }
    if (!PyTuple_Check(dims[0]) || PyTuple_GET_SIZE(dims[0]) != 4) return PyLong_FromLong(0);
    int overflow;
    long long T = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(dims[0], 1), &overflow);
    if (overflow || T < 1 || T > (speculative ? max_spec_T : max_T)) return PyLong_FromLong(0);
    const long long want[N_TENSORS][4] = {
        {B, T, H, K}, {B, T, H, K}, {B, T, HV, V}, {B, T, HV, 0}, {B, T, HV, 0},
    };
    const int ndims[N_TENSORS] = {4, 4, 4, 3, 3};
    Py_buffer views[N_TENSORS];
    int held = 0, verdict = 0;
    Py_ssize_t total = 0;
    for (int i = 0; i < N_TENSORS; i++) {
        if (!dims_equal(dims[i], want[i], ndims[i])) goto release;
        if (PyObject_GetBuffer(data[i], &views[i], PyBUF_SIMPLE) != 0) goto release_error;
        held++;
        long long numel = 1;
        for (int d = 0; d < ndims[i]; d++) numel *= want[i][d];
        if (views[i].len != 2 * numel) goto release;
        total += views[i].len;
    }
    verdict = 2;
    if (total < finite_max_bytes) {
        verdict = 1; /* below the limit the check is a few microseconds: the GIL stays held */
        for (int i = 0; i < N_TENSORS && verdict; i++)
            if (has_nonfinite_bf16(views[i].buf, views[i].len)) verdict = 0;
    }
release:
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    return PyLong_FromLong(verdict);
release_error:
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    return NULL;
}

/* -- copies of big buffers, on several threads ------------------------------------------- */

#define MAX_COPY_THREADS 16

typedef struct {
    const Span *spans;
    Py_ssize_t n_spans;
    Py_ssize_t begin, end; /* this thread's bytes, counted over all spans back to back */
    uint8_t *found;        /* per span: a NaN/Inf seen in this thread's part */
} CopyPart;

/* Copies src to dst (len bytes, even) and says whether a bf16 word of it is NaN or Inf: one read
   of the source for both, where a copy then a check would read the bytes twice. */
static int copy_checking(uint8_t *dst, const uint8_t *src, Py_ssize_t len) {
    Py_ssize_t n = len / 2;
    uint16_t hit = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t word;
        memcpy(&word, src + 2 * i, 2);
        memcpy(dst + 2 * i, &word, 2);
        hit |= nonfinite_bf16(word);
    }
    return hit != 0;
}

static void *copy_part(void *arg) {
    CopyPart *part = arg;
    Py_ssize_t at = 0; /* where span i starts, over all spans */
    for (Py_ssize_t i = 0; i < part->n_spans && at < part->end; i++) {
        const Span *sp = &part->spans[i];
        Py_ssize_t lo = part->begin > at ? part->begin - at : 0;
        Py_ssize_t hi = part->end - at < sp->len ? part->end - at : sp->len;
        if (lo < hi) {
            if (sp->mode == SPAN_CHECK) {
                if (copy_checking(sp->dst + lo, sp->src + lo, hi - lo)) part->found[i] = 1;
            } else if (sp->mode == SPAN_STREAM) {
                copy_for_another_core(sp->dst + lo, sp->src + lo, (size_t)(hi - lo));
            } else {
                memcpy(sp->dst + lo, sp->src + lo, hi - lo);
            }
        }
        at += sp->len;
    }
    return NULL;
}

/* The copy threads live between calls: starting and joining a thread costs tens of microseconds
   on a virtual machine (bench/copy_threads.py: ~28 us each on the CPU box), as much as the
   share of a copy it would take. Workers block on a condition between jobs (no CPU); jobs run
   one at a time (`job` lock); worker i runs part i of a job that has more than i parts. */
static struct {
    pthread_mutex_t job;   /* held by a caller for its whole job */
    pthread_mutex_t state; /* guards the fields below */
    pthread_cond_t posted; /* a new job (generation changed) */
    pthread_cond_t ended;  /* a worker finished its part */
    int workers;           /* started so far: parts 1..workers */
    unsigned long generation;
    CopyPart *parts;
    int n_parts;
    int pending; /* workers' parts of this job not finished yet */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          0, 0, NULL, 0, 0};
static unsigned long pool_start_generation[MAX_COPY_THREADS];

static void *pool_worker(void *arg) {
    int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.state);
    unsigned long seen = pool_start_generation[index]; /* the generation before its first job */
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.posted, &pool.state);
        seen = pool.generation;
        if (index < pool.n_parts) {
            CopyPart *part = &pool.parts[index];
            pthread_mutex_unlock(&pool.state);
            copy_part(part);
            pthread_mutex_lock(&pool.state);
            if (--pool.pending == 0) pthread_cond_signal(&pool.ended);
        }
    }
    return NULL;
}

/* In a forked child the workers do not exist and the locks may be held by parent threads. */
static void pool_after_fork_in_child(void) {
    pthread_mutex_init(&pool.job, NULL);
    pthread_mutex_init(&pool.state, NULL);
    pthread_cond_init(&pool.posted, NULL);
    pthread_cond_init(&pool.ended, NULL);
    pool.workers = 0;
    pool.parts = NULL;
    pool.n_parts = pool.pending = 0;
}

/* Runs the spans' copies split evenly (at even byte counts) over `threads` threads, this one
   included (the others from the pool, started the first time they are needed); ORs what each
   part found into found[]. Call without the GIL. Parts no worker could take (a thread that
   could not be started) run on this thread. */
void copy_spans(const Span *spans, Py_ssize_t n_spans, int threads, uint8_t *found) {
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n_spans; i++) total += spans[i].len;
    if (threads < 1) threads = 1;
    if (threads > MAX_COPY_THREADS) threads = MAX_COPY_THREADS;
    CopyPart parts[MAX_COPY_THREADS];
    uint8_t *flags = calloc((size_t)threads * (size_t)(n_spans ? n_spans : 1), 1);
    if (flags == NULL) threads = 1; /* no room for per-thread flags: one part, found[] directly */
    Py_ssize_t step = (total / threads + 1) & ~(Py_ssize_t)1;
    for (int t = 0; t < threads; t++) {
        Py_ssize_t begin = step * t, end = t == threads - 1 ? total : step * (t + 1);
        if (begin > total) begin = total;
        if (end > total) end = total;
        parts[t] = (CopyPart){spans, n_spans, begin, end, flags ? flags + (size_t)t * n_spans : found};
    }
    if (threads == 1) {
        copy_part(&parts[0]);
    } else {
        pthread_mutex_lock(&pool.job);
        while (pool.workers < threads - 1) { /* generation only changes under `job`: read it here */
            int index = pool.workers + 1;
            pthread_t id;
            pool_start_generation[index] = pool.generation;
            if (pthread_create(&id, NULL, pool_worker, (void *)(intptr_t)index) != 0) break;
            pthread_detach(id);
            pool.workers++;
        }
        int helpers = pool.workers < threads - 1 ? pool.workers : threads - 1;
        pthread_mutex_lock(&pool.state);
        pool.parts = parts;
        pool.n_parts = helpers + 1;
        pool.pending = helpers;
        pool.generation++;
        pthread_cond_broadcast(&pool.posted);
        pthread_mutex_unlock(&pool.state);
        copy_part(&parts[0]);
        for (int t = helpers + 1; t < threads; t++) copy_part(&parts[t]);
        pthread_mutex_lock(&pool.state);
        while (pool.pending > 0) pthread_cond_wait(&pool.ended, &pool.state);
        pool.parts = NULL;
        pool.n_parts = 0;
        pthread_mutex_unlock(&pool.state);
        pthread_mutex_unlock(&pool.job);
    }
    if (flags != NULL) {
        for (int t = 0; t < threads; t++)
            for (Py_ssize_t i = 0; i < n_spans; i++) found[i] |= flags[(size_t)t * n_spans + i];
        free(flags);
    }
}

static PyObject *copy_bf16_spans(PyObject *self, PyObject *args) {
    Py_buffer dst;
    PyObject *spans_in;
    int threads;
    if (!PyArg_ParseTuple(args, "w*O!i", &dst, &PyList_Type, &spans_in, &threads)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(spans_in), held = 0;
    Span *spans = PyMem_Calloc(n ? n : 1, sizeof(Span));
    Py_buffer *srcs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    uint8_t *found = PyMem_Calloc(n ? n : 1, 1);
    PyObject *result = NULL;
    if (spans == NULL || srcs == NULL || found == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t offset;
        PyObject *src;
        int check;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(spans_in, i), "nOp", &offset, &src, &check)) goto done;
        if (PyObject_GetBuffer(src, &srcs[i], PyBUF_SIMPLE) != 0) goto done;
        held++;
        if (offset < 0 || srcs[i].len % 2 || offset + srcs[i].len > dst.len) {
            PyErr_SetString(PyExc_ValueError, "a span does not fit the buffer (or has an odd length)");
            goto done;
        }
        spans[i] = (Span){(uint8_t *)dst.buf + offset, srcs[i].buf, srcs[i].len, check ? SPAN_CHECK : SPAN_COPY};
    }
    Py_BEGIN_ALLOW_THREADS
    copy_spans(spans, n, threads, found);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *flag = found[i] ? Py_True : Py_False;
        Py_INCREF(flag);
        PyList_SET_ITEM(result, i, flag);
    }
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&srcs[i]);
    PyMem_Free(spans);
    PyMem_Free(srcs);
    PyMem_Free(found);
    PyBuffer_Release(&dst);
    return result;
}

/* -- replies ------------------------------------------------------------------------------ */

static Py_ssize_t varint_size(uint64_t v) {
    Py_ssize_t n = 1;
    while (v > 0x7F) {
        v >>= 7;
        n++;
    }
    return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
    while (v > 0x7F) {
        *p++ = (uint8_t)(v & 0x7F) | 0x80;
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

/* The values of a tuple of ints as uint64 (int64 two's complement for negatives, as protobuf
   writes an int64); -1 with an exception when one is not an int or out of range. */
static int tuple_u64(PyObject *tuple, uint64_t *out, Py_ssize_t n, int is_signed) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(tuple, i);
        if (is_signed) {
            long long v = PyLong_AsLongLong(item);
            if (v == -1 && PyErr_Occurred()) return -1;
            out[i] = (uint64_t)v;
        } else {
            unsigned long long v = PyLong_AsUnsignedLongLong(item);
            if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
            out[i] = v;
        }
    }
    return 0;
}

static Py_ssize_t packed_size(const uint64_t *v, Py_ssize_t n) {
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < n; i++) size += varint_size(v[i]);
    return size;
}

static PyObject *encode_decode_response(PyObject *self, PyObject *args) {
    Py_buffer data;
    PyObject *shape, *positions, *request_id;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "y*O!O!U|i", &data, &PyTuple_Type, &shape, &PyTuple_Type, &positions, &request_id,
                          &threads))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_dims = PyTuple_GET_SIZE(shape), n_pos = PyTuple_GET_SIZE(positions), rid_len;
    uint64_t *values = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n_dims + n_pos + 1));
    const char *rid = PyUnicode_AsUTF8AndSize(request_id, &rid_len);
    if (values == NULL || rid == NULL) {
        if (values == NULL) PyErr_NoMemory();
        goto done;
    }
    uint64_t *dims = values, *pos = values + n_dims;
    if (tuple_u64(shape, dims, n_dims, 1) != 0 || tuple_u64(positions, pos, n_pos, 0) != 0) goto done;

    /* o: dtype (BF16), shape (packed), data; then positions (packed), request_id: field order */
    Py_ssize_t dims_size = packed_size(dims, n_dims), pos_size = packed_size(pos, n_pos);
    Py_ssize_t o_size = 2 + (n_dims ? 1 + varint_size(dims_size) + dims_size : 0) +
                        (data.len ? 1 + varint_size(data.len) + data.len : 0);
    Py_ssize_t total = 1 + varint_size(o_size) + o_size + (n_pos ? 1 + varint_size(pos_size) + pos_size : 0) +
                       (rid_len ? 1 + varint_size(rid_len) + rid_len : 0);
    PyObject *wire = PyBytes_FromStringAndSize(NULL, total);
    if (wire == NULL) goto done;
    uint8_t *start = (uint8_t *)PyBytes_AS_STRING(wire), *p = start;
    *p++ = 0x0A; /* DecodeResponse.o */
    p = put_varint(p, o_size);
    *p++ = 0x08; /* Tensor.dtype = BF16 */
    *p++ = BF16;
    if (n_dims) {
        *p++ = 0x12; /* Tensor.shape */
        p = put_varint(p, dims_size);
        for (Py_ssize_t i = 0; i < n_dims; i++) p = put_varint(p, dims[i]);
    }
    Py_ssize_t at = total; /* no data: the end, as the Python encoder says */
    if (data.len) {
        *p++ = 0x1A; /* Tensor.data */
        p = put_varint(p, data.len);
        at = p - start;
        if (threads > 1 && data.len % 2 == 0) { /* a big output: its copy split over threads */
            Span span = {p, data.buf, data.len, SPAN_COPY};
            uint8_t found = 0;
            Py_BEGIN_ALLOW_THREADS
            copy_spans(&span, 1, threads, &found);
            Py_END_ALLOW_THREADS
        } else {
            memcpy(p, data.buf, data.len);
        }
        p += data.len;
    }
    if (n_pos) {
        *p++ = 0x12; /* DecodeResponse.positions */
        p = put_varint(p, pos_size);
        for (Py_ssize_t i = 0; i < n_pos; i++) p = put_varint(p, pos[i]);
    }
    if (rid_len) {
        *p++ = 0x1A; /* DecodeResponse.request_id */
        p = put_varint(p, rid_len);
        memcpy(p, rid, rid_len);
    }
    result = Py_BuildValue("(Nn)", wire, at);
done:
    PyMem_Free(values);
    PyBuffer_Release(&data);
    return result;
}

/* -- staging ------------------------------------------------------------------------------ */

static PyObject *fill_bf16(PyObject *self, PyObject *args) {
    Py_buffer dst;
    PyObject *places, *works;
    Py_ssize_t max_piece, threaded_from = PY_SSIZE_T_MAX;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "w*O!O!n|ni", &dst, &PyTuple_Type, &places, &PyList_Type, &works, &max_piece,
                          &threaded_from, &threads))
        return NULL;
    Py_ssize_t n_works = PyList_GET_SIZE(works);
    PyObject *left = PyList_New(0);
    /* every piece's buffer is held until the copies are done: they may run without the GIL */
    Py_buffer *pieces = PyMem_Calloc(n_works ? n_works * N_TENSORS : 1, sizeof(Py_buffer));
    Span *spans = PyMem_Calloc(n_works ? n_works * N_TENSORS : 1, sizeof(Span));
    Py_ssize_t held = 0, n_spans = 0, total = 0;
    Py_ssize_t offset[N_TENSORS], per_row[N_TENSORS];
    if (left == NULL) goto fail;
    if (pieces == NULL || spans == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (PyTuple_GET_SIZE(places) != N_TENSORS) {
        PyErr_SetString(PyExc_ValueError, "places: one (offset, bytes per row) for each of q, k, v, a, b");
        goto fail;
    }
    for (int i = 0; i < N_TENSORS; i++)
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(places, i), "nn", &offset[i], &per_row[i])) goto fail;

    Py_ssize_t row = 0;
    for (Py_ssize_t w = 0; w < n_works; w++) {
        PyObject *work = PyList_GET_ITEM(works, w);
        PyObject *ids = PyObject_GetAttrString(work, "session_ids");
        if (ids == NULL) goto fail;
        Py_ssize_t rows = PyObject_Length(ids);
        Py_DECREF(ids);
        PyObject *raw = PyObject_GetAttrString(work, "bf16_bytes");
        if (rows < 0 || raw == NULL) {
            Py_XDECREF(raw);
            goto fail;
        }
        PyObject *checked = PyObject_GetAttrString(work, "finite_checked");
        if (checked == NULL) {
            Py_DECREF(raw);
            goto fail;
        }
        int finite_checked = PyObject_IsTrue(checked);
        Py_DECREF(checked);
        Py_ssize_t first = held; /* this work's pieces: pieces[first .. held) */
        int copy = finite_checked == 1 && raw != Py_None && PyTuple_Check(raw) && PyTuple_GET_SIZE(raw) == N_TENSORS;
        for (int i = 0; copy && i < N_TENSORS; i++) {
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(raw, i), &pieces[held], PyBUF_SIMPLE) != 0) {
                Py_DECREF(raw);
                goto fail;
            }
            Py_buffer *piece = &pieces[held++];
            if (piece->len >= max_piece) copy = 0;
            else if (offset[i] + row * per_row[i] + piece->len > dst.len) {
                PyErr_SetString(PyExc_ValueError, "a request's input does not fit the staging buffer");
                Py_DECREF(raw);
                goto fail;
            }
        }
        Py_DECREF(raw);
        if (copy) {
            for (int i = 0; i < N_TENSORS; i++) {
                Py_buffer *piece = &pieces[first + i];
                spans[n_spans++] = (Span){(uint8_t *)dst.buf + offset[i] + row * per_row[i], piece->buf, piece->len, SPAN_COPY};
                total += piece->len;
            }
        } else {
            while (held > first) PyBuffer_Release(&pieces[--held]); /* left to the caller */
            PyObject *index = PyLong_FromSsize_t(w);
            if (index == NULL || PyList_Append(left, index) != 0) {
                Py_XDECREF(index);
                goto fail;
            }
            Py_DECREF(index);
        }
        row += rows;
    }
    if (threads > 1 && total >= threaded_from) {
        /* a launch's worth of requests: split over the copy threads, without the GIL */
        uint8_t *found = PyMem_Calloc(n_spans ? n_spans : 1, 1);
        if (found == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        Py_BEGIN_ALLOW_THREADS
        copy_spans(spans, n_spans, threads, found);
        Py_END_ALLOW_THREADS
        PyMem_Free(found);
    } else {
        /* into pinned staging, read next by the device: streaming stores, as the lane's fill */
        for (Py_ssize_t i = 0; i < n_spans; i++) copy_for_another_core(spans[i].dst, spans[i].src, (size_t)spans[i].len);
    }
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&pieces[i]);
    PyMem_Free(pieces);
    PyMem_Free(spans);
    PyBuffer_Release(&dst);
    return left;
fail:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&pieces[i]);
    PyMem_Free(pieces);
    PyMem_Free(spans);
    Py_XDECREF(left);
    PyBuffer_Release(&dst);
    return NULL;
}

static PyMethodDef methods[] = {
    {"parse_decode_request", parse_decode_request, METH_VARARGS,
     "parse_decode_request(data: bytes, zero_copy_from: int) -> tuple | None"},
    {"check_bf16_step", check_bf16_step, METH_VARARGS,
     "check_bf16_step(parsed: tuple, limits: tuple, finite_max_bytes: int) -> int"},
    {"encode_decode_response", encode_decode_response, METH_VARARGS,
     "encode_decode_response(data: buffer, shape: tuple, positions: tuple, request_id: str) -> (bytes, int)"},
    {"copy_bf16_spans", copy_bf16_spans, METH_VARARGS,
     "copy_bf16_spans(dst: writable buffer, spans: list[(offset, src, check)], threads: int) -> list[bool]"},
    {"fill_bf16", fill_bf16, METH_VARARGS,
     "fill_bf16(dst: writable buffer, places: tuple, works: list, max_piece_bytes: int, threaded_from_bytes: int = "
     "no limit, threads: int = 1) -> list[int]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gdn_server._native",
    "The decode path's per-request work in C (the Python code it stands in for is the reference).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    static int registered = 0;
    if (!registered && pthread_atfork(NULL, NULL, pool_after_fork_in_child) == 0) registered = 1;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (add_scheduler_functions(m) < 0 || add_link_functions(m) < 0 || add_reply_box(m) < 0 ||
                      add_lane_type(m) < 0 || add_cuda_functions(m) < 0 ||
                      add_h2_transport(m) < 0)) Py_CLEAR(m);
    return m;
}
