/* The C-ABI hot path: the common case of the kernel-table ops on a C-ABI chip, run from the
 * router without the Python runner (flagos/runtime/_adapter_ops.py).
 *
 * The fast case: an elementwise op of the adapter's kernel table (add/sub/mul/div.Tensor with
 * two flagos tensors and no keyword, or a one-argument unary op: neg, relu, silu, sigmoid,
 * tanh, exp) on contiguous operands of one floating dtype on one device, same-shaped or
 * broadcast, the dtype in the kernel's and the device's native masks, no negative bit, at most
 * FLAGOS_MAX_DIMS dims and at least one element. That is exactly a call the runner's _binary /
 * _unary builders and _try_kernel would send to the kernel with a contiguous output: the
 * descriptors, the output buffer (Adapter.alloc_tensor's allocation) and the wrapper
 * (_make_wrapper_subclass with `_payload` set) are made here the same way. Anything else (and a
 * kernel that declines its arguments) goes to the runner, which decides as it always did.
 */
#include "adapter_fast.h"

#include <string.h>

#include "adapter_internal.h"
#include "payload.h"

enum {
    FAST_UNKNOWN = 0, FAST_NONE,
    FAST_BINARY_ALPHA, FAST_BINARY, FAST_UNARY, /* elementwise: contiguous operands, broadcast */
    FAST_MM, FAST_BMM, FAST_ADDMM, FAST_SOFTMAX /* any strides: the kernel reads them */
};

static const struct {
    const char *op;
    int kind;
} fast_ops[] = {
    {"aten::add.Tensor", FAST_BINARY_ALPHA}, {"aten::sub.Tensor", FAST_BINARY_ALPHA},
    {"aten::mul.Tensor", FAST_BINARY},       {"aten::div.Tensor", FAST_BINARY},
    {"aten::neg", FAST_UNARY},               {"aten::relu", FAST_UNARY},
    {"aten::silu", FAST_UNARY},              {"aten::sigmoid", FAST_UNARY},
    {"aten::tanh", FAST_UNARY},              {"aten::exp", FAST_UNARY},
    {"aten::mm", FAST_MM},                   {"aten::bmm", FAST_BMM},
    {"aten::addmm", FAST_ADDMM},             {"aten::_softmax", FAST_SOFTMAX},
};

/* Per kind: the aten arguments it takes (positional, no keyword), and its tensors among them
 * (the first ones). */
static const int kind_args[] = {0, 0, 2, 2, 1, 2, 2, 3, 3};
static const int kind_tensors[] = {0, 0, 2, 2, 1, 2, 2, 3, 1};

/* float32, float16, bfloat16, float64: the codes whose elementwise results keep their dtype. */
#define FAST_DTYPES (FLAGOS_DTYPE_BIT(0) | FLAGOS_DTYPE_BIT(1) | FLAGOS_DTYPE_BIT(2) | FLAGOS_DTYPE_BIT(3))
static const int64_t item_sizes[FLAGOS_N_DTYPES] = {4, 2, 2, 8, 8, 4, 2, 1, 1, 1};

/* ---- configuration --------------------------------------------------------- */

int flagos_adapter_fast_parse(PyObject *runner, adapter_fast_spec *spec)
{
    memset(spec, 0, sizeof(*spec));
    if (runner == NULL || runner == Py_None)
        return 0;
    PyObject *c_fast = PyObject_GetAttrString(runner, "c_fast");
    if (c_fast == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
    }
    if (c_fast == NULL || c_fast == Py_None) {
        Py_XDECREF(c_fast);
        return 0; /* a runner without one: every op goes to it */
    }
    PyObject *adapter, *native, *dtypes;
    if (!PyArg_ParseTuple(c_fast, "OO!O!", &adapter, &PyTuple_Type, &native, &PyTuple_Type, &dtypes) ||
        !flagos_is_adapter(adapter) || PyTuple_GET_SIZE(native) > MAX_DEVICES ||
        PyTuple_GET_SIZE(dtypes) != FLAGOS_N_DTYPES) {
        Py_DECREF(c_fast);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "adapter_dispatch.c_fast: (Adapter, native dtype mask per "
                     "device (at most %d), the %d torch dtypes of the flagos dtype codes)",
                     MAX_DEVICES, FLAGOS_N_DTYPES);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(native); i++) {
        spec->native[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(native, i));
        if (PyErr_Occurred()) {
            Py_DECREF(c_fast);
            return -1;
        }
    }
    spec->n_devices = (int)PyTuple_GET_SIZE(native);
    spec->adapter = Py_NewRef(adapter);
    spec->dtypes = Py_NewRef(dtypes);
    Py_DECREF(c_fast);
    return 0;
}

void flagos_adapter_fast_install(flagos_state *st, adapter_fast_spec *spec, PyObject **old_adapter,
                                 PyObject **old_dtypes)
{
    *old_adapter = st->fast_adapter;
    *old_dtypes = st->fast_dtypes;
    st->fast_adapter = spec->adapter;
    st->fast_dtypes = spec->dtypes;
    memcpy(st->fast_native, spec->native, sizeof(st->fast_native));
    st->fast_n_devices = spec->n_devices;
    st->fast_generation++;
    spec->adapter = spec->dtypes = NULL;
}

/* ---- the op's kind and kernel, once per op and configuration ------------------ */

static void resolve_kind(flagos_state *st, op_entry *e)
{
    e->fast_generation = st->fast_generation;
    e->fast_kind = FAST_NONE;
    const char *name = PyUnicode_AsUTF8(e->name);
    if (name == NULL) {
        PyErr_Clear();
        return;
    }
    int kind = FAST_NONE;
    for (size_t i = 0; i < sizeof(fast_ops) / sizeof(fast_ops[0]); i++)
        if (strcmp(fast_ops[i].op, name) == 0)
            kind = fast_ops[i].kind;
    if (kind == FAST_NONE)
        return;
    /* the last entry of that name, as the runner's kernel dict keeps it */
    const flagos_adapter *api = ((AdapterObject *)st->fast_adapter)->api;
    for (int32_t i = 0; i < api->n_kernels; i++) {
        if (api->kernels[i].op != NULL && strcmp(api->kernels[i].op, name) == 0) {
            e->fast_kind = kind;
            e->fast_kernel = i;
            e->fast_kernel_dtypes = api->kernels[i].dtypes;
        }
    }
}

/* ---- operands ---------------------------------------------------------------- */

typedef struct operand {
    PyObject *shape;     /* owned: the wrapper's torch.Size */
    BufferObject *buf;   /* owned */
    int code;
    int device;
    int64_t offset;
    int ndim;
    int64_t sizes[FLAGOS_MAX_DIMS];
    int64_t strides[FLAGOS_MAX_DIMS];
} operand;

static void operand_release(operand *o)
{
    Py_CLEAR(o->shape);
    Py_CLEAR(o->buf);
}

/* ints of a tuple into v (n of them); 0, or -1 when one is not an int. */
static int read_ints(PyObject *tuple, int64_t *v, int n)
{
    for (int i = 0; i < n; i++) {
        v[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
        if (v[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* PyTorch's is_contiguous(): size-1 dims may have any stride. */
static int is_contiguous(const operand *o)
{
    int64_t expected = 1;
    for (int i = o->ndim - 1; i >= 0; i--) {
        if (o->sizes[i] == 0)
            return 1;
        if (o->sizes[i] != 1) {
            if (o->strides[i] != expected)
                return 0;
            expected *= o->sizes[i];
        }
    }
    return 1;
}

/* An operand in the fast case: 1 (o filled, its references owned), 0 (not in the fast case: o
 * holds nothing, no error set), or -1 (an error that is not about the fast case). */
static int read_operand(flagos_state *st, PyObject *adapter, PyObject *dtypes, PyObject *t,
                        int contiguous, operand *o)
{
    static PyObject *is_neg_name = NULL; /* kept for the process */
    if (is_neg_name == NULL && (is_neg_name = PyUnicode_InternFromString("is_neg")) == NULL)
        return -1;
    memset(o, 0, sizeof(*o));
    if (Py_TYPE(t) != (PyTypeObject *)st->wrapper_type)
        return 0;
    PyObject *payload = NULL, *dtype = NULL, *stride = NULL, *offset = NULL, *device = NULL,
             *neg = NULL;
    int ok = 0;
    payload = PyObject_GetAttr(t, fl_names.payload);
    if (payload == NULL || Py_TYPE(payload) != &flagos_buffer_type ||
        (PyObject *)((BufferObject *)payload)->adapter != adapter)
        goto done;
    dtype = PyObject_GetAttr(t, fl_names.dtype);
    if (dtype == NULL)
        goto done;
    o->code = -1;
    for (int i = 0; i < FLAGOS_N_DTYPES; i++)
        if (PyTuple_GET_ITEM(dtypes, i) == dtype)
            o->code = i;
    if (o->code < 0 || !((FAST_DTYPES >> o->code) & 1))
        goto done;
    o->shape = PyObject_GetAttr(t, fl_names.shape);
    if (o->shape == NULL || !PyTuple_Check(o->shape) || PyTuple_GET_SIZE(o->shape) > FLAGOS_MAX_DIMS)
        goto done;
    o->ndim = (int)PyTuple_GET_SIZE(o->shape);
    stride = PyObject_CallMethodNoArgs(t, fl_names.stride);
    if (stride == NULL || !PyTuple_Check(stride) || PyTuple_GET_SIZE(stride) != o->ndim ||
        read_ints(o->shape, o->sizes, o->ndim) < 0 || read_ints(stride, o->strides, o->ndim) < 0)
        goto done;
    offset = PyObject_CallMethodNoArgs(t, fl_names.storage_offset);
    if (offset == NULL || (o->offset = PyLong_AsLongLong(offset)) < 0)
        goto done;
    device = PyObject_CallMethodNoArgs(t, fl_names.get_device);
    if (device == NULL)
        goto done;
    long index = PyLong_AsLong(device);
    if (index < 0 || index >= st->fast_n_devices || index != ((BufferObject *)payload)->device)
        goto done;
    o->device = (int)index;
    neg = PyObject_CallMethodNoArgs(t, is_neg_name);
    if (neg != Py_False || (contiguous && !is_contiguous(o)))
        goto done;
    /* inside its buffer, as Adapter.run_kernel checks (a view outside goes to the runner, which
     * raises that error) */
    layout l = {.ndim = o->ndim, .has_strides = 1};
    memcpy(l.sizes, o->sizes, sizeof(o->sizes));
    memcpy(l.strides, o->strides, sizeof(o->strides));
    uint64_t need;
    if (flagos_storage_nbytes(&l, o->offset, item_sizes[o->code], &need) < 0 ||
        need > ((BufferObject *)payload)->nbytes)
        goto done;
    o->buf = (BufferObject *)Py_NewRef(payload);
    ok = 1;
done:
    Py_XDECREF(payload);
    Py_XDECREF(dtype);
    Py_XDECREF(stride);
    Py_XDECREF(offset);
    Py_XDECREF(device);
    Py_XDECREF(neg);
    if (!ok) {
        PyErr_Clear(); /* the runner meets the same tensor and says what is wrong with it */
        operand_release(o);
    }
    return ok;
}

/* The kernel's view of an operand, broadcast to the output's shape as the runner's _desc
 * does: strides rewritten only when the shapes differ. */
static void describe(const operand *o, const int64_t *shape, int ndim, flagos_tensor *t)
{
    memset(t, 0, sizeof(*t));
    t->buffer = o->buf->buffer;
    t->offset = o->offset;
    t->dtype = o->code;
    t->ndim = ndim;
    int same = o->ndim == ndim && memcmp(o->sizes, shape, (size_t)ndim * sizeof(int64_t)) == 0;
    int pad = ndim - o->ndim;
    for (int i = 0; i < ndim; i++) {
        t->sizes[i] = shape[i];
        if (same)
            t->strides[i] = o->strides[i];
        else
            t->strides[i] = i < pad || (o->sizes[i - pad] == 1 && shape[i] != 1)
                                ? 0 : o->strides[i - pad];
    }
}

/* ---- the call ------------------------------------------------------------------ */

/* A tuple of n ints. */
static PyObject *int_tuple(const int64_t *v, int n)
{
    PyObject *t = PyTuple_New(n);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* Allocate, run and wrap with the operands read; same return values as the caller. */
static int run(flagos_state *st, op_entry *e, const operand *ops, int n_ops, int64_t dim,
               PyObject **out)
{
    AdapterObject *adapter = (AdapterObject *)st->fast_adapter;
    int code = ops[0].code, device = ops[0].device;
    for (int i = 1; i < n_ops; i++)
        if (ops[i].code != code || ops[i].device != device)
            return 0; /* type promotion, or mixed devices: the runner's */
    if (!((e->fast_kernel_dtypes >> code) & 1) || !((st->fast_native[device] >> code) & 1) ||
        device >= PyTuple_GET_SIZE(st->flagos_devices))
        return 0;
    int ndim = 0, n_scalars = 0;
    int64_t shape[FLAGOS_MAX_DIMS], ints[1];
    double scalars[2] = {1.0, 1.0};
    const operand *a = &ops[0], *b = &ops[1], *c = &ops[2];
    /* the output shape, and which operands the kernel sees broadcast to it: the runner's
     * builders (_binary, _unary, _mm, _bmm, _addmm, _softmax) */
    int broadcast = 0; /* operands [0, broadcast) are broadcast to the output's shape */
    switch (e->fast_kind) {
    case FAST_MM:
        if (a->ndim != 2 || b->ndim != 2 || a->sizes[1] != b->sizes[0])
            return 0;
        ndim = 2;
        shape[0] = a->sizes[0];
        shape[1] = b->sizes[1];
        break;
    case FAST_BMM:
        if (a->ndim != 3 || b->ndim != 3 || a->sizes[0] != b->sizes[0] || a->sizes[2] != b->sizes[1])
            return 0;
        ndim = 3;
        shape[0] = a->sizes[0];
        shape[1] = a->sizes[1];
        shape[2] = b->sizes[2];
        break;
    case FAST_ADDMM: /* addmm(self, mat1, mat2), beta = alpha = 1: self broadcast to the result */
        if (b->ndim != 2 || c->ndim != 2 || b->sizes[1] != c->sizes[0] || a->ndim > 2)
            return 0;
        ndim = 2;
        shape[0] = b->sizes[0];
        shape[1] = c->sizes[1];
        for (int d = 0; d < a->ndim; d++) {
            int64_t s = a->sizes[d];
            if (s != 1 && s != shape[d + 2 - a->ndim])
                return 0; /* _broadcast(self.shape, shape) != shape */
        }
        broadcast = 1;
        n_scalars = 2;
        break;
    case FAST_SOFTMAX:
        if (a->ndim == 0 || dim < -a->ndim || dim >= a->ndim)
            return 0;
        ndim = a->ndim;
        memcpy(shape, a->sizes, (size_t)ndim * sizeof(int64_t));
        ints[0] = (dim + ndim) % ndim;
        break;
    default: /* elementwise: the operands' broadcast (the runner's _broadcast) */
        for (int i = 0; i < n_ops; i++)
            ndim = ops[i].ndim > ndim ? ops[i].ndim : ndim;
        for (int d = 0; d < ndim; d++) {
            shape[d] = 1;
            for (int i = 0; i < n_ops; i++) {
                int k = d - (ndim - ops[i].ndim);
                int64_t s = k < 0 ? 1 : ops[i].sizes[k];
                if (s != shape[d] && s != 1 && shape[d] != 1)
                    return 0; /* not broadcastable: the host raises PyTorch's error */
                if (s != 1)
                    shape[d] = s;
            }
        }
        broadcast = n_ops;
        n_scalars = e->fast_kind == FAST_BINARY_ALPHA;
    }
    layout l = {.ndim = ndim, .has_strides = 0};
    memcpy(l.sizes, shape, (size_t)ndim * sizeof(int64_t));
    uint64_t nbytes;
    if (flagos_storage_nbytes(&l, 0, item_sizes[code], &nbytes) < 0 || nbytes == 0)
        return 0; /* empty (or absurd) results: the runner's */
    int64_t strides[FLAGOS_MAX_DIMS];
    int64_t acc = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = acc;
        acc *= shape[d];
    }
    /* the shape object of the result: an operand's when it has the result's shape */
    PyObject *shape_obj = NULL;
    for (int i = 0; i < n_ops && shape_obj == NULL; i++)
        if (ops[i].ndim == ndim && memcmp(ops[i].sizes, shape, (size_t)ndim * sizeof(int64_t)) == 0)
            shape_obj = Py_NewRef(ops[i].shape);
    if (shape_obj == NULL && (shape_obj = int_tuple(shape, ndim)) == NULL)
        return -1;
    PyObject *stride_obj = NULL, *offset_obj = NULL, *buf = NULL, *w = NULL;
    flagos_tensor inputs[3], output;
    operand out_op = {.code = code, .ndim = ndim};
    flagos_status status = {0};
    int rc = -1;
    stride_obj = int_tuple(strides, ndim);
    offset_obj = PyLong_FromLong(0);
    if (stride_obj == NULL || offset_obj == NULL)
        goto done;
    buf = flagos_adapter_new_buffer(adapter, device, nbytes); /* OOM: the runner's error */
    if (buf == NULL)
        goto done;
    for (int i = 0; i < n_ops; i++) {
        if (i < broadcast)
            describe(&ops[i], shape, ndim, &inputs[i]);
        else
            describe(&ops[i], ops[i].sizes, ops[i].ndim, &inputs[i]);
    }
    out_op.buf = (BufferObject *)buf;
    memcpy(out_op.sizes, shape, sizeof(shape));
    memcpy(out_op.strides, strides, sizeof(strides));
    describe(&out_op, shape, ndim, &output);
    flagos_kernel_args ka = {
        .struct_size = sizeof(ka), .device = device, .n_inputs = n_ops, .inputs = inputs,
        .n_outputs = 1, .outputs = &output, .n_scalars = n_scalars, .scalars = scalars,
        .n_ints = e->fast_kind == FAST_SOFTMAX, .ints = ints,
    };
    int k = flagos_adapter_call_kernel(adapter, e->fast_kernel, &ka, &status);
    if (k != 0) {
        rc = k > 0 ? 0 : -1; /* declined: the runner asks again and takes the host round trip */
        goto done;
    }
    w = flagos_new_wrapper(st, shape_obj, stride_obj, offset_obj,
                           PyTuple_GET_ITEM(st->fast_dtypes, code), device);
    if (w == NULL || PyObject_SetAttr(w, fl_names.payload, buf) < 0) {
        Py_CLEAR(w);
        goto done;
    }
    *out = w;
    rc = 1;
done:
    Py_XDECREF(buf);
    Py_XDECREF(shape_obj);
    Py_XDECREF(stride_obj);
    Py_XDECREF(offset_obj);
    return rc;
}

int flagos_adapter_fast_call(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                             PyObject **out)
{
    *out = NULL;
    if (st->fast_adapter == NULL)
        return 0;
    if (e->fast_generation != st->fast_generation)
        resolve_kind(st, e);
    if (e->fast_kind == FAST_NONE || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0))
        return 0;
    int n_ops = kind_tensors[e->fast_kind];
    if (PyTuple_GET_SIZE(args) != kind_args[e->fast_kind])
        return 0;
    int64_t dim = 0;
    if (e->fast_kind == FAST_SOFTMAX) { /* _softmax(self, dim, half_to_float=False) */
        PyObject *d = PyTuple_GET_ITEM(args, 1);
        if (!PyLong_CheckExact(d) || PyTuple_GET_ITEM(args, 2) != Py_False)
            return 0;
        dim = PyLong_AsLongLong(d);
        if (dim == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    }
    /* held: reading the operands runs Python code, which may configure another chip */
    PyObject *adapter = Py_NewRef(st->fast_adapter), *dtypes = Py_NewRef(st->fast_dtypes);
    operand ops[3];
    memset(ops, 0, sizeof(ops));
    int got = 0, rc = 0;
    for (; got < n_ops; got++) {
        rc = read_operand(st, adapter, dtypes, PyTuple_GET_ITEM(args, got),
                          e->fast_kind <= FAST_UNARY, &ops[got]);
        if (rc <= 0)
            break;
    }
    if (got == n_ops && adapter == st->fast_adapter && dtypes == st->fast_dtypes)
        rc = run(st, e, ops, n_ops, dim, out);
    else if (rc > 0)
        rc = 0;
    for (int i = 0; i < got; i++)
        operand_release(&ops[i]);
    Py_DECREF(adapter);
    Py_DECREF(dtypes);
    return rc;
}
