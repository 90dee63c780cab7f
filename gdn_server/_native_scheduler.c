/* gdn_server._native, the scheduler's part: a round's per-request loops, for plain steps.

   gdn_server.scheduler's Python stays the reference and handles everything else. Each function
   does what the Python it stands in for does for the requests it takes, touching the same
   Python objects (the sessions' records stay Python objects: this saves the bytecode, not the
   attribute traffic), and leaves the others to that Python untouched.

   make_decode_items(requests, item_type, now) -> list
       Scheduler.submit_decodes's items: for each (work, done, cancelled) of `requests`, an
       item_type (_DecodeItem) with those, rows = len(work.session_ids) and enqueued = now, made
       without running its __init__ (the front-end link queues every read's requests this way).
       A LaneRun among `requests` (_native_lane.c) is queued as it is, its records stamped `now`.

   admit_plain(items, start, rows, max_rows, ctx) -> (index, rows)
       Scheduler._launch's loop over items[start:]. A _DecodeItem is deferred
       when a session of it is busy in this round (or it would pass max_rows), whatever its step;
       else, if it is a plain step (not speculative; every session known, owned by the request's
       owner, at the request's position where positions are given, with no speculative record,
       provisional or scratch_current, at any layer), it is dropped (cancelled) or admitted:
       routed to its sessions' home rows and added to the round's batch of its T. Returns the
       index of the first item it did not take (len(items) when it took all) and the round's
       rows so far; it has not touched that item.
       ctx = (decode_item_type, sessions_by_id, busy, deferred, batches, step_batch_type,
       admitted_type): the round's state that _launch keeps (busy set, deferred list, batches
       dict T -> (StepBatch, [_Admitted])) and the classes it makes.

   submit_plain(members, tokens, started, now, on_dispatch, step_record_type, last_step_type)
       -> (queue_wait, leftovers)
       Scheduler._submit's loop once a batch is queued on the device, for members of plain steps
       (not speculative, no scratch rows released): each session's position advances, its
       LastStep points at the step's StepRecord. Returns the summed queue wait of the members it
       took and the members it left.

   finish_plain(members, whole, row_bytes, tokens, tail, encode, result_type) -> None
       Scheduler._finish's answers for one finished batch, for every member (answers are alike
       for every kind of step, so nothing is left to the Python): each member's slice of the
       output `whole` (the backend's reused buffer), encoded with encode(data, shape, positions,
       request_id) -> (wire, offset) where encode is not None, else copied into bytes of its
       own; kept as the step's record.out and passed to its item's done().

   tests/test_scheduler_native.py runs rounds of every kind through both paths and compares
   the answers and the session records. */
#include "_native.h"

/* attribute names, interned once */
static PyObject *s_work, *s_session_ids, *s_speculative, *s_layer, *s_positions, *s_owner, *s_tokens,
    *s_provisional, *s_scratch_current, *s_slot, *s_num_layers, *s_cancelled, *s_slots, *s_out_slots,
    *s_layers, *s_works, *s_read_rows, *s_write_rows, *s_item, *s_released, *s_enqueued, *s_sessions,
    *s_record, *s_last_steps, *s_last_used, *s_first_row, *s_request_id, *s_out, *s_done, *s_rows;

/* PyObject_IsTrue(obj.name): 1, 0, or -1 with an error set. */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_GetAttr(obj, name);
    int truth = value ? PyObject_IsTrue(value) : -1;
    Py_XDECREF(value);
    return truth;
}

/* The sessions of a plain step, checked as Scheduler._admit would; NULL with no error set when
   the step is not plain (the Python then decides what it is), NULL with an error set when a
   call failed. */
static PyObject *plain_sessions(PyObject *work, PyObject *ids, PyObject *by_id, Py_ssize_t layer) {
    PyObject *owner = PyObject_GetAttr(work, s_owner);
    PyObject *positions = owner ? PyObject_GetAttr(work, s_positions) : NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    PyObject *sessions = positions ? PyList_New(n) : NULL;
    if (sessions == NULL) goto not_taken;
    if (positions != Py_None && (!PyTuple_Check(positions) || PyTuple_GET_SIZE(positions) != n)) goto not_taken;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyDict_GetItemWithError(by_id, PyTuple_GET_ITEM(ids, i)); /* borrowed */
        if (s == NULL) goto not_taken; /* unknown (no error set): the Python answers NotFound */
        Py_INCREF(s);
        PyList_SET_ITEM(sessions, i, s);
        PyObject *s_own = PyObject_GetAttr(s, s_owner);
        if (s_own == NULL) goto not_taken;
        int differs = PyObject_RichCompareBool(s_own, owner, Py_NE);
        Py_DECREF(s_own);
        if (differs != 0) goto not_taken;
        int open = attr_true(s, s_provisional);
        if (open == 0) open = attr_true(s, s_scratch_current);
        if (open != 0) goto not_taken;
        if (positions == Py_None) continue;
        PyObject *counts = PyObject_GetAttr(s, s_positions);
        if (counts == NULL) goto not_taken;
        int same = 0;
        if (PyList_Check(counts) && layer < PyList_GET_SIZE(counts))
            same = PyObject_RichCompareBool(PyList_GET_ITEM(counts, layer), PyTuple_GET_ITEM(positions, i), Py_EQ);
        Py_DECREF(counts);
        if (same != 1) goto not_taken; /* a retry or a wrong position: the Python decides which */
    }
    Py_DECREF(owner);
    Py_DECREF(positions);
    return sessions;
not_taken: /* not plain, or a call failed (its error is set) */
    Py_XDECREF(owner);
    Py_XDECREF(positions);
    Py_XDECREF(sessions);
    return NULL;
}

static int extend_attr(PyObject *obj, PyObject *name, PyObject *values) {
    PyObject *list = PyObject_GetAttr(obj, name);
    if (list == NULL) return -1;
    int rc = PyList_Check(list) ? PyList_SetSlice(list, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, values) : -1;
    if (rc < 0 && !PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%U is not a list", name);
    Py_DECREF(list);
    return rc;
}

static int append_attr(PyObject *obj, PyObject *name, PyObject *value) {
    PyObject *list = PyObject_GetAttr(obj, name);
    if (list == NULL) return -1;
    int rc = PyList_Check(list) ? PyList_Append(list, value) : -1;
    if (rc < 0 && !PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%U is not a list", name);
    Py_DECREF(list);
    return rc;
}

/* The round's (StepBatch, members) entry for T (borrowed), made and stored when new. */
static PyObject *batch_entry(PyObject *batches, PyObject *tokens, PyObject *step_batch_type) {
    PyObject *entry = PyDict_GetItemWithError(batches, tokens);
    if (entry != NULL || PyErr_Occurred()) return entry;
    PyObject *batch = PyObject_CallOneArg(step_batch_type, tokens);
    PyObject *members = batch ? PyList_New(0) : NULL;
    entry = members ? PyTuple_Pack(2, batch, members) : NULL;
    Py_XDECREF(batch);
    Py_XDECREF(members);
    if (entry == NULL) return NULL;
    int rc = PyDict_SetItem(batches, tokens, entry);
    Py_DECREF(entry); /* the dict holds it */
    return rc < 0 ? NULL : entry;
}

/* 1: taken (admitted, deferred or dropped), 0: left to the Python, -1: error. */
static int admit_one(PyObject *item, Py_ssize_t *rows, Py_ssize_t max_rows, PyObject *const *ctx) {
    PyObject *decode_item_type = ctx[0], *by_id = ctx[1], *busy = ctx[2], *deferred = ctx[3], *batches = ctx[4],
             *step_batch_type = ctx[5], *admitted_type = ctx[6];
    if ((PyObject *)Py_TYPE(item) != decode_item_type) return 0;
    int taken = -1;
    PyObject *work = NULL, *ids = NULL, *layer_obj = NULL, *tokens = NULL, *sessions = NULL, *homes = NULL,
             *layers = NULL, *member = NULL;
    work = PyObject_GetAttr(item, s_work);
    if (work == NULL) goto done;
    ids = PyObject_GetAttr(work, s_session_ids);
    if (ids == NULL) goto done;
    if (!PyTuple_Check(ids)) {
        taken = 0;
        goto done;
    }
    /* a session already in this round, or past max_rows: deferred, whatever the step is */
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    int is_busy = *rows && *rows + n > max_rows;
    for (Py_ssize_t i = 0; i < n && !is_busy; i++) {
        is_busy = PySet_Contains(busy, PyTuple_GET_ITEM(ids, i));
        if (is_busy < 0) goto done;
    }
    if (is_busy) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (PySet_Add(busy, PyTuple_GET_ITEM(ids, i)) < 0) goto done;
        taken = PyList_Append(deferred, item) < 0 ? -1 : 1;
        goto done;
    }
    int speculative = attr_true(work, s_speculative);
    if (speculative != 0) {
        taken = speculative < 0 ? -1 : 0;
        goto done;
    }
    layer_obj = PyObject_GetAttr(work, s_layer);
    tokens = layer_obj ? PyObject_GetAttr(work, s_tokens) : NULL;
    if (tokens == NULL) goto done;
    Py_ssize_t layer = PyLong_AsSsize_t(layer_obj);
    if (layer == -1 && PyErr_Occurred()) goto done;
    if (layer < 0) {
        taken = 0;
        goto done;
    }
    sessions = plain_sessions(work, ids, by_id, layer);
    if (sessions == NULL) {
        taken = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    PyObject *cancelled = PyObject_GetAttr(item, s_cancelled);
    if (cancelled == NULL) goto done;
    int gone = 0;
    if (cancelled != Py_None) {
        PyObject *answer = PyObject_CallNoArgs(cancelled);
        gone = answer ? PyObject_IsTrue(answer) : -1;
        Py_XDECREF(answer);
    }
    Py_DECREF(cancelled);
    if (gone < 0) goto done;
    if (gone) { /* the client gave up: never reaches the device */
        taken = 1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (PySet_Add(busy, PyTuple_GET_ITEM(ids, i)) < 0) goto done;

    /* routed: a plain step reads and writes each session's home row */
    homes = PyList_New(n);
    layers = homes ? PyList_New(n) : NULL;
    if (layers == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(sessions, i);
        PyObject *slot = PyObject_GetAttr(s, s_slot), *num_layers = slot ? PyObject_GetAttr(s, s_num_layers) : NULL;
        Py_ssize_t a = slot ? PyLong_AsSsize_t(slot) : -1, b = num_layers ? PyLong_AsSsize_t(num_layers) : -1;
        Py_XDECREF(slot);
        Py_XDECREF(num_layers);
        if (PyErr_Occurred()) goto done;
        PyObject *home = PyLong_FromSsize_t(a * b + layer);
        if (home == NULL) goto done;
        PyList_SET_ITEM(homes, i, home);
        Py_INCREF(layer_obj);
        PyList_SET_ITEM(layers, i, layer_obj);
    }
    PyObject *entry = batch_entry(batches, tokens, step_batch_type); /* borrowed */
    if (entry == NULL) goto done;
    PyObject *batch = PyTuple_GET_ITEM(entry, 0), *members = PyTuple_GET_ITEM(entry, 1);
    PyObject *slots = PyObject_GetAttr(batch, s_slots);
    if (slots == NULL) goto done;
    Py_ssize_t first_row = PyObject_Length(slots);
    Py_DECREF(slots);
    if (first_row < 0) goto done;
    PyObject *first = PyLong_FromSsize_t(first_row);
    if (first == NULL) goto done;
    PyObject *args[3] = {item, sessions, first};
    member = PyObject_Vectorcall(admitted_type, args, 3, NULL);
    Py_DECREF(first);
    if (member == NULL || extend_attr(member, s_read_rows, homes) < 0 || extend_attr(member, s_write_rows, homes) < 0 ||
        PyList_Append(members, member) < 0 || extend_attr(batch, s_slots, homes) < 0 ||
        extend_attr(batch, s_out_slots, homes) < 0 || extend_attr(batch, s_layers, layers) < 0 ||
        append_attr(batch, s_works, work) < 0)
        goto done;
    *rows += n;
    taken = 1;
done:
    Py_XDECREF(work);
    Py_XDECREF(ids);
    Py_XDECREF(layer_obj);
    Py_XDECREF(tokens);
    Py_XDECREF(sessions);
    Py_XDECREF(homes);
    Py_XDECREF(layers);
    Py_XDECREF(member);
    return taken;
}

static PyObject *admit_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[0]) || !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != 7) {
        PyErr_SetString(PyExc_TypeError, "admit_plain(items: list, start: int, rows: int, max_rows: int, ctx: 7-tuple)");
        return NULL;
    }
    PyObject *items = args[0], *const *ctx = &PyTuple_GET_ITEM(args[4], 0);
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), rows = PyLong_AsSsize_t(args[2]), max_rows = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (!PyDict_Check(ctx[1]) || !PySet_Check(ctx[2]) || !PyList_Check(ctx[3]) || !PyDict_Check(ctx[4])) {
        PyErr_SetString(PyExc_TypeError, "admit_plain: ctx is (type, dict, set, list, dict, type, type)");
        return NULL;
    }
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < PyList_GET_SIZE(items); i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        Py_INCREF(item);
        int taken = admit_one(item, &rows, max_rows, ctx);
        Py_DECREF(item);
        if (taken < 0) return NULL;
        if (taken == 0) break;
    }
    return Py_BuildValue("(nn)", i, rows);
}

/* 1: taken, 0: left (speculative, or rows to release), -1: error. */
static int submit_one(PyObject *m, PyObject *tokens, Py_ssize_t t, PyObject *now_obj, double started, double now,
                      PyObject *on_dispatch, PyObject *record_type, PyObject *last_step_type, double *queue_wait) {
    int taken = -1;
    PyObject *item = NULL, *work = NULL, *released = NULL, *sessions = NULL, *layer_obj = NULL, *record = NULL,
             *after = NULL;
    item = PyObject_GetAttr(m, s_item);
    work = item ? PyObject_GetAttr(item, s_work) : NULL;
    released = work ? PyObject_GetAttr(m, s_released) : NULL;
    if (released == NULL) goto done;
    int speculative = attr_true(work, s_speculative);
    Py_ssize_t n_released = speculative == 0 ? PyObject_Length(released) : 0;
    if (speculative < 0 || n_released < 0) goto done;
    if (speculative || n_released) {
        taken = 0;
        goto done;
    }
    PyObject *enq = PyObject_GetAttr(item, s_enqueued);
    double enqueued = enq ? PyFloat_AsDouble(enq) : -1.0;
    Py_XDECREF(enq);
    if (PyErr_Occurred()) goto done;
    *queue_wait += now - enqueued;
    if (on_dispatch != Py_None) {
        PyObject *waited = PyFloat_FromDouble(started - enqueued);
        PyObject *r = waited ? PyObject_CallOneArg(on_dispatch, waited) : NULL;
        Py_XDECREF(waited);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    sessions = PyObject_GetAttr(m, s_sessions);
    layer_obj = sessions ? PyObject_GetAttr(work, s_layer) : NULL;
    if (layer_obj == NULL) goto done;
    if (!PyList_Check(sessions)) {
        PyErr_SetString(PyExc_TypeError, "submit_plain: a member's sessions is not a list");
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(sessions), layer = PyLong_AsSsize_t(layer_obj);
    if (layer == -1 && PyErr_Occurred()) goto done;
    PyObject *n_obj = PyLong_FromSsize_t(n);
    if (n_obj == NULL) goto done;
    PyObject *record_args[2] = {tokens, n_obj};
    record = PyObject_Vectorcall(record_type, record_args, 2, NULL);
    Py_DECREF(n_obj);
    if (record == NULL || PyObject_SetAttr(m, s_record, record) < 0) goto done;
    after = PyTuple_New(n);
    if (after == NULL) goto done;
    for (Py_ssize_t row = 0; row < n; row++) {
        PyObject *s = PyList_GET_ITEM(sessions, row);
        PyObject *counts = PyObject_GetAttr(s, s_positions);
        if (counts == NULL) goto done;
        if (!PyList_Check(counts) || layer < 0 || layer >= PyList_GET_SIZE(counts)) {
            Py_DECREF(counts);
            PyErr_SetString(PyExc_IndexError, "submit_plain: a session has no position at the step's layer");
            goto done;
        }
        PyObject *before = PyList_GET_ITEM(counts, layer);
        Py_INCREF(before);
        Py_ssize_t b = PyLong_AsSsize_t(before);
        PyObject *after_step = (b == -1 && PyErr_Occurred()) ? NULL : PyLong_FromSsize_t(b + t);
        if (after_step == NULL) {
            Py_DECREF(before);
            Py_DECREF(counts);
            goto done;
        }
        Py_INCREF(after_step);
        PyList_SetItem(counts, layer, after_step); /* steals one reference */
        Py_DECREF(counts);
        PyTuple_SET_ITEM(after, row, after_step);
        PyObject *row_obj = PyLong_FromSsize_t(row);
        PyObject *last = NULL;
        if (row_obj != NULL) {
            PyObject *last_args[3] = {before, record, row_obj};
            last = PyObject_Vectorcall(last_step_type, last_args, 3, NULL);
            Py_DECREF(row_obj);
        }
        Py_DECREF(before);
        PyObject *last_steps = last ? PyObject_GetAttr(s, s_last_steps) : NULL;
        int rc = last_steps ? PyObject_SetItem(last_steps, layer_obj, last) : -1;
        Py_XDECREF(last_steps);
        Py_XDECREF(last);
        if (rc < 0 || PyObject_SetAttr(s, s_last_used, now_obj) < 0) goto done;
    }
    if (PyObject_SetAttr(m, s_positions, after) < 0) goto done;
    taken = 1;
done:
    Py_XDECREF(item);
    Py_XDECREF(work);
    Py_XDECREF(released);
    Py_XDECREF(sessions);
    Py_XDECREF(layer_obj);
    Py_XDECREF(record);
    Py_XDECREF(after);
    return taken;
}

static PyObject *submit_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "submit_plain(members: list, tokens: int, started: float, now: float, "
                                         "on_dispatch, step_record_type, last_step_type)");
        return NULL;
    }
    PyObject *members = args[0], *tokens = args[1];
    Py_ssize_t t = PyLong_AsSsize_t(tokens);
    double started = PyFloat_AsDouble(args[2]), now = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    PyObject *left = PyList_New(0);
    if (left == NULL) return NULL;
    double queue_wait = 0.0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(members); i++) {
        PyObject *m = PyList_GET_ITEM(members, i);
        Py_INCREF(m);
        int taken = submit_one(m, tokens, t, args[3], started, now, args[4], args[5], args[6], &queue_wait);
        if (taken == 0 && PyList_Append(left, m) < 0) taken = -1;
        Py_DECREF(m);
        if (taken < 0) {
            Py_DECREF(left);
            return NULL;
        }
    }
    return Py_BuildValue("(dN)", queue_wait, left);
}

static int finish_one(PyObject *m, PyObject *whole, Py_ssize_t row_bytes, int single, PyObject *tokens,
                      PyObject *tail, PyObject *encode, PyObject *result_type) {
    int rc = -1;
    PyObject *item = NULL, *work = NULL, *sessions = NULL, *positions = NULL, *request_id = NULL, *data = NULL,
             *shape = NULL, *wire = NULL, *result = NULL, *record = NULL, *done = NULL;
    item = PyObject_GetAttr(m, s_item);
    work = item ? PyObject_GetAttr(item, s_work) : NULL;
    sessions = work ? PyObject_GetAttr(m, s_sessions) : NULL;
    positions = sessions ? PyObject_GetAttr(m, s_positions) : NULL;
    request_id = positions ? PyObject_GetAttr(work, s_request_id) : NULL;
    if (request_id == NULL) goto done;
    Py_ssize_t rows = PyObject_Length(sessions);
    if (rows < 0) goto done;
    Py_ssize_t first = 0;
    if (!single) {
        PyObject *first_obj = PyObject_GetAttr(m, s_first_row);
        first = first_obj ? PyLong_AsSsize_t(first_obj) : -1;
        Py_XDECREF(first_obj);
        if (PyErr_Occurred()) goto done;
    }
    if (encode == Py_None) {
        /* bytes of the request's own, copied once straight out of the backend's buffer (which a
           later launch reuses): the step's record.out and the answer's output */
        Py_buffer view;
        if (PyObject_GetBuffer(whole, &view, PyBUF_SIMPLE) < 0) goto done;
        Py_ssize_t at = single ? 0 : first * row_bytes, len = single ? view.len : rows * row_bytes;
        if (at < 0 || len < 0 || at + len > view.len) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "finish_plain: a member's rows lie outside the output");
            goto done;
        }
        data = PyBytes_FromStringAndSize((const char *)view.buf + at, len);
        PyBuffer_Release(&view);
        if (data == NULL) goto done;
    } else if (single) {
        Py_INCREF(whole);
        data = whole;
    } else {
        data = PySequence_GetSlice(whole, first * row_bytes, (first + rows) * row_bytes);
        if (data == NULL) goto done;
    }
    Py_ssize_t n_tail = PyTuple_GET_SIZE(tail);
    shape = PyTuple_New(2 + n_tail);
    if (shape == NULL) goto done;
    PyTuple_SET_ITEM(shape, 0, PyLong_FromSsize_t(rows));
    Py_INCREF(tokens);
    PyTuple_SET_ITEM(shape, 1, tokens);
    for (Py_ssize_t i = 0; i < n_tail; i++) {
        PyObject *d = PyTuple_GET_ITEM(tail, i);
        Py_INCREF(d);
        PyTuple_SET_ITEM(shape, 2 + i, d);
    }
    if (PyTuple_GET_ITEM(shape, 0) == NULL) goto done;
    if (encode != Py_None) {
        PyObject *enc_args[4] = {data, shape, positions, request_id};
        PyObject *encoded = PyObject_Vectorcall(encode, enc_args, 4, NULL);
        if (encoded == NULL) goto done;
        Py_ssize_t at = -1, len = PyObject_Length(data);
        if (PyTuple_Check(encoded) && PyTuple_GET_SIZE(encoded) == 2) {
            wire = PyTuple_GET_ITEM(encoded, 0);
            Py_INCREF(wire);
            at = PyLong_AsSsize_t(PyTuple_GET_ITEM(encoded, 1));
        }
        Py_DECREF(encoded);
        if (wire == NULL || at < 0 || len < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "encode_reply must return (wire, offset)");
            goto done;
        }
        PyObject *view = PyMemoryView_FromObject(wire);
        if (view == NULL) goto done;
        Py_DECREF(data);
        data = PySequence_GetSlice(view, at, at + len); /* the output's copy in the reply */
        Py_DECREF(view);
        if (data == NULL) goto done;
    } else {
        Py_INCREF(Py_None);
        wire = Py_None;
    }
    record = PyObject_GetAttr(m, s_record);
    if (record == NULL || PyObject_SetAttr(record, s_out, data) < 0) goto done;
    PyObject *result_args[5] = {data, shape, positions, request_id, wire};
    result = PyObject_Vectorcall(result_type, result_args, 5, NULL);
    done = result ? PyObject_GetAttr(item, s_done) : NULL;
    PyObject *r = done ? PyObject_CallOneArg(done, result) : NULL;
    if (r == NULL) goto done;
    Py_DECREF(r);
    rc = 0;
done:
    Py_XDECREF(item);
    Py_XDECREF(work);
    Py_XDECREF(sessions);
    Py_XDECREF(positions);
    Py_XDECREF(request_id);
    Py_XDECREF(data);
    Py_XDECREF(shape);
    Py_XDECREF(wire);
    Py_XDECREF(result);
    Py_XDECREF(record);
    Py_XDECREF(done);
    return rc;
}

static PyObject *finish_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyList_Check(args[0]) || !PyTuple_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "finish_plain(members: list, whole, row_bytes: int, tokens: int, tail: tuple, "
                                         "encode, result_type)");
        return NULL;
    }
    PyObject *members = args[0];
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[2]);
    if (row_bytes == -1 && PyErr_Occurred()) return NULL;
    int single = PyList_GET_SIZE(members) == 1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(members); i++) {
        PyObject *m = PyList_GET_ITEM(members, i);
        Py_INCREF(m);
        int rc = finish_one(m, args[1], row_bytes, single, args[3], args[4], args[5], args[6]);
        Py_DECREF(m);
        if (rc < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* make_decode_items: see the top of this file. */
static PyObject *make_decode_items(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "make_decode_items(requests: list, item_type: type, now: float)");
        return NULL;
    }
    PyObject *requests = args[0], *now = args[2];
    PyTypeObject *item_type = (PyTypeObject *)args[1];
    if (item_type->tp_new == NULL) {
        PyErr_SetString(PyExc_TypeError, "make_decode_items: item_type cannot be instantiated");
        return NULL;
    }
    PyObject *no_args = PyTuple_New(0);
    Py_ssize_t n = PyList_GET_SIZE(requests);
    PyObject *items = no_args ? PyList_New(n) : NULL;
    if (items == NULL) goto fail;
    double stamp = PyFloat_AsDouble(now);
    if (stamp == -1.0 && PyErr_Occurred()) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *request = PyList_GET_ITEM(requests, i);
        if (lane_check(request)) { /* the link's plain one-row steps: queued as they are */
            lane_stamp(request, stamp);
            Py_INCREF(request);
            PyList_SET_ITEM(items, i, request);
            continue;
        }
        if (!PyTuple_Check(request) || PyTuple_GET_SIZE(request) != 3) {
            PyErr_SetString(PyExc_TypeError, "make_decode_items: each request is (work, done, cancelled)");
            goto fail;
        }
        PyObject *work = PyTuple_GET_ITEM(request, 0);
        PyObject *ids = PyObject_GetAttr(work, s_session_ids);
        Py_ssize_t count = ids ? PyObject_Length(ids) : -1;
        Py_XDECREF(ids);
        if (count < 0) goto fail;
        PyObject *rows = PyLong_FromSsize_t(count);
        PyObject *item = rows ? item_type->tp_new(item_type, no_args, NULL) : NULL;
        int failed = item == NULL || PyObject_SetAttr(item, s_work, work) < 0
            || PyObject_SetAttr(item, s_done, PyTuple_GET_ITEM(request, 1)) < 0
            || PyObject_SetAttr(item, s_rows, rows) < 0
            || PyObject_SetAttr(item, s_cancelled, PyTuple_GET_ITEM(request, 2)) < 0
            || PyObject_SetAttr(item, s_enqueued, now) < 0;
        Py_XDECREF(rows);
        if (failed) {
            Py_XDECREF(item);
            goto fail;
        }
        PyList_SET_ITEM(items, i, item);
    }
    Py_DECREF(no_args);
    return items;
fail:
    Py_XDECREF(no_args);
    Py_XDECREF(items); /* unfilled entries are NULL: list_dealloc skips them */
    return NULL;
}

static PyMethodDef scheduler_methods[] = {
    {"make_decode_items", (PyCFunction)(void (*)(void))make_decode_items, METH_FASTCALL,
     "make_decode_items(requests: list, item_type: type, now: float) -> list"},
    {"admit_plain", (PyCFunction)(void (*)(void))admit_plain, METH_FASTCALL,
     "admit_plain(items: list, start: int, rows: int, max_rows: int, ctx: tuple) -> (int, int)"},
    {"submit_plain", (PyCFunction)(void (*)(void))submit_plain, METH_FASTCALL,
     "submit_plain(members: list, tokens: int, started: float, now: float, on_dispatch, step_record_type, "
     "last_step_type) -> (float, list)"},
    {"finish_plain", (PyCFunction)(void (*)(void))finish_plain, METH_FASTCALL,
     "finish_plain(members: list, whole, row_bytes: int, tokens: int, tail: tuple, encode, result_type) -> None"},
    {NULL, NULL, 0, NULL},
};

int add_scheduler_functions(PyObject *module) {
    static const InternedName names[] = {
        {&s_work, "work"},           {&s_session_ids, "session_ids"},
        {&s_speculative, "speculative"}, {&s_layer, "layer"},
        {&s_positions, "positions"}, {&s_owner, "owner"},
        /* DecodeWork.tokens is a property over _tokens, which both of its constructors set */
        {&s_tokens, "_tokens"},      {&s_provisional, "provisional"},
        {&s_scratch_current, "scratch_current"}, {&s_slot, "slot"},
        {&s_num_layers, "num_layers"}, {&s_cancelled, "cancelled"},
        {&s_slots, "slots"},         {&s_out_slots, "out_slots"},
        {&s_layers, "layers"},       {&s_works, "works"},
        {&s_read_rows, "read_rows"}, {&s_write_rows, "write_rows"},
        {&s_item, "item"},           {&s_released, "released"},
        {&s_enqueued, "enqueued"},   {&s_sessions, "sessions"},
        {&s_record, "record"},       {&s_last_steps, "last_steps"},
        {&s_last_used, "last_used"}, {&s_first_row, "first_row"},
        {&s_request_id, "request_id"}, {&s_out, "out"},
        {&s_done, "done"},           {&s_rows, "rows"},
    };
    if (intern_names(names, sizeof(names) / sizeof(names[0])) < 0) return -1;
    return PyModule_AddFunctions(module, scheduler_methods);
}
