/* flagos._C: module definition, configuration and the Python-visible entry points.
 *
 * The router's configuration lives in module state. The table it holds is
 * process-wide in effect (PyTorch's dispatcher is), but keeping it in module
 * state gives it one owner and one cleanup path.
 */
#include "router.h"
#include "state.h"
#include "adapter.h"
#include "adapter_fast.h"
#include "guard.h"
#include "payload.h"
#include "staging.h"

static flagos_state *flagos_get_state(PyObject *module)
{
    return (flagos_state *)PyModule_GetState(module);
}

static void state_clear_config(flagos_state *st)
{
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->device_type);
    Py_CLEAR(st->wrapper_type);
    Py_CLEAR(st->make_wrapper);
    Py_CLEAR(st->to_copy);
    Py_CLEAR(st->copy_);
    Py_CLEAR(st->host_device);
    Py_CLEAR(st->chip_devices);
    Py_CLEAR(st->flagos_devices);
    Py_CLEAR(st->describe);
    Py_CLEAR(st->resolve);
    Py_CLEAR(st->fallback_warning);
    Py_CLEAR(st->fallback_error);
    Py_CLEAR(st->device_mismatch);
    Py_CLEAR(st->skip_prefixes);
    Py_CLEAR(st->adapter_dispatch);
    Py_CLEAR(st->fast_adapter);
    Py_CLEAR(st->fast_dtypes);
    Py_CLEAR(st->fast_runner_ops);
    Py_CLEAR(st->fast_kernel_ops);
    Py_CLEAR(st->set_metadata);
    Py_CLEAR(st->math_call);
    Py_CLEAR(st->complex_dtypes);
    Py_CLEAR(st->downcast_from);
    Py_CLEAR(st->downcast_to);
    Py_CLEAR(st->downcast_device_type);
    Py_CLEAR(st->downcast_warning);
    Py_CLEAR(st->downcast_message);
    st->configured = 0;
}

/* ---- entry points ----------------------------------------------------- */

/* 1 when the op's overloaded types include a tensor subclass that is not flagos's and has a
 * __torch_dispatch__ of its own (a jagged nested tensor over flagos values, a subclass of the
 * program): PyTorch's protocol then has flagos answer NotImplemented, so that subclass handles
 * the op and calls flagos back with plain flagos tensors. The fake and functional tensors of a
 * compilation are not such: flagos routes them itself (payload.c). 0 otherwise, -1 on error. */
static int defers_to_another_subclass(flagos_state *st, PyObject *types)
{
    static PyObject *traced[2]; /* FakeTensor, FunctionalTensor: kept for the process */
    if (!st->device_mode)
        return 0;
    if (traced[1] == NULL) {
        const char *where[2][2] = {{"torch._subclasses.fake_tensor", "FakeTensor"},
                                   {"torch._subclasses.functional_tensor", "FunctionalTensor"}};
        for (int k = 0; k < 2; k++) {
            PyObject *mod = PyImport_ImportModule(where[k][0]);
            PyObject *cls = mod ? PyObject_GetAttrString(mod, where[k][1]) : NULL;
            Py_XDECREF(mod);
            if (cls == NULL) {
                Py_CLEAR(traced[0]);
                return -1;
            }
            traced[k] = cls;
        }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
        PyObject *tp = PyTuple_GET_ITEM(types, i);
        if (!PyType_Check(tp))
            continue;
        PyTypeObject *t = (PyTypeObject *)tp;
        if (!PyType_IsSubtype(t, (PyTypeObject *)st->wrapper_type) &&
            !PyType_IsSubtype(t, (PyTypeObject *)traced[0]) && !PyType_IsSubtype(t, (PyTypeObject *)traced[1]))
            return 1;
    }
    return 0;
}

/* FlagosTensor.__torch_dispatch__ (bound as a classmethod): (cls, func, types, args, kwargs) */
static PyObject *fl_dispatch(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc < 3 || argc > 5) {
        PyErr_SetString(PyExc_TypeError, "dispatch(cls, func, types, args=(), kwargs=None)");
        return NULL;
    }
    PyObject *args = argc > 3 ? argv[3] : NULL;
    PyObject *kwargs = argc > 4 ? argv[4] : NULL;
    PyObject *empty = NULL;
    if (args == NULL) {
        empty = PyTuple_New(0);
        if (empty == NULL)
            return NULL;
        args = empty;
    }
    if (!PyTuple_Check(args) || (kwargs != NULL && kwargs != Py_None && !PyDict_Check(kwargs))) {
        Py_XDECREF(empty);
        PyErr_SetString(PyExc_TypeError, "dispatch: args must be a tuple and kwargs a dict");
        return NULL;
    }
    PyObject *types = argv[2];
    if (PyTuple_Check(types) && PyTuple_GET_SIZE(types) > 1) {
        int other = defers_to_another_subclass(flagos_get_state(module), types);
        if (other != 0) {
            Py_XDECREF(empty);
            return other < 0 ? NULL : Py_NewRef(Py_NotImplemented);
        }
    }
    PyObject *r = flagos_route_call(flagos_get_state(module), argv[1], args, kwargs, 0);
    Py_XDECREF(empty);
    return r;
}

/* The native-mode dispatch mode calls this: (func, types, args, kwargs) */
static PyObject *fl_dispatch_native(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc != 4 || !PyTuple_Check(argv[2]) ||
        (argv[3] != Py_None && !PyDict_Check(argv[3]))) {
        PyErr_SetString(PyExc_TypeError, "dispatch_native(func, types, args: tuple, kwargs: dict)");
        return NULL;
    }
    return flagos_route_call(flagos_get_state(module), argv[0], argv[2], argv[3], 0);
}

/* PrivateUse1 boxed fallback: ops that reach the flagos key with no flagos tensor
 * argument, i.e. factories such as empty.memory_format with device="flagos". */
static PyObject *fl_dispatch_factory(PyObject *module, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) < 1) {
        PyErr_SetString(PyExc_TypeError, "dispatch_factory(op, *args, **kwargs)");
        return NULL;
    }
    PyObject *rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
    if (rest == NULL)
        return NULL;
    PyObject *r = flagos_route_call(flagos_get_state(module), PyTuple_GET_ITEM(args, 0), rest,
                                    kwargs, 1);
    Py_DECREF(rest);
    return r;
}

/* The floor of the mechanism, for benchmarks/dispatch_overhead.py: a wrapper subclass whose
 * __torch_dispatch__ is this function (cls, func, types, args, kwargs) unwraps the top-level
 * `_payload` of arguments of type cls, calls func._op, and wraps each tensor output (one, or
 * each item of a tuple: layer_norm's three) with _make_wrapper_subclass on the payload's
 * device; other outputs are returned as they are. No table, no routes, no checks: what any
 * C-dispatched wrapper pays. */
static PyObject *make_wrapper, *wrapper_kwnames; /* kept for the process */

/* A new reference: `out` wrapped in cls when it is a tensor, else `out` itself. */
static PyObject *floor_wrap(PyObject *cls, PyObject *out)
{
    if (!PyObject_HasAttr(out, fl_names.storage_offset))
        return Py_NewRef(out);
    PyObject *shape = PyObject_GetAttr(out, fl_names.shape);
    PyObject *stride = shape ? PyObject_CallMethodNoArgs(out, fl_names.stride) : NULL;
    PyObject *offset = stride ? PyObject_CallMethodNoArgs(out, fl_names.storage_offset) : NULL;
    PyObject *dtype = offset ? PyObject_GetAttr(out, fl_names.dtype) : NULL;
    PyObject *device = dtype ? PyObject_GetAttr(out, fl_names.device) : NULL;
    PyObject *w = NULL;
    if (device != NULL) {
        PyObject *wargv[6] = {cls, shape, stride, offset, dtype, device};
        w = PyObject_Vectorcall(make_wrapper, wargv, 2, wrapper_kwnames);
        if (w != NULL && PyObject_SetAttr(w, fl_names.payload, out) < 0)
            Py_CLEAR(w);
    }
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(offset);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    return w;
}

/* A new reference: an argument with its wrappers of type cls replaced by their payloads: the
 * argument itself, or the items of a list or tuple (cat's tensors, index's indices). */
static PyObject *floor_unwrap(PyObject *cls, PyObject *v)
{
    if (Py_TYPE(v) == (PyTypeObject *)cls)
        return PyObject_GetAttr(v, fl_names.payload);
    if (!PyTuple_Check(v) && !PyList_Check(v))
        return Py_NewRef(v);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    PyObject *u = PyTuple_Check(v) ? PyTuple_New(n) : PyList_New(n);
    for (Py_ssize_t i = 0; u != NULL && i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(v, i);
        PyObject *ui = Py_TYPE(item) == (PyTypeObject *)cls ? PyObject_GetAttr(item, fl_names.payload)
                                                            : Py_NewRef(item);
        if (ui == NULL) {
            Py_CLEAR(u);
        } else if (PyTuple_Check(u)) {
            PyTuple_SET_ITEM(u, i, ui);
        } else {
            PyList_SET_ITEM(u, i, ui);
        }
    }
    return u;
}

static PyObject *fl_floor_dispatch(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    (void)module;
    if (argc < 4 || !PyType_Check(argv[0]) || !PyTuple_Check(argv[3]) ||
        (argc > 4 && argv[4] != Py_None && !PyDict_Check(argv[4]))) {
        PyErr_SetString(PyExc_TypeError, "floor_dispatch(cls, func, types, args, kwargs=None)");
        return NULL;
    }
    if (make_wrapper == NULL) {
        PyObject *torch = PyImport_ImportModule("torch");
        PyObject *tensor = torch ? PyObject_GetAttrString(torch, "Tensor") : NULL;
        PyObject *mw = tensor ? PyObject_GetAttrString(tensor, "_make_wrapper_subclass") : NULL;
        PyObject *names = mw ? Py_BuildValue("(ssss)", "strides", "storage_offset", "dtype",
                                             "device") : NULL;
        Py_XDECREF(torch);
        Py_XDECREF(tensor);
        if (names == NULL) {
            Py_XDECREF(mw);
            return NULL;
        }
        make_wrapper = mw;
        wrapper_kwnames = names;
    }
    PyObject *cls = argv[0], *args = argv[3];
    PyObject *kwargs = argc > 4 && argv[4] != Py_None ? argv[4] : NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *uargs = PyTuple_New(n);
    for (Py_ssize_t i = 0; uargs != NULL && i < n; i++) {
        PyObject *u = floor_unwrap(cls, PyTuple_GET_ITEM(args, i));
        if (u == NULL)
            Py_CLEAR(uargs);
        else
            PyTuple_SET_ITEM(uargs, i, u);
    }
    PyObject *ukwargs = NULL;
    if (uargs != NULL && kwargs != NULL && (ukwargs = PyDict_New()) != NULL) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (ukwargs != NULL && PyDict_Next(kwargs, &pos, &key, &value)) {
            PyObject *u = floor_unwrap(cls, value);
            if (u == NULL || PyDict_SetItem(ukwargs, key, u) < 0)
                Py_CLEAR(ukwargs);
            Py_XDECREF(u);
        }
    }
    if (uargs == NULL || (kwargs != NULL && ukwargs == NULL)) {
        Py_XDECREF(uargs);
        return NULL;
    }
    /* func._op, as the router calls it: no Python frame of OpOverload.__call__ */
    PyObject *fn = PyObject_GetAttr(argv[1], fl_names.op);
    PyObject *out = fn != NULL ? PyObject_Call(fn, uargs, ukwargs) : NULL;
    Py_XDECREF(fn);
    Py_DECREF(uargs);
    Py_XDECREF(ukwargs);
    if (out == NULL || (!PyTuple_Check(out) && !PyList_Check(out))) {
        PyObject *w = out != NULL ? floor_wrap(cls, out) : NULL;
        Py_XDECREF(out);
        return w;
    }
    /* several outputs (layer_norm's three) or a list of them (split's): each wrapped */
    Py_ssize_t m = PySequence_Fast_GET_SIZE(out);
    PyObject *wrapped = PyTuple_Check(out) ? PyTuple_New(m) : PyList_New(m);
    for (Py_ssize_t i = 0; wrapped != NULL && i < m; i++) {
        PyObject *w = floor_wrap(cls, PySequence_Fast_GET_ITEM(out, i));
        if (w == NULL)
            Py_CLEAR(wrapped);
        else if (PyTuple_Check(wrapped))
            PyTuple_SET_ITEM(wrapped, i, w);
        else
            PyList_SET_ITEM(wrapped, i, w);
    }
    Py_DECREF(out);
    return wrapped;
}

/* wrap(payload, index=-1): the flagos tensor whose payload is `payload` (FlagosTensor's
 * __tensor_unflatten__ makes every output of a compiled graph with it). */
static PyObject *fl_wrap(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc < 1 || argc > 2 || (argc == 2 && !PyLong_Check(argv[1]))) {
        PyErr_SetString(PyExc_TypeError, "wrap(payload, index: int = -1)");
        return NULL;
    }
    flagos_state *st = flagos_get_state(module);
    if (flagos_check_configured(st) < 0)
        return NULL;
    long index = argc == 2 ? PyLong_AsLong(argv[1]) : -1;
    if (index == -1 && PyErr_Occurred())
        return NULL;
    if (index > INT_MAX) {
        PyErr_Format(PyExc_RuntimeError, "chip device %ld has no flagos device", index);
        return NULL;
    }
    return flagos_wrap_payload(st, argv[0], index < 0 ? -1 : (int)index);
}

/* The report's count of compiled-graph calls: each compiled flagos graph's generated code calls
 * count_compiled_call() once per call, so it costs a C call, not a Python frame and a lock (the
 * GIL orders the increments). compiled_calls(reset=False) reads it, and zeroes it when asked. */
static PyObject *fl_count_compiled_call(PyObject *module, PyObject *unused)
{
    (void)unused;
    flagos_get_state(module)->compiled_calls++;
    Py_RETURN_NONE;
}

static PyObject *fl_compiled_calls(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc > 1) {
        PyErr_SetString(PyExc_TypeError, "compiled_calls(reset=False)");
        return NULL;
    }
    int reset = argc == 1 ? PyObject_IsTrue(argv[0]) : 0;
    if (reset < 0)
        return NULL;
    flagos_state *st = flagos_get_state(module);
    PyObject *n = PyLong_FromUnsignedLongLong(st->compiled_calls);
    if (n != NULL && reset)
        st->compiled_calls = 0;
    return n;
}

/* ---- configuration ---------------------------------------------------- */

static PyObject *fl_configure(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"device_mode", "chip_is_host", "tensor_type",
                             "device_type", "wrapper_type", "make_wrapper", "to_copy",
                             "copy_", "host_device", "chip_devices", "flagos_devices",
                             "describe", "resolve", "fallback_warning", "fallback_error",
                             "device_mismatch", "skip_prefixes", "set_metadata", "adapter_dispatch", NULL};
    int device_mode = -1, chip_is_host = -1;
    PyObject *o[17] = {NULL}, *set_metadata = NULL, *adapter_dispatch = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$ppOOOOOOOO!O!OOOOOO!OO", kwlist,
                                     &device_mode, &chip_is_host, &o[0], &o[1], &o[2],
                                     &o[3], &o[4], &o[5], &o[6], &PyTuple_Type, &o[7],
                                     &PyTuple_Type, &o[8], &o[9], &o[10], &o[11], &o[12],
                                     &o[13], &PyTuple_Type, &o[14], &set_metadata, &adapter_dispatch))
        return NULL;
    for (int i = 0; i < 15; i++) {
        if (o[i] == NULL || set_metadata == NULL || device_mode < 0 || chip_is_host < 0) {
            PyErr_Format(PyExc_TypeError, "configure() needs every keyword but adapter_dispatch");
            return NULL;
        }
    }
    adapter_fast_spec fast;
    if (flagos_adapter_fast_parse(adapter_dispatch, &fast) < 0)
        return NULL;
    flagos_state *st = flagos_get_state(module);
    /* The new configuration is in place before the old one is dropped: dropping a reference
     * can run Python code, and an op routed by another thread meanwhile must find a whole
     * configuration. (The hooks set after configure() stay until they are set again.) */
    PyObject **slots[17] = {&st->tensor_type,     &st->device_type,    &st->wrapper_type,
                            &st->make_wrapper,    &st->to_copy,        &st->copy_,
                            &st->host_device,     &st->chip_devices,   &st->flagos_devices,
                            &st->describe,        &st->resolve,        &st->fallback_warning,
                            &st->fallback_error,  &st->device_mismatch, &st->skip_prefixes,
                            &st->set_metadata,    &st->adapter_dispatch};
    o[15] = set_metadata;
    o[16] = adapter_dispatch != Py_None ? adapter_dispatch : NULL;
    PyObject *old[17];
    for (int i = 0; i < 17; i++) {
        old[i] = *slots[i];
        *slots[i] = Py_XNewRef(o[i]);
    }
    PyObject *old_fast_adapter, *old_fast_dtypes, *old_runner_ops, *old_kernel_ops;
    flagos_adapter_fast_install(st, &fast, &old_fast_adapter, &old_fast_dtypes, &old_runner_ops,
                                &old_kernel_ops);
    st->device_mode = device_mode;
    st->chip_is_host = chip_is_host;
    st->device_epoch++; /* every thread back on flagos:0 (Python's side: a new Active) */
    st->configured = st->refusal == NULL; /* a refused forked child stays refused */
    flagos_table_clear(st);
    for (int i = 0; i < 17; i++)
        Py_XDECREF(old[i]);
    Py_XDECREF(old_fast_adapter);
    Py_XDECREF(old_fast_dtypes);
    Py_XDECREF(old_runner_ops);
    Py_XDECREF(old_kernel_ops);
    Py_RETURN_NONE;
}

static PyObject *fl_set_math_call(PyObject *module, PyObject *args)
{
    PyObject *fn, *dtypes;
    if (!PyArg_ParseTuple(args, "OO!:set_math_call", &fn, &PyTuple_Type, &dtypes))
        return NULL;
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_math_call(fn, complex_dtypes): fn must be callable");
        return NULL;
    }
    flagos_state *st = flagos_get_state(module);
    Py_XSETREF(st->math_call, Py_NewRef(fn));
    Py_XSETREF(st->complex_dtypes, Py_NewRef(dtypes));
    Py_RETURN_NONE;
}

/* set_downcast(from_dtype, to_dtype, device_type, warning, message) turns the downcast policy
 * on; set_downcast(None) turns it off (strict). The warning is given once per turning on. */
static PyObject *fl_set_downcast(PyObject *module, PyObject *args)
{
    PyObject *from, *to = NULL, *device_type = NULL, *warning = NULL, *message = NULL;
    if (!PyArg_ParseTuple(args, "O|OUOU:set_downcast", &from, &to, &device_type, &warning,
                          &message))
        return NULL;
    flagos_state *st = flagos_get_state(module);
    if (from == Py_None) {
        PyObject *old[5] = {st->downcast_from, st->downcast_to, st->downcast_device_type,
                            st->downcast_warning, st->downcast_message};
        st->downcast_from = st->downcast_to = st->downcast_device_type = NULL;
        st->downcast_warning = st->downcast_message = NULL;
        for (int i = 0; i < 5; i++)
            Py_XDECREF(old[i]);
        Py_RETURN_NONE;
    }
    if (message == NULL) {
        PyErr_SetString(PyExc_TypeError, "set_downcast(from_dtype, to_dtype, device_type, "
                                         "warning, message) or set_downcast(None)");
        return NULL;
    }
    if (st->downcast_from == NULL)
        st->downcast_warned = 0;
    /* The new values are in place before the old ones are dropped (see configure). */
    PyObject *old[5] = {st->downcast_from, st->downcast_to, st->downcast_device_type,
                        st->downcast_warning, st->downcast_message};
    st->downcast_to = Py_NewRef(to);
    st->downcast_device_type = Py_NewRef(device_type);
    st->downcast_warning = Py_NewRef(warning);
    st->downcast_message = Py_NewRef(message);
    st->downcast_from = Py_NewRef(from);
    for (int i = 0; i < 5; i++)
        Py_XDECREF(old[i]);
    Py_RETURN_NONE;
}

static PyObject *fl_set_fallback_policy(PyObject *module, PyObject *arg)
{
    long p = PyLong_AsLong(arg);
    if (p == -1 && PyErr_Occurred())
        return NULL;
    if (p < 0 || p > 2) {
        PyErr_SetString(PyExc_ValueError, "fallback policy is 0 (allow), 1 (warn) or 2 (error)");
        return NULL;
    }
    flagos_get_state(module)->fallback_policy = (int)p;
    Py_RETURN_NONE;
}

/* The calling thread's current device (torch.flagos.set_device): what "flagos" without an
 * index means. */
static PyObject *fl_set_current_device(PyObject *module, PyObject *arg)
{
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0 || i >= MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device index %ld is out of range", i);
        return NULL;
    }
    flagos_set_current_device(flagos_get_state(module), (int)i);
    Py_RETURN_NONE;
}

/* New calls see flagos inactive; a call still running keeps a whole configuration, which the
 * next configure() (or the module's end) releases. */
static PyObject *fl_deconfigure(PyObject *module, PyObject *Py_UNUSED(arg))
{
    flagos_state *st = flagos_get_state(module);
    st->configured = 0;
    flagos_table_clear(st);
    Py_RETURN_NONE;
}

/* A forked child of a process whose chip does not survive fork (an OpenCL driver's threads
 * stay in the parent): every call raises `message` instead of waiting on the driver forever,
 * and inherited buffers are dropped without calling the adapter. */
static PyObject *fl_refuse_forked_child(PyObject *module, PyObject *message)
{
    if (!PyUnicode_Check(message)) {
        PyErr_SetString(PyExc_TypeError, "refuse_forked_child(message: str)");
        return NULL;
    }
    flagos_state *st = flagos_get_state(module);
    Py_INCREF(message);
    Py_XSETREF(st->refusal, message);
    st->configured = 0;
    flagos_adapter_forget_buffers();
    Py_RETURN_NONE;
}

static PyObject *fl_invalidate(PyObject *module, PyObject *Py_UNUSED(arg))
{
    flagos_table_invalidate(flagos_get_state(module));
    Py_RETURN_NONE;
}

static PyObject *fl_table(PyObject *module, PyObject *Py_UNUSED(arg))
{
    return flagos_table_export(flagos_get_state(module), 0);
}

/* Zero the counters; routes, call sites and the once-per-op warnings stay. */
static PyObject *fl_reset_counters(PyObject *module, PyObject *Py_UNUSED(arg))
{
    flagos_state *st = flagos_get_state(module);
    op_entry *e, *tmp;
    HASH_ITER(hh, st->table, e, tmp) {
        memset(e->calls, 0, sizeof(e->calls));
        e->fallback_ns = e->bytes_to_host = e->bytes_to_device = e->dtype_mask = 0;
        e->downcast_calls = e->downcast_bytes = 0;
        e->flags &= ~(unsigned)OP_FALLBACK_SITE;
    }
    Py_RETURN_NONE;
}

static PyObject *fl_table_size(PyObject *module, PyObject *Py_UNUSED(arg))
{
    return PyLong_FromSize_t(HASH_COUNT(flagos_get_state(module)->table));
}

static PyMethodDef fl_methods[] = {
    {"dispatch", (PyCFunction)(void (*)(void))fl_dispatch, METH_FASTCALL,
     "__torch_dispatch__ of flagos tensors: route one aten op."},
    {"dispatch_native", (PyCFunction)(void (*)(void))fl_dispatch_native, METH_FASTCALL,
     "Route one aten op in native mode (called by the flagos dispatch mode)."},
    {"dispatch_factory", (PyCFunction)(void (*)(void))fl_dispatch_factory,
     METH_VARARGS | METH_KEYWORDS,
     "PrivateUse1 fallback: route an op that reached the flagos key without flagos tensors."},
    {"floor_dispatch", (PyCFunction)(void (*)(void))fl_floor_dispatch, METH_FASTCALL,
     "Benchmark floor: a __torch_dispatch__ that unwraps, calls and wraps each tensor output."},
    {"wrap", (PyCFunction)(void (*)(void))fl_wrap, METH_FASTCALL,
     "wrap(payload, index=-1): the flagos tensor whose payload is payload (no copy)."},
    {"count_compiled_call", fl_count_compiled_call, METH_NOARGS,
     "Count one call of a compiled flagos graph (its generated code calls this)."},
    {"compiled_calls", (PyCFunction)(void (*)(void))fl_compiled_calls, METH_FASTCALL,
     "compiled_calls(reset=False): the calls counted so far; reset zeroes the count after reading it."},
    {"configure", (PyCFunction)(void (*)(void))fl_configure, METH_VARARGS | METH_KEYWORDS,
     "Set the active chip's configuration; clears the dispatch table."},
    {"deconfigure", fl_deconfigure, METH_NOARGS, "Refuse new calls and clear the table."},
    {"refuse_forked_child", fl_refuse_forked_child, METH_O,
     "In a forked child whose chip does not survive fork: every call raises this message."},
    {"set_current_device", fl_set_current_device, METH_O,
     "The index that a flagos device without one stands for (the current device)."},
    {"set_fallback_policy", fl_set_fallback_policy, METH_O,
     "0 allow, 1 warn once per op, 2 raise before running."},
    {"set_math_call", fl_set_math_call, METH_VARARGS,
     "set_math_call(fn, complex_dtypes): how chip ops on complex tensors are called."},
    {"set_downcast", fl_set_downcast, METH_VARARGS,
     "set_downcast(from_dtype, to_dtype, device_type, warning, message), or set_downcast(None)."},
    {"invalidate", fl_invalidate, METH_NOARGS, "Resolve every op's route again on its next call."},
    {"table", fl_table, METH_NOARGS, "One dict per op seen: route, counters, call site."},
    {"reset_counters", fl_reset_counters, METH_NOARGS, "Zero every op's counters."},
    {"table_size", fl_table_size, METH_NOARGS, "Number of ops in the dispatch table."},
    {"load_adapter", flagos_load_adapter, METH_O,
     "load_adapter(path) -> Adapter: dlopen a chip adapter and check its ABI."},
    {"set_error_types", flagos_set_error_types, METH_VARARGS,
     "set_error_types(adapter_error, out_of_memory, device_error): what adapter failures raise."},
    {"staging_take", flagos_staging_take_py, METH_O,
     "staging_take(nbytes) -> a uint8 host tensor of at least nbytes from the fallback's pool."},
    {"staging_give", flagos_staging_give_py, METH_O,
     "staging_give(t): hand a staging_take tensor back once nothing else can see its memory."},
    {"staging_release", flagos_staging_release_py, METH_NOARGS,
     "Free every kept fallback staging buffer (the chip's empty_cache calls it)."},
    {"staging_stats", flagos_staging_stats_py, METH_NOARGS,
     "The staging pool: kept_bytes, kept_buffers, limit, hits, misses."},
    {NULL, NULL, 0, NULL},
};

/* ---- module lifecycle ------------------------------------------------- */

static int fl_traverse(PyObject *module, visitproc visit, void *arg)
{
    flagos_state *st = flagos_get_state(module);
    if (st == NULL)
        return 0;
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->device_type);
    Py_VISIT(st->wrapper_type);
    Py_VISIT(st->make_wrapper);
    Py_VISIT(st->to_copy);
    Py_VISIT(st->copy_);
    Py_VISIT(st->host_device);
    Py_VISIT(st->chip_devices);
    Py_VISIT(st->flagos_devices);
    Py_VISIT(st->describe);
    Py_VISIT(st->resolve);
    Py_VISIT(st->fallback_warning);
    Py_VISIT(st->fallback_error);
    Py_VISIT(st->device_mismatch);
    Py_VISIT(st->skip_prefixes);
    Py_VISIT(st->set_metadata);
    Py_VISIT(st->adapter_dispatch);
    Py_VISIT(st->fast_adapter);
    Py_VISIT(st->fast_dtypes);
    Py_VISIT(st->fast_runner_ops);
    Py_VISIT(st->fast_kernel_ops);
    Py_VISIT(st->math_call);
    Py_VISIT(st->complex_dtypes);
    Py_VISIT(st->downcast_from);
    Py_VISIT(st->downcast_to);
    Py_VISIT(st->downcast_device_type);
    Py_VISIT(st->downcast_warning);
    Py_VISIT(st->downcast_message);
    Py_VISIT(st->refusal);
    op_entry *e, *tmp;
    HASH_ITER(hh, st->table, e, tmp) {
        Py_VISIT(e->func);
        Py_VISIT(e->call);
        Py_VISIT(e->override);
    }
    return 0;
}

static int fl_clear(PyObject *module)
{
    flagos_state *st = flagos_get_state(module);
    if (st == NULL)
        return 0;
    flagos_table_clear(st);
    state_clear_config(st);
    Py_CLEAR(st->refusal);
    for (int i = 0; i < st->n_dtypes; i++)
        Py_CLEAR(st->dtypes[i]);
    st->n_dtypes = 0;
    flagos_adapter_types_clear();
    flagos_staging_clear();
    return 0;
}

static void fl_free(void *module)
{
    fl_clear((PyObject *)module);
}

static int fl_exec(PyObject *module)
{
    if (flagos_intern_names() < 0)
        return -1;
    flagos_state *st = flagos_get_state(module);
    memset(st, 0, sizeof(*st));
    st->fallback_policy = 1;
    if (PyModule_AddIntConstant(module, "ROUTE_OVERRIDE", ROUTE_OVERRIDE) < 0 ||
        PyModule_AddIntConstant(module, "ROUTE_NATIVE", ROUTE_NATIVE) < 0 ||
        PyModule_AddIntConstant(module, "ROUTE_FALLBACK", ROUTE_FALLBACK) < 0 ||
        PyModule_AddIntConstant(module, "ROUTE_ERROR", ROUTE_ERROR) < 0 ||
        PyModule_AddIntConstant(module, "OP_VIEW", OP_VIEW) < 0 ||
        PyModule_AddIntConstant(module, "STAGING_MIN_BYTES", (long)FLAGOS_STAGING_MIN_BYTES) < 0 ||
        PyModule_AddIntConstant(module, "OP_CROSS_DEVICE", OP_CROSS_DEVICE) < 0 ||
        PyModule_AddIntConstant(module, "OP_DEVICE_ARG", OP_DEVICE_ARG) < 0 ||
        PyModule_AddIntConstant(module, "OP_RELAYOUT", OP_RELAYOUT) < 0 ||
        PyModule_AddIntConstant(module, "OP_SPARSE", OP_SPARSE) < 0 ||
        PyModule_AddIntConstant(module, "OP_HOST_OUTPUT1", OP_HOST_OUTPUT1) < 0 ||
        PyModule_AddIntConstant(module, "OP_NESTED", OP_NESTED) < 0 ||
        PyModule_AddIntConstant(module, "OP_DTYPE_KW", OP_DTYPE_KW) < 0 ||
        PyModule_AddIntConstant(module, "OP_DECOMPOSES", OP_DECOMPOSES) < 0 ||
        PyModule_AddIntConstant(module, "OP_MATH_KEYS", OP_MATH_KEYS) < 0)
        return -1;
    if (flagos_adapter_types_ready(module) < 0 || flagos_guard_ready(module) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "WRAPPER_STORAGE_BYTES", (long)WRAPPER_STORAGE_BYTES) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot fl_slots[] = {
    {Py_mod_exec, fl_exec},
#ifdef Py_mod_gil
    /* The router's table and the adapter calls rely on the GIL: not free-threading safe. */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef fl_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "flagos._C",
    .m_doc = "flagos core: the per-op router, its dispatch table and the fallback report.",
    .m_size = sizeof(flagos_state),
    .m_methods = fl_methods,
    .m_slots = fl_slots,
    .m_traverse = fl_traverse,
    .m_clear = fl_clear,
    .m_free = fl_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&fl_module);
}
