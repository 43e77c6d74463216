/* Between flagos tensors and chip payloads: the unwrap of an op's arguments, the rewrap of its
 * results, the resync of written wrappers, the caller's own objects for written results, and the
 * call of a chip op on payloads. The router's native route and the CPU fallback both use these;
 * this unit calls neither of them.
 */
#include "payload.h"

/* ---- containers --------------------------------------------------------- */

PyObject *flagos_map_sequence(PyObject *seq, flagos_item_fn fn, void *ctx)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_Check(seq) ? PyList_New(n) : PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = fn(ctx, PySequence_Fast_ITEMS(seq)[i]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PySequence_Fast_ITEMS(out)[i] = item; /* steals item */
    }
    return out;
}

/* ---- devices and tensors ---------------------------------------------- */

int flagos_is_chip_tensor(flagos_state *st, PyObject *obj)
{
    if (st->device_mode)
        return Py_TYPE(obj) == (PyTypeObject *)st->wrapper_type ||
               PyObject_TypeCheck(obj, (PyTypeObject *)st->wrapper_type);
    if (!PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type))
        return 0;
    if (st->chip_is_host)
        return 1;
    PyObject *idx = PyObject_CallMethodNoArgs(obj, fl_names.get_device);
    if (idx == NULL) {
        PyErr_Clear();
        return 0;
    }
    long i = PyLong_AsLong(idx);
    Py_DECREF(idx);
    return i >= 0;
}

PyObject *flagos_payload(flagos_state *st, PyObject *obj)
{
    if (!st->device_mode)
        return Py_NewRef(obj);
    PyObject *p = PyObject_GetAttr(obj, fl_names.payload);
    if (p == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_RuntimeError,
                        "flagos tensor has no payload: it was created without flagos "
                        "(use tensor.to(flagos.device()) to make flagos tensors)");
    }
    return p;
}

/* flagos index of a torch.device of type "flagos", -1 for another device, -2 on error. */
static int flagos_device_index(flagos_state *st, PyObject *dev)
{
    if (!st->device_mode)
        return -1;
    PyObject *type = PyObject_GetAttr(dev, fl_names.type);
    if (type == NULL)
        return -2;
    int is_flagos = PyUnicode_CompareWithASCIIString(type, "flagos") == 0;
    Py_DECREF(type);
    if (!is_flagos)
        return -1;
    PyObject *index = PyObject_GetAttr(dev, fl_names.index);
    if (index == NULL)
        return -2;
    long i = index == Py_None ? flagos_current_device(st) : PyLong_AsLong(index);
    Py_DECREF(index);
    if (i == -1 && PyErr_Occurred())
        return -2;
    if (i < 0 || i >= PyTuple_GET_SIZE(st->chip_devices)) {
        PyErr_Format(PyExc_RuntimeError,
                     "flagos:%ld does not exist: the active chip has %zd device(s) "
                     "(see flagos.list_devices())",
                     i, PyTuple_GET_SIZE(st->chip_devices));
        return -2;
    }
    return (int)i;
}

static int target_of_value(flagos_state *st, PyObject *v)
{
    if (!PyObject_TypeCheck(v, (PyTypeObject *)st->device_type))
        return TARGET_FOLLOW;
    int i = flagos_device_index(st, v);
    if (i == -2)
        return TARGET_ERROR;
    return i >= 0 ? i : TARGET_HOST;
}

int flagos_find_target(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs)
{
    if (!(e->flags & OP_DEVICE_ARG))
        return TARGET_FOLLOW;
    if (kwargs != NULL) {
        PyObject *v = PyDict_GetItemWithError(kwargs, fl_names.device);
        if (v != NULL && v != Py_None)
            return target_of_value(st, v);
        if (PyErr_Occurred())
            return TARGET_ERROR;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        int t = target_of_value(st, PyTuple_GET_ITEM(args, i));
        if (t != TARGET_FOLLOW)
            return t;
    }
    return TARGET_FOLLOW;
}

/* ---- unwrap ----------------------------------------------------------- */

static PyObject *arg_name(op_entry *e, Py_ssize_t pos, PyObject *kwname)
{
    if (kwname != NULL)
        return kwname;
    if (pos >= 0 && pos < PyTuple_GET_SIZE(e->arg_names))
        return PyTuple_GET_ITEM(e->arg_names, pos);
    return NULL;
}

static int is_host_scalar(PyObject *t)
{
    /* PyTorch lets a 0-dim CPU tensor join an op on any device, as a scalar. */
    PyObject *dim = PyObject_CallMethodNoArgs(t, fl_names.dim);
    if (dim == NULL)
        return -1;
    long d = PyLong_AsLong(dim);
    Py_DECREF(dim);
    if (d != 0)
        return 0;
    PyObject *cpu = PyObject_GetAttr(t, fl_names.cpu);
    if (cpu == NULL)
        return -1;
    int r = PyObject_IsTrue(cpu);
    Py_DECREF(cpu);
    return r;
}

static int check_foreign_tensor(flagos_state *st, op_entry *e, PyObject *t, Py_ssize_t pos,
                                PyObject *kwname)
{
    if (e->flags & OP_CROSS_DEVICE)
        return 0;
    int scalar = is_host_scalar(t);
    if (scalar != 0)
        return scalar < 0 ? -1 : 0;
    PyObject *dev = PyObject_GetAttr(t, fl_names.device);
    if (dev == NULL)
        return -1;
    PyObject *name = arg_name(e, pos, kwname);
    PyErr_Format(st->device_mismatch,
                 "%U: argument '%S' is a tensor on %S, but the op runs on flagos; every "
                 "tensor argument must be on the same device. Move it with "
                 ".to(flagos.device()) (PyTorch only lets 0-dim CPU tensors mix in).",
                 e->name, name ? name : Py_None, dev);
    Py_DECREF(dev);
    return -1;
}

/* Index of a tensor on the flagos device that is not a flagos tensor, -1 for any other tensor,
 * -2 on error. A graph being traced by torch.compile makes such tensors: its factories
 * (`torch.arange(n, device=x.device)`) run on fake tensors, which carry the flagos device
 * without a payload. A plain torch.Tensor there was made outside flagos and holds no memory
 * (PyTorch's DLPack import of a capsule that torch._C._to_dlpack took of a flagos tensor):
 * copying it to the payload device would come back here without end. */
static int traced_flagos_index(flagos_state *st, PyObject *t)
{
    if (!st->device_mode)
        return -1;
    PyObject *dev = PyObject_GetAttr(t, fl_names.device);
    if (dev == NULL)
        return -2;
    int i = flagos_device_index(st, dev);
    if (i >= 0 && Py_TYPE(t) == (PyTypeObject *)st->tensor_type) {
        PyErr_Format(PyExc_RuntimeError,
                     "a tensor on %S that flagos did not make: it has no memory (PyTorch made "
                     "it from a DLPack capsule of a flagos tensor's wrapper, or from a raw "
                     "pointer). Export a flagos tensor with torch.utils.dlpack.to_dlpack(t) or "
                     "t.__dlpack__() (they export the chip's memory), and make flagos tensors "
                     "with .to(flagos.device()).", dev);
        i = -2;
    }
    Py_DECREF(dev);
    return i;
}

/* New reference: the traced tensor t copied to the payload device of flagos:index, a step
 * of the traced graph that Inductor compiles for the payload device (flagos/integrations/_compile.py). */
static PyObject *to_payload_device(flagos_state *st, PyObject *t, int index)
{
    PyObject *kw = Py_BuildValue("{s:O}", "device", PyTuple_GET_ITEM(st->chip_devices, index));
    if (kw == NULL)
        return NULL;
    PyObject *argv[1] = {t};
    PyObject *out = PyObject_VectorcallDict(st->to_copy, argv, 1, kw);
    Py_DECREF(kw);
    return out;
}

typedef struct unwrap_ctx {
    flagos_state *st;
    op_entry *e;
    Py_ssize_t pos;
    PyObject *kwname;
    int check;
} unwrap_ctx;

static PyObject *unwrap_value(flagos_state *st, op_entry *e, PyObject *v, Py_ssize_t pos,
                              PyObject *kwname, int check);

static PyObject *unwrap_item(void *ctx, PyObject *item)
{
    unwrap_ctx *c = ctx;
    return unwrap_value(c->st, c->e, item, c->pos, c->kwname, c->check);
}

/* New reference: v with flagos tensors replaced by payloads and flagos devices by chip devices. */
static PyObject *unwrap_value(flagos_state *st, op_entry *e, PyObject *v, Py_ssize_t pos,
                              PyObject *kwname, int check)
{
    PyTypeObject *tp = Py_TYPE(v);
    if (tp == (PyTypeObject *)st->wrapper_type)
        return flagos_payload(st, v);
    if (PyObject_TypeCheck(v, (PyTypeObject *)st->tensor_type)) {
        if (PyObject_TypeCheck(v, (PyTypeObject *)st->wrapper_type))
            return flagos_payload(st, v);
        int traced = traced_flagos_index(st, v);
        if (traced == -2)
            return NULL;
        if (traced >= 0)
            return to_payload_device(st, v, traced);
        if (check && check_foreign_tensor(st, e, v, pos, kwname) < 0)
            return NULL;
        return Py_NewRef(v);
    }
    if (tp == &PyList_Type || tp == &PyTuple_Type) {
        unwrap_ctx c = {st, e, pos, kwname, check};
        return flagos_map_sequence(v, unwrap_item, &c);
    }
    if ((e->flags & OP_DEVICE_ARG) && PyObject_TypeCheck(v, (PyTypeObject *)st->device_type)) {
        int i = flagos_device_index(st, v);
        if (i == -2)
            return NULL;
        if (i >= 0)
            return Py_NewRef(PyTuple_GET_ITEM(st->chip_devices, i));
    }
    return Py_NewRef(v);
}

int flagos_unwrap_call(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                       int check, PyObject **out_args, PyObject **out_kwargs)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *a = PyTuple_New(n);
    if (a == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *u = unwrap_value(st, e, PyTuple_GET_ITEM(args, i), i, NULL, check);
        if (u == NULL) {
            Py_DECREF(a);
            return -1;
        }
        PyTuple_SET_ITEM(a, i, u);
    }
    PyObject *k = NULL;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        k = PyDict_New();
        if (k == NULL)
            goto error;
        PyObject *key, *val;
        Py_ssize_t p = 0;
        while (PyDict_Next(kwargs, &p, &key, &val)) {
            PyObject *u = unwrap_value(st, e, val, -1, key, check);
            if (u == NULL)
                goto error;
            int rc = PyDict_SetItem(k, key, u);
            Py_DECREF(u);
            if (rc < 0)
                goto error;
        }
    }
    *out_args = a;
    *out_kwargs = k;
    return 0;
error:
    Py_DECREF(a);
    Py_XDECREF(k);
    return -1;
}

/* ---- rewrap ----------------------------------------------------------- */

/* The conjugate and negative bits say how to read a tensor's memory. PyTorch's fallbacks for
 * them sit above the Python key, so they act only if the wrapper carries the payload's bits:
 * a wrapper without them would hand a conjugate view to ops that ignore the bit. */
static int copy_math_bits(PyObject *w, PyObject *t, int complex)
{
    static PyObject *is_conj, *is_neg, *set_conj, *set_neg; /* kept for the process */
    if (set_neg == NULL) {
        PyObject *torch_c = PyImport_ImportModule("torch._C");
        if (torch_c == NULL)
            return -1;
        is_conj = PyUnicode_InternFromString("is_conj");
        is_neg = PyUnicode_InternFromString("is_neg");
        set_conj = PyObject_GetAttrString(torch_c, "_set_conj");
        set_neg = set_conj ? PyObject_GetAttrString(torch_c, "_set_neg") : NULL;
        Py_DECREF(torch_c);
        if (is_conj == NULL || is_neg == NULL || set_neg == NULL) {
            Py_CLEAR(set_conj);
            return -1;
        }
    }
    PyObject *names[2] = {is_conj, is_neg}, *setters[2] = {set_conj, set_neg};
    /* Only a complex tensor can carry the conjugate bit (conj() of a real tensor is itself);
     * the negative bit can be on any (imag() of a conjugate view). */
    for (int i = complex ? 0 : 1; i < 2; i++) {
        PyObject *bit = PyObject_CallMethodNoArgs(t, names[i]);
        if (bit == NULL)
            return -1;
        int on = bit == Py_True;
        Py_DECREF(bit);
        if (on) {
            PyObject *r = PyObject_CallFunctionObjArgs(setters[i], w, Py_True, NULL);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
        }
    }
    return 0;
}

/* 1 if stride is the contiguous stride of shape (every size at least 1, so no size-0 or size-1
 * ambiguity in what _make_wrapper_subclass would compute), 0 if not. Only plain ints are read:
 * a symbolic size (torch.SymInt) is never converted, which could specialize it while tracing. */
static int contiguous_strides(PyObject *shape, PyObject *stride)
{
    if (!PyTuple_Check(shape) || !PyTuple_Check(stride))
        return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(shape);
    if (PyTuple_GET_SIZE(stride) != n)
        return 0;
    long long expect = 1;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *size_obj = PyTuple_GET_ITEM(shape, i), *stride_obj = PyTuple_GET_ITEM(stride, i);
        if (!PyLong_CheckExact(size_obj) || !PyLong_CheckExact(stride_obj))
            return 0;
        int overflow = 0; /* an exact int cannot fail to convert, only overflow */
        long long size = PyLong_AsLongLongAndOverflow(size_obj, &overflow);
        if (overflow || size < 1 || size > (1LL << 62) / expect)
            return 0;
        long long got = PyLong_AsLongLongAndOverflow(stride_obj, &overflow);
        if (overflow || got != expect)
            return 0;
        expect *= size;
    }
    return 1;
}

/* _make_wrapper_subclass(cls, size, *, strides, storage_offset, dtype, device, storage_size):
 * a new wrapper on flagos:index with this metadata and no payload yet. A contiguous layout at
 * offset 0 (most outputs) leaves strides and storage_offset out: PyTorch computes the same
 * ones itself, and parsing two fewer keyword arguments saves time on every output. */
PyObject *flagos_new_wrapper(flagos_state *st, PyObject *shape, PyObject *stride, PyObject *offset,
                             PyObject *dtype, int index)
{
    /* built once, kept for the process: strings and a constant, nothing configure() changes */
    static PyObject *kwnames = NULL, *kwnames_contig = NULL, *storage_size = NULL;
    if (storage_size == NULL) {
        PyObject *names = Py_BuildValue("(sssss)", "strides", "storage_offset", "dtype", "device",
                                        "storage_size");
        PyObject *short_names = Py_BuildValue("(sss)", "dtype", "device", "storage_size");
        PyObject *size = PyLong_FromLongLong(WRAPPER_STORAGE_BYTES);
        if (names == NULL || short_names == NULL || size == NULL) {
            Py_XDECREF(names);
            Py_XDECREF(short_names);
            Py_XDECREF(size);
            return NULL;
        }
        kwnames = names;
        kwnames_contig = short_names;
        storage_size = size;
    }
    PyObject *device = PyTuple_GET_ITEM(st->flagos_devices, index);
    int overflow = 0; /* an exact int cannot fail to convert, only overflow */
    long long off = PyLong_CheckExact(offset) ? PyLong_AsLongLongAndOverflow(offset, &overflow) : -1;
    if (off == 0 && !overflow && contiguous_strides(shape, stride)) {
        PyObject *argv[5] = {st->wrapper_type, shape, dtype, device, storage_size};
        return PyObject_Vectorcall(st->make_wrapper, argv, 2, kwnames_contig);
    }
    PyObject *argv[7] = {st->wrapper_type, shape, stride, offset, dtype, device, storage_size};
    return PyObject_Vectorcall(st->make_wrapper, argv, 2, kwnames);
}

/* t.get_device() into *index (-1 for a host tensor); 0, or -1 with an error set. */
static int device_index(PyObject *t, int *index)
{
    PyObject *d = PyObject_CallMethodNoArgs(t, fl_names.get_device);
    if (d == NULL)
        return -1;
    long v = PyLong_AsLong(d);
    Py_DECREF(d);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *index = v < 0 ? -1 : (int)v;
    return 0;
}

static PyObject *wrap_tensor(flagos_state *st, PyObject *t, int target)
{
    int index = target;
    if (index < 0) {
        if (st->chip_is_host) {
            index = 0;
        } else {
            if (device_index(t, &index) < 0)
                return NULL;
            if (index < 0) /* the chip op gave a host tensor: hand it out as is */
                return Py_NewRef(t);
        }
    }
    if (index >= PyTuple_GET_SIZE(st->flagos_devices)) {
        PyErr_Format(PyExc_RuntimeError, "chip device %d has no flagos device", index);
        return NULL;
    }
    PyObject *shape = NULL, *stride = NULL, *offset = NULL, *dtype = NULL, *w = NULL;
    shape = PyObject_GetAttr(t, fl_names.shape);
    if (shape == NULL)
        goto done;
    stride = PyObject_CallMethodNoArgs(t, fl_names.stride);
    if (stride == NULL)
        goto done;
    offset = PyObject_CallMethodNoArgs(t, fl_names.storage_offset);
    if (offset == NULL)
        goto done;
    dtype = PyObject_GetAttr(t, fl_names.dtype);
    if (dtype == NULL)
        goto done;
    w = flagos_new_wrapper(st, shape, stride, offset, dtype, index);
    if (w == NULL)
        goto done;
    int complex = 0;
    if (st->complex_dtypes != NULL)
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->complex_dtypes); i++)
            complex |= dtype == PyTuple_GET_ITEM(st->complex_dtypes, i);
    else
        complex = 1; /* not told which dtypes are complex: ask the tensor */
    if (PyObject_SetAttr(w, fl_names.payload, t) < 0 || copy_math_bits(w, t, complex) < 0)
        Py_CLEAR(w);
done:
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(offset);
    Py_XDECREF(dtype);
    return w;
}

PyObject *flagos_wrap_payload(flagos_state *st, PyObject *t, int index)
{
    if (!PyObject_TypeCheck(t, (PyTypeObject *)st->tensor_type) ||
        PyObject_TypeCheck(t, (PyTypeObject *)st->wrapper_type)) {
        PyErr_Format(PyExc_TypeError, "wrap: expected a chip tensor, got %.200s",
                     Py_TYPE(t)->tp_name);
        return NULL;
    }
    if (index < 0) { /* the payload's device; a host tensor stands for flagos:0 */
        if (device_index(t, &index) < 0)
            return NULL;
        if (index < 0)
            index = 0;
    }
    PyObject *w = wrap_tensor(st, t, index);
    if (w == NULL)
        return NULL;
    /* a payload that requires grad (a traced one) gives a leaf wrapper that does too */
    PyObject *grad = PyObject_GetAttr(t, fl_names.requires_grad);
    if (grad == NULL) {
        Py_DECREF(w);
        return NULL;
    }
    int rc = grad == Py_True ? PyObject_SetAttr(w, fl_names.requires_grad, Py_True) : 0;
    Py_DECREF(grad);
    if (rc < 0)
        Py_CLEAR(w);
    return w;
}

typedef struct wrap_ctx {
    flagos_state *st;
    int target;
} wrap_ctx;

static PyObject *wrap_value(flagos_state *st, PyObject *v, int target);

static PyObject *wrap_item(void *ctx, PyObject *item)
{
    wrap_ctx *c = ctx;
    return wrap_value(c->st, item, c->target);
}

static PyObject *wrap_value(flagos_state *st, PyObject *v, int target)
{
    PyTypeObject *tp = Py_TYPE(v);
    if (tp == &PyTuple_Type || tp == &PyList_Type) {
        wrap_ctx c = {st, target};
        return flagos_map_sequence(v, wrap_item, &c);
    }
    if (PyObject_TypeCheck(v, (PyTypeObject *)st->tensor_type) &&
        !PyObject_TypeCheck(v, (PyTypeObject *)st->wrapper_type))
        return wrap_tensor(st, v, target);
    return Py_NewRef(v);
}

PyObject *flagos_wrap_outputs(flagos_state *st, op_entry *e, PyObject *out, PyObject *target)
{
    if (!st->device_mode || out == NULL)
        return out;
    int t = (int)PyLong_AsLong(target);
    if (t == TARGET_HOST)
        return out;
    PyObject *w = wrap_value(st, out, t);
    if (w != NULL && (e->flags & OP_HOST_OUTPUT1) && PyTuple_CheckExact(w) &&
        PyTuple_GET_SIZE(w) > 1 && PyTuple_CheckExact(out) && PyTuple_GET_SIZE(out) > 1) {
        /* w is the new tuple wrap_value made (a tuple of tensors is never returned as is) */
        PyObject *host = Py_NewRef(PyTuple_GET_ITEM(out, 1));
        Py_SETREF(PyTuple_GET_ITEM(w, 1), host);
    }
    Py_DECREF(out);
    return w;
}

/* Under torch.inference_mode(), a view of a normal tensor is a normal tensor: autograd gives
 * it the base's version counter, which an inference tensor cannot take. The wrapper of such
 * a view is therefore made with inference mode off. */
PyObject *flagos_view_guard(flagos_state *st, PyObject *args)
{
    static PyObject *enabled_fn, *mode_type, *is_inference; /* kept for the process */
    if (mode_type == NULL) {
        PyObject *torch_c = PyImport_ImportModule("torch._C");
        if (torch_c == NULL)
            return NULL;
        enabled_fn = PyObject_GetAttrString(torch_c, "is_inference_mode_enabled");
        mode_type = enabled_fn ? PyObject_GetAttrString(torch_c, "_InferenceMode") : NULL;
        Py_DECREF(torch_c);
        is_inference = PyUnicode_InternFromString("is_inference");
        if (mode_type == NULL || is_inference == NULL) {
            Py_CLEAR(enabled_fn);
            Py_CLEAR(mode_type);
            return NULL;
        }
    }
    PyObject *on = PyObject_CallNoArgs(enabled_fn);
    if (on == NULL)
        return NULL;
    int inference = on == Py_True;
    Py_DECREF(on);
    PyObject *base = PyTuple_GET_SIZE(args) > 0 ? PyTuple_GET_ITEM(args, 0) : NULL;
    if (!inference || base == NULL || !PyObject_TypeCheck(base, (PyTypeObject *)st->tensor_type))
        Py_RETURN_NONE;
    PyObject *base_inf = PyObject_CallMethodNoArgs(base, is_inference);
    if (base_inf == NULL)
        return NULL;
    inference = base_inf == Py_True;
    Py_DECREF(base_inf);
    if (inference)
        Py_RETURN_NONE;
    PyObject *guard = PyObject_CallOneArg(mode_type, Py_False);
    if (guard == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethod(guard, "__enter__", NULL);
    if (r == NULL) {
        Py_DECREF(guard);
        return NULL;
    }
    Py_DECREF(r);
    return guard;
}

PyObject *flagos_leave_guard(PyObject *guard, PyObject *result)
{
    if (guard == Py_None) {
        Py_DECREF(guard);
        return result;
    }
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *r = PyObject_CallMethod(guard, "__exit__", "OOO", Py_None, Py_None, Py_None);
    Py_DECREF(guard);
    if (exc_type != NULL) { /* the first error wins */
        Py_XDECREF(r);
        PyErr_Restore(exc_type, exc_value, exc_tb);
        return result;
    }
    if (r == NULL) {
        Py_XDECREF(result);
        return NULL;
    }
    Py_DECREF(r);
    return result;
}

PyObject *flagos_wrap_view_outputs(flagos_state *st, op_entry *e, PyObject *out, PyObject *target,
                                   PyObject *args)
{
    if (out == NULL)
        return NULL;
    PyObject *guard = flagos_view_guard(st, args);
    if (guard == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    return flagos_leave_guard(guard, flagos_wrap_outputs(st, e, out, target));
}

/* ---- written arguments ------------------------------------------------- */

PyObject *flagos_argument_value(op_entry *e, PyObject *args, PyObject *kwargs, Py_ssize_t i)
{
    if (i < PyTuple_GET_SIZE(args))
        return PyTuple_GET_ITEM(args, i);
    if (kwargs == NULL || i >= PyTuple_GET_SIZE(e->arg_names))
        return NULL;
    return PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(e->arg_names, i));
}

/* An op that wrote a flagos tensor may have changed its payload's view (out= resizes,
 * unsqueeze_, t_, as_strided_): make the wrapper say the same. */
static int sync_one(flagos_state *st, PyObject *w)
{
    if (!PyObject_TypeCheck(w, (PyTypeObject *)st->wrapper_type))
        return 0;
    PyObject *p = flagos_payload(st, w);
    if (p == NULL)
        return -1;
    int rc = -1, same = 0;
    PyObject *ws = NULL, *ps = NULL, *wst = NULL, *pst = NULL, *po = NULL, *wo = NULL;
    if (!PyObject_TypeCheck(p, (PyTypeObject *)st->tensor_type)) {
        rc = 0; /* adapter buffers: the adapter runner keeps wrappers in sync itself */
        goto done;
    }
    if ((ws = PyObject_GetAttr(w, fl_names.shape)) == NULL ||
        (ps = PyObject_GetAttr(p, fl_names.shape)) == NULL ||
        (wst = PyObject_CallMethodNoArgs(w, fl_names.stride)) == NULL ||
        (pst = PyObject_CallMethodNoArgs(p, fl_names.stride)) == NULL ||
        (wo = PyObject_CallMethodNoArgs(w, fl_names.storage_offset)) == NULL ||
        (po = PyObject_CallMethodNoArgs(p, fl_names.storage_offset)) == NULL)
        goto done;
    same = PyObject_RichCompareBool(ws, ps, Py_EQ);
    if (same == 1)
        same = PyObject_RichCompareBool(wst, pst, Py_EQ);
    if (same == 1)
        same = PyObject_RichCompareBool(wo, po, Py_EQ);
    if (same < 0)
        goto done;
    if (!same) {
        PyObject *r = PyObject_CallFunctionObjArgs(st->set_metadata, w, ps, pst, po, NULL);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    rc = 0;
done:
    Py_DECREF(p);
    Py_XDECREF(ws);
    Py_XDECREF(ps);
    Py_XDECREF(wst);
    Py_XDECREF(pst);
    Py_XDECREF(wo);
    Py_XDECREF(po);
    return rc;
}

int flagos_sync_written(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs)
{
    for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(e->write_args); w++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->write_args, w));
        PyObject *v = flagos_argument_value(e, args, kwargs, i);
        if (v == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        if (PyList_Check(v) || PyTuple_Check(v)) {
            for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(v); k++)
                if (sync_one(st, PySequence_Fast_ITEMS(v)[k]) < 0)
                    return -1;
        } else if (sync_one(st, v) < 0) {
            return -1;
        }
    }
    return 0;
}

PyObject *flagos_alias_outputs(op_entry *e, PyObject *args, PyObject *kwargs, PyObject *out)
{
    Py_ssize_t nret = PyTuple_GET_SIZE(e->return_alias);
    if (nret == 1) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->return_alias, 0));
        PyObject *orig = i >= 0 ? flagos_argument_value(e, args, kwargs, i) : NULL;
        if (orig == NULL || PyErr_Occurred()) {
            PyErr_Clear();
            return out;
        }
        Py_DECREF(out);
        return Py_NewRef(orig);
    }
    if (!PyTuple_Check(out) || PyTuple_GET_SIZE(out) != nret)
        return out;
    PyObject *res = PyTuple_New(nret);
    if (res == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    for (Py_ssize_t r = 0; r < nret; r++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->return_alias, r));
        PyObject *orig = i >= 0 ? flagos_argument_value(e, args, kwargs, i) : NULL;
        if (orig == NULL) {
            PyErr_Clear();
            orig = PyTuple_GET_ITEM(out, r);
        }
        PyTuple_SET_ITEM(res, r, Py_NewRef(orig));
    }
    Py_DECREF(out);
    return res;
}

/* ---- the call on payloads ---------------------------------------------- */

/* The entry's callables are held for the call: a route change inside it (an override that
 * calls set_route) must not free the function that is running. */
static PyObject *call_with(PyObject *fn, PyObject *args, PyObject *kwargs)
{
    Py_INCREF(fn);
    PyObject *r = PyObject_Call(fn, args, kwargs);
    Py_DECREF(fn);
    return r;
}

/* 1 if a tensor argument (top level, or in a list) is complex, 0 if none, -1 on error. */
static int is_complex_tensor(flagos_state *st, PyObject *v)
{
    if (!PyObject_TypeCheck(v, (PyTypeObject *)st->tensor_type))
        return 0;
    PyObject *dtype = PyObject_GetAttr(v, fl_names.dtype);
    if (dtype == NULL)
        return -1;
    int found = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->complex_dtypes); i++)
        found |= dtype == PyTuple_GET_ITEM(st->complex_dtypes, i);
    Py_DECREF(dtype);
    return found;
}

static int any_complex(flagos_state *st, PyObject *args, PyObject *kwargs)
{
    PyObject *vals = kwargs ? PyDict_Values(kwargs) : NULL;
    if (kwargs && vals == NULL)
        return -1;
    PyObject *groups[2] = {args, vals};
    int found = 0;
    for (int g = 0; g < 2 && !found && groups[g] != NULL; g++) {
        PyObject *seq = groups[g];
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && !found; i++) {
            PyObject *v = PySequence_Fast_ITEMS(seq)[i];
            if (PyList_Check(v) || PyTuple_Check(v)) {
                for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(v) && !found; k++)
                    found = is_complex_tensor(st, PySequence_Fast_ITEMS(v)[k]);
            } else {
                found = is_complex_tensor(st, v);
            }
            if (found < 0)
                break;
        }
    }
    Py_XDECREF(vals);
    return found;
}

/* Inside __torch_dispatch__ PyTorch excludes every key above Python, the conjugate and negative
 * fallbacks too; a composite op on complex payloads (pinv, lstsq) makes conjugate views inside
 * and needs them, so those calls re-enable them. So do decompositions that can make complex
 * intermediates of real inputs (OP_MATH_KEYS), which reach the router whole under inference
 * mode. */
PyObject *flagos_call_payload(flagos_state *st, const op_entry *e, PyObject *fn, PyObject *args,
                              PyObject *kwargs)
{
    if (st->math_call != NULL) {
        int c = (e->flags & OP_MATH_KEYS) ? 1 : any_complex(st, args, kwargs);
        if (c < 0)
            return NULL;
        if (c)
            return PyObject_CallFunctionObjArgs(st->math_call, fn, args,
                                                kwargs ? kwargs : Py_None, NULL);
    }
    return call_with(fn, args, kwargs);
}
