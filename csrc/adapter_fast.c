/* The C-ABI hot path: the common case of the ops a model repeats on a C-ABI chip, run from the
 * router without the Python runner (flagos/runtime/_adapter_ops.py).
 *
 * The fast cases, on flagos tensors of one floating dtype on one device, without the negative
 * bit, at most FLAGOS_MAX_DIMS dims, inside their buffers:
 * - kernel-table ops (the dtype in the kernel's and the device's native masks, a non-empty
 *   result): the elementwise add/sub/mul/div.Tensor (alpha 1), neg, relu, silu, sigmoid,
 *   tanh, exp on contiguous operands, same-shaped or broadcast (a broadcast over an operand
 *   with a size-1 dim at a stride of its own is the runner's: TensorIterator's layout rule);
 *   mm, bmm, addmm (beta = alpha = 1), _softmax, sum and sum.dim_IntList (no dtype),
 *   native_layer_norm on any strides. That
 *   is exactly a call the runner's builders and _try_kernel send to the kernel with a
 *   contiguous output: the descriptors, the output buffers (Adapter.alloc_tensor's
 *   allocation) and the wrappers (_make_wrapper_subclass with `_payload` set) are made here
 *   the same way.
 * - in-place add_/sub_/mul_/div_.Tensor on contiguous operands whose broadcast is self's
 *   shape: the out-of-place kernel writes a scratch buffer, copied into self on the device
 *   (the ABI does not promise that a kernel's output may alias an input); the caller's own
 *   object is returned, as the runner's round trip returns it.
 * - views (view and _unsafe_view of a tensor laid out row-major, detach, alias, t,
 *   transpose.int, permute, unsqueeze, expand, slice.Tensor, select.int): PyTorch's metadata
 *   rule applied here, the new wrapper over the same buffer.
 * Anything else (errors included: PyTorch's own message comes from the runner) and a kernel
 * that declines its arguments goes to the runner, which decides as it always did.
 */
#include "adapter_fast.h"

#include <string.h>

#include "adapter_internal.h"
#include "payload.h"

enum {
    FAST_UNKNOWN = 0, FAST_NONE,
    /* elementwise: contiguous operands, broadcast */
    FAST_BINARY_ALPHA, FAST_BINARY, FAST_UNARY, FAST_INPLACE_ALPHA, FAST_INPLACE,
    /* any strides: the kernel reads them */
    FAST_MM, FAST_BMM, FAST_ADDMM, FAST_SOFTMAX, FAST_SUM, FAST_SUM_DIM, FAST_LAYER_NORM,
    /* views: metadata only, no kernel */
    FAST_VIEW, FAST_ALIAS, FAST_T, FAST_TRANSPOSE, FAST_PERMUTE, FAST_UNSQUEEZE, FAST_EXPAND,
    FAST_SLICE, FAST_SELECT
};
#define FAST_FIRST_VIEW FAST_VIEW
#define IS_ELEMENTWISE(kind) ((kind) >= FAST_BINARY_ALPHA && (kind) <= FAST_INPLACE)
#define IS_INPLACE(kind) ((kind) == FAST_INPLACE_ALPHA || (kind) == FAST_INPLACE)

/* op: the aten op; kernel: the adapter kernel it runs (NULL: a view, none needed) */
static const struct {
    const char *op;
    const char *kernel;
    int kind;
} fast_ops[] = {
    {"aten::add.Tensor", "aten::add.Tensor", FAST_BINARY_ALPHA},
    {"aten::sub.Tensor", "aten::sub.Tensor", FAST_BINARY_ALPHA},
    {"aten::mul.Tensor", "aten::mul.Tensor", FAST_BINARY},
    {"aten::div.Tensor", "aten::div.Tensor", FAST_BINARY},
    {"aten::add_.Tensor", "aten::add.Tensor", FAST_INPLACE_ALPHA},
    {"aten::sub_.Tensor", "aten::sub.Tensor", FAST_INPLACE_ALPHA},
    {"aten::mul_.Tensor", "aten::mul.Tensor", FAST_INPLACE},
    {"aten::div_.Tensor", "aten::div.Tensor", FAST_INPLACE},
    {"aten::neg", "aten::neg", FAST_UNARY},
    {"aten::relu", "aten::relu", FAST_UNARY},
    {"aten::silu", "aten::silu", FAST_UNARY},
    {"aten::sigmoid", "aten::sigmoid", FAST_UNARY},
    {"aten::tanh", "aten::tanh", FAST_UNARY},
    {"aten::exp", "aten::exp", FAST_UNARY},
    {"aten::mm", "aten::mm", FAST_MM},
    {"aten::bmm", "aten::bmm", FAST_BMM},
    {"aten::addmm", "aten::addmm", FAST_ADDMM},
    {"aten::_softmax", "aten::_softmax", FAST_SOFTMAX},
    {"aten::sum", "aten::sum.dim_IntList", FAST_SUM},
    {"aten::sum.dim_IntList", "aten::sum.dim_IntList", FAST_SUM_DIM},
    {"aten::native_layer_norm", "aten::native_layer_norm", FAST_LAYER_NORM},
    {"aten::view", NULL, FAST_VIEW},
    {"aten::_unsafe_view", NULL, FAST_VIEW},
    {"aten::detach", NULL, FAST_ALIAS},
    {"aten::alias", NULL, FAST_ALIAS},
    {"aten::t", NULL, FAST_T},
    {"aten::transpose.int", NULL, FAST_TRANSPOSE},
    {"aten::permute", NULL, FAST_PERMUTE},
    {"aten::unsqueeze", NULL, FAST_UNSQUEEZE},
    {"aten::expand", NULL, FAST_EXPAND},
    {"aten::slice.Tensor", NULL, FAST_SLICE},
    {"aten::select.int", NULL, FAST_SELECT},
};

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
    PyObject *adapter, *native, *dtypes, *runner_ops = NULL, *kernel_ops = NULL;
    if (!PyArg_ParseTuple(c_fast, "OO!O!|O!O!", &adapter, &PyTuple_Type, &native, &PyTuple_Type, &dtypes,
                          &PyFrozenSet_Type, &runner_ops, &PyFrozenSet_Type, &kernel_ops) ||
        (runner_ops != NULL && kernel_ops == NULL) ||
        !flagos_is_adapter(adapter) || PyTuple_GET_SIZE(native) > MAX_DEVICES ||
        PyTuple_GET_SIZE(dtypes) != FLAGOS_N_DTYPES) {
        Py_DECREF(c_fast);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "adapter_dispatch.c_fast: (Adapter, native dtype mask per "
                     "device (at most %d), the %d torch dtypes of the flagos dtype codes[, the "
                     "frozensets of the op names the runner always handles itself and of those "
                     "it tries a kernel for])",
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
    spec->runner_ops = Py_XNewRef(runner_ops);
    spec->kernel_ops = Py_XNewRef(kernel_ops);
    Py_DECREF(c_fast);
    return 0;
}

void flagos_adapter_fast_install(flagos_state *st, adapter_fast_spec *spec, PyObject **old_adapter,
                                 PyObject **old_dtypes, PyObject **old_runner_ops,
                                 PyObject **old_kernel_ops)
{
    *old_adapter = st->fast_adapter;
    *old_dtypes = st->fast_dtypes;
    *old_runner_ops = st->fast_runner_ops;
    *old_kernel_ops = st->fast_kernel_ops;
    st->fast_adapter = spec->adapter;
    st->fast_dtypes = spec->dtypes;
    st->fast_runner_ops = spec->runner_ops;
    st->fast_kernel_ops = spec->kernel_ops;
    memcpy(st->fast_native, spec->native, sizeof(st->fast_native));
    st->fast_n_devices = spec->n_devices;
    st->fast_generation++;
    spec->adapter = spec->dtypes = spec->runner_ops = spec->kernel_ops = NULL;
}

/* ---- the op's kind and kernel, once per op and configuration ------------------ */

void flagos_adapter_fast_resolve(flagos_state *st, op_entry *e)
{
    e->fast_generation = st->fast_generation;
    e->fast_kind = FAST_NONE;
    e->fast_fallback = 0;
    if (st->fast_adapter == NULL)
        return; /* a runner without a C fast path (no `c_fast`): every op goes to it */
    /* a host output is the runner's to keep (Runner._fallback) */
    if (st->fast_runner_ops != NULL && !(e->flags & (OP_VIEW | OP_HOST_OUTPUT1))) {
        /* PySet_Contains on a str runs no Python code */
        int special = PySet_Contains(st->fast_runner_ops, e->name);
        int kernel = special == 0 ? PySet_Contains(st->fast_kernel_ops, e->name) : -1;
        /* a decomposition the runner runs as its parts unless routed to the fallback */
        if (kernel < 0)
            PyErr_Clear();
        else
            e->fast_fallback = kernel || (e->flags & OP_DECOMPOSES) ? FAST_FALLBACK_ROUTED
                                                                     : FAST_FALLBACK_ALWAYS;
    }
    const char *name = PyUnicode_AsUTF8(e->name);
    if (name == NULL) {
        PyErr_Clear();
        return;
    }
    int kind = FAST_NONE;
    const char *kernel = NULL;
    for (size_t i = 0; i < sizeof(fast_ops) / sizeof(fast_ops[0]); i++) {
        if (strcmp(fast_ops[i].op, name) == 0) {
            kind = fast_ops[i].kind;
            kernel = fast_ops[i].kernel;
        }
    }
    if (kind == FAST_NONE)
        return;
    if (kernel == NULL) { /* a view: metadata, no kernel */
        e->fast_kind = kind;
        return;
    }
    /* the last entry of that name, as the runner's kernel dict keeps it */
    const flagos_adapter *api = ((AdapterObject *)st->fast_adapter)->api;
    for (int32_t i = 0; i < api->n_kernels; i++) {
        if (api->kernels[i].op != NULL && strcmp(api->kernels[i].op, kernel) == 0) {
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
                        int contiguous, uint64_t codes, operand *o)
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
    if (o->code < 0 || !((codes >> o->code) & 1))
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

/* ---- arguments ------------------------------------------------------------------- */

/* The arguments of one call in the fast case, read by parse_args. */
typedef struct call_args {
    PyObject *tensors[3]; /* borrowed; NULL: an absent optional tensor (layer_norm's weight, bias) */
    int n_tensors;
    double scalars[2];    /* alpha (elementwise, default 1); eps (layer_norm) */
    int64_t a, b;         /* _softmax's dim; transpose's dims; unsqueeze's dim; select's dim and
                           * index; slice's dim */
    int64_t start, end, step; /* slice's */
    int64_t list[FLAGOS_MAX_DIMS]; /* view's and expand's size, permute's dims, sum's dims,
                                    * layer_norm's normalized shape */
    int n_list;           /* -1: None (sum over every dim) */
    int keepdim;
} call_args;

/* 1 and *out for a Python int (bool is not one) that fits; 0 otherwise, no error set. */
static int as_int(PyObject *v, int64_t *out)
{
    if (!PyLong_CheckExact(v))
        return 0;
    *out = PyLong_AsLongLong(v);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* 1 and *out for a Python float or int; 0 otherwise, no error set. */
static int as_number(PyObject *v, double *out)
{
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return 1;
    }
    if (!PyLong_CheckExact(v))
        return 0;
    *out = PyLong_AsDouble(v);
    if (*out == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* A list or tuple of at most FLAGOS_MAX_DIMS ints into ca->list; 1, or 0 (no error set). */
static int as_int_list(PyObject *v, call_args *ca)
{
    if (!PyList_Check(v) && !PyTuple_Check(v))
        return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    if (n > FLAGOS_MAX_DIMS)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!as_int(PySequence_Fast_GET_ITEM(v, i), &ca->list[i]))
            return 0;
    ca->n_list = (int)n;
    return 1;
}

/* The call's arguments when they have the fast case's form: 1 (ca filled), or 0 (no error
 * set). PyTorch leaves trailing defaults out of `args`, and keyword-only ones out of `kwargs`. */
static int parse_args(int kind, PyObject *args, PyObject *kwargs, call_args *ca)
{
    memset(ca, 0, sizeof(*ca));
    ca->scalars[0] = ca->scalars[1] = 1.0;
    ca->n_list = -1;
    ca->step = 1;
    ca->end = INT64_MAX;
    ca->n_tensors = 1;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n == 0)
        return 0;
    ca->tensors[0] = PyTuple_GET_ITEM(args, 0);
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        /* alpha is the one keyword of the fast case */
        PyObject *alpha;
        if ((kind != FAST_BINARY_ALPHA && kind != FAST_INPLACE_ALPHA) || PyDict_GET_SIZE(kwargs) != 1 ||
            (alpha = PyDict_GetItemString(kwargs, "alpha")) == NULL || !as_number(alpha, &ca->scalars[0]))
            return 0;
        /* Another alpha goes to the runner: sim's kernel rounds a + alpha * b differently from
         * the CPU, and optimizers (SGD's add_(grad, alpha=-lr)) must match it bit for bit. */
        if (ca->scalars[0] != 1.0)
            return 0;
    }
    PyObject *x1 = n > 1 ? PyTuple_GET_ITEM(args, 1) : NULL;
    PyObject *x2 = n > 2 ? PyTuple_GET_ITEM(args, 2) : NULL;
    switch (kind) {
    case FAST_BINARY_ALPHA: case FAST_BINARY: case FAST_INPLACE_ALPHA: case FAST_INPLACE:
    case FAST_MM: case FAST_BMM:
        ca->n_tensors = 2;
        ca->tensors[1] = x1;
        return n == 2;
    case FAST_UNARY: case FAST_SUM: case FAST_ALIAS: case FAST_T:
        return n == 1;
    case FAST_ADDMM:
        ca->n_tensors = 3;
        ca->tensors[1] = x1;
        ca->tensors[2] = x2;
        return n == 3;
    case FAST_SOFTMAX: /* _softmax(self, dim, half_to_float=False) */
        return n == 3 && as_int(x1, &ca->a) && x2 == Py_False;
    case FAST_SUM_DIM: /* sum.dim_IntList(self, dim, keepdim=False) */
        if (n > 3 || (x1 != NULL && x1 != Py_None && !as_int_list(x1, ca)))
            return 0;
        if (x2 != NULL && x2 != Py_True && x2 != Py_False)
            return 0;
        ca->keepdim = x2 == Py_True;
        return 1;
    case FAST_LAYER_NORM: { /* native_layer_norm(input, normalized_shape, weight, bias, eps) */
        if (n != 5 || !as_int_list(x1, ca) || !as_number(PyTuple_GET_ITEM(args, 4), &ca->scalars[0]))
            return 0;
        PyObject *bias = PyTuple_GET_ITEM(args, 3);
        ca->n_tensors = 3;
        ca->tensors[1] = x2 == Py_None ? NULL : x2;
        ca->tensors[2] = bias == Py_None ? NULL : bias;
        return 1;
    }
    case FAST_VIEW: case FAST_PERMUTE: case FAST_EXPAND:
        return n == 2 && as_int_list(x1, ca);
    case FAST_UNSQUEEZE:
        return n == 2 && as_int(x1, &ca->a);
    case FAST_TRANSPOSE: case FAST_SELECT:
        return n == 3 && as_int(x1, &ca->a) && as_int(x2, &ca->b);
    case FAST_SLICE: { /* slice.Tensor(self, dim=0, start=None, end=None, step=1) */
        PyObject *end = n > 3 ? PyTuple_GET_ITEM(args, 3) : NULL;
        PyObject *step = n > 4 ? PyTuple_GET_ITEM(args, 4) : NULL;
        return n <= 5 && (x1 == NULL || as_int(x1, &ca->a)) &&
               (x2 == NULL || x2 == Py_None || as_int(x2, &ca->start)) &&
               (end == NULL || end == Py_None || as_int(end, &ca->end)) &&
               (step == NULL || as_int(step, &ca->step));
    }
    default:
        return 0;
    }
}

/* ---- kernel calls ------------------------------------------------------------------ */

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

static void contiguous_strides(const int64_t *shape, int ndim, int64_t *strides)
{
    int64_t acc = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = acc;
        acc *= shape[d] > 1 ? shape[d] : 1;
    }
}

/* A new wrapper of (shape, contiguous or given strides, offset) over buf; shape_obj: the
 * shape as a tuple when the caller has one (borrowed), else NULL. */
PyObject *flagos_adapter_wrap(flagos_state *st, PyObject *buf, PyObject *shape_obj,
                              const int64_t *shape, const int64_t *strides, int ndim,
                              int64_t offset, int code, int device)
{
    PyObject *stride_obj = int_tuple(strides, ndim), *offset_obj = PyLong_FromLongLong(offset);
    PyObject *own_shape = shape_obj == NULL ? int_tuple(shape, ndim) : Py_NewRef(shape_obj);
    PyObject *w = NULL;
    if (stride_obj != NULL && offset_obj != NULL && own_shape != NULL)
        w = flagos_new_wrapper(st, own_shape, stride_obj, offset_obj,
                               PyTuple_GET_ITEM(st->fast_dtypes, code), device);
    if (w != NULL && PyObject_SetAttr(w, fl_names.payload, buf) < 0)
        Py_CLEAR(w);
    Py_XDECREF(stride_obj);
    Py_XDECREF(offset_obj);
    Py_XDECREF(own_shape);
    return w;
}

static int same_sizes(const int64_t *a, int na, const int64_t *b, int nb)
{
    return na == nb && memcmp(a, b, (size_t)na * sizeof(int64_t)) == 0;
}

static int same_operand_shapes(const operand *ops, int n_ops, const int64_t *shape, int ndim)
{
    for (int i = 0; i < n_ops; i++)
        if (!same_sizes(shape, ndim, ops[i].sizes, ops[i].ndim))
            return 0;
    return 1;
}

/* Whether every operand has exactly torch.empty's strides, size-1 dims included. */
static int canonical_strides(const operand *ops, int n_ops)
{
    for (int i = 0; i < n_ops; i++) {
        int64_t expected = 1;
        for (int d = ops[i].ndim - 1; d >= 0; d--) {
            if (ops[i].strides[d] != expected)
                return 0;
            expected *= ops[i].sizes[d] > 1 ? ops[i].sizes[d] : 1;
        }
    }
    return 1;
}

/* Whether self (written) and other (read, contiguous both) overlap in part, which PyTorch
 * refuses for an in-place op ("unsupported operation: some elements of the input tensor and
 * the written-to tensor refer to a single memory location"): the runner then raises that. */
static int partial_overlap(const operand *self, const operand *other, int64_t item)
{
    if (self->buf != other->buf)
        return 0;
    int64_t n_self = 1, n_other = 1;
    for (int d = 0; d < self->ndim; d++)
        n_self *= self->sizes[d];
    for (int d = 0; d < other->ndim; d++)
        n_other *= other->sizes[d];
    int64_t a0 = self->offset * item, a1 = a0 + n_self * item;
    int64_t b0 = other->offset * item, b1 = b0 + n_other * item;
    if (a1 <= b0 || b1 <= a0)
        return 0;
    return !(a0 == b0 && a1 == b1 && same_sizes(self->sizes, self->ndim, other->sizes, other->ndim) &&
             same_sizes(self->strides, self->ndim, other->strides, other->ndim));
}

/* Allocate, run and wrap with the operands read (absent ones have no buffer); same return
 * values as flagos_adapter_fast_call. self: the written tensor of an in-place op. */
static int run(flagos_state *st, op_entry *e, const operand *ops, const call_args *ca,
               PyObject *self, PyObject **out)
{
    AdapterObject *adapter = (AdapterObject *)st->fast_adapter;
    int kind = e->fast_kind, n_ops = ca->n_tensors;
    int code = ops[0].code, device = ops[0].device;
    for (int i = 1; i < n_ops; i++)
        if (ops[i].buf != NULL && (ops[i].code != code || ops[i].device != device))
            return 0; /* type promotion, or mixed devices: the runner's */
    if (!((e->fast_kernel_dtypes >> code) & 1) || !((st->fast_native[device] >> code) & 1) ||
        device >= PyTuple_GET_SIZE(st->flagos_devices))
        return 0;
    const operand *a = &ops[0], *b = &ops[1], *c = &ops[2];
    /* the outputs' shapes (as the kernel sees them, and as the wrappers say when that
     * differs: keepdim=False sums), and which operands the kernel sees broadcast to the
     * first output's shape: the runner's builders (_binary, _unary, _mm, _bmm, _addmm,
     * _softmax, _reduce, _layer_norm) */
    int n_outs = 1, ndim = 0, final_ndim = -1, n_scalars = 0, n_ints = 0;
    int64_t shape[FLAGOS_MAX_DIMS], stats[FLAGOS_MAX_DIMS], final[FLAGOS_MAX_DIMS];
    int64_t ints[FLAGOS_MAX_DIMS];
    int broadcast = 0; /* operands [0, broadcast) are broadcast to the output's shape */
    switch (kind) {
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
        if (a->ndim == 0 || ca->a < -a->ndim || ca->a >= a->ndim)
            return 0;
        ndim = a->ndim;
        memcpy(shape, a->sizes, (size_t)ndim * sizeof(int64_t));
        ints[0] = (ca->a + ndim) % ndim;
        n_ints = 1;
        break;
    case FAST_SUM: case FAST_SUM_DIM: { /* the keepdim shape; ints: the reduced dims, ascending */
        int reduced[FLAGOS_MAX_DIMS] = {0};
        int64_t limit = a->ndim > 0 ? a->ndim : 1;
        int all = ca->n_list <= 0; /* None or []: every dim */
        for (int i = 0; i < ca->n_list; i++) {
            int64_t d = ca->list[i];
            if (d < -limit || d >= limit)
                return 0; /* PyTorch's IndexError, from the runner */
            d = d < 0 ? d + limit : d;
            if (reduced[d]++)
                return 0; /* a dim named twice (0 and -1 of a 0-dim tensor too): PyTorch's error */
        }
        ndim = a->ndim;
        final_ndim = 0;
        for (int d = 0; d < ndim; d++) {
            int r = all || reduced[d];
            shape[d] = r ? 1 : a->sizes[d];
            if (r)
                ints[n_ints++] = d;
            if (!r || ca->keepdim)
                final[final_ndim++] = shape[d];
        }
        break;
    }
    case FAST_LAYER_NORM: { /* out: the input's shape; mean, rstd: leading dims, then 1s */
        int k = ca->n_list;
        if (k < 1 || k > a->ndim || !same_sizes(a->sizes + a->ndim - k, k, ca->list, k))
            return 0;
        for (int i = 1; i < 3; i++)
            if (ops[i].buf != NULL && !same_sizes(ops[i].sizes, ops[i].ndim, ca->list, k))
                return 0;
        ndim = a->ndim;
        memcpy(shape, a->sizes, (size_t)ndim * sizeof(int64_t));
        for (int d = 0; d < ndim; d++)
            stats[d] = d < ndim - k ? a->sizes[d] : 1;
        n_outs = 3;
        n_scalars = 1;
        ints[0] = k;
        n_ints = 1;
        break;
    }
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
        n_scalars = kind == FAST_BINARY_ALPHA || kind == FAST_INPLACE_ALPHA;
        /* Broadcast operands, one with a size-1 dim at a stride of its own (contiguous all
         * the same): PyTorch's TensorIterator sorts the dims by the operands' strides and may
         * give the result's size-1 dims strides that are not the contiguous ones this path
         * gives. The runner works that layout out; operands with torch.empty's strides
         * always give a contiguous result. */
        if (!IS_INPLACE(kind) && !same_operand_shapes(ops, n_ops, shape, ndim) &&
            !canonical_strides(ops, n_ops))
            return 0;
        if (IS_INPLACE(kind) && (!same_sizes(shape, ndim, a->sizes, a->ndim) ||
                                 partial_overlap(a, b, item_sizes[code])))
            return 0; /* the broadcast is not self's shape, or a partial overlap: PyTorch's error */
    }
    int64_t out_shapes[3][FLAGOS_MAX_DIMS], out_strides[3][FLAGOS_MAX_DIMS];
    uint64_t nbytes[3];
    for (int o = 0; o < n_outs; o++) {
        memcpy(out_shapes[o], o == 0 ? shape : stats, sizeof(shape));
        contiguous_strides(out_shapes[o], ndim, out_strides[o]);
        layout l = {.ndim = ndim, .has_strides = 0};
        memcpy(l.sizes, out_shapes[o], (size_t)ndim * sizeof(int64_t));
        if (flagos_storage_nbytes(&l, 0, item_sizes[code], &nbytes[o]) < 0 || nbytes[o] == 0)
            return 0; /* empty (or absurd) results: the runner's */
    }
    PyObject *bufs[3] = {NULL, NULL, NULL}, *wrappers[3] = {NULL, NULL, NULL};
    flagos_tensor inputs[3], outputs[3];
    flagos_status status = {0};
    int rc = -1;
    for (int o = 0; o < n_outs; o++) {
        /* OOM: the runner's error; an in-place op's scratch buffer: the runner's round trip,
         * which needs no device memory */
        bufs[o] = flagos_adapter_new_buffer(adapter, device, nbytes[o]);
        if (bufs[o] == NULL) {
            if (IS_INPLACE(kind)) {
                PyErr_Clear();
                rc = 0;
            }
            goto done;
        }
    }
    for (int i = 0; i < n_ops; i++) {
        if (ops[i].buf == NULL) {
            memset(&inputs[i], 0, sizeof(inputs[i]));
            inputs[i].ndim = -1; /* an absent optional input */
        } else if (i < broadcast) {
            describe(&ops[i], shape, ndim, &inputs[i]);
        } else {
            describe(&ops[i], ops[i].sizes, ops[i].ndim, &inputs[i]);
        }
    }
    for (int o = 0; o < n_outs; o++) {
        operand out_op = {.code = code, .ndim = ndim, .buf = (BufferObject *)bufs[o]};
        memcpy(out_op.sizes, out_shapes[o], sizeof(out_op.sizes));
        memcpy(out_op.strides, out_strides[o], sizeof(out_op.strides));
        describe(&out_op, out_shapes[o], ndim, &outputs[o]);
    }
    flagos_kernel_args ka = {
        .struct_size = sizeof(ka), .device = device, .n_inputs = n_ops, .inputs = inputs,
        .n_outputs = n_outs, .outputs = outputs, .n_scalars = n_scalars,
        .scalars = ca->scalars, .n_ints = n_ints, .ints = ints,
    };
    int k = flagos_adapter_call_kernel(adapter, e->fast_kernel, &ka, &status);
    if (k != 0) {
        rc = k > 0 ? 0 : -1; /* declined: the runner asks again and takes the host round trip */
        goto done;
    }
    if (IS_INPLACE(kind)) { /* the result into self's bytes (contiguous: the same order) */
        int32_t r = adapter->api->copy_d2d(device, a->buf->buffer, (uint64_t)a->offset * (uint64_t)item_sizes[code],
                                           device, ((BufferObject *)bufs[0])->buffer, 0, nbytes[0], &status);
        if (r != 0) {
            flagos_adapter_raise_status(adapter, "device copy", device, r, &status, NULL);
            goto done;
        }
        *out = Py_NewRef(self);
        rc = 1;
        goto done;
    }
    for (int o = 0; o < n_outs; o++) {
        int64_t *wshape = out_shapes[o], *wstrides = out_strides[o], fstrides[FLAGOS_MAX_DIMS];
        int wndim = ndim;
        if (final_ndim >= 0) { /* keepdim=False: same bytes, the final shape */
            wshape = final;
            wndim = final_ndim;
            contiguous_strides(final, final_ndim, fstrides);
            wstrides = fstrides;
        }
        /* the shape object of the result: an operand's when it has the result's shape */
        PyObject *shape_obj = NULL;
        for (int i = 0; i < n_ops && shape_obj == NULL; i++)
            if (ops[i].buf != NULL && same_sizes(ops[i].sizes, ops[i].ndim, wshape, wndim))
                shape_obj = ops[i].shape;
        wrappers[o] = flagos_adapter_wrap(st, bufs[o], shape_obj, wshape, wstrides, wndim, 0, code,
                                        device);
        if (wrappers[o] == NULL)
            goto done;
    }
    if (n_outs == 1) {
        *out = Py_NewRef(wrappers[0]);
    } else if ((*out = PyTuple_New(n_outs)) != NULL) {
        for (int o = 0; o < n_outs; o++)
            PyTuple_SET_ITEM(*out, o, Py_NewRef(wrappers[o]));
    } else {
        goto done;
    }
    rc = 1;
done:
    for (int o = 0; o < n_outs; o++) {
        Py_XDECREF(bufs[o]);
        Py_XDECREF(wrappers[o]);
    }
    return rc;
}

/* ---- views ------------------------------------------------------------------------- */

/* dim wrapped into [0, ndim) (ndim > 0); 0 when out of range. */
static int wrap_dim(int64_t d, int ndim, int64_t *out)
{
    if (d < -ndim || d >= ndim)
        return 0;
    *out = d < 0 ? d + ndim : d;
    return 1;
}

static void remove_dim(int64_t *v, int ndim, int64_t d)
{
    memmove(v + d, v + d + 1, (size_t)(ndim - d - 1) * sizeof(int64_t));
}

/* A view of a, by PyTorch's metadata rule for the op (TensorShape.cpp), over a's buffer; same
 * return values as flagos_adapter_fast_call. Cases PyTorch refuses go to the runner, whose
 * meta tensors raise PyTorch's own error. */
static int run_view(flagos_state *st, int kind, const operand *a, const call_args *ca, PyObject **out)
{
    int ndim = a->ndim, n = ndim;
    int64_t sizes[FLAGOS_MAX_DIMS + 1], strides[FLAGOS_MAX_DIMS + 1], offset = a->offset;
    int64_t numel = 1, d0, d1;
    memcpy(sizes, a->sizes, sizeof(a->sizes));
    memcpy(strides, a->strides, sizeof(a->strides));
    for (int d = 0; d < ndim; d++)
        numel *= a->sizes[d];
    if (numel == 0)
        return 0; /* empty tensors: the runner's */
    switch (kind) {
    case FAST_VIEW: { /* of a tensor laid out row-major, size-1 dims included: row-major */
        int64_t expected = 1, known = 1;
        for (int d = ndim - 1; d >= 0; d--) {
            if (a->strides[d] != expected)
                return 0; /* PyTorch's stride rule for the other layouts: the runner's */
            expected *= a->sizes[d];
        }
        int infer = -1;
        n = ca->n_list;
        for (int d = 0; d < n; d++) {
            int64_t v = ca->list[d];
            if (v == -1 && infer < 0)
                infer = d;
            else if (v < 0 || __builtin_mul_overflow(known, v, &known))
                return 0;
            sizes[d] = v;
        }
        if (infer >= 0) {
            if (known == 0 || numel % known != 0)
                return 0;
            sizes[infer] = numel / known;
        } else if (known != numel) {
            return 0;
        }
        contiguous_strides(sizes, n, strides);
        break;
    }
    case FAST_ALIAS:
        break;
    case FAST_T:
        if (ndim > 2)
            return 0;
        if (ndim == 2) {
            sizes[0] = a->sizes[1], sizes[1] = a->sizes[0];
            strides[0] = a->strides[1], strides[1] = a->strides[0];
        }
        break;
    case FAST_TRANSPOSE:
        if (ndim == 0 || !wrap_dim(ca->a, ndim, &d0) || !wrap_dim(ca->b, ndim, &d1))
            return 0;
        sizes[d0] = a->sizes[d1], sizes[d1] = a->sizes[d0];
        strides[d0] = a->strides[d1], strides[d1] = a->strides[d0];
        break;
    case FAST_PERMUTE: {
        unsigned seen = 0;
        if (ca->n_list != ndim)
            return 0;
        for (int d = 0; d < ndim; d++) {
            if (!wrap_dim(ca->list[d], ndim, &d0) || (seen >> d0) & 1u)
                return 0;
            seen |= 1u << d0;
            sizes[d] = a->sizes[d0];
            strides[d] = a->strides[d0];
        }
        break;
    }
    case FAST_UNSQUEEZE:
        if (ndim + 1 > FLAGOS_MAX_DIMS || !wrap_dim(ca->a, ndim + 1, &d0))
            return 0;
        n = ndim + 1;
        memmove(sizes + d0 + 1, sizes + d0, (size_t)(ndim - d0) * sizeof(int64_t));
        memmove(strides + d0 + 1, strides + d0, (size_t)(ndim - d0) * sizeof(int64_t));
        sizes[d0] = 1;
        strides[d0] = d0 >= ndim ? 1 : a->sizes[d0] * a->strides[d0];
        break;
    case FAST_EXPAND: /* inferExpandGeometry */
        n = ca->n_list;
        if (ndim == 0 || n < ndim)
            return 0;
        for (int i = n - 1; i >= 0; i--) {
            int dim = ndim - (n - i);
            int64_t size = dim >= 0 ? a->sizes[dim] : 1;
            int64_t stride = dim >= 0 ? a->strides[dim] : sizes[i + 1] * strides[i + 1];
            int64_t target = ca->list[i];
            if (target == -1) {
                if (dim < 0)
                    return 0;
                target = size;
            }
            if (target < 0 || (size != target && size != 1))
                return 0;
            if (size != target)
                stride = 0;
            sizes[i] = target;
            strides[i] = stride;
        }
        break;
    case FAST_SLICE: {
        if (ndim == 0 || ca->step <= 0 || !wrap_dim(ca->a, ndim, &d0))
            return 0;
        int64_t size = a->sizes[d0], start = ca->start, end = ca->end;
        if (start == INT64_MAX)
            start = 0;
        if (start < 0)
            start += size;
        if (end < 0)
            end += size;
        start = start < 0 ? 0 : start >= size ? size : start;
        end = end < start ? start : end >= size ? size : end;
        offset += start * a->strides[d0];
        sizes[d0] = (end - start) / ca->step + ((end - start) % ca->step != 0);
        if (__builtin_mul_overflow(a->strides[d0], ca->step, &strides[d0]))
            return 0;
        break;
    }
    case FAST_SELECT:
        if (ndim == 0 || !wrap_dim(ca->a, ndim, &d0) || ca->b < -a->sizes[d0] || ca->b >= a->sizes[d0])
            return 0;
        offset += (ca->b < 0 ? ca->b + a->sizes[d0] : ca->b) * a->strides[d0];
        remove_dim(sizes, ndim, d0);
        remove_dim(strides, ndim, d0);
        n = ndim - 1;
        break;
    default:
        return 0;
    }
    int64_t count = 1;
    for (int d = 0; d < n; d++)
        if (__builtin_mul_overflow(count, sizes[d], &count))
            return 0;
    if (count == 0)
        return 0; /* empty views: the runner's */
    *out = flagos_adapter_wrap(st, (PyObject *)a->buf,
                             kind == FAST_ALIAS || same_sizes(sizes, n, a->sizes, ndim) ? a->shape : NULL,
                             sizes, strides, n, offset, a->code, a->device);
    return *out == NULL ? -1 : 1;
}

/* ---- the entry --------------------------------------------------------------------- */

int flagos_adapter_fast_call(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                             PyObject **out)
{
    *out = NULL;
    if (st->fast_adapter == NULL)
        return 0;
    if (e->fast_generation != st->fast_generation)
        flagos_adapter_fast_resolve(st, e);
    int kind = e->fast_kind;
    call_args ca;
    if (kind == FAST_NONE || !parse_args(kind, args, kwargs, &ca))
        return 0;
    /* held: reading the operands runs Python code, which may configure another chip */
    PyObject *adapter = Py_NewRef(st->fast_adapter), *dtypes = Py_NewRef(st->fast_dtypes);
    /* views are metadata: any dtype; kernels: the floating ones */
    uint64_t codes = kind >= FAST_FIRST_VIEW ? ~(uint64_t)0 : FAST_DTYPES;
    operand ops[3];
    memset(ops, 0, sizeof(ops));
    int got = 0, rc = 1;
    for (; got < ca.n_tensors; got++) {
        if (ca.tensors[got] == NULL)
            continue; /* an absent optional tensor: no buffer */
        rc = read_operand(st, adapter, dtypes, ca.tensors[got], IS_ELEMENTWISE(kind), codes,
                          &ops[got]);
        if (rc <= 0)
            break;
    }
    if (got == ca.n_tensors && adapter == st->fast_adapter && dtypes == st->fast_dtypes)
        rc = kind >= FAST_FIRST_VIEW ? run_view(st, kind, &ops[0], &ca, out)
                                     : run(st, e, ops, &ca, ca.tensors[0], out);
    else if (rc > 0)
        rc = 0;
    for (int i = 0; i < got; i++)
        operand_release(&ops[i]);
    Py_DECREF(adapter);
    Py_DECREF(dtypes);
    return rc;
}
