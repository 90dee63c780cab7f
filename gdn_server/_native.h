/* What gdn_server._native's source files share: each file adds its own functions to the module. */
#ifndef GDN_NATIVE_H
#define GDN_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* _native.c: helpers the other files share. */
/* A str of UTF-8 bytes; NULL without an exception set when they are not valid UTF-8. */
PyObject *utf8(const uint8_t *s, Py_ssize_t n);

/* Attribute or key names, each interned once into its slot. */
typedef struct {
    PyObject **slot;
    const char *name;
} InternedName;

/* Interns each name into its slot (once); 0 on success, -1 with an exception set. */
int intern_names(const InternedName *names, size_t count);

/* _native.c: a copy of len bytes (even) for copy_spans, and how it is done. */
#define SPAN_COPY 0   /* memcpy */
#define SPAN_CHECK 1  /* memcpy, looking for bf16 NaN/Inf as it goes */
#define SPAN_STREAM 2 /* copy_for_another_core: another process or the device reads it next */
typedef struct {
    uint8_t *dst;
    const uint8_t *src;
    Py_ssize_t len;
    int mode;
} Span;

/* _native.c: the spans' copies split evenly over `threads` threads (this one and a pool kept
   between calls); found[i] is set when span i is SPAN_CHECK and holds a NaN/Inf. Call without
   the GIL. */
void copy_spans(const Span *spans, Py_ssize_t n_spans, int threads, uint8_t *found);

/* _native_replies.c: copies n bytes into memory that another process (a link ring) or the device
   (pinned staging, read by DMA or by a kernel through its mapping) reads next, with stores that
   bypass this core's caches where the CPU has them (x86-64), else memcpy. */
void copy_for_another_core(void *dst, const void *src, size_t n);

/* _native_scheduler.c: the scheduler's plain steps; 0 on success, -1 with an exception set. */
int add_scheduler_functions(PyObject *module);

/* _native_link.c: the engine's decode of front-end link frames and its reply writer (LinkSender);
   0 on success, -1 with an exception set. */
int add_link_functions(PyObject *module);

/* The front-end link's request frame (gdn_server/link.py is the reference): its kind, flags
   and fixed header, read little-endian. */
#define LINK_INPUTS 5 /* q, k, v, a, b */
#define KIND_DECODE 1
#define FLAG_SPECULATIVE 1
#define FLAG_POSITIONS 2
#define FLAG_F32 4
#define FLAG_IN_RING 8
#define FLAG_UNCHECKED 16
#define HEADER_BYTES 23 /* link.REQUEST: <BQBIIBHH */

static inline uint16_t u16_at(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline uint32_t u32_at(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t u64_at(const uint8_t *p) { return (uint64_t)u32_at(p) | (uint64_t)u32_at(p + 4) << 32; }

/* Bytes of each bf16 input of a request of `rows` x T token rows (rows = B * T): q, k
   [.., H, K], v [.., HV, V], a, b [.., HV], which lie back to back; heads = (H, HV, K, V). */
static inline void link_input_bytes(const Py_ssize_t *heads, Py_ssize_t rows, Py_ssize_t *nbytes) {
    nbytes[0] = nbytes[1] = 2 * rows * heads[0] * heads[2];
    nbytes[2] = 2 * rows * heads[1] * heads[3];
    nbytes[3] = nbytes[4] = 2 * rows * heads[1];
}

/* _native_link.c: the five inputs as slices of `view` (a memoryview), back to back from
   `offset`; a new tuple, or NULL with an exception set. */
PyObject *link_inputs(PyObject *view, Py_ssize_t offset, const Py_ssize_t *nbytes);

/* _native_link.c: the DecodeWork (of type work_type, made as DecodeWork.of_bf16 makes one) of a
   link request with bf16 inputs `raw` (five bytes-likes), which the worker checked for NaN/Inf
   unless `finite_checked` is 0; B rows, T tokens, heads = (H, HV, K, V). A new reference, or NULL
   with an exception set. */
PyObject *link_work(PyObject *work_type, unsigned long layer, PyObject *ids, PyObject *positions, PyObject *request_id,
                    PyObject *owner, int speculative, int finite_checked, PyObject *raw, Py_ssize_t B, int T,
                    const Py_ssize_t *heads);

/* _native_replies.c: ReplyBox, one link connection's replies; 0 on success, -1 with an exception set. */
int add_reply_box(PyObject *module);

/* _native_replies.c, for the lane: whether obj is a ReplyBox; its expect(tag); its dropped(tag)
   (1: cancelled and answered, 0: not, -1: error); its answer(tag, result); and the answer of a
   one-row step's output `out` (a bytes-like) at `position` after the step. 0 or the said value on
   success, -1 with an exception set. */
int reply_box_check(PyObject *obj);
int reply_box_expect(PyObject *box, PyObject *tag);
int reply_box_dropped(PyObject *box, PyObject *tag);
int reply_box_answer(PyObject *box, PyObject *tag, PyObject *result);
int reply_box_answer_output(PyObject *box, PyObject *tag, unsigned long long position, long tokens, PyObject *out);

/* _native_lane.c: LaneRun, the engine's plain one-row steps as records. lane_take_frame reads one
   link frame into a LaneRun at the end of `out` (1), or leaves it (0: not a lane frame), or fails
   (-1, an exception set); heads = (H, HV, K, V). lane_check: whether obj is a LaneRun. lane_stamp:
   the queue time of its records not yet stamped. */
int lane_take_frame(const uint8_t *base, Py_ssize_t len, PyObject *ring, PyObject *box, const Py_ssize_t *heads,
                    PyObject *out);
int lane_check(PyObject *obj);
void lane_stamp(PyObject *run, double now);
int add_lane_type(PyObject *module);
int add_h2_transport(PyObject *module); /* _native_h2.c: the workers' HTTP/2 transport */

/* _native_cuda.c: a small launch's graph launch and event record, straight to the CUDA driver
   (opened at first use); 0 on success, -1 with an exception set. */
int add_cuda_functions(PyObject *module);

#endif
