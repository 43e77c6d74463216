/* The host round trip of a C-ABI chip in C: the common case of the CPU fallback, run from the
 * router without the Python runner (flagos/runtime/_adapter_ops.py, Runner._fallback).
 *
 * It does what the runner's round trip does, in the same order and with the same results:
 * - one host region per adapter buffer, covering every view of it in the call (host views of
 *   one buffer alias each other as on the device), copied to the host once: into a staging
 *   buffer from FLAGOS_STAGING_MIN_BYTES on (staging.c), else into a host tensor of its own;
 * - the op on host views laid out as the flagos tensors are;
 * - written arguments go back: their region once, or, when out= resized one, a buffer of its
 *   own (Runner._write_back_fresh);
 * - results that are written arguments are the caller's own objects; new results are
 *   uploaded to new buffers (contiguous ones here, other layouts by Runner._upload).
 * It takes calls whose tensors are flagos tensors of this adapter on one device, in a dtype
 * with a flagos code (not complex), without the negative bit, non-empty, inside their buffers,
 * as arguments or in lists and tuples of arguments, with no device argument and no host tensor.
 * Everything else (errors the runner words, host results for .to("cpu"), mixed devices) is
 * declined before anything ran, and the runner takes it as before.
 */
#include "adapter_fallback.h"

#include <string.h>

#include "adapter_fast.h"
#include "clock.h"
#include "adapter_internal.h"
#include "fallback.h"
#include "payload.h"
#include "staging.h"

/* Flagos tensors and buffers one call may have here; a call with more goes to the runner. */
#define FB_MAX_TENSORS 64

static const int64_t item_sizes[FLAGOS_N_DTYPES] = {4, 2, 2, 8, 8, 4, 2, 1, 1, 1};

static struct {
    PyObject *data_ptr, *view, *as_strided, *is_neg, *is_contiguous, *is_zerotensor, *layout,
        *write_back_fresh, *upload, *strided;
} names; /* kept for the process */

static int init_names(void)
{
    if (names.strided != NULL)
        return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL)
        return -1;
    PyObject *strided = PyObject_GetAttrString(torch, "strided");
    Py_DECREF(torch);
    if (strided == NULL)
        return -1;
    static const char *const s[] = {"data_ptr", "view", "as_strided", "is_neg", "is_contiguous",
                                    "_is_zerotensor", "layout", "_write_back_fresh", "_upload"};
    PyObject **slots[] = {&names.data_ptr, &names.view, &names.as_strided, &names.is_neg,
                          &names.is_contiguous, &names.is_zerotensor, &names.layout,
                          &names.write_back_fresh, &names.upload};
    for (size_t i = 0; i < sizeof(s) / sizeof(*s); i++) {
        if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(s[i])) == NULL) {
            Py_DECREF(strided);
            return -1;
        }
    }
    names.strided = strided;
    return 0;
}

/* One buffer's host region: bytes [b0, b1) of the buffer, in `data` at `ptr`. */
typedef struct region {
    BufferObject *buf; /* borrowed from its tensors */
    uint64_t b0, b1;
    int64_t item;      /* the largest item size viewing it */
    PyObject *data;    /* owned: a uint8 host tensor, or a staging buffer */
    int staged;        /* data came from flagos_staging_take */
    char *ptr;
    int uploaded;
    int n_views;       /* tensors viewing it */
    int whole;         /* the tensor of a region's first view is row-major from b0 on */
    int direct;        /* data is that tensor's host view itself (typed, its shape) */
    int kept;          /* ... from flagos_host_tensor_take: the op writes no argument */
} region;

/* One flagos tensor of the call. */
typedef struct fb_tensor {
    PyObject *w;       /* borrowed: the caller's wrapper */
    PyObject *dtype;   /* owned */
    PyObject *shape;   /* owned: torch.Size */
    PyObject *stride;  /* owned: tuple */
    PyObject *host;    /* owned: its host view, once made */
    int64_t offset;
    int code;
    int region;
    int contiguous;    /* row-major, with torch.empty(shape)'s strides */
} fb_tensor;

typedef struct fb_call {
    flagos_state *st;
    AdapterObject *adapter;
    int device;
    int n_tensors, n_regions;
    int writes;        /* the op writes an argument (in place, out=) */
    fb_tensor t[FB_MAX_TENSORS];
    region r[FB_MAX_TENSORS];
} fb_call;

static fb_tensor *first_view(fb_call *c, int i);

static void call_release(fb_call *c)
{
    for (int i = 0; i < c->n_tensors; i++)
        Py_CLEAR(c->t[i].host);
    /* the host views are gone: staging buffers and kept host tensors go back to their pools */
    for (int i = 0; i < c->n_regions; i++) {
        region *g = &c->r[i];
        PyObject *data = g->data;
        g->data = NULL;
        fb_tensor *t = first_view(c, i);
        if (data != NULL && g->staged)
            flagos_staging_give(data);
        else if (data != NULL && g->kept)
            flagos_host_tensor_give(data, t->shape, t->dtype, g->b1 - g->b0);
        else
            Py_XDECREF(data);
    }
    for (int i = 0; i < c->n_tensors; i++) {
        Py_CLEAR(c->t[i].dtype);
        Py_CLEAR(c->t[i].shape);
        Py_CLEAR(c->t[i].stride);
    }
    c->n_tensors = c->n_regions = 0;
}

/* ---- reading the call ----------------------------------------------------------------- */

static int find_tensor(fb_call *c, PyObject *w)
{
    for (int i = 0; i < c->n_tensors; i++)
        if (c->t[i].w == w)
            return i;
    return -1;
}

/* Add one wrapper: 1, 0 (not the common case: declined, no error set), -1 (error). */
static int add_tensor(fb_call *c, PyObject *w)
{
    flagos_state *st = c->st;
    if (find_tensor(c, w) >= 0)
        return 1;
    if (c->n_tensors == FB_MAX_TENSORS)
        return 0;
    fb_tensor *t = &c->t[c->n_tensors];
    memset(t, 0, sizeof(*t));
    t->w = w;
    c->n_tensors++; /* from here call_release owns what t holds */
    PyObject *payload = NULL, *offset = NULL, *device = NULL, *neg = NULL;
    int ok = 0;
    int64_t sizes[FLAGOS_MAX_DIMS], strides[FLAGOS_MAX_DIMS];
    payload = PyObject_GetAttr(w, fl_names.payload);
    if (payload == NULL || Py_TYPE(payload) != &flagos_buffer_type ||
        ((BufferObject *)payload)->adapter != c->adapter)
        goto done;
    BufferObject *buf = (BufferObject *)payload;
    if ((t->dtype = PyObject_GetAttr(w, fl_names.dtype)) == NULL)
        goto done;
    t->code = -1;
    for (int i = 0; i < FLAGOS_N_DTYPES; i++)
        if (PyTuple_GET_ITEM(st->fast_dtypes, i) == t->dtype)
            t->code = i;
    if (t->code < 0)
        goto done; /* complex and other dtypes without a code: the runner's */
    t->shape = PyObject_GetAttr(w, fl_names.shape);
    if (t->shape == NULL || !PyTuple_Check(t->shape) || PyTuple_GET_SIZE(t->shape) > FLAGOS_MAX_DIMS)
        goto done;
    int ndim = (int)PyTuple_GET_SIZE(t->shape);
    t->stride = PyObject_CallMethodNoArgs(w, fl_names.stride);
    if (t->stride == NULL || !PyTuple_Check(t->stride) || PyTuple_GET_SIZE(t->stride) != ndim)
        goto done;
    for (int d = 0; d < ndim; d++) {
        sizes[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(t->shape, d));
        strides[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(t->stride, d));
        if (PyErr_Occurred() || sizes[d] <= 0 || strides[d] < 0)
            goto done; /* empty tensors: the runner's */
    }
    offset = PyObject_CallMethodNoArgs(w, fl_names.storage_offset);
    if (offset == NULL || (t->offset = PyLong_AsLongLong(offset)) < 0)
        goto done;
    device = PyObject_CallMethodNoArgs(w, fl_names.get_device);
    long index = device != NULL ? PyLong_AsLong(device) : -1;
    if (index < 0 || index != buf->device || (c->device >= 0 && index != c->device))
        goto done; /* mixed devices: the runner's check and error */
    c->device = (int)index;
    neg = PyObject_CallMethodNoArgs(w, names.is_neg);
    if (neg != Py_False)
        goto done;
    t->contiguous = 1; /* exactly torch.empty(shape)'s strides, size-1 dims included */
    int64_t expected = 1;
    for (int d = ndim - 1; d >= 0 && t->contiguous; d--) {
        t->contiguous = strides[d] == expected;
        expected *= sizes[d];
    }
    /* the bytes it touches, PyTorch's span; inside its buffer, or the runner says why not */
    int64_t item = item_sizes[t->code];
    uint64_t lo = (uint64_t)t->offset, hi = lo + 1;
    for (int d = 0; d < ndim; d++)
        if (__builtin_add_overflow(hi, (uint64_t)(sizes[d] - 1) * (uint64_t)strides[d], &hi))
            goto done;
    uint64_t b0 = lo * (uint64_t)item, b1;
    if (__builtin_mul_overflow(hi, (uint64_t)item, &b1) || b1 > buf->nbytes)
        goto done;
    int r = 0;
    while (r < c->n_regions && c->r[r].buf != buf)
        r++;
    if (r == c->n_regions) {
        memset(&c->r[r], 0, sizeof(c->r[r]));
        c->r[r].buf = buf; /* borrowed: t's wrapper holds the buffer for the call */
        c->r[r].b0 = b0;
        c->r[r].b1 = b1;
        c->r[r].item = item;
        c->r[r].whole = t->contiguous;
        c->n_regions++;
    } else {
        region *g = &c->r[r];
        g->b0 = b0 < g->b0 ? b0 : g->b0;
        g->b1 = b1 > g->b1 ? b1 : g->b1;
        g->item = item > g->item ? item : g->item;
    }
    t->region = r;
    c->r[r].n_views++;
    ok = 1;
done:
    Py_XDECREF(payload);
    Py_XDECREF(offset);
    Py_XDECREF(device);
    Py_XDECREF(neg);
    if (!ok && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1; /* KeyboardInterrupt and the like are not the runner's to word */
        PyErr_Clear(); /* the runner meets the same tensor and says what is wrong with it */
    }
    return ok;
}

/* One argument value: 1 (the common case, its flagos tensors added), 0 (declined), -1. */
static int scan_value(fb_call *c, PyObject *v, int depth)
{
    flagos_state *st = c->st;
    PyTypeObject *tp = Py_TYPE(v);
    if (tp == (PyTypeObject *)st->wrapper_type)
        return add_tensor(c, v);
    if (tp == &PyList_Type || tp == &PyTuple_Type) {
        if (depth > 0)
            return 0;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); i++) {
            int r = scan_value(c, PySequence_Fast_GET_ITEM(v, i), depth + 1);
            if (r <= 0)
                return r;
        }
        return 1;
    }
    /* host tensors (the runner checks them), wrapper subclasses, devices: the runner's */
    if (PyObject_TypeCheck(v, (PyTypeObject *)st->tensor_type) ||
        PyObject_TypeCheck(v, (PyTypeObject *)st->device_type))
        return 0;
    return 1;
}

/* ---- the round trip ---------------------------------------------------------------------- */

static int data_pointer(PyObject *t, char **ptr)
{
    PyObject *p = PyObject_CallMethodNoArgs(t, names.data_ptr);
    if (p == NULL)
        return -1;
    *ptr = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    return *ptr == NULL && PyErr_Occurred() ? -1 : 0;
}

/* The tensor of region i's first view. */
static fb_tensor *first_view(fb_call *c, int i)
{
    for (int k = 0; k < c->n_tensors; k++)
        if (c->t[k].region == i)
            return &c->t[k];
    return NULL;
}

/* Each region to the host; adds the bytes moved to *moved. */
static int download(fb_call *c, uint64_t *moved)
{
    for (int i = 0; i < c->n_regions; i++) {
        region *g = &c->r[i];
        g->b0 -= g->b0 % (uint64_t)g->item; /* every item size viewing it divides the start */
        uint64_t n = g->b1 - g->b0;
        fb_tensor *t = first_view(c, i);
        if (n < FLAGOS_STAGING_MIN_BYTES && g->n_views == 1 && g->whole &&
            g->b0 == (uint64_t)t->offset * (uint64_t)item_sizes[t->code]) {
            /* one row-major tensor: a host tensor like it is its view, no retyping; the copy
             * overwrites all of it, so one kept from an earlier call serves where no op
             * writes to it (or resizes it) */
            g->kept = !c->writes;
            g->data = g->kept ? flagos_host_tensor_take(t->shape, t->dtype) : flagos_host_empty(t->shape, t->dtype);
            g->direct = 1;
        } else if (n >= FLAGOS_STAGING_MIN_BYTES) {
            g->data = flagos_staging_take(n);
            g->staged = 1;
        } else {
            /* whole items of the largest size: its typed view covers every view's last item */
            g->data = flagos_host_bytes(n + (uint64_t)g->item - 1 - (n + (uint64_t)g->item - 1) % (uint64_t)g->item);
        }
        if (g->data == NULL || data_pointer(g->data, &g->ptr) < 0)
            return -1;
        flagos_status status = {0};
        int32_t rc = c->adapter->api->copy_d2h(g->buf->device, g->ptr, g->buf->buffer, g->b0, n, &status);
        if (rc != 0) {
            flagos_adapter_raise_status(c->adapter, "copy to host", g->buf->device, rc, &status, NULL);
            return -1;
        }
        *moved += n;
    }
    return 0;
}

/* Each flagos tensor's host view: its region typed as it is, with its sizes, strides and
 * offset (in items of its dtype from the region's start). */
static int host_views(fb_call *c)
{
    for (int i = 0; i < c->n_tensors; i++) {
        fb_tensor *t = &c->t[i];
        region *g = &c->r[t->region];
        int64_t item = item_sizes[t->code];
        if (g->direct) {
            t->host = Py_NewRef(g->data);
            continue;
        }
        PyObject *typed = PyObject_CallMethodOneArg(g->data, names.view, t->dtype);
        PyObject *offset = typed ? PyLong_FromLongLong(((int64_t)t->offset * item - (int64_t)g->b0) / item)
                                 : NULL;
        if (offset != NULL) {
            PyObject *argv[4] = {typed, t->shape, t->stride, offset};
            t->host = PyObject_VectorcallMethod(names.as_strided, argv, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                                NULL);
        }
        Py_XDECREF(typed);
        Py_XDECREF(offset);
        if (t->host == NULL)
            return -1;
    }
    return 0;
}

static PyObject *to_host(fb_call *c, PyObject *v);

static PyObject *to_host_item(void *ctx, PyObject *item)
{
    return to_host(ctx, item);
}

/* New reference: v with its flagos tensors replaced by their host views. */
static PyObject *to_host(fb_call *c, PyObject *v)
{
    PyTypeObject *tp = Py_TYPE(v);
    if (tp == (PyTypeObject *)c->st->wrapper_type)
        return Py_NewRef(c->t[find_tensor(c, v)].host);
    if (tp == &PyList_Type || tp == &PyTuple_Type)
        return flagos_map_sequence(v, to_host_item, c);
    return Py_NewRef(v);
}

/* Bring a written flagos tensor's new contents back; adds the bytes moved to *moved. */
static int write_back(fb_call *c, PyObject *runner, PyObject *w, uint64_t *moved)
{
    int i = find_tensor(c, w);
    if (i < 0)
        return 0;
    fb_tensor *t = &c->t[i];
    region *g = &c->r[t->region];
    char *expected = g->ptr + (t->offset * item_sizes[t->code] - (int64_t)g->b0), *ptr;
    PyObject *shape = PyObject_GetAttr(t->host, fl_names.shape);
    PyObject *stride = shape ? PyObject_CallMethodNoArgs(t->host, fl_names.stride) : NULL;
    int same = stride ? PyObject_RichCompareBool(shape, t->shape, Py_EQ) : -1;
    if (same == 1)
        same = PyObject_RichCompareBool(stride, t->stride, Py_EQ);
    if (same == 1)
        same = data_pointer(t->host, &ptr) < 0 ? -1 : ptr == expected;
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    if (same < 0)
        return -1;
    if (!same) { /* out= resized it (or an in-place op re-laid it): a buffer of its own */
        PyObject *n = PyObject_CallMethodObjArgs(runner, names.write_back_fresh, w, t->host, NULL);
        unsigned long long b = n ? PyLong_AsUnsignedLongLong(n) : 0;
        Py_XDECREF(n);
        if (n == NULL || PyErr_Occurred())
            return -1;
        *moved += b;
        return 0;
    }
    if (g->uploaded)
        return 0;
    g->uploaded = 1;
    flagos_status status = {0};
    int32_t rc = c->adapter->api->copy_h2d(g->buf->device, g->buf->buffer, g->b0, g->ptr, g->b1 - g->b0,
                                           &status);
    if (rc != 0) {
        flagos_adapter_raise_status(c->adapter, "copy from host", g->buf->device, rc, &status, NULL);
        return -1;
    }
    *moved += g->b1 - g->b0;
    return 0;
}

static int write_back_value(fb_call *c, PyObject *runner, PyObject *v, uint64_t *moved)
{
    if (Py_TYPE(v) == (PyTypeObject *)c->st->wrapper_type)
        return write_back(c, runner, v, moved);
    if (PyList_Check(v) || PyTuple_Check(v))
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); i++)
            if (write_back_value(c, runner, PySequence_Fast_GET_ITEM(v, i), moved) < 0)
                return -1;
    return 0;
}

/* 1 when a method of t returns `want` (Py_True / Py_False), 0 when not, -1 on error. */
static int method_is(PyObject *t, PyObject *name, PyObject *want)
{
    PyObject *v = PyObject_CallMethodNoArgs(t, name);
    if (v == NULL)
        return -1;
    Py_DECREF(v);
    return v == want;
}

/* New reference: a host result on the chip. A dense row-major one with a flagos dtype goes
 * here, into a new buffer; the rest as Runner._upload lays it out. */
static PyObject *upload(fb_call *c, PyObject *runner, PyObject *h, uint64_t *moved)
{
    flagos_state *st = c->st;
    PyObject *nb = PyObject_GetAttr(h, fl_names.nbytes);
    unsigned long long nbytes = nb ? PyLong_AsUnsignedLongLong(nb) : 0;
    Py_XDECREF(nb);
    if (nb == NULL || PyErr_Occurred())
        return NULL;
    *moved += nbytes; /* the runner counts numel * element_size, whatever the path */
    int code = -1, ok = Py_TYPE(h) == (PyTypeObject *)st->tensor_type && nbytes > 0;
    PyObject *dtype = NULL, *shape = NULL, *layout = NULL, *buf = NULL, *w = NULL;
    if (ok) {
        layout = PyObject_GetAttr(h, names.layout);
        dtype = layout ? PyObject_GetAttr(h, fl_names.dtype) : NULL;
        shape = dtype ? PyObject_GetAttr(h, fl_names.shape) : NULL;
        if (shape == NULL)
            goto fail;
        for (int i = 0; i < FLAGOS_N_DTYPES; i++)
            if (PyTuple_GET_ITEM(st->fast_dtypes, i) == dtype)
                code = i;
        ok = layout == names.strided && code >= 0 && PyTuple_Check(shape) &&
             PyTuple_GET_SIZE(shape) <= FLAGOS_MAX_DIMS;
    }
    int r;
    if (ok && ((r = method_is(h, names.is_contiguous, Py_True)) < 1 ||
               (r = method_is(h, names.is_neg, Py_False)) < 1 ||
               (r = method_is(h, names.is_zerotensor, Py_False)) < 1)) {
        if (r < 0)
            goto fail;
        ok = 0;
    }
    if (!ok) {
        Py_XDECREF(layout);
        Py_XDECREF(dtype);
        Py_XDECREF(shape);
        return PyObject_CallMethod(runner, "_upload", "Oi", h, c->device);
    }
    int ndim = (int)PyTuple_GET_SIZE(shape), size_one = 0;
    int64_t sizes[FLAGOS_MAX_DIMS], strides[FLAGOS_MAX_DIMS], acc = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        sizes[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
        strides[d] = acc;
        acc *= sizes[d] > 1 ? sizes[d] : 1;
        size_one |= sizes[d] == 1;
    }
    if (size_one && !PyErr_Occurred()) {
        /* contiguous, but a size-1 dim's stride is free: the result keeps the host's, as the
         * CPU's result has them (the bytes are the same) */
        PyObject *host_strides = PyObject_CallMethodNoArgs(h, fl_names.stride);
        if (host_strides == NULL)
            goto fail;
        if (PyTuple_Check(host_strides) && PyTuple_GET_SIZE(host_strides) == ndim)
            for (int d = 0; d < ndim; d++)
                if (sizes[d] == 1)
                    strides[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(host_strides, d));
        Py_DECREF(host_strides);
    }
    char *src;
    if (PyErr_Occurred() || data_pointer(h, &src) < 0)
        goto fail;
    buf = flagos_adapter_new_buffer(c->adapter, c->device, nbytes); /* OOM: torch.OutOfMemoryError */
    if (buf == NULL)
        goto fail;
    flagos_status status = {0};
    int32_t rc = c->adapter->api->copy_h2d(c->device, ((BufferObject *)buf)->buffer, 0, src, nbytes,
                                           &status);
    if (rc != 0) {
        flagos_adapter_raise_status(c->adapter, "copy from host", c->device, rc, &status, NULL);
        goto fail;
    }
    w = flagos_adapter_wrap(st, buf, shape, sizes, strides, ndim, 0, code, c->device);
fail:
    Py_XDECREF(buf);
    Py_XDECREF(layout);
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    return w;
}

static PyObject *to_chip(fb_call *c, PyObject *runner, PyObject *v, uint64_t *moved)
{
    flagos_state *st = c->st;
    if (PyObject_TypeCheck(v, (PyTypeObject *)st->tensor_type) &&
        !PyObject_TypeCheck(v, (PyTypeObject *)st->wrapper_type))
        return upload(c, runner, v, moved);
    if (PyList_Check(v) || PyTuple_Check(v)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
        PyObject *out = PyList_Check(v) ? PyList_New(n) : PyTuple_New(n);
        for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
            PyObject *d = to_chip(c, runner, PySequence_Fast_GET_ITEM(v, i), moved);
            if (d == NULL)
                Py_CLEAR(out);
            else if (PyList_Check(out))
                PyList_SET_ITEM(out, i, d);
            else
                PyTuple_SET_ITEM(out, i, d);
        }
        return out;
    }
    return Py_NewRef(v);
}

/* The caller's argument `alias` (a written one) for a result that is it, else v uploaded. */
static PyObject *result(fb_call *c, PyObject *runner, op_entry *e, PyObject *args, PyObject *kwargs,
                        PyObject *alias, PyObject *v, uint64_t *moved)
{
    Py_ssize_t a = PyLong_AsSsize_t(alias);
    if (a == -1 && PyErr_Occurred())
        return NULL;
    if (a < 0)
        return to_chip(c, runner, v, moved);
    PyObject *arg = flagos_argument_value(e, args, kwargs, a);
    if (arg == NULL && PyErr_Occurred())
        return NULL;
    return Py_NewRef(arg != NULL ? arg : Py_None);
}

static PyObject *results(fb_call *c, PyObject *runner, op_entry *e, PyObject *args, PyObject *kwargs,
                         PyObject *out, uint64_t *moved)
{
    Py_ssize_t nret = PyTuple_GET_SIZE(e->return_alias);
    if (nret == 0)
        return Py_NewRef(out);
    if (nret == 1)
        return result(c, runner, e, args, kwargs, PyTuple_GET_ITEM(e->return_alias, 0), out, moved);
    if (!PyTuple_Check(out) && !PyList_Check(out)) {
        PyErr_Format(PyExc_RuntimeError, "%U returned %R, not its %zd results", e->name, out, nret);
        return NULL;
    }
    /* zip(return_alias, out): as many as the shorter has */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(out) < nret ? PySequence_Fast_GET_SIZE(out) : nret;
    PyObject *res = PyTuple_New(n);
    for (Py_ssize_t r = 0; res != NULL && r < n; r++) {
        PyObject *d = result(c, runner, e, args, kwargs, PyTuple_GET_ITEM(e->return_alias, r),
                             PySequence_Fast_GET_ITEM(out, r), moved);
        if (d == NULL)
            Py_CLEAR(res);
        else
            PyTuple_SET_ITEM(res, r, d);
    }
    return res;
}

/* The dtypes of the call's flagos tensors, into the op's report row: in the order the
 * runner gives them (sorted by name when there are several). */
static int note_dtypes(fb_call *c, op_entry *e)
{
    PyObject *seen[FB_MAX_TENSORS];
    int n = 0;
    for (int i = 0; i < c->n_tensors; i++) {
        int k = 0;
        while (k < n && seen[k] != c->t[i].dtype)
            k++;
        if (k == n)
            seen[n++] = c->t[i].dtype;
    }
    if (n > 1) {
        PyObject *list = PyList_New(n);
        if (list == NULL)
            return -1;
        for (int i = 0; i < n; i++)
            PyList_SET_ITEM(list, i, Py_NewRef(seen[i]));
        /* sorted(dtypes, key=str) */
        PyObject *builtins = PyEval_GetBuiltins(); /* borrowed */
        PyObject *sorted = builtins ? PyDict_GetItemString(builtins, "sorted") : NULL;
        PyObject *kw = sorted ? Py_BuildValue("{s:O}", "key", (PyObject *)&PyUnicode_Type) : NULL;
        PyObject *argv[1] = {list};
        PyObject *order = kw ? PyObject_VectorcallDict(sorted, argv, 1, kw) : NULL;
        Py_XDECREF(kw);
        Py_DECREF(list);
        if (order == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(order); i++)
            flagos_note_dtype(c->st, e, PyList_GET_ITEM(order, i));
        Py_DECREF(order);
        return 0;
    }
    for (int i = 0; i < n; i++)
        flagos_note_dtype(c->st, e, seen[i]);
    return 0;
}

int flagos_adapter_fallback(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                            int (*before)(flagos_state *, op_entry *), PyObject **out)
{
    *out = NULL;
    if (st->fast_adapter == NULL || st->adapter_dispatch == NULL || !st->device_mode)
        return 0;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0 &&
        PyDict_GetItemWithError(kwargs, fl_names.device) != NULL)
        return 0; /* where the results go is the runner's */
    if (PyErr_Occurred() || init_names() < 0)
        return -1;
    fb_call *c = PyMem_Calloc(1, sizeof(*c));
    if (c == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* held: reading the tensors runs Python code, which may configure another chip */
    PyObject *adapter = Py_NewRef(st->fast_adapter), *dtypes = Py_NewRef(st->fast_dtypes);
    PyObject *runner = Py_NewRef(st->adapter_dispatch);
    c->st = st;
    c->adapter = (AdapterObject *)adapter;
    c->device = -1;
    c->writes = PyTuple_GET_SIZE(e->write_args) > 0;
    PyObject *hargs = NULL, *hkwargs = NULL, *hout = NULL, *res = NULL;
    int rc = scan_value(c, args, -1);
    if (rc > 0 && kwargs != NULL) {
        PyObject *key, *val;
        Py_ssize_t p = 0;
        while (rc > 0 && PyDict_Next(kwargs, &p, &key, &val))
            rc = scan_value(c, val, 0);
    }
    if (rc > 0 && (c->n_tensors == 0 || adapter != st->fast_adapter || dtypes != st->fast_dtypes ||
                   runner != st->adapter_dispatch || c->device >= PyTuple_GET_SIZE(st->flagos_devices)))
        rc = 0; /* nothing of the chip's, or a new configuration meanwhile: the runner's */
    if (rc <= 0)
        goto done;
    /* the policy acts before anything runs: the warning, or FLAGOS_FALLBACK=error's error */
    if (before(st, e) < 0) {
        rc = -1;
        goto done;
    }
    /* The chip's queued work finishes first (the download would wait for it anyway), so that
     * the fallback's time is its copies and host op, not the kernels an asynchronous chip
     * queued before it. */
    flagos_status sync_status = {0};
    rc = -1;
    if (flagos_adapter_check(c->adapter, c->adapter->api->synchronize(c->device, &sync_status),
                             "synchronize", c->device, &sync_status) < 0)
        goto done;
    uint64_t t0 = flagos_now_ns(), to_host_bytes = 0, to_device_bytes = 0;
    if (download(c, &to_host_bytes) < 0 || host_views(c) < 0 || (hargs = to_host(c, args)) == NULL)
        goto done;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        if ((hkwargs = PyDict_New()) == NULL)
            goto done;
        PyObject *key, *val;
        Py_ssize_t p = 0;
        while (PyDict_Next(kwargs, &p, &key, &val)) {
            PyObject *h = to_host(c, val);
            if (h == NULL || PyDict_SetItem(hkwargs, key, h) < 0) {
                Py_XDECREF(h);
                goto done;
            }
            Py_DECREF(h);
        }
    }
    hout = flagos_call_payload(st, e, e->call, hargs, hkwargs);
    if (hout == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(e->write_args); i++) {
        Py_ssize_t a = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->write_args, i));
        PyObject *v = flagos_argument_value(e, args, kwargs, a);
        if (PyErr_Occurred() || (v != NULL && write_back_value(c, runner, v, &to_device_bytes) < 0))
            goto done;
    }
    res = results(c, runner, e, args, kwargs, hout, &to_device_bytes);
    if (res == NULL || note_dtypes(c, e) < 0)
        goto done;
    e->bytes_to_host += to_host_bytes;
    e->bytes_to_device += to_device_bytes;
    e->fallback_ns += flagos_now_ns() - t0;
    *out = res;
    res = NULL;
    rc = 1;
done:
    Py_XDECREF(hargs);
    Py_XDECREF(hkwargs);
    Py_XDECREF(hout);
    Py_XDECREF(res);
    call_release(c); /* after every host view: the staging buffers go back */
    PyMem_Free(c);
    Py_DECREF(adapter);
    Py_DECREF(dtypes);
    Py_DECREF(runner);
    return rc;
}
