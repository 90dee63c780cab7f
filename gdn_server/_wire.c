/* gdn_server._wire: the decode RPCs' per-message wire work, in C.

   A decode step's message is read and answered once per step and client, on the event loop that
   serves every client, so its cost bounds a server process's steps per second
   (bench/DECISIONS.md, entry 17).

   StepLimits(num_layers=, num_q_heads=, num_v_heads=, head_dim_k=, head_dim_v=, max_tokens=,
              max_speculative_tokens=, max_session_id_len=, max_request_id_len=)
       What parse_step checks a step against, by name (gdn_server.validation.step_limits makes it
       once per server); read-only attributes of the same names.

   parse_step(data, limits) -> CheckedStep | None
       A serialized DecodeRequest that is a valid bf16 step, plain or speculative, checked: every
       session id 1..max_id characters and distinct, request_id at most max_request_id
       characters, layer below num_layers, speculative 0 or 1, positions (when given) one per
       session with position + T below 2^63 (the count after the step must stay a signed 64-bit
       number), q, k, v, a, b in BF16 with the shapes of B sessions and T tokens (1 <= T <=
       max_tokens, or max_speculative_tokens for a speculative step) and the byte lengths those
       shapes give, or by reference (Tensor.ref, no data; and o_ref): then the input is (region,
       offset) and by_reference is set, and validation resolves, checks and digests the bytes in
       the region. Inline inputs are checked for NaN/Inf and each session's inputs digested
       (`checked_digests`) in the same pass over the bytes.
       None for anything else: the caller parses it with protobuf and gdn_server.validation says
       what is wrong with it, or takes it the long way (other dtypes). So this reads only the
       plain encoding: each known field with its own wire type, a singular field at most once,
       positions packed, speculative as protobuf writes a bool, no unknown fields; whatever it
       accepts, protobuf parses to the same values (tests/test_wire_c.py checks both on a corpus
       and on fuzzed bytes). The field numbers and the BF16 code it reads are the module's
       constants (FIELDS, BF16, MAX_POSITION), which tests/test_wire_c.py checks against gdn_pb2.

   checked_digests(inputs, rows, bf16=True) -> (bad, digests)
       The NaN/Inf rule of bf16 inputs and their digests, in one pass over the five buffers q, k,
       v, a, b of `rows` sessions each: `bad` is the index of the first input holding a NaN or
       Inf (an exponent of all ones; `digests` is then ()), else None (always, for inputs of
       another dtype: bf16 False, digests only), and `digests` a CRC-32 of
       each session's inputs as sent: its row of q, k, v, a and b, in that order, read whole up
       to DIGEST_FULL_ROW_BYTES and one byte in DIGEST_STRIDE beyond (a prime, so every byte
       offset of an element is sampled somewhere). The same whatever other sessions shared the
       request, so a retry may regroup sessions. A retried step must match its first try's. The
       check reads a few rows just before the digest samples them, so the bytes come from memory
       once.

   encode_reply(out, shape, positions, request_id) -> bytes
       A DecodeResponse with o = the bf16 bytes `out` of `shape`, byte for byte what protobuf's
       SerializeToString gives, with one copy of the output (a protobuf message takes two).

   reply_o_data(reply) -> memoryview
       The bytes of o (its Tensor.data) inside a reply encode_reply made, as a read-only view of
       it: where a step's output is kept once encoded (for retries and an o_ref's region),
       instead of in a copy of its own beside the reply. ValueError for bytes encode_reply did
       not make.

   stage_inputs(dst, places, requests, limit) -> list
       A launch's bf16 requests copied into its staging buffer, in one call for the whole batch
       (gdn_server/backends/staging.py): dst a writable buffer, places the five inputs' (byte
       offset, bytes per row) in it, requests a sequence of (first row, (q, k, v, a, b)) with the
       inputs as bytes-like objects; input i of a request goes to dst at offset_i + row *
       per_row_i. Inputs of `limit` bytes or more are not copied but returned as (start, input)
       pairs, for a parallel copy by the caller. ValueError, and nothing copied, where an input
       would end past dst. The copies run without the GIL when they are big. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define N_INPUTS 5
#define BF16 1 /* gdn.v1.DType.BF16 */
#define MAX_POSITION ((uint64_t)INT64_MAX)
/* field numbers of gdn.v1.DecodeRequest and gdn.v1.Tensor this parse reads or writes */
enum { F_LAYER = 1, F_SESSION_IDS = 2, F_Q = 3, F_B = 7, F_POSITIONS = 8, F_REQUEST_ID = 9, F_SPECULATIVE = 10,
       F_O_REF = 11 };
enum { F_TENSOR_DTYPE = 1, F_TENSOR_SHAPE = 2, F_TENSOR_DATA = 3, F_TENSOR_REF = 4 };
enum { F_REF_REGION = 1, F_REF_OFFSET = 2 };
enum { F_REPLY_O = 1, F_REPLY_POSITIONS = 2, F_REPLY_REQUEST_ID = 3 };
#define DIGEST_FULL_ROW_BYTES 1024
#define DIGEST_STRIDE 61

enum { WIRE_VARINT = 0, WIRE_LEN = 2 };

/* -- reading the wire ------------------------------------------------------------------------ */

/* A varint that fits 64 bits (at most 10 bytes); 0 on success. */
static int read_varint(const uint8_t **pos, const uint8_t *end, uint64_t *out) {
    const uint8_t *p = *pos;
    uint64_t value = 0;
    for (int shift = 0; shift < 64 && p < end; shift += 7) {
        uint8_t byte = *p++;
        if (shift == 63 && byte > 1) return -1;
        value |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) {
            *pos = p;
            *out = value;
            return 0;
        }
    }
    return -1;
}

/* A length-delimited value [*start, *start + *len) that lies inside [*pos, end); 0 on success. */
static int read_len(const uint8_t **pos, const uint8_t *end, const uint8_t **start, Py_ssize_t *len) {
    uint64_t n;
    if (read_varint(pos, end, &n) != 0 || n > (uint64_t)(end - *pos)) return -1;
    *start = *pos;
    *len = (Py_ssize_t)n;
    *pos += n;
    return 0;
}

typedef struct {
    int seen; /* the field was in the message */
    const uint8_t *region; /* UTF-8, not terminated */
    Py_ssize_t region_len;
    uint64_t offset;
} Ref;

typedef struct {
    int seen; /* the field was in the message */
    uint64_t dtype;
    uint64_t dims[4];
    int ndim;
    const uint8_t *data;
    Py_ssize_t len;
    Ref ref;
} Tensor;

/* A TensorRef message in the plain encoding into *ref (seen set); 0 on success, -1 else. */
static int read_ref(const uint8_t *p, const uint8_t *end, Ref *ref) {
    int seen_region = 0, seen_offset = 0;
    ref->seen = 1;
    while (p < end) {
        uint64_t key;
        if (read_varint(&p, end, &key) != 0) return -1;
        if (key == (F_REF_REGION << 3 | WIRE_LEN) && !seen_region) {
            seen_region = 1;
            if (read_len(&p, end, &ref->region, &ref->region_len) != 0) return -1;
        } else if (key == (F_REF_OFFSET << 3 | WIRE_VARINT) && !seen_offset) {
            seen_offset = 1;
            if (read_varint(&p, end, &ref->offset) != 0) return -1;
        } else {
            return -1;
        }
    }
    return 0;
}

/* A Tensor message in the plain encoding; 0 on success, -1 for anything else. */
static int read_tensor(const uint8_t *p, const uint8_t *end, Tensor *t) {
    int seen_dtype = 0, seen_shape = 0, seen_data = 0;
    while (p < end) {
        uint64_t key;
        const uint8_t *start;
        Py_ssize_t len;
        if (read_varint(&p, end, &key) != 0) return -1;
        if (key == (F_TENSOR_DTYPE << 3 | WIRE_VARINT) && !seen_dtype) {
            seen_dtype = 1;
            if (read_varint(&p, end, &t->dtype) != 0) return -1;
        } else if (key == (F_TENSOR_SHAPE << 3 | WIRE_LEN) && !seen_shape) {
            seen_shape = 1;
            if (read_len(&p, end, &start, &len) != 0) return -1;
            const uint8_t *q = start, *q_end = start + len;
            while (q < q_end) {
                if (t->ndim == 4 || read_varint(&q, q_end, &t->dims[t->ndim]) != 0) return -1;
                t->ndim++;
            }
        } else if (key == (F_TENSOR_DATA << 3 | WIRE_LEN) && !seen_data) {
            seen_data = 1;
            if (read_len(&p, end, &t->data, &t->len) != 0) return -1;
        } else if (key == (F_TENSOR_REF << 3 | WIRE_LEN) && !t->ref.seen) {
            if (read_len(&p, end, &start, &len) != 0 || read_ref(start, start + len, &t->ref) != 0) return -1;
        } else {
            return -1;
        }
    }
    return 0;
}

/* -- checks and digests ---------------------------------------------------------------------- */

/* The largest magnitude (bits but the sign) of the bf16 values of data[0:nbytes], at least `top`:
   a value is NaN or Inf where its exponent bits are all ones, that is where its magnitude is at
   least NONFINITE_BF16. No early exit, and CHECK_LANES running maxima: the loop vectorizes to an
   and and a signed 16-bit max per 8 values with baseline x86-64's SSE2, several of them
   independent in each iteration, so it runs at the speed the bytes arrive rather than at one
   max's latency per 8 values. */
#define NONFINITE_BF16 0x7F80
#define CHECK_LANES 64
static int16_t max_magnitude_bf16(const uint8_t *data, Py_ssize_t nbytes, int16_t top) {
    int16_t lane[CHECK_LANES];
    Py_ssize_t words = nbytes / 2, i = 0;
    for (int j = 0; j < CHECK_LANES; j++) lane[j] = top;
    for (; i + CHECK_LANES <= words; i += CHECK_LANES) {
        for (int j = 0; j < CHECK_LANES; j++) {
            uint16_t word;
            memcpy(&word, data + 2 * (i + j), 2);
            int16_t magnitude = (int16_t)(word & 0x7FFF);
            lane[j] = magnitude > lane[j] ? magnitude : lane[j];
        }
    }
    for (; i < words; i++) {
        uint16_t word;
        memcpy(&word, data + 2 * i, 2);
        int16_t magnitude = (int16_t)(word & 0x7FFF);
        top = magnitude > top ? magnitude : top;
    }
    for (int j = 0; j < CHECK_LANES; j++) top = lane[j] > top ? lane[j] : top;
    return top;
}

static uint32_t crc_table[256];

static void make_crc_table(void) { /* CRC-32 (ISO-HDLC), the one zlib.crc32 computes */
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* Rows digested side by side. One row's CRC is a chain of table lookups, each waiting on the
   last; DIGEST_LANES rows' chains are independent, so the core runs them at once. A B = 256
   qwen3-next step's check and digests on one EPYC core: 200 us a row at a time, 125 us eight at
   a time (the digests alone 180 -> 75 us: what is left is reading the 4 MB, which the check and
   the digest each do). The rows of a group are what the check reads just before the digest
   samples them: DIGEST_LANES rows of an input, tens of KB, stay in L1 or L2 in between. (Four to
   ten lanes all measured within noise of eight; twelve spill registers.) */
#define DIGEST_LANES 8

/* The CRC-32 registers crc[0:lanes] (not yet inverted) carried on over bytes first, first +
   stride, ... below per_row of the `lanes` rows p, p + per_row, ...; inlined with lanes a
   constant, the loop over lanes unrolls and each register stays in one. */
static inline void crc_rows(uint32_t *crc, const uint8_t *p, Py_ssize_t per_row, Py_ssize_t first, Py_ssize_t stride,
                            int lanes) {
    for (Py_ssize_t i = first; i < per_row; i += stride)
        for (int l = 0; l < lanes; l++) crc[l] = crc_table[(crc[l] ^ p[l * per_row + i]) & 0xFF] ^ (crc[l] >> 8);
}

/* Each of `rows` rows' digest (see checked_digests above) into out, and the index of the first
   input holding a NaN or Inf (-1: none); data[i] holds len[i] bytes. DIGEST_LANES rows at a
   time (the rows left over one by one): each input's rows of the group checked, then digested
   while the check's read has them in the cache. */
static int check_and_digest_rows(const uint8_t *const *data, const Py_ssize_t *len, Py_ssize_t rows, int check,
                                 uint32_t *out) {
    Py_ssize_t row_bytes = 0;
    int16_t top[N_INPUTS] = {0};
    for (int i = 0; i < N_INPUTS; i++) row_bytes += len[i] / rows;
    Py_ssize_t stride = row_bytes <= DIGEST_FULL_ROW_BYTES ? 1 : DIGEST_STRIDE;
    for (Py_ssize_t r = 0; r < rows;) {
        int lanes = rows - r >= DIGEST_LANES ? DIGEST_LANES : 1;
        uint32_t crc[DIGEST_LANES];
        for (int l = 0; l < lanes; l++) crc[l] = 0xFFFFFFFFu;
        Py_ssize_t offset = 0; /* of this input's row in the session's row: the stride runs on */
        for (int i = 0; i < N_INPUTS; i++) {
            Py_ssize_t per_row = len[i] / rows, first = (stride - offset % stride) % stride;
            const uint8_t *p = data[i] + r * per_row;
            if (check && per_row % 2 == 0) { /* whole words in each row: the group's rows as one run */
                top[i] = max_magnitude_bf16(p, lanes * per_row, top[i]);
            } else if (check) {
                for (int l = 0; l < lanes; l++) top[i] = max_magnitude_bf16(p + l * per_row, per_row, top[i]);
            }
            if (lanes == DIGEST_LANES) crc_rows(crc, p, per_row, first, stride, DIGEST_LANES);
            else crc_rows(crc, p, per_row, first, stride, 1);
            offset += per_row;
        }
        for (int l = 0; l < lanes; l++) out[r + l] = ~crc[l];
        r += lanes;
    }
    for (int i = 0; i < N_INPUTS; i++)
        if (top[i] >= NONFINITE_BF16) return i;
    return -1;
}

/* The checked_digests of data[i] (len[i] bytes each) as (bad, digests); NULL with an error set
   only where memory ran out. */
static PyObject *checked_digest_pair(const uint8_t *const *data, const Py_ssize_t *len, Py_ssize_t rows, int check) {
    uint32_t *crcs = PyMem_Malloc(sizeof(uint32_t) * (size_t)rows);
    if (crcs == NULL) return PyErr_NoMemory();
    int bad = check_and_digest_rows(data, len, rows, check, crcs);
    PyObject *tuple = PyTuple_New(bad < 0 ? rows : 0);
    for (Py_ssize_t r = 0; tuple != NULL && bad < 0 && r < rows; r++) {
        PyObject *n = PyLong_FromUnsignedLong(crcs[r]);
        if (n == NULL) Py_CLEAR(tuple);
        else PyTuple_SET_ITEM(tuple, r, n);
    }
    PyMem_Free(crcs);
    if (tuple == NULL) return NULL;
    PyObject *index = bad < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(bad);
    PyObject *pair = index != NULL ? PyTuple_Pack(2, index, tuple) : NULL;
    Py_XDECREF(index);
    Py_DECREF(tuple);
    return pair;
}

static PyObject *checked_digests(PyObject *self, PyObject *args) {
    PyObject *inputs;
    Py_ssize_t rows;
    int bf16 = 1;
    if (!PyArg_ParseTuple(args, "On|p", &inputs, &rows, &bf16)) return NULL;
    PyObject *seq = PySequence_Fast(inputs, "inputs must be a sequence");
    if (seq == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != N_INPUTS || rows < 1) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "checked_digests takes five inputs and rows >= 1");
        return NULL;
    }
    Py_buffer views[N_INPUTS];
    const uint8_t *data[N_INPUTS];
    Py_ssize_t len[N_INPUTS];
    int held = 0;
    PyObject *result = NULL;
    for (; held < N_INPUTS; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held], PyBUF_SIMPLE) != 0) goto done;
        data[held] = views[held].buf;
        len[held] = views[held].len;
    }
    result = checked_digest_pair(data, len, rows, bf16);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    return result;
}

/* -- parse_step ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    long long num_layers, num_q_heads, num_v_heads, head_dim_k, head_dim_v, max_tokens, max_speculative_tokens,
        max_session_id_len, max_request_id_len;
} StepLimits;

static PyMemberDef step_limits_members[] = {
    {"num_layers", T_LONGLONG, offsetof(StepLimits, num_layers), READONLY, NULL},
    {"num_q_heads", T_LONGLONG, offsetof(StepLimits, num_q_heads), READONLY, NULL},
    {"num_v_heads", T_LONGLONG, offsetof(StepLimits, num_v_heads), READONLY, NULL},
    {"head_dim_k", T_LONGLONG, offsetof(StepLimits, head_dim_k), READONLY, NULL},
    {"head_dim_v", T_LONGLONG, offsetof(StepLimits, head_dim_v), READONLY, NULL},
    {"max_tokens", T_LONGLONG, offsetof(StepLimits, max_tokens), READONLY, "T of a plain step at most"},
    {"max_speculative_tokens", T_LONGLONG, offsetof(StepLimits, max_speculative_tokens), READONLY,
     "T of a speculative step at most"},
    {"max_session_id_len", T_LONGLONG, offsetof(StepLimits, max_session_id_len), READONLY, NULL},
    {"max_request_id_len", T_LONGLONG, offsetof(StepLimits, max_request_id_len), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *step_limits_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"num_layers", "num_q_heads", "num_v_heads", "head_dim_k", "head_dim_v", "max_tokens",
                            "max_speculative_tokens", "max_session_id_len", "max_request_id_len", NULL};
    long long v[9];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$LLLLLLLLL:StepLimits", names, &v[0], &v[1], &v[2], &v[3],
                                     &v[4], &v[5], &v[6], &v[7], &v[8]))
        return NULL;
    for (int i = 0; i < 9; i++) {
        if (v[i] < 1) {
            PyErr_Format(PyExc_ValueError, "StepLimits: %s must be >= 1, got %lld", names[i], v[i]);
            return NULL;
        }
    }
    StepLimits *self = (StepLimits *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->num_layers = v[0], self->num_q_heads = v[1], self->num_v_heads = v[2], self->head_dim_k = v[3];
    self->head_dim_v = v[4], self->max_tokens = v[5], self->max_speculative_tokens = v[6];
    self->max_session_id_len = v[7], self->max_request_id_len = v[8];
    return (PyObject *)self;
}

static PyTypeObject StepLimitsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gdn_server._wire.StepLimits",
    .tp_basicsize = sizeof(StepLimits),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What parse_step checks a step against (keyword arguments, read-only attributes).",
    .tp_members = step_limits_members,
    .tp_new = step_limits_new,
};

static PyTypeObject CheckedStepType;

static PyStructSequence_Field checked_step_fields[] = {
    {"layer", NULL},
    {"session_ids", "tuple of str"},
    {"positions", "tuple of int, or None when the request gave none"},
    {"request_id", NULL},
    {"inputs", "q, k, v, a, b: read-only memoryviews of the message's bf16 bytes, or (region, offset) "
               "for a tensor by reference"},
    {"dims", "the five inputs' shapes"},
    {"digests", "each session's checked_digests; () where some input is by reference (validation checks "
                "and digests those)"},
    {"by_reference", "some input or the output is by reference (a shared-memory region)"},
    {"o_ref", "(region, offset) where o goes, or None"},
    {"speculative", "a draft step (bool): T up to max_speculative_tokens"},
    {NULL, NULL},
};

static PyStructSequence_Desc checked_step_desc = {
    "gdn_server._wire.CheckedStep", "A DecodeRequest that is a valid bf16 step, checked (parse_step).",
    checked_step_fields, 10,
};

/* A str of the UTF-8 bytes, or NULL (no error set) where they are not valid UTF-8 or the str
   has more than max_chars characters. */
static PyObject *short_str(const uint8_t *s, Py_ssize_t n, long long max_chars) {
    PyObject *str = PyUnicode_DecodeUTF8((const char *)s, n, NULL);
    if (str == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
        return NULL;
    }
    if (PyUnicode_GET_LENGTH(str) > max_chars) Py_CLEAR(str);
    return str;
}

/* (region, offset) of a reference; NULL with no error set where the region is not valid UTF-8. */
static PyObject *ref_tuple(const Ref *ref) {
    PyObject *region = short_str(ref->region, ref->region_len, PY_SSIZE_T_MAX);
    if (region == NULL) return NULL;
    PyObject *offset = PyLong_FromUnsignedLongLong(ref->offset);
    PyObject *pair = offset != NULL ? PyTuple_Pack(2, region, offset) : NULL;
    Py_DECREF(region);
    Py_XDECREF(offset);
    return pair;
}

#define NOT_TAKEN goto not_taken

static PyObject *parse_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyObject_TypeCheck(args[1], &StepLimitsType)) {
        PyErr_SetString(PyExc_TypeError, "parse_step(data: bytes, limits: StepLimits)");
        return NULL;
    }
    const StepLimits *lim = (const StepLimits *)args[1];
    const long long L = lim->num_layers, H = lim->num_q_heads, HV = lim->num_v_heads, K = lim->head_dim_k,
                    V = lim->head_dim_v, max_id = lim->max_session_id_len, max_rid = lim->max_request_id_len;
    PyObject *message = args[0];
    const uint8_t *base = (const uint8_t *)PyBytes_AS_STRING(message), *p = base;
    const uint8_t *end = base + PyBytes_GET_SIZE(message);

    uint64_t layer = 0, speculative = 0;
    int seen_layer = 0, seen_rid = 0, seen_spec = 0, seen_positions = 0;
    Ref o_ref = {0};
    const uint8_t *rid = NULL, *pos_start = NULL;
    Py_ssize_t rid_len = 0, pos_len = 0;
    Tensor t[N_INPUTS];
    memset(t, 0, sizeof t);
    PyObject *ids = PyList_New(0), *positions = NULL, *str = NULL, *inputs = NULL, *dims = NULL, *view = NULL,
             *checked = NULL, *digests = NULL, *result = NULL, *o_ref_obj = NULL;
    if (ids == NULL) return NULL;

    while (p < end) {
        uint64_t key;
        const uint8_t *start;
        Py_ssize_t len;
        if (read_varint(&p, end, &key) != 0) NOT_TAKEN;
        uint64_t field = key >> 3, wire = key & 7;
        if (field == F_LAYER && wire == WIRE_VARINT && !seen_layer) {
            seen_layer = 1;
            if (read_varint(&p, end, &layer) != 0) NOT_TAKEN;
        } else if (field == F_SESSION_IDS && wire == WIRE_LEN) {
            if (read_len(&p, end, &start, &len) != 0 || (str = short_str(start, len, max_id)) == NULL) goto not_taken_or_error;
            if (PyUnicode_GET_LENGTH(str) == 0) NOT_TAKEN;
            if (PyList_Append(ids, str) != 0) goto error;
            Py_CLEAR(str);
        } else if (field >= F_Q && field <= F_B && wire == WIRE_LEN && !t[field - F_Q].seen) {
            t[field - F_Q].seen = 1;
            if (read_len(&p, end, &start, &len) != 0 || read_tensor(start, start + len, &t[field - F_Q]) != 0) NOT_TAKEN;
        } else if (field == F_POSITIONS && wire == WIRE_LEN && !seen_positions) {
            seen_positions = 1;
            if (read_len(&p, end, &pos_start, &pos_len) != 0) NOT_TAKEN;
        } else if (field == F_REQUEST_ID && wire == WIRE_LEN && !seen_rid) {
            seen_rid = 1;
            if (read_len(&p, end, &rid, &rid_len) != 0) NOT_TAKEN;
        } else if (field == F_SPECULATIVE && wire == WIRE_VARINT && !seen_spec) {
            seen_spec = 1;
            if (read_varint(&p, end, &speculative) != 0) NOT_TAKEN;
        } else if (field == F_O_REF && wire == WIRE_LEN && !o_ref.seen) {
            if (read_len(&p, end, &start, &len) != 0 || read_ref(start, start + len, &o_ref) != 0) NOT_TAKEN;
        } else {
            NOT_TAKEN; /* an unknown field, a field twice or in another wire type: protobuf decides */
        }
    }
    Py_ssize_t B = PyList_GET_SIZE(ids);
    /* a bool as protobuf writes it; any other value protobuf reads as true, and it decides */
    if (B == 0 || speculative > 1 || layer >= (uint64_t)L) NOT_TAKEN;
    if (B > 1) {
        PyObject *distinct = PySet_New(ids);
        if (distinct == NULL) goto error;
        Py_ssize_t n = PySet_GET_SIZE(distinct);
        Py_DECREF(distinct);
        if (n != B) NOT_TAKEN;
    }

    /* the five inputs: BF16, the shapes of B sessions and T tokens, their byte lengths */
    const long long max_T = speculative ? lim->max_speculative_tokens : lim->max_tokens;
    uint64_t T = t[0].ndim == 4 ? t[0].dims[1] : 0;
    if (T < 1 || T > (uint64_t)max_T) NOT_TAKEN;
    /* positions: none, or one per session, each with position + T below 2^63 */
    if (pos_len > 0) {
        positions = PyTuple_New(B);
        if (positions == NULL) goto error;
        const uint8_t *q = pos_start, *q_end = pos_start + pos_len;
        for (Py_ssize_t i = 0; i < B; i++) {
            uint64_t value;
            if (q >= q_end || read_varint(&q, q_end, &value) != 0 || value > MAX_POSITION - T) NOT_TAKEN;
            PyObject *n = PyLong_FromUnsignedLongLong(value);
            if (n == NULL) goto error;
            PyTuple_SET_ITEM(positions, i, n);
        }
        if (q != q_end) NOT_TAKEN;
    } else {
        positions = Py_NewRef(Py_None);
    }

    const long long want[N_INPUTS][4] = {
        {B, (long long)T, H, K}, {B, (long long)T, H, K}, {B, (long long)T, HV, V}, {B, (long long)T, HV, 1},
        {B, (long long)T, HV, 1},
    };
    const int ndims[N_INPUTS] = {4, 4, 4, 3, 3};
    const uint8_t *data[N_INPUTS];
    Py_ssize_t lens[N_INPUTS];
    int by_reference = o_ref.seen;
    for (int i = 0; i < N_INPUTS; i++) {
        if (!t[i].seen || t[i].dtype != BF16 || t[i].ndim != ndims[i]) NOT_TAKEN;
        long long numel = 1;
        for (int d = 0; d < ndims[i]; d++) {
            if (t[i].dims[d] != (uint64_t)want[i][d]) NOT_TAKEN;
            numel *= want[i][d];
        }
        if (t[i].ref.seen) { /* its bytes are in a region: validation resolves, checks and digests them */
            if (t[i].len != 0) NOT_TAKEN;
            by_reference = 1;
        } else if (t[i].len != 2 * numel) {
            NOT_TAKEN;
        }
        data[i] = t[i].data;
        lens[i] = t[i].len;
    }
    if (!by_reference) {
        if ((checked = checked_digest_pair(data, lens, B, 1)) == NULL) goto error;
        if (PyTuple_GET_ITEM(checked, 0) != Py_None) NOT_TAKEN; /* a NaN or Inf: validation names the input */
    }
    if (rid_len > 0) {
        if ((str = short_str(rid, rid_len, max_rid)) == NULL) goto not_taken_or_error;
    } else {
        str = PyUnicode_New(0, 0);
        if (str == NULL) goto error;
    }

    /* the result: inputs as views of the message (no copy), their shapes, digests */
    view = PyMemoryView_FromObject(message);
    inputs = view ? PyTuple_New(N_INPUTS) : NULL;
    dims = inputs ? PyTuple_New(N_INPUTS) : NULL;
    if (dims == NULL) goto error;
    for (int i = 0; i < N_INPUTS; i++) {
        PyObject *slice;
        if (t[i].ref.seen) {
            slice = ref_tuple(&t[i].ref);
            if (slice == NULL) goto not_taken_or_error;
        } else {
            Py_ssize_t offset = data[i] - base;
            slice = PySequence_GetSlice(view, offset, offset + lens[i]);
            if (slice == NULL) goto error;
        }
        PyTuple_SET_ITEM(inputs, i, slice);
        PyObject *shape = ndims[i] == 4 ? Py_BuildValue("(LLLL)", want[i][0], want[i][1], want[i][2], want[i][3])
                                        : Py_BuildValue("(LLL)", want[i][0], want[i][1], want[i][2]);
        if (shape == NULL) goto error;
        PyTuple_SET_ITEM(dims, i, shape);
    }
    if (o_ref.seen) {
        if ((o_ref_obj = ref_tuple(&o_ref)) == NULL) goto not_taken_or_error;
    } else {
        o_ref_obj = Py_NewRef(Py_None);
    }
    digests = by_reference ? PyTuple_New(0) : Py_NewRef(PyTuple_GET_ITEM(checked, 1));
    if (digests == NULL) goto error;
    result = PyStructSequence_New(&CheckedStepType);
    if (result == NULL) goto error;
    PyObject *id_tuple = PyList_AsTuple(ids);
    if (id_tuple == NULL) goto error;
    PyObject *fields[10] = {
        PyLong_FromUnsignedLongLong(layer), id_tuple, positions, str, inputs, dims, digests,
        Py_NewRef(by_reference ? Py_True : Py_False), o_ref_obj, Py_NewRef(speculative ? Py_True : Py_False),
    };
    if (fields[0] == NULL) {
        Py_DECREF(id_tuple);
        goto error;
    }
    positions = str = inputs = dims = digests = o_ref_obj = NULL; /* the result holds them now */
    for (int i = 0; i < 10; i++) PyStructSequence_SET_ITEM(result, i, fields[i]);
    goto done;

not_taken_or_error:
    if (PyErr_Occurred()) goto error;
not_taken:
    result = Py_NewRef(Py_None);
    goto done;
error:
    Py_CLEAR(result);
done:
    Py_XDECREF(ids);
    Py_XDECREF(positions);
    Py_XDECREF(str);
    Py_XDECREF(inputs);
    Py_XDECREF(dims);
    Py_XDECREF(view);
    Py_XDECREF(checked);
    Py_XDECREF(digests);
    Py_XDECREF(o_ref_obj);
    return result;
}

/* -- encode_reply ---------------------------------------------------------------------------- */

static Py_ssize_t varint_size(uint64_t v) {
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

/* A tuple of ints as uint64 (negatives as their two's complement, as protobuf writes int64). */
static int read_ints(PyObject *tuple, uint64_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(tuple, i);
        out[i] = (uint64_t)PyLong_AsUnsignedLongLongMask(item);
        if (out[i] == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *encode_reply(PyObject *self, PyObject *args) {
    Py_buffer out;
    PyObject *shape, *positions, *request_id;
    if (!PyArg_ParseTuple(args, "y*O!O!U", &out, &PyTuple_Type, &shape, &PyTuple_Type, &positions, &request_id))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_dims = PyTuple_GET_SIZE(shape), n_pos = PyTuple_GET_SIZE(positions), rid_len;
    uint64_t *ints = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n_dims + n_pos + 1));
    const char *rid = PyUnicode_AsUTF8AndSize(request_id, &rid_len);
    if (ints == NULL || rid == NULL) {
        if (ints == NULL) PyErr_NoMemory();
        goto done;
    }
    if (read_ints(shape, ints, n_dims) != 0 || read_ints(positions, ints + n_dims, n_pos) != 0) goto done;
    Py_ssize_t dims_bytes = 0, pos_bytes = 0;
    for (Py_ssize_t i = 0; i < n_dims; i++) dims_bytes += varint_size(ints[i]);
    for (Py_ssize_t i = 0; i < n_pos; i++) pos_bytes += varint_size(ints[n_dims + i]);
    /* o: dtype, shape (packed), data; then positions (packed), request_id; proto3 leaves empty
       fields out */
    Py_ssize_t tensor = 2 + (n_dims ? 1 + varint_size(dims_bytes) + dims_bytes : 0) +
                        (out.len ? 1 + varint_size(out.len) + out.len : 0);
    Py_ssize_t total = 1 + varint_size(tensor) + tensor + (n_pos ? 1 + varint_size(pos_bytes) + pos_bytes : 0) +
                       (rid_len ? 1 + varint_size(rid_len) + rid_len : 0);
    result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL) goto done;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(result);
    *p++ = F_REPLY_O << 3 | WIRE_LEN;
    p = put_varint(p, tensor);
    *p++ = F_TENSOR_DTYPE << 3 | WIRE_VARINT;
    *p++ = BF16;
    if (n_dims) {
        *p++ = F_TENSOR_SHAPE << 3 | WIRE_LEN;
        p = put_varint(p, dims_bytes);
        for (Py_ssize_t i = 0; i < n_dims; i++) p = put_varint(p, ints[i]);
    }
    if (out.len) {
        *p++ = F_TENSOR_DATA << 3 | WIRE_LEN;
        p = put_varint(p, out.len);
        memcpy(p, out.buf, out.len);
        p += out.len;
    }
    if (n_pos) {
        *p++ = F_REPLY_POSITIONS << 3 | WIRE_LEN;
        p = put_varint(p, pos_bytes);
        for (Py_ssize_t i = 0; i < n_pos; i++) p = put_varint(p, ints[n_dims + i]);
    }
    if (rid_len) {
        *p++ = F_REPLY_REQUEST_ID << 3 | WIRE_LEN;
        p = put_varint(p, rid_len);
        memcpy(p, rid, rid_len);
    }
done:
    PyMem_Free(ints);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *reply_o_data(PyObject *self, PyObject *reply) {
    if (!PyBytes_Check(reply)) {
        PyErr_SetString(PyExc_TypeError, "reply_o_data(reply: bytes)");
        return NULL;
    }
    const uint8_t *base = (const uint8_t *)PyBytes_AS_STRING(reply), *p = base, *end = p + PyBytes_GET_SIZE(reply);
    const uint8_t *tensor, *data = NULL;
    Py_ssize_t tensor_len, data_len = 0;
    uint64_t key;
    /* encode_reply writes o first, and in o: dtype, shape, then data (each left out when empty) */
    if (read_varint(&p, end, &key) != 0 || key != (F_REPLY_O << 3 | WIRE_LEN) ||
        read_len(&p, end, &tensor, &tensor_len) != 0)
        goto bad;
    for (const uint8_t *q = tensor, *q_end = tensor + tensor_len; q < q_end;) {
        const uint8_t *start;
        Py_ssize_t len;
        uint64_t value;
        if (read_varint(&q, q_end, &key) != 0) goto bad;
        if (key == (F_TENSOR_DTYPE << 3 | WIRE_VARINT)) {
            if (read_varint(&q, q_end, &value) != 0) goto bad;
        } else if (key == (F_TENSOR_SHAPE << 3 | WIRE_LEN) || key == (F_TENSOR_DATA << 3 | WIRE_LEN)) {
            if (read_len(&q, q_end, &start, &len) != 0) goto bad;
            if (key == (F_TENSOR_DATA << 3 | WIRE_LEN)) data = start, data_len = len;
        } else {
            goto bad;
        }
    }
    PyObject *view = PyMemoryView_FromObject(reply);
    if (view == NULL) return NULL;
    Py_ssize_t offset = data != NULL ? data - base : 0;
    PyObject *slice = PySequence_GetSlice(view, offset, offset + data_len);
    Py_DECREF(view);
    return slice;
bad:
    PyErr_SetString(PyExc_ValueError, "reply_o_data: not a reply encode_reply made");
    return NULL;
}

/* -- stage_inputs ---------------------------------------------------------------------------- */

/* Bytes a stage_inputs call copies from which it lets other threads run meanwhile. */
#define STAGE_RELEASE_GIL_BYTES (64 << 10)

static PyObject *stage_inputs(PyObject *self, PyObject *args) {
    Py_buffer dst;
    PyObject *places, *requests, *place_seq = NULL, *request_seq = NULL, *inputs = NULL, *big = NULL;
    Py_ssize_t limit, offset[N_INPUTS], per_row[N_INPUTS], held = 0, total = 0;
    Py_buffer *views = NULL;
    Py_ssize_t *starts = NULL;
    if (!PyArg_ParseTuple(args, "w*OOn", &dst, &places, &requests, &limit)) return NULL;
    if ((place_seq = PySequence_Fast(places, "places must be a sequence")) == NULL) goto error;
    if (PySequence_Fast_GET_SIZE(place_seq) != N_INPUTS) {
        PyErr_SetString(PyExc_ValueError, "stage_inputs takes the places of five inputs");
        goto error;
    }
    for (int i = 0; i < N_INPUTS; i++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(place_seq, i), "nn", &offset[i], &per_row[i])) goto error;
        if (offset[i] < 0 || offset[i] > dst.len || per_row[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "stage_inputs: a place outside the buffer");
            goto error;
        }
    }
    if ((request_seq = PySequence_Fast(requests, "requests must be a sequence")) == NULL) goto error;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(request_seq);
    views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(n * N_INPUTS + 1));
    starts = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n * N_INPUTS + 1));
    if ((big = PyList_New(0)) == NULL) goto error;
    if (views == NULL || starts == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        Py_ssize_t row;
        PyObject *request_inputs;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(request_seq, r), "nO", &row, &request_inputs)) goto error;
        if ((inputs = PySequence_Fast(request_inputs, "a request's inputs must be a sequence")) == NULL) goto error;
        if (PySequence_Fast_GET_SIZE(inputs) != N_INPUTS) {
            PyErr_SetString(PyExc_ValueError, "stage_inputs takes five inputs a request");
            goto error;
        }
        for (int i = 0; i < N_INPUTS; i++) {
            PyObject *input = PySequence_Fast_GET_ITEM(inputs, i);
            if (PyObject_GetBuffer(input, &views[held], PyBUF_SIMPLE) != 0) goto error;
            Py_ssize_t len = views[held].len, room = dst.len - offset[i], start;
            if (row < 0 || (per_row[i] > 0 && row > room / per_row[i]) || len > room - row * per_row[i]) {
                PyBuffer_Release(&views[held]);
                PyErr_Format(PyExc_ValueError, "stage_inputs: input %d of the request at row %zd ends past the buffer", i,
                             row);
                goto error;
            }
            start = offset[i] + row * per_row[i];
            if (len >= limit) { /* the caller copies it */
                PyBuffer_Release(&views[held]);
                PyObject *pair = Py_BuildValue("(nO)", start, input);
                if (pair == NULL || PyList_Append(big, pair) != 0) {
                    Py_XDECREF(pair);
                    goto error;
                }
                Py_DECREF(pair);
                continue;
            }
            starts[held++] = start;
            total += len;
        }
        Py_CLEAR(inputs);
    }
    uint8_t *base = dst.buf;
    if (total >= STAGE_RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < held; j++) memcpy(base + starts[j], views[j].buf, views[j].len);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t j = 0; j < held; j++) memcpy(base + starts[j], views[j].buf, views[j].len);
    }
    goto done;
error:
    Py_CLEAR(big);
done:
    for (Py_ssize_t j = 0; j < held; j++) PyBuffer_Release(&views[j]);
    PyMem_Free(views);
    PyMem_Free(starts);
    Py_XDECREF(inputs);
    Py_XDECREF(request_seq);
    Py_XDECREF(place_seq);
    PyBuffer_Release(&dst);
    return big;
}

/* -- the module ------------------------------------------------------------------------------ */

static PyMethodDef methods[] = {
    {"parse_step", (PyCFunction)(void (*)(void))parse_step, METH_FASTCALL,
     "parse_step(data, limits) -> CheckedStep | None: a serialized DecodeRequest that is a valid bf16 step, checked"},
    {"checked_digests", checked_digests, METH_VARARGS,
     "checked_digests(inputs, rows, bf16=True) -> (bad, digests): the first bf16 input with a NaN or Inf (or None), and "
     "each session's inputs' CRC-32"},
    {"encode_reply", encode_reply, METH_VARARGS,
     "encode_reply(out, shape, positions, request_id) -> bytes: a serialized DecodeResponse"},
    {"reply_o_data", reply_o_data, METH_O, "reply_o_data(reply) -> memoryview: o's bytes inside an encode_reply reply"},
    {"stage_inputs", stage_inputs, METH_VARARGS,
     "stage_inputs(dst, places, requests, limit) -> list: a launch's bf16 requests copied into its staging buffer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gdn_server._wire", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* PyModule_AddObjectRef of a new reference (NULL: the error that made it), which it gives up */
static int add_new_ref(PyObject *m, const char *name, PyObject *value) {
    if (value == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, name, value);
    Py_DECREF(value);
    return rc;
}

PyMODINIT_FUNC PyInit__wire(void) {
    make_crc_table();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (CheckedStepType.tp_name == NULL && PyStructSequence_InitType2(&CheckedStepType, &checked_step_desc) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "CheckedStep", (PyObject *)&CheckedStepType) != 0 || PyType_Ready(&StepLimitsType) != 0 ||
        PyModule_AddObjectRef(m, "StepLimits", (PyObject *)&StepLimitsType) != 0 ||
        PyModule_AddIntConstant(m, "BF16", BF16) != 0 || add_new_ref(m, "MAX_POSITION", PyLong_FromUnsignedLongLong(MAX_POSITION)) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* the field numbers this module reads and writes, by message and field name */
    PyObject *fields = Py_BuildValue(
        "{s{sisisisisisisisisisisi}s{sisisisi}s{sisi}s{sisisi}}", "DecodeRequest", "layer", F_LAYER, "session_ids",
        F_SESSION_IDS, "q", F_Q, "k", F_Q + 1, "v", F_Q + 2, "a", F_Q + 3, "b", F_B, "positions", F_POSITIONS,
        "request_id", F_REQUEST_ID, "speculative", F_SPECULATIVE, "o_ref", F_O_REF, "Tensor", "dtype", F_TENSOR_DTYPE,
        "shape", F_TENSOR_SHAPE, "data", F_TENSOR_DATA, "ref", F_TENSOR_REF, "TensorRef", "region", F_REF_REGION,
        "offset", F_REF_OFFSET, "DecodeResponse", "o", F_REPLY_O, "positions", F_REPLY_POSITIONS, "request_id",
        F_REPLY_REQUEST_ID);
    if (add_new_ref(m, "FIELDS", fields) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
