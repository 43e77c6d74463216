/* The CPU fallback route: copy the op's chip tensors to the host, run the op
 * there, write mutated arguments back, and copy new results to the chip.
 *
 * Mutation semantics are kept: arguments the schema marks as written ("!")
 * are copied back into the caller's tensors, and results that are those
 * arguments are returned as the caller's own objects.
 */
#include "fallback.h" /* first: Python.h sets the feature macros */

#include "clock.h"
#include "payload.h"
#include "staging.h"


/* Arguments of one call whose host copies can live in staging buffers; the rest get their own. */
#define MAX_STAGED 16

/* One fallback call: what it copies and what it learns on the way. */
typedef struct copy_ctx {
    flagos_state *st;
    op_entry *e;
    int device_index;      /* chip device of the first chip tensor seen */
    int target;            /* flagos index results go to, for to_chip over containers */
    int stage;             /* host copies may live in staging buffers (results are copied out) */
    int n_staged;
    PyObject *staged[MAX_STAGED]; /* the staging buffers this call took */
} copy_ctx;

static int get_nbytes(PyObject *t, uint64_t *out)
{
    PyObject *n = PyObject_GetAttr(t, fl_names.nbytes);
    if (n == NULL)
        return -1;
    unsigned long long b = PyLong_AsUnsignedLongLong(n);
    Py_DECREF(n);
    if (b == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = b;
    return 0;
}

static int add_bytes(PyObject *t, uint64_t *counter)
{
    uint64_t b;
    if (get_nbytes(t, &b) < 0)
        return -1;
    *counter += b;
    return 0;
}

void flagos_note_dtype(flagos_state *st, op_entry *e, PyObject *dtype)
{
    int i;
    for (i = 0; i < st->n_dtypes; i++)
        if (st->dtypes[i] == dtype)
            break;
    if (i == st->n_dtypes && i < MAX_DTYPES)
        st->dtypes[st->n_dtypes++] = Py_NewRef(dtype);
    if (i < MAX_DTYPES)
        e->dtype_mask |= (uint64_t)1 << i;
}

static int note_device(copy_ctx *c, PyObject *payload)
{
    if (c->device_index >= 0 || c->st->chip_is_host)
        return 0;
    PyObject *d = PyObject_CallMethodNoArgs(payload, fl_names.get_device);
    if (d == NULL)
        return -1;
    c->device_index = (int)PyLong_AsLong(d);
    Py_DECREF(d);
    return 0;
}

/* New reference: a copy of a host tensor t in host memory. On a chip whose payloads are host
 * tensors `clone()` is the same copy as `_to_copy(t, device=cpu)` (math bits resolved, layout
 * kept) at half its cost: a Tensor method instead of an op called through its schema. */
static PyObject *host_copy(copy_ctx *c, PyObject *t, PyObject *device)
{
    if (c->st->chip_is_host) {
        PyObject *on_cpu = PyObject_GetAttr(t, fl_names.cpu);
        int yes = on_cpu ? PyObject_IsTrue(on_cpu) : -1;
        Py_XDECREF(on_cpu);
        if (yes < 0)
            return NULL;
        if (yes)
            return PyObject_CallMethodNoArgs(t, fl_names.clone);
    }
    PyObject *kw = Py_BuildValue("{s:O}", "device", device);
    if (kw == NULL)
        return NULL;
    PyObject *argv[1] = {t};
    PyObject *r = PyObject_VectorcallDict(c->st->to_copy, argv, 1, kw);
    Py_DECREF(kw);
    return r;
}

static PyObject *to_host(copy_ctx *c, PyObject *v);

static PyObject *to_host_item(void *ctx, PyObject *item)
{
    return to_host(ctx, item);
}

/* New reference: v with chip tensors replaced by host copies. */
static PyObject *to_host(copy_ctx *c, PyObject *v)
{
    flagos_state *st = c->st;
    if (flagos_is_chip_tensor(st, v)) {
        PyObject *payload = flagos_payload(st, v);
        if (payload == NULL)
            return NULL;
        PyObject *h = NULL, *dtype = NULL;
        uint64_t nbytes;
        if (note_device(c, payload) < 0 || (dtype = PyObject_GetAttr(payload, fl_names.dtype)) == NULL ||
            get_nbytes(payload, &nbytes) < 0)
            goto out;
        flagos_note_dtype(st, c->e, dtype);
        c->e->bytes_to_host += nbytes;
        if (c->stage && c->n_staged < MAX_STAGED) {
            /* straight into a reused host buffer laid out as the payload */
            PyObject *flat;
            h = flagos_staging_copy(payload, nbytes, dtype, &flat);
            if (flat != NULL)
                c->staged[c->n_staged++] = flat;
            if (h == Py_None)
                Py_CLEAR(h);
            else if (h == NULL)
                goto out;
        }
        if (h == NULL)
            h = host_copy(c, payload, st->host_device);
out:
        Py_XDECREF(dtype);
        Py_DECREF(payload);
        return h;
    }
    PyTypeObject *tp = Py_TYPE(v);
    if (tp == &PyList_Type || tp == &PyTuple_Type)
        return flagos_map_sequence(v, to_host_item, c);
    if (st->device_mode && PyObject_TypeCheck(v, (PyTypeObject *)st->device_type)) {
        PyObject *type = PyObject_GetAttr(v, fl_names.type);
        if (type == NULL)
            return NULL;
        int is_flagos = PyUnicode_CompareWithASCIIString(type, "flagos") == 0;
        Py_DECREF(type);
        if (is_flagos)
            return Py_NewRef(st->host_device);
    }
    return Py_NewRef(v);
}

/* Copy host results into the caller's chip tensors (arguments the op wrote). */
static int write_back(copy_ctx *c, PyObject *orig, PyObject *host)
{
    flagos_state *st = c->st;
    if (orig == NULL || host == NULL || orig == Py_None)
        return 0;
    if (flagos_is_chip_tensor(st, orig)) {
        PyObject *payload = flagos_payload(st, orig);
        if (payload == NULL)
            return -1;
        PyObject *r = NULL;
        /* out= may have resized the host copy: give the payload the same shape first. */
        PyObject *hshape = PyObject_GetAttr(host, fl_names.shape);
        PyObject *pshape = hshape ? PyObject_GetAttr(payload, fl_names.shape) : NULL;
        int same = pshape ? PyObject_RichCompareBool(hshape, pshape, Py_EQ) : -1;
        if (same == 0) {
            PyObject *rs = PyObject_CallMethod(payload, "resize_", "O", hshape);
            same = rs ? 1 : -1;
            Py_XDECREF(rs);
        }
        Py_XDECREF(hshape);
        Py_XDECREF(pshape);
        if (same == 1 && add_bytes(host, &c->e->bytes_to_device) == 0)
            r = PyObject_CallFunctionObjArgs(st->copy_, payload, host, NULL);
        Py_DECREF(payload);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    if ((PyList_Check(orig) || PyTuple_Check(orig)) && (PyList_Check(host) || PyTuple_Check(host))) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(orig);
        if (n != PySequence_Fast_GET_SIZE(host))
            return 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (write_back(c, PySequence_Fast_ITEMS(orig)[i], PySequence_Fast_ITEMS(host)[i]) < 0)
                return -1;
    }
    return 0;
}

static PyObject *to_chip(copy_ctx *c, PyObject *v, int target);

static PyObject *to_chip_item(void *ctx, PyObject *item)
{
    copy_ctx *c = ctx;
    return to_chip(c, item, c->target);
}

/* New reference: v with host tensors copied to the chip (and wrapped in device mode). */
static PyObject *to_chip(copy_ctx *c, PyObject *v, int target)
{
    flagos_state *st = c->st;
    PyTypeObject *tp = Py_TYPE(v);
    if (tp == &PyList_Type || tp == &PyTuple_Type) {
        c->target = target;
        return flagos_map_sequence(v, to_chip_item, c);
    }
    if (!PyObject_TypeCheck(v, (PyTypeObject *)st->tensor_type) ||
        (st->device_mode && PyObject_TypeCheck(v, (PyTypeObject *)st->wrapper_type)))
        return Py_NewRef(v);
    int index = target >= 0 ? target : (c->device_index >= 0 ? c->device_index : 0);
    if (index >= PyTuple_GET_SIZE(st->chip_devices))
        index = 0;
    PyObject *d = NULL;
    if (add_bytes(v, &c->e->bytes_to_device) == 0)
        d = host_copy(c, v, PyTuple_GET_ITEM(st->chip_devices, index));
    if (d == NULL || !st->device_mode)
        return d;
    PyObject *tgt = PyLong_FromLong(index);
    if (tgt == NULL) {
        Py_DECREF(d);
        return NULL;
    }
    PyObject *w = flagos_wrap_outputs(st, c->e, d, tgt); /* steals d */
    Py_DECREF(tgt);
    return w;
}

/* Result values that are not the caller's own (written) tensors go to the chip. */
static PyObject *results_to_chip(copy_ctx *c, PyObject *out, int target)
{
    Py_ssize_t nret = PyTuple_GET_SIZE(c->e->return_alias);
    if (nret <= 1 || !PyTuple_Check(out)) {
        if (nret == 1 && PyLong_AsSsize_t(PyTuple_GET_ITEM(c->e->return_alias, 0)) >= 0)
            return Py_NewRef(out); /* replaced by the caller's object below */
        return to_chip(c, out, target);
    }
    PyObject *res = PyTuple_New(PyTuple_GET_SIZE(out));
    if (res == NULL)
        return NULL;
    for (Py_ssize_t r = 0; r < PyTuple_GET_SIZE(out); r++) {
        PyObject *v = PyTuple_GET_ITEM(out, r);
        int aliased = r < nret && PyLong_AsSsize_t(PyTuple_GET_ITEM(c->e->return_alias, r)) >= 0;
        PyObject *d = aliased ? Py_NewRef(v) : to_chip(c, v, target);
        if (d == NULL) {
            Py_DECREF(res);
            return NULL;
        }
        PyTuple_SET_ITEM(res, r, d);
    }
    return res;
}

PyObject *flagos_run_fallback(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                              PyObject *target_obj)
{
    uint64_t t0 = flagos_now_ns();
    int target = (int)PyLong_AsLong(target_obj);
    /* Host copies may be staging buffers only when every result is copied out of them: not
     * when the op's host results are handed back as they are (.cpu()). */
    copy_ctx c = {st, e, -1, target, !(st->device_mode && target == TARGET_HOST), 0, {0}};
    PyObject *hargs = NULL, *hkwargs = NULL, *out = NULL, *res = NULL;

    hargs = to_host(&c, args);
    if (hargs == NULL)
        goto done;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        hkwargs = PyDict_New();
        if (hkwargs == NULL)
            goto done;
        PyObject *key, *val;
        Py_ssize_t p = 0;
        while (PyDict_Next(kwargs, &p, &key, &val)) {
            PyObject *h = to_host(&c, val);
            if (h == NULL || PyDict_SetItem(hkwargs, key, h) < 0) {
                Py_XDECREF(h);
                goto done;
            }
            Py_DECREF(h);
        }
    }
    out = flagos_call_payload(st, e, e->call, hargs, hkwargs);
    if (out == NULL)
        goto done;
    for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(e->write_args); w++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->write_args, w));
        PyObject *orig = flagos_argument_value(e, args, kwargs, i);
        PyObject *host = flagos_argument_value(e, hargs, hkwargs, i);
        if (PyErr_Occurred() || write_back(&c, orig, host) < 0)
            goto done;
    }
    if (st->device_mode && target == TARGET_HOST) {
        res = Py_NewRef(out); /* the op asked for host results (e.g. .cpu()) */
    } else {
        res = results_to_chip(&c, out, target);
    }
    if (res != NULL && (e->flags & OP_RELAYOUT) && st->device_mode &&
        flagos_sync_written(st, e, args, kwargs) < 0)
        Py_CLEAR(res);
    if (res != NULL && PyTuple_GET_SIZE(e->write_args) > 0)
        res = flagos_alias_outputs(e, args, kwargs, res);
done:
    Py_XDECREF(hargs);
    Py_XDECREF(hkwargs);
    Py_XDECREF(out);
    for (int i = 0; i < c.n_staged; i++) /* their host views are gone with hargs and out */
        flagos_staging_give(c.staged[i]);
    e->fallback_ns += flagos_now_ns() - t0;
    return res;
}
