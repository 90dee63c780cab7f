/* gdn_server._native, the front-end link's part: an engine's decode of a request frame.

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

   tests/test_native.py compares it with the Python decode on the same frames. */
#include "_native.h"
#include <stdint.h>
#include <string.h>

#define N_INPUTS 5
#define KIND_DECODE 1
#define FLAG_SPECULATIVE 1
#define FLAG_POSITIONS 2
#define FLAG_F32 4
#define FLAG_IN_RING 8
#define HEADER_BYTES 23 /* link.REQUEST: <BQBIIBHH */

static PyObject *k_layer, *k_session_ids, *k_positions, *k_request_id, *k_owner, *k_speculative, *k_bf16_bytes,
    *k_input_dims, *k_finite_checked, *k_tokens;

static uint16_t u16_at(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static uint32_t u32_at(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t u64_at(const uint8_t *p) { return (uint64_t)u32_at(p) | (uint64_t)u32_at(p + 4) << 32; }

/* Sets work.__dict__[key] = value, taking the reference to value; -1 with an error set. */
static int set_field(PyObject *fields, PyObject *key, PyObject *value) {
    if (value == NULL) return -1;
    int failed = PyDict_SetItem(fields, key, value);
    Py_DECREF(value);
    return failed;
}

static PyObject *decode_link_request(PyObject *self, PyObject *args) {
    Py_buffer frame;
    PyObject *work_type, *ring = Py_None;
    Py_ssize_t H, HV, K, V;
    if (!PyArg_ParseTuple(args, "y*O!(nnnn)|O", &frame, &PyType_Type, &work_type, &H, &HV, &K, &V, &ring))
        return NULL;
    const uint8_t *base = frame.buf, *end = base + frame.len;
    PyObject *result = NULL, *ids = NULL, *positions = NULL, *request_id = NULL, *identity = NULL, *view = NULL,
             *raw = NULL, *work = NULL;

    if (frame.len < HEADER_BYTES || base[0] != KIND_DECODE) goto python;
    uint64_t tag = u64_at(base + 1);
    uint8_t flags = base[9];
    uint32_t layer = u32_at(base + 10), B = u32_at(base + 14);
    uint8_t T = base[18];
    uint16_t rid_len = u16_at(base + 19), ident_len = u16_at(base + 21);
    if (flags & FLAG_F32 || B == 0 || T == 0) goto python;
    const uint8_t *p = base + HEADER_BYTES;
    const uint8_t *id_lens = p, *position_words = NULL;
    if ((uint64_t)(end - p) < 2ull * B) goto python;
    p += 2 * (size_t)B;
    if (flags & FLAG_POSITIONS) {
        if ((uint64_t)(end - p) < 8ull * B) goto python;
        position_words = p;
        p += 8 * (size_t)B;
    }

    if ((ids = PyTuple_New(B)) == NULL) goto done;
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
        if ((positions = PyTuple_New(B)) == NULL) goto done;
        for (uint32_t i = 0; i < B; i++) {
            PyObject *n = PyLong_FromUnsignedLongLong(u64_at(position_words + 8 * i));
            if (n == NULL) goto done;
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
    Py_ssize_t n = (Py_ssize_t)B * T;
    Py_ssize_t nbytes[N_INPUTS] = {2 * n * H * K, 2 * n * H * K, 2 * n * HV * V, 2 * n * HV, 2 * n * HV};
    Py_ssize_t offset = p - base, total = 0;
    for (int i = 0; i < N_INPUTS; i++) total += nbytes[i];
    if (flags & FLAG_IN_RING) { /* the frame ends with the inputs' monotonic offset in the ring */
        if (ring == Py_None || !PyMemoryView_Check(ring) || frame.len - offset != 8 || flags & FLAG_SPECULATIVE)
            goto python;
        Py_ssize_t ring_len = PyObject_Length(ring);
        if (ring_len <= 0) goto python_or_error;
        uint64_t at = u64_at(p);
        offset = (Py_ssize_t)(at % (uint64_t)ring_len);
        if (offset + total > ring_len) goto python;
        view = ring;
        Py_INCREF(view);
    } else {
        if (frame.len - offset != total) goto python;
        if ((view = PyMemoryView_FromObject(frame.obj)) == NULL) goto done;
    }
    if ((raw = PyTuple_New(N_INPUTS)) == NULL) goto done;
    for (int i = 0; i < N_INPUTS; i++) {
        PyObject *piece = PySequence_GetSlice(view, offset, offset + nbytes[i]);
        if (piece == NULL) goto done;
        PyTuple_SET_ITEM(raw, i, piece);
        offset += nbytes[i];
    }

    /* DecodeWork.of_bf16's object: object.__new__ and the fields straight into its __dict__ */
    PyTypeObject *type = (PyTypeObject *)work_type;
    PyObject *no_args = PyTuple_New(0);
    if (no_args == NULL) goto done;
    work = PyBaseObject_Type.tp_new(type, no_args, NULL);
    Py_DECREF(no_args);
    if (work == NULL) goto done;
    PyObject *fields = PyObject_GenericGetDict(work, NULL);
    if (fields == NULL) goto done;
    Py_ssize_t bt = B;
    int failed = set_field(fields, k_layer, PyLong_FromUnsignedLong(layer))
        || PyDict_SetItem(fields, k_session_ids, ids) || PyDict_SetItem(fields, k_positions, positions)
        || PyDict_SetItem(fields, k_request_id, request_id) || PyDict_SetItem(fields, k_owner, identity)
        || PyDict_SetItem(fields, k_speculative, flags & FLAG_SPECULATIVE ? Py_True : Py_False)
        || PyDict_SetItem(fields, k_bf16_bytes, raw)
        || set_field(fields, k_input_dims,
                     Py_BuildValue("((nnnn)(nnnn)(nnnn)(nnn)(nnn))", bt, (Py_ssize_t)T, H, K, bt, (Py_ssize_t)T, H,
                                   K, bt, (Py_ssize_t)T, HV, V, bt, (Py_ssize_t)T, HV, bt, (Py_ssize_t)T, HV))
        || PyDict_SetItem(fields, k_finite_checked, Py_True) /* the worker checked the inputs */
        || set_field(fields, k_tokens, PyLong_FromLong(T));
    Py_DECREF(fields);
    if (failed) goto done;
    result = Py_BuildValue("(KO)", (unsigned long long)tag, work);
    goto done;

python_or_error:
    if (PyErr_Occurred()) goto done; /* out of memory: raise it */
python:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(ids);
    Py_XDECREF(positions);
    Py_XDECREF(request_id);
    Py_XDECREF(identity);
    Py_XDECREF(raw);
    Py_XDECREF(view);
    Py_XDECREF(work);
    PyBuffer_Release(&frame);
    return result;
}

static PyMethodDef link_methods[] = {
    {"decode_link_request", decode_link_request, METH_VARARGS,
     "decode_link_request(frame: bytes-like, work_type: type, heads: (H, HV, K, V), ring: memoryview | None = None)"
     " -> (tag, DecodeWork) | None"},
    {NULL, NULL, 0, NULL},
};

int add_link_functions(PyObject *module) {
    static const InternedName names[] = {
        {&k_layer, "layer"},           {&k_session_ids, "session_ids"}, {&k_positions, "positions"},
        {&k_request_id, "request_id"}, {&k_owner, "owner"},             {&k_speculative, "speculative"},
        {&k_bf16_bytes, "bf16_bytes"}, {&k_input_dims, "input_dims"},   {&k_finite_checked, "finite_checked"},
        {&k_tokens, "_tokens"},
    };
    if (intern_names(names, sizeof(names) / sizeof(names[0])) < 0) return -1;
    return PyModule_AddFunctions(module, link_methods);
}
