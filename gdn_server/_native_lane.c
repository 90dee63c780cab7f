/* gdn_server._native, the engine's lane: plain one-row steps from the front-end link to the reply
   ring as C records, with no Python object per request but the few the session records keep.

   Why: behind `--frontends N` the engine does every request's host work on its one thread, and
   a plain step cost ~18-29 us there on the CPU box, most of it the Python objects made and read
   around ~2-4 us of copies (bench/NOTES.md, twenty-fourth session, section 4: the lane's floor).
   Those objects are what bound batching on against batching off at 64 clients.

   What takes the lane: a KIND_DECODE frame of one session, one token, positions given, inputs
   bf16 in the request ring, not speculative, from a connection with a ReplyBox.
   Every other frame decodes to a DecodeWork as before (_native_link.c). At admission a record
   leaves the lane for the Python path when its step is not plain (an unknown session, another
   owner, a speculative record at any layer, a position that is not the session's count: a retry
   or an error): Scheduler._launch then gets it as a _DecodeItem, in its place in the queue.

   LaneRun: records in queue order. The same type serves as a queue item (records from one or
   more reads, in the scheduler's `_pending` like a _DecodeItem), as the records a round defers,
   and as the lane rows of a StepBatch (`StepBatch.lane`, after the batch's other rows).
   Records in [cursor, count) are the run's; those before the cursor have been handed on.

       rows, enqueued          records left, and the oldest one's queue time (the hold's clock)
       take(n)                 the next n records as a run of their own (a queue's room)
       done(result)            answers every record left with `result` (an exception)
       admit(rows, max_rows, ctx) -> (rows, item | None)
                               Scheduler._launch for the records from the cursor on: deferred
                               (a busy session, or past max_rows), dropped (cancelled), or
                               admitted to batches[1]'s lane; stops at a record that is not a
                               plain step and returns it as a _DecodeItem
       seal(batch)             the lane's rows join batch.slots/out_slots/layers, after the others
       fill(dst, places)       copies each row's inputs from the request ring into staging
       submitted(now, started, on_dispatch, step_record_type, last_step_type) -> queue_wait
                               the positions advance, each session's LastStep points at a
                               StepRecord of its own, as Scheduler._submit does
       finish(whole, row_bytes) each row's output into bytes (its StepRecord.out) and its reply
       roll_back()             a failed launch: positions and LastSteps as before `submitted`
       works(work_type)        each record as a DecodeWork (backends that compute on the host)
       sample_session()        the middle row's session (--batch-fill's sample)

   tests/test_lane.py runs the same requests through the lane and through the Python path and
   compares the answers and the session records. */
#include "_native.h"
#include <string.h>


typedef struct {
    PyObject *box;     /* the connection's ReplyBox */
    PyObject *tag;     /* int: the worker's tag of the request */
    PyObject *sid;     /* str: the session id */
    PyObject *request_id; /* str: the client's (the engine's replies carry none: the worker keeps it) */
    PyObject *owner;   /* str or None: the caller's identity */
    PyObject *ring;    /* the request ring (a memoryview): holds the inputs */
    PyObject *session; /* the Session, once admitted */
    PyObject *step;    /* its StepRecord, once submitted */
    Py_ssize_t offset; /* the inputs' byte offset in the ring: q, k, v, a, b back to back */
    Py_ssize_t slot;   /* the pool row, once admitted */
    unsigned long long position; /* the session's count at the layer before the step */
    Py_ssize_t layer;
    double enqueued; /* 0 until the scheduler queues it */
} LaneRecord;

typedef struct {
    PyObject_HEAD
    LaneRecord *recs;
    Py_ssize_t count, cap, cursor;
    Py_ssize_t first_row; /* where seal() put the lane's rows in its batch */
    Py_ssize_t heads[4];  /* H, HV, K, V */
} LaneRun;

static PyTypeObject *lane_type;
static PyObject *l_owner, *l_provisional, *l_scratch_current, *l_positions, *l_slot, *l_num_layers, *l_lane,
    *l_slots, *l_out_slots, *l_layers, *l_last_steps, *l_last_used, *l_tokens, *l_rows, *l_out, *l_count_before,
    *l_record, *l_row, *l_work, *l_done, *l_cancelled, *l_enqueued, *l_answer, *l_dropped;

static void record_release(LaneRecord *r) {
    Py_CLEAR(r->box);
    Py_CLEAR(r->tag);
    Py_CLEAR(r->sid);
    Py_CLEAR(r->request_id);
    Py_CLEAR(r->owner);
    Py_CLEAR(r->ring);
    Py_CLEAR(r->session);
    Py_CLEAR(r->step);
}

static LaneRun *run_new(const Py_ssize_t *heads) {
    LaneRun *run = PyObject_New(LaneRun, lane_type);
    if (run == NULL) return NULL;
    run->recs = NULL;
    run->count = run->cap = run->cursor = run->first_row = 0;
    memcpy(run->heads, heads, sizeof(run->heads));
    return run;
}

/* Moves *rec (its references) to the end of run; the caller forgets it. -1 when out of memory
   (the record then stays the caller's). */
static int run_push(LaneRun *run, LaneRecord *rec) {
    if (run->count == run->cap) {
        Py_ssize_t cap = run->cap ? 2 * run->cap : 16;
        LaneRecord *grown = PyMem_Realloc(run->recs, sizeof(LaneRecord) * (size_t)cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        run->recs = grown;
        run->cap = cap;
    }
    run->recs[run->count++] = *rec;
    memset(rec, 0, sizeof(*rec));
    return 0;
}

static void run_dealloc(LaneRun *self) {
    for (Py_ssize_t i = self->cursor; i < self->count; i++) record_release(&self->recs[i]);
    PyMem_Free(self->recs);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free(self);
    Py_DECREF(type);
}

int lane_check(PyObject *obj) { return lane_type != NULL && (PyObject *)Py_TYPE(obj) == (PyObject *)lane_type; }

void lane_stamp(PyObject *run_obj, double now) {
    LaneRun *run = (LaneRun *)run_obj;
    for (Py_ssize_t i = run->cursor; i < run->count; i++)
        if (run->recs[i].enqueued == 0.0) run->recs[i].enqueued = now;
}

int lane_take_frame(const uint8_t *base, Py_ssize_t len, PyObject *ring, PyObject *box, const Py_ssize_t *heads,
                    PyObject *out) {
    const uint8_t *end = base + len;
    if (len < HEADER_BYTES || base[0] != KIND_DECODE || !reply_box_check(box)) return 0;
    if (base[9] != (FLAG_POSITIONS | FLAG_IN_RING)) return 0; /* not speculative, not f32 */
    uint32_t layer = u32_at(base + 10), B = u32_at(base + 14);
    uint8_t T = base[18];
    uint16_t rid_len = u16_at(base + 19), ident_len = u16_at(base + 21);
    if (B != 1 || T != 1) return 0;
    const uint8_t *p = base + HEADER_BYTES;
    if (end - p < 10) return 0;
    Py_ssize_t id_len = u16_at(p);
    unsigned long long position = u64_at(p + 2);
    p += 10;
    if (end - p != id_len + rid_len + ident_len + 8) return 0;
    if (ring == Py_None || !PyMemoryView_Check(ring)) return 0;
    Py_ssize_t ring_len = PyMemoryView_GET_BUFFER(ring)->len, nbytes[LINK_INPUTS], total = 0;
    link_input_bytes(heads, 1, nbytes);
    for (int i = 0; i < LINK_INPUTS; i++) total += nbytes[i];
    if (ring_len <= 0) return 0;
    Py_ssize_t offset = (Py_ssize_t)(u64_at(p + id_len + rid_len + ident_len) % (uint64_t)ring_len);
    if (offset + total > ring_len) return 0;

    LaneRecord rec = {0};
    rec.sid = utf8(p, id_len);
    if (rec.sid == NULL) goto python_or_error;
    if ((rec.request_id = utf8(p + id_len, rid_len)) == NULL) goto python_or_error;
    if (ident_len == 0) {
        rec.owner = Py_None;
        Py_INCREF(Py_None);
    } else if ((rec.owner = utf8(p + id_len + rid_len, ident_len)) == NULL) {
        goto python_or_error;
    }
    if ((rec.tag = PyLong_FromUnsignedLongLong(u64_at(base + 1))) == NULL) goto fail;
    rec.box = box;
    Py_INCREF(box);
    rec.ring = ring;
    Py_INCREF(ring);
    rec.offset = offset;
    rec.layer = (Py_ssize_t)layer;
    rec.position = position;
    Py_ssize_t n = PyList_GET_SIZE(out);
    LaneRun *run = NULL;
    if (n > 0 && lane_check(PyList_GET_ITEM(out, n - 1))) {
        run = (LaneRun *)PyList_GET_ITEM(out, n - 1);
    } else {
        if ((run = run_new(heads)) == NULL) goto fail;
        int appended = PyList_Append(out, (PyObject *)run);
        Py_DECREF(run); /* the list holds it */
        if (appended < 0) goto fail;
    }
    /* outstanding from now on, as EngineLink._take's expect */
    if (reply_box_expect(box, rec.tag) < 0 || run_push(run, &rec) < 0) goto fail;
    return 1;
python_or_error:
    if (!PyErr_Occurred()) {
        record_release(&rec);
        return 0;
    }
fail:
    record_release(&rec);
    return -1;
}

/* -- the run's methods --------------------------------------------------------------------- */

static PyObject *run_get_rows(LaneRun *self, void *closure) { return PyLong_FromSsize_t(self->count - self->cursor); }

static PyObject *run_get_enqueued(LaneRun *self, void *closure) {
    double first = 0.0;
    for (Py_ssize_t i = self->cursor; i < self->count; i++) /* deferred runs mix reads: the oldest */
        if (i == self->cursor || self->recs[i].enqueued < first) first = self->recs[i].enqueued;
    return PyFloat_FromDouble(first);
}

static Py_ssize_t run_len(LaneRun *self) { return self->count - self->cursor; }

static PyObject *run_done(LaneRun *self, PyObject *result) {
    while (self->cursor < self->count) {
        LaneRecord *r = &self->recs[self->cursor++];
        int rc = reply_box_answer(r->box, r->tag, result);
        record_release(r);
        if (rc < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* PyObject_IsTrue(obj.name): 1, 0, or -1 with an error set. */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_GetAttr(obj, name);
    int truth = value ? PyObject_IsTrue(value) : -1;
    Py_XDECREF(value);
    return truth;
}

/* The session of a plain step (a new reference), NULL with no error when the record's step is
   not plain (the Python path decides what it is), NULL with an error set when a call failed. As
   _native_scheduler.c's plain_sessions, for one session. */
static PyObject *plain_session(LaneRecord *r, PyObject *by_id) {
    PyObject *s = PyDict_GetItemWithError(by_id, r->sid);
    if (s == NULL) return NULL;
    Py_INCREF(s); /* held while its attributes are read */
    int same = 0;
    PyObject *own = PyObject_GetAttr(s, l_owner);
    if (own == NULL) goto done;
    int differs = PyObject_RichCompareBool(own, r->owner, Py_NE);
    Py_DECREF(own);
    if (differs != 0) goto done;
    int open = attr_true(s, l_provisional);
    if (open == 0) open = attr_true(s, l_scratch_current);
    if (open != 0) goto done;
    PyObject *counts = PyObject_GetAttr(s, l_positions);
    if (counts == NULL) goto done;
    if (PyList_Check(counts) && r->layer < PyList_GET_SIZE(counts)) {
        PyObject *count = PyList_GET_ITEM(counts, r->layer);
        unsigned long long value = PyLong_Check(count) ? PyLong_AsUnsignedLongLong(count) : (unsigned long long)-1;
        if (PyErr_Occurred()) PyErr_Clear(); /* negative or huge: not the record's, the Python decides */
        else same = value == r->position;
    }
    Py_DECREF(counts);
done:
    if (same) return s;
    Py_DECREF(s);
    return NULL;
}

/* The record as link.decode_request's DecodeWork (as _native_link.c's decode_frame makes one). */
static PyObject *record_work(LaneRecord *r, const Py_ssize_t *heads, PyObject *work_type) {
    PyObject *work = NULL, *raw = NULL, *ids = NULL, *position = NULL, *positions = NULL;
    Py_ssize_t nbytes[LINK_INPUTS];
    link_input_bytes(heads, 1, nbytes);
    if ((raw = link_inputs(r->ring, r->offset, nbytes)) == NULL) goto done;
    ids = PyTuple_Pack(1, r->sid);
    position = ids ? PyLong_FromUnsignedLongLong(r->position) : NULL;
    positions = position ? PyTuple_Pack(1, position) : NULL;
    if (positions != NULL)
        work = link_work(work_type, (unsigned long)r->layer, ids, positions, r->request_id, r->owner, 0, 1, raw, 1, 1,
                         heads);
done:
    Py_XDECREF(raw);
    Py_XDECREF(ids);
    Py_XDECREF(position);
    Py_XDECREF(positions);
    return work;
}

/* The record as a queued _DecodeItem (as the link's take and make_decode_items make one). */
static PyObject *record_item(LaneRecord *r, const Py_ssize_t *heads, PyObject *item_type, PyObject *work_type,
                             PyObject *partial) {
    PyObject *item = NULL, *answer = NULL, *dropped = NULL, *done = NULL, *cancelled = NULL, *rows = NULL,
             *enqueued = NULL, *no_args = NULL;
    PyObject *work = record_work(r, heads, work_type);
    if (work == NULL) return NULL;
    answer = PyObject_GetAttr(r->box, l_answer);
    dropped = answer ? PyObject_GetAttr(r->box, l_dropped) : NULL;
    done = dropped ? PyObject_CallFunctionObjArgs(partial, answer, r->tag, NULL) : NULL;
    cancelled = done ? PyObject_CallFunctionObjArgs(partial, dropped, r->tag, NULL) : NULL;
    rows = cancelled ? PyLong_FromLong(1) : NULL;
    enqueued = rows ? PyFloat_FromDouble(r->enqueued) : NULL;
    no_args = enqueued ? PyTuple_New(0) : NULL;
    if (no_args == NULL) goto done;
    PyTypeObject *type = (PyTypeObject *)item_type;
    item = type->tp_new(type, no_args, NULL);
    if (item == NULL) goto done;
    if (PyObject_SetAttr(item, l_work, work) < 0 || PyObject_SetAttr(item, l_done, done) < 0 ||
        PyObject_SetAttr(item, l_rows, rows) < 0 || PyObject_SetAttr(item, l_cancelled, cancelled) < 0 ||
        PyObject_SetAttr(item, l_enqueued, enqueued) < 0)
        Py_CLEAR(item);
done:
    Py_DECREF(work);
    Py_XDECREF(answer);
    Py_XDECREF(dropped);
    Py_XDECREF(done);
    Py_XDECREF(cancelled);
    Py_XDECREF(rows);
    Py_XDECREF(enqueued);
    Py_XDECREF(no_args);
    return item;
}

/* batches[1]'s StepBatch's lane (borrowed), made (with the batch, as Scheduler._launch makes one)
   when new. */
static LaneRun *admitted_lane(PyObject *batches, PyObject *step_batch_type, const Py_ssize_t *heads) {
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(batches, one); /* borrowed */
    if (entry == NULL && !PyErr_Occurred()) {
        PyObject *batch = PyObject_CallOneArg(step_batch_type, one);
        PyObject *members = batch ? PyList_New(0) : NULL;
        entry = members ? PyTuple_Pack(2, batch, members) : NULL;
        Py_XDECREF(batch);
        Py_XDECREF(members);
        if (entry != NULL) {
            int rc = PyDict_SetItem(batches, one, entry);
            Py_DECREF(entry); /* the dict holds it */
            if (rc < 0) entry = NULL;
        }
    }
    Py_DECREF(one);
    if (entry == NULL) return NULL;
    PyObject *batch = PyTuple_GET_ITEM(entry, 0);
    PyObject *lane = PyObject_GetAttr(batch, l_lane);
    if (lane == NULL) return NULL;
    Py_DECREF(lane); /* the batch holds it */
    if (lane_check(lane)) return (LaneRun *)lane;
    if (lane != Py_None) {
        PyErr_SetString(PyExc_TypeError, "a StepBatch's lane must be a LaneRun or None");
        return NULL;
    }
    LaneRun *made = run_new(heads);
    if (made == NULL) return NULL;
    int rc = PyObject_SetAttr(batch, l_lane, (PyObject *)made);
    Py_DECREF(made);
    return rc < 0 ? NULL : made;
}

static PyObject *run_admit(LaneRun *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != 8) {
        PyErr_SetString(PyExc_TypeError, "admit(rows: int, max_rows: int, ctx: 8-tuple)");
        return NULL;
    }
    Py_ssize_t rows = PyLong_AsSsize_t(args[0]), max_rows = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    PyObject *const *ctx = &PyTuple_GET_ITEM(args[2], 0);
    PyObject *by_id = ctx[0], *busy = ctx[1], *deferred = ctx[2], *batches = ctx[3], *step_batch_type = ctx[4],
             *item_type = ctx[5], *work_type = ctx[6], *partial = ctx[7];
    if (!PyDict_Check(by_id) || !PySet_Check(busy) || !PyList_Check(deferred) || !PyDict_Check(batches) ||
        !PyType_Check(item_type) || !PyType_Check(work_type)) {
        PyErr_SetString(PyExc_TypeError, "admit: ctx is (dict, set, list, dict, type, type, type, callable)");
        return NULL;
    }
    LaneRun *admitted = NULL;
    while (self->cursor < self->count) {
        LaneRecord *r = &self->recs[self->cursor];
        /* a session already in this round (or behind a deferred request), or past max_rows: deferred */
        int is_busy = rows && rows + 1 > max_rows;
        if (!is_busy && (is_busy = PySet_Contains(busy, r->sid)) < 0) return NULL;
        if (is_busy) {
            if (PySet_Add(busy, r->sid) < 0) return NULL;
            Py_ssize_t n = PyList_GET_SIZE(deferred);
            LaneRun *later = n > 0 && lane_check(PyList_GET_ITEM(deferred, n - 1))
                ? (LaneRun *)PyList_GET_ITEM(deferred, n - 1) : NULL;
            if (later == NULL) {
                if ((later = run_new(self->heads)) == NULL) return NULL;
                int rc = PyList_Append(deferred, (PyObject *)later);
                Py_DECREF(later);
                if (rc < 0) return NULL;
            }
            if (run_push(later, r) < 0) return NULL;
            self->cursor++;
            continue;
        }
        PyObject *s = plain_session(r, by_id);
        if (s == NULL) {
            if (PyErr_Occurred()) return NULL;
            /* not a plain step: the Python path takes it, in its place */
            PyObject *item = record_item(r, self->heads, item_type, work_type, partial);
            if (item == NULL) return NULL;
            record_release(r);
            self->cursor++;
            return Py_BuildValue("(nN)", rows, item);
        }
        int gone = reply_box_dropped(r->box, r->tag);
        if (gone != 0) {
            Py_DECREF(s);
            if (gone < 0) return NULL;
            record_release(r); /* the client gave up: never reaches the device */
            self->cursor++;
            continue;
        }
        r->session = s; /* the record holds it from here on (released with the record) */
        if (PySet_Add(busy, r->sid) < 0) return NULL;
        PyObject *slot = PyObject_GetAttr(s, l_slot), *num_layers = slot ? PyObject_GetAttr(s, l_num_layers) : NULL;
        Py_ssize_t a = slot ? PyLong_AsSsize_t(slot) : -1, b = num_layers ? PyLong_AsSsize_t(num_layers) : -1;
        Py_XDECREF(slot);
        Py_XDECREF(num_layers);
        if (PyErr_Occurred()) return NULL;
        if (admitted == NULL && (admitted = admitted_lane(batches, step_batch_type, self->heads)) == NULL) return NULL;
        r->slot = a * b + r->layer; /* Session.pool_slot: a plain step reads and writes its home row */
        if (run_push(admitted, r) < 0) return NULL;
        self->cursor++;
        rows++;
    }
    return Py_BuildValue("(nO)", rows, Py_None);
}

/* Extends the list obj.name with `values` ints, one per lane row. */
static int extend_ints(PyObject *obj, PyObject *name, LaneRun *self, int which) {
    PyObject *list = PyObject_GetAttr(obj, name);
    if (list == NULL) return -1;
    int rc = -1;
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%U is not a list", name);
        goto done;
    }
    for (Py_ssize_t i = self->cursor; i < self->count; i++) {
        PyObject *v = PyLong_FromSsize_t(which ? self->recs[i].layer : self->recs[i].slot);
        if (v == NULL || PyList_Append(list, v) < 0) {
            Py_XDECREF(v);
            goto done;
        }
        Py_DECREF(v);
    }
    rc = 0;
done:
    Py_DECREF(list);
    return rc;
}

static PyObject *run_seal(LaneRun *self, PyObject *batch) {
    PyObject *slots = PyObject_GetAttr(batch, l_slots);
    if (slots == NULL) return NULL;
    Py_ssize_t first = PyObject_Length(slots);
    Py_DECREF(slots);
    if (first < 0) return NULL;
    self->first_row = first;
    if (extend_ints(batch, l_slots, self, 0) < 0 || extend_ints(batch, l_out_slots, self, 0) < 0 ||
        extend_ints(batch, l_layers, self, 1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *run_fill(LaneRun *self, PyObject *args) {
    Py_buffer dst;
    PyObject *places;
    if (!PyArg_ParseTuple(args, "w*O!", &dst, &PyTuple_Type, &places)) return NULL;
    Py_ssize_t offset[LINK_INPUTS], per_row[LINK_INPUTS], nbytes[LINK_INPUTS];
    link_input_bytes(self->heads, 1, nbytes);
    if (PyTuple_GET_SIZE(places) != LINK_INPUTS) {
        PyErr_SetString(PyExc_ValueError, "places: one (offset, bytes per row) for each of q, k, v, a, b");
        goto fail;
    }
    for (int i = 0; i < LINK_INPUTS; i++) {
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(places, i), "nn", &offset[i], &per_row[i])) goto fail;
        if (per_row[i] != nbytes[i]) {
            PyErr_Format(PyExc_ValueError, "a lane row's input %d is %zd bytes, the staging plan's %zd", i, nbytes[i],
                         per_row[i]);
            goto fail;
        }
    }
    for (Py_ssize_t i = self->cursor; i < self->count; i++) {
        LaneRecord *r = &self->recs[i];
        Py_ssize_t row = self->first_row + (i - self->cursor), from = r->offset;
        Py_buffer *ring = PyMemoryView_GET_BUFFER(r->ring);
        for (int j = 0; j < LINK_INPUTS; j++) {
            Py_ssize_t to = offset[j] + row * per_row[j];
            if (to < 0 || to + nbytes[j] > dst.len || from + nbytes[j] > ring->len) {
                PyErr_SetString(PyExc_ValueError, "fill: a lane row lies outside the staging buffer or its ring");
                goto fail;
            }
            /* the device's DMA (or the kernel, mapped) reads the staging next, not this core: streaming
               stores skip reading each destination line in first (bench/NOTES.md, twenty-seventh session) */
            copy_for_another_core((uint8_t *)dst.buf + to, (const uint8_t *)ring->buf + from, (size_t)nbytes[j]);
            from += nbytes[j];
        }
    }
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&dst);
    return NULL;
}

/* An instance of a slotted class made without its __init__, with `count` (name, value) pairs
   (value references are the caller's). */
static PyObject *make_slotted(PyObject *type_obj, PyObject *no_args, int count, PyObject **names, PyObject **values) {
    PyTypeObject *type = (PyTypeObject *)type_obj;
    PyObject *obj = type->tp_new(type, no_args, NULL);
    if (obj == NULL) return NULL;
    for (int i = 0; i < count; i++)
        if (PyObject_SetAttr(obj, names[i], values[i]) < 0) {
            Py_DECREF(obj);
            return NULL;
        }
    return obj;
}

static PyObject *run_submitted(LaneRun *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyType_Check(args[3]) || !PyType_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "submitted(now: float, started: float, on_dispatch, step_record_type, "
                                         "last_step_type)");
        return NULL;
    }
    PyObject *now_obj = args[0], *on_dispatch = args[2], *record_type = args[3], *last_step_type = args[4];
    double now = PyFloat_AsDouble(now_obj), started = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred()) return NULL;
    PyObject *no_args = PyTuple_New(0), *one = PyLong_FromLong(1), *zero = PyLong_FromLong(0);
    double queue_wait = 0.0;
    if (no_args == NULL || one == NULL || zero == NULL) goto fail;
    for (Py_ssize_t i = self->cursor; i < self->count; i++) {
        LaneRecord *r = &self->recs[i];
        queue_wait += now - r->enqueued;
        if (on_dispatch != Py_None) {
            PyObject *waited = PyFloat_FromDouble(started - r->enqueued);
            PyObject *res = waited ? PyObject_CallOneArg(on_dispatch, waited) : NULL;
            Py_XDECREF(waited);
            if (res == NULL) goto fail;
            Py_DECREF(res);
        }
        /* the step is queued on the device: later requests see the new position */
        PyObject *counts = PyObject_GetAttr(r->session, l_positions);
        if (counts == NULL) goto fail;
        if (!PyList_Check(counts) || r->layer >= PyList_GET_SIZE(counts)) {
            Py_DECREF(counts);
            PyErr_SetString(PyExc_IndexError, "submitted: a session has no position at the step's layer");
            goto fail;
        }
        PyObject *before = PyLong_FromUnsignedLongLong(r->position),
                 *after = before ? PyLong_FromUnsignedLongLong(r->position + 1) : NULL;
        int rc = after ? PyList_SetItem(counts, r->layer, after) : -1; /* steals after */
        Py_DECREF(counts);
        PyObject *record_names[3] = {l_tokens, l_rows, l_out}, *record_values[3] = {one, one, Py_None};
        PyObject *step = rc == 0 ? make_slotted(record_type, no_args, 3, record_names, record_values) : NULL;
        PyObject *last = NULL;
        if (step != NULL) {
            PyObject *last_names[3] = {l_count_before, l_record, l_row}, *last_values[3] = {before, step, zero};
            last = make_slotted(last_step_type, no_args, 3, last_names, last_values);
        }
        Py_XDECREF(before);
        PyObject *layer = last ? PyLong_FromSsize_t(r->layer) : NULL;
        PyObject *last_steps = layer ? PyObject_GetAttr(r->session, l_last_steps) : NULL;
        rc = last_steps ? PyObject_SetItem(last_steps, layer, last) : -1;
        Py_XDECREF(last_steps);
        Py_XDECREF(layer);
        Py_XDECREF(last);
        if (rc < 0 || PyObject_SetAttr(r->session, l_last_used, now_obj) < 0) {
            Py_XDECREF(step);
            goto fail;
        }
        Py_XSETREF(r->step, step);
    }
    Py_DECREF(no_args);
    Py_DECREF(one);
    Py_DECREF(zero);
    return PyFloat_FromDouble(queue_wait);
fail:
    Py_XDECREF(no_args);
    Py_XDECREF(one);
    Py_XDECREF(zero);
    return NULL;
}

static PyObject *run_finish(LaneRun *self, PyObject *args) {
    Py_buffer whole;
    Py_ssize_t row_bytes;
    if (!PyArg_ParseTuple(args, "y*n", &whole, &row_bytes)) return NULL;
    PyObject *result = NULL;
    if (row_bytes <= 0 || (self->first_row + run_len(self)) * row_bytes > whole.len) {
        PyErr_SetString(PyExc_ValueError, "finish: the lane's rows lie outside the output");
        goto done;
    }
    for (Py_ssize_t i = self->cursor; i < self->count; i++) {
        LaneRecord *r = &self->recs[i];
        Py_ssize_t at = (self->first_row + (i - self->cursor)) * row_bytes;
        /* bytes of the step's own, copied once out of the backend's buffer (which a later launch
           reuses): what a retry is answered from, and what the reply ring's copy is made from */
        PyObject *out = PyBytes_FromStringAndSize((const char *)whole.buf + at, row_bytes);
        if (out == NULL) goto done;
        int rc = r->step != NULL ? PyObject_SetAttr(r->step, l_out, out) : 0;
        if (rc == 0) rc = reply_box_answer_output(r->box, r->tag, r->position + 1, 1, out);
        Py_DECREF(out);
        if (rc < 0) goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&whole);
    return result;
}

static PyObject *run_roll_back(LaneRun *self, PyObject *unused) {
    for (Py_ssize_t i = self->cursor; i < self->count; i++) {
        LaneRecord *r = &self->recs[i];
        if (r->step == NULL || r->session == NULL) continue;
        PyObject *layer = PyLong_FromSsize_t(r->layer);
        PyObject *last_steps = layer ? PyObject_GetAttr(r->session, l_last_steps) : NULL;
        PyObject *last = last_steps ? PyObject_GetItem(last_steps, layer) : NULL;
        int rc = 0;
        if (last == NULL) {
            if (PyErr_ExceptionMatches(PyExc_KeyError)) PyErr_Clear();
            else rc = -1;
        } else {
            PyObject *record = PyObject_GetAttr(last, l_record);
            if (record == NULL) {
                rc = -1;
            } else if (record == r->step) { /* still this step's: undo its advance */
                PyObject *counts = PyObject_GetAttr(r->session, l_positions);
                PyObject *before = counts ? PyLong_FromUnsignedLongLong(r->position) : NULL;
                rc = before ? PyObject_SetItem(counts, layer, before) : -1;
                if (rc == 0) rc = PyObject_DelItem(last_steps, layer);
                Py_XDECREF(before);
                Py_XDECREF(counts);
            }
            Py_XDECREF(record);
        }
        Py_XDECREF(last);
        Py_XDECREF(last_steps);
        Py_XDECREF(layer);
        if (rc < 0 || PyErr_Occurred()) return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *run_works(LaneRun *self, PyObject *work_type) {
    if (!PyType_Check(work_type)) {
        PyErr_SetString(PyExc_TypeError, "works(work_type: type)");
        return NULL;
    }
    PyObject *works = PyList_New(0);
    if (works == NULL) return NULL;
    for (Py_ssize_t i = self->cursor; i < self->count; i++) {
        PyObject *work = record_work(&self->recs[i], self->heads, work_type);
        if (work == NULL || PyList_Append(works, work) < 0) {
            Py_XDECREF(work);
            Py_DECREF(works);
            return NULL;
        }
        Py_DECREF(work);
    }
    return works;
}

static PyObject *run_take(LaneRun *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || n > run_len(self)) {
        PyErr_SetString(PyExc_ValueError, "take(n): n must be between 0 and the records left");
        return NULL;
    }
    LaneRun *head = run_new(self->heads);
    if (head == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (run_push(head, &self->recs[self->cursor]) < 0) {
            Py_DECREF(head);
            return NULL;
        }
        self->cursor++;
    }
    return (PyObject *)head;
}

static PyObject *run_sample_session(LaneRun *self, PyObject *unused) {
    Py_ssize_t n = run_len(self);
    PyObject *s = n > 0 ? self->recs[self->cursor + n / 2].session : NULL;
    if (s == NULL) Py_RETURN_NONE;
    Py_INCREF(s);
    return s;
}

static PyMethodDef run_methods[] = {
    {"done", (PyCFunction)run_done, METH_O, "done(result) -> None: answers every record left with result"},
    {"admit", (PyCFunction)(void (*)(void))run_admit, METH_FASTCALL,
     "admit(rows: int, max_rows: int, ctx: tuple) -> (int, _DecodeItem | None)"},
    {"seal", (PyCFunction)run_seal, METH_O, "seal(batch: StepBatch) -> None"},
    {"fill", (PyCFunction)run_fill, METH_VARARGS, "fill(dst: writable buffer, places: tuple) -> None"},
    {"submitted", (PyCFunction)(void (*)(void))run_submitted, METH_FASTCALL,
     "submitted(now: float, started: float, on_dispatch, step_record_type, last_step_type) -> float"},
    {"finish", (PyCFunction)run_finish, METH_VARARGS, "finish(whole: buffer, row_bytes: int) -> None"},
    {"roll_back", (PyCFunction)run_roll_back, METH_NOARGS, "roll_back() -> None"},
    {"works", (PyCFunction)run_works, METH_O, "works(work_type: type) -> list[DecodeWork]"},
    {"take", (PyCFunction)run_take, METH_O, "take(n: int) -> LaneRun: the next n records, as a run of their own"},
    {"sample_session", (PyCFunction)run_sample_session, METH_NOARGS, "sample_session() -> Session | None"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef run_getset[] = {
    {"rows", (getter)run_get_rows, NULL, "records left", NULL},
    {"enqueued", (getter)run_get_enqueued, NULL, "the oldest record's queue time", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot run_slots[] = {
    {Py_tp_dealloc, run_dealloc},
    {Py_tp_methods, run_methods},
    {Py_tp_getset, run_getset},
    {Py_sq_length, run_len},
    {Py_tp_doc, "Plain one-row steps from the front-end link, as records (gdn_server/_native_lane.c)."},
    {0, NULL},
};

static PyType_Spec run_spec = {
    "gdn_server._native.LaneRun", sizeof(LaneRun), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, run_slots,
};

int add_lane_type(PyObject *module) {
    static const InternedName names[] = {
        {&l_owner, "owner"}, {&l_provisional, "provisional"}, {&l_scratch_current, "scratch_current"},
        {&l_positions, "positions"}, {&l_slot, "slot"}, {&l_num_layers, "num_layers"}, {&l_lane, "lane"},
        {&l_slots, "slots"}, {&l_out_slots, "out_slots"}, {&l_layers, "layers"}, {&l_last_steps, "last_steps"},
        {&l_last_used, "last_used"}, {&l_tokens, "tokens"}, {&l_rows, "rows"}, {&l_out, "out"},
        {&l_count_before, "count_before"}, {&l_record, "record"}, {&l_row, "row"}, {&l_work, "work"},
        {&l_done, "done"}, {&l_cancelled, "cancelled"}, {&l_enqueued, "enqueued"}, {&l_answer, "answer"},
        {&l_dropped, "dropped"},
    };
    if (intern_names(names, sizeof(names) / sizeof(names[0])) < 0) return -1;
    PyObject *type = PyType_FromSpec(&run_spec);
    if (type == NULL) return -1;
    Py_INCREF(type);
    lane_type = (PyTypeObject *)type; /* kept for the module's life */
    if (PyModule_AddObject(module, "LaneRun", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}
