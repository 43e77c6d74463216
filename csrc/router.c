/* The per-op hot path: table lookup, route, unwrap, call, count, rewrap.
 *
 * Every aten op on a flagos tensor (device mode) or on any tensor while native
 * mode is active enters flagos_route_call(). The schema facts and the route of
 * an op are computed once, in Python, the first time the op is seen; after
 * that a call costs one hash lookup plus the unwrap/rewrap of its arguments.
 */
#include "router.h"

flagos_names fl_names;

static const char *const route_names[N_ROUTES] = {"override", "native", "fallback", "error"};

/* ---- table ------------------------------------------------------------ */

static void entry_free(op_entry *e)
{
    Py_XDECREF(e->func);
    Py_XDECREF(e->call);
    Py_XDECREF(e->name);
    Py_XDECREF(e->arg_names);
    Py_XDECREF(e->write_args);
    Py_XDECREF(e->return_alias);
    Py_XDECREF(e->override);
    Py_XDECREF(e->site);
    PyMem_Free(e);
}

/* A call (or an export) keeps its entry alive while it runs Python code. */
static void entry_hold(op_entry *e)
{
    e->users++;
}

static void entry_release(op_entry *e)
{
    if (--e->users == 0 && e->detached)
        entry_free(e);
}

/* Freeing an entry drops references, which can run Python code and switch threads: the
 * table is emptied first, without running any, and the entries are freed after, each one by
 * this function or, if a call is running with it, by that call when it ends. */
void flagos_table_clear(flagos_state *st)
{
    st->routes_generation++;
    op_entry *e, *tmp, *cleared = NULL;
    HASH_ITER(hh, st->table, e, tmp) {
        e->next_cleared = cleared;
        cleared = e;
    }
    HASH_CLEAR(hh, st->table);
    while (cleared != NULL) {
        e = cleared;
        cleared = e->next_cleared;
        if (e->users > 0)
            e->detached = 1;
        else
            entry_free(e);
    }
}

/* Routes changed (set_route, a new override, a new chip): resolve again on next call.
 * Entries stay where they are; the overrides they held are dropped once the loop is done
 * (dropping one can run Python code, which may change the table). */
void flagos_table_invalidate(flagos_state *st)
{
    st->routes_generation++;
    PyObject *dropped = PyList_New(0); /* NULL: keep the overrides, the next resolve replaces them */
    if (dropped == NULL)
        PyErr_Clear();
    op_entry *e, *tmp;
    HASH_ITER(hh, st->table, e, tmp) {
        e->route = ROUTE_UNRESOLVED; /* OP_NOT_IMPLEMENTED stays: the chip still lacks it */
        if (e->override != NULL && dropped != NULL) {
            if (PyList_Append(dropped, e->override) == 0)
                Py_CLEAR(e->override); /* the list holds it: nothing is freed here */
            else
                PyErr_Clear();
        }
    }
    Py_XDECREF(dropped);
}

/* describe(func) -> (name, arg_names, write_args, return_alias, flags) */
static op_entry *entry_create(flagos_state *st, PyObject *func)
{
    PyObject *facts = PyObject_CallOneArg(st->describe, func);
    if (facts == NULL)
        return NULL;
    op_entry *e = PyMem_Calloc(1, sizeof(*e));
    if (e == NULL) {
        Py_DECREF(facts);
        PyErr_NoMemory();
        return NULL;
    }
    unsigned int flags = 0;
    if (!PyArg_ParseTuple(facts, "UO!O!O!I", &e->name, &PyTuple_Type, &e->arg_names,
                          &PyTuple_Type, &e->write_args, &PyTuple_Type, &e->return_alias,
                          &flags)) {
        Py_DECREF(facts);
        PyMem_Free(e);
        return NULL;
    }
    Py_INCREF(e->name);
    Py_INCREF(e->arg_names);
    Py_INCREF(e->write_args);
    Py_INCREF(e->return_alias);
    Py_DECREF(facts);
    e->flags = flags;
    e->route = ROUTE_UNRESOLVED;
    e->func = Py_NewRef(func);
    e->call = PyObject_GetAttr(func, fl_names.op);
    if (e->call == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            entry_free(e);
            return NULL;
        }
        PyErr_Clear(); /* not an OpOverload (a test double or a HOP): call it as is */
        e->call = Py_NewRef(func);
    }
    e->site = flagos_user_call_site(st);
    if (e->site == NULL) {
        entry_free(e);
        return NULL;
    }
    /* The Python calls above can switch threads: another thread may have added this op
     * meanwhile, and one op must have one row (one set of counters, one warning). */
    op_entry *existing;
    HASH_FIND_PTR(st->table, &func, existing);
    if (existing != NULL) {
        entry_free(e);
        return existing;
    }
    HASH_ADD_PTR(st->table, func, e);
    return e;
}

/* The route of this call, and in *override a new reference to its override kernel (NULL
 * when none): the entry's cached answer, or the resolver's. The resolver is Python and may
 * let another thread change the routes meanwhile; its answer is then used for this call
 * only, so a change made during the call is not overwritten by the answer from before it. */
static int entry_route(flagos_state *st, op_entry *e, PyObject **override)
{
    if (e->route != ROUTE_UNRESOLVED) {
        *override = Py_XNewRef(e->override);
        return e->route;
    }
    uint64_t generation = st->routes_generation;
    PyObject *res = PyObject_CallOneArg(st->resolve, e->name);
    if (res == NULL)
        return -1;
    int route;
    PyObject *kernel;
    if (!PyArg_ParseTuple(res, "iO", &route, &kernel)) {
        Py_DECREF(res);
        return -1;
    }
    if (route < 0 || route >= N_ROUTES || (route == ROUTE_OVERRIDE && kernel == Py_None)) {
        Py_DECREF(res);
        PyErr_Format(PyExc_ValueError, "resolver returned route %d%s for %U", route,
                     route == ROUTE_OVERRIDE ? " without a kernel" : "", e->name);
        return -1;
    }
    /* Views are metadata over the same memory: a host round trip would break aliasing. */
    if ((e->flags & OP_VIEW) && route == ROUTE_FALLBACK)
        route = ROUTE_NATIVE;
    if (e->flags & OP_NOT_IMPLEMENTED && route == ROUTE_NATIVE)
        route = ROUTE_FALLBACK;
    *override = kernel == Py_None ? NULL : Py_NewRef(kernel);
    Py_DECREF(res);
    if (st->routes_generation == generation && e->route == ROUTE_UNRESOLVED) {
        PyObject *previous = e->override;
        e->override = Py_XNewRef(*override);
        e->route = route;
        Py_XDECREF(previous);
    }
    return route;
}

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

/* New reference to the chip tensor behind obj (itself in native mode). */
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
    long i = index == Py_None ? 0 : PyLong_AsLong(index);
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

/* The device the op's outputs go to, from its Device argument:
 * >= 0 a flagos index, -1 none given (follow the inputs), -2 a non-flagos device,
 * -3 on error. */
#define TARGET_FOLLOW (-1)
#define TARGET_HOST (-2)
#define TARGET_ERROR (-3)

static int target_of_value(flagos_state *st, PyObject *v)
{
    if (!PyObject_TypeCheck(v, (PyTypeObject *)st->device_type))
        return TARGET_FOLLOW;
    int i = flagos_device_index(st, v);
    if (i == -2)
        return TARGET_ERROR;
    return i >= 0 ? i : TARGET_HOST;
}

static int find_target(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs)
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
 * -2 on error. Only a graph being traced by torch.compile makes such tensors: its factories
 * (`torch.arange(n, device=x.device)`) run on fake tensors, which carry the flagos device
 * without a payload. */
static int traced_flagos_index(flagos_state *st, PyObject *t)
{
    if (!st->device_mode)
        return -1;
    PyObject *dev = PyObject_GetAttr(t, fl_names.device);
    if (dev == NULL)
        return -2;
    int i = flagos_device_index(st, dev);
    Py_DECREF(dev);
    return i;
}

/* New reference: the traced tensor t copied to the payload device of flagos:index, a step
 * of the traced graph that Inductor compiles for the payload device (flagos/_compile.py). */
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

static int unwrap_call(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
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
static int copy_math_bits(PyObject *w, PyObject *t)
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
    for (int i = 0; i < 2; i++) {
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

static PyObject *wrap_tensor(flagos_state *st, PyObject *t, int target)
{
    int index = target;
    if (index < 0) {
        if (st->chip_is_host) {
            index = 0;
        } else {
            PyObject *d = PyObject_CallMethodNoArgs(t, fl_names.get_device);
            if (d == NULL)
                return NULL;
            long v = PyLong_AsLong(d);
            Py_DECREF(d);
            if (v == -1 && PyErr_Occurred())
                return NULL;
            index = (int)v;
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
    /* _make_wrapper_subclass(cls, size, *, strides, storage_offset, dtype, device, storage_size) */
    static PyObject *kwnames = NULL, *storage_size = NULL; /* built once, kept for the process */
    if (kwnames == NULL) {
        PyObject *names = Py_BuildValue("(sssss)", "strides", "storage_offset", "dtype", "device",
                                        "storage_size");
        PyObject *size = PyLong_FromLongLong(WRAPPER_STORAGE_BYTES);
        if (names == NULL || size == NULL) {
            Py_XDECREF(names);
            Py_XDECREF(size);
            goto done;
        }
        kwnames = names;
        storage_size = size;
    }
    PyObject *argv[7] = {st->wrapper_type, shape, stride, offset, dtype,
                         PyTuple_GET_ITEM(st->flagos_devices, index), storage_size};
    w = PyObject_Vectorcall(st->make_wrapper, argv, 2, kwnames);
    if (w == NULL)
        goto done;
    if (PyObject_SetAttr(w, fl_names.payload, t) < 0 || copy_math_bits(w, t) < 0)
        Py_CLEAR(w);
done:
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(offset);
    Py_XDECREF(dtype);
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

/* New reference: the op's result as the caller must see it. out is stolen.
 * target: a PyLong holding a flagos index, TARGET_FOLLOW or TARGET_HOST. */
PyObject *flagos_wrap_outputs(flagos_state *st, op_entry *e, PyObject *out, PyObject *target)
{
    (void)e;
    if (!st->device_mode || out == NULL)
        return out;
    int t = (int)PyLong_AsLong(target);
    if (t == TARGET_HOST)
        return out;
    PyObject *w = wrap_value(st, out, t);
    Py_DECREF(out);
    return w;
}

/* Under torch.inference_mode(), a view of a normal tensor is a normal tensor: autograd gives
 * it the base's version counter, which an inference tensor cannot take. The wrapper of such
 * a view is therefore made with inference mode off.
 * Returns a new reference to an entered torch._C._InferenceMode(False) when that is needed,
 * Py_None (new reference) when not, NULL on error. */
static PyObject *normal_view_guard(flagos_state *st, PyObject *args)
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

/* Leave the guard (stolen); result is returned, or NULL if it or the exit failed. */
static PyObject *leave_guard(PyObject *guard, PyObject *result)
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

static PyObject *wrap_view_outputs(flagos_state *st, op_entry *e, PyObject *out, PyObject *target,
                                   PyObject *args)
{
    if (out == NULL)
        return NULL;
    PyObject *guard = normal_view_guard(st, args);
    if (guard == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    return leave_guard(guard, flagos_wrap_outputs(st, e, out, target));
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

static PyObject *argument_value(op_entry *e, PyObject *args, PyObject *kwargs, Py_ssize_t i);

int flagos_sync_written(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs)
{
    for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(e->write_args); w++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->write_args, w));
        PyObject *v = argument_value(e, args, kwargs, i);
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

/* In-place and out= ops return the tensor they wrote: hand back the caller's own object,
 * so identity (and autograd's view/version bookkeeping on it) is kept. */
static PyObject *alias_outputs(op_entry *e, PyObject *args, PyObject *kwargs, PyObject *out);

/* ---- the entry point -------------------------------------------------- */

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

/* Call a chip op on payloads. Inside __torch_dispatch__ PyTorch excludes every key above
 * Python, the conjugate and negative fallbacks too; a composite op on complex payloads
 * (pinv, lstsq) makes conjugate views inside and needs them, so those calls re-enable them. */
PyObject *flagos_call_payload(flagos_state *st, PyObject *fn, PyObject *args, PyObject *kwargs)
{
    if (st->math_call != NULL) {
        int c = any_complex(st, args, kwargs);
        if (c < 0)
            return NULL;
        if (c)
            return PyObject_CallFunctionObjArgs(st->math_call, fn, args,
                                                kwargs ? kwargs : Py_None, NULL);
    }
    return call_with(fn, args, kwargs);
}

static int raise_route_error(flagos_state *st, op_entry *e)
{
    PyErr_Format(st->fallback_error,
                 "%U is routed to 'error' on this chip (FLAGOS_ROUTE or flagos.set_route); "
                 "route it to 'native' or 'fallback' to run it.",
                 e->name);
    return -1;
}

static int check_policy(flagos_state *st, op_entry *e)
{
    if (st->fallback_policy == 2) {
        PyErr_Format(st->fallback_error,
                     "%U would fall back to the CPU, and FLAGOS_FALLBACK=error forbids it. "
                     "Set FLAGOS_FALLBACK=warn (or allow), or register an override kernel "
                     "with flagos.register_kernel(\"%U\", fn).",
                     e->name, e->name);
        return -1;
    }
    if (st->fallback_policy == 1 && !(e->flags & OP_WARNED)) {
        e->flags |= OP_WARNED;
        if (PyErr_WarnFormat(st->fallback_warning, 1,
                             "%U falls back to the CPU on this chip (each call copies its "
                             "tensors to the host and back); see flagos.fallback_report(). "
                             "Silence with FLAGOS_FALLBACK=allow.",
                             e->name) < 0)
            return -1;
    }
    return 0;
}

static int note_fallback(flagos_state *st, op_entry *e)
{
    if (!(e->flags & OP_FALLBACK_SITE)) {
        /* The report's call site of a fallback op is where it first fell back. */
        PyObject *site = flagos_user_call_site(st);
        if (site == NULL)
            return -1;
        Py_XSETREF(e->site, site);
        e->flags |= OP_FALLBACK_SITE;
    }
    return 0;
}

/* C-ABI chips: the payload is an adapter buffer, and the Python runner (flagos/_adapter_ops.py)
 * marshals the op for the adapter's kernel or the host round trip. It returns
 * (result, route taken, bytes to host, bytes to device, fallback ns, dtypes); the table,
 * the counters and the warnings stay here. */
static PyObject *route_adapter(flagos_state *st, PyObject *runner, op_entry *e, PyObject *func,
                               PyObject *args, PyObject *kwargs, int route, int from_factory)
{
    PyObject *uargs = NULL, *ukwargs = NULL;
    if (!from_factory) {
        if (unwrap_call(st, e, args, kwargs, 1, &uargs, &ukwargs) < 0)
            return NULL;
        Py_DECREF(uargs);
        Py_XDECREF(ukwargs);
    }
    /* The runner stops short of a fallback while a policy still has to act (warn not yet
     * given, or error), so the warning or the error comes before anything ran. */
    int policy = st->fallback_policy == 1 && (e->flags & OP_WARNED) ? 0 : st->fallback_policy;
    PyObject *res;
    for (;;) {
        res = PyObject_CallFunction(runner, "OOiiIOO", func, e->name, route, policy, e->flags,
                                    args, kwargs ? kwargs : Py_None);
        if (res == NULL)
            return NULL;
        if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 6 ||
            PyLong_AsLong(PyTuple_GET_ITEM(res, 1)) != ROUTE_ERROR)
            break;
        Py_DECREF(res);
        if (policy == 0) {
            PyErr_SetString(PyExc_RuntimeError, "adapter runner stopped before a fallback it was allowed");
            return NULL;
        }
        if (check_policy(st, e) < 0)
            return NULL; /* error: raised before running; warn: a warning that became an error */
        policy = 0;      /* the warning is given: run it */
        route = ROUTE_FALLBACK;
    }
    PyObject *out, *dtypes;
    int taken;
    unsigned long long to_host, to_device, ns;
    if (!PyArg_ParseTuple(res, "OiKKKO", &out, &taken, &to_host, &to_device, &ns, &dtypes) ||
        taken < 0 || taken >= ROUTE_ERROR) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "adapter runner returned a bad route");
        Py_DECREF(res);
        return NULL;
    }
    Py_INCREF(out);
    e->calls[taken]++;
    e->bytes_to_host += to_host;
    e->bytes_to_device += to_device;
    e->fallback_ns += ns;
    if (taken == ROUTE_FALLBACK) {
        Py_ssize_t n = PyTuple_Check(dtypes) ? PyTuple_GET_SIZE(dtypes) : 0;
        for (Py_ssize_t i = 0; i < n; i++)
            flagos_note_dtype(st, e, PyTuple_GET_ITEM(dtypes, i));
        if (note_fallback(st, e) < 0)
            Py_CLEAR(out);
    }
    Py_DECREF(res);
    return out;
}

/* Whether a payload op's result comes from a graph being traced by torch.compile (fake or
 * functional tensors, subclasses of torch.Tensor) rather than from running the op: traced
 * ops are not counted, the compiled graph's calls are (flagos/_compile.py). */
static int is_traced_value(flagos_state *st, PyObject *out)
{
    if ((PyTuple_Check(out) || PyList_Check(out)) && PySequence_Fast_GET_SIZE(out) > 0)
        out = PySequence_Fast_GET_ITEM(out, 0);
    PyTypeObject *tp = Py_TYPE(out);
    return tp != (PyTypeObject *)st->tensor_type &&
           PyObject_TypeCheck(out, (PyTypeObject *)st->tensor_type);
}

/* One op with its entry held and its route resolved; override: the kernel of ROUTE_OVERRIDE. */
static PyObject *route_entry(flagos_state *st, op_entry *e, int route, PyObject *override,
                             PyObject *func, PyObject *args, PyObject *kwargs, int from_factory)
{
    PyObject *target = NULL, *uargs = NULL, *ukwargs = NULL, *out = NULL;
    if ((e->flags & OP_SPARSE) && st->device_mode) {
        PyErr_Format(PyExc_RuntimeError, "%U: sparse tensors are not supported on flagos; "
                     "keep them on the CPU, or use a dense tensor (.to_dense()).", e->name);
        return NULL;
    }
    if (route == ROUTE_ERROR) {
        raise_route_error(st, e);
        return NULL;
    }
    if (st->adapter_dispatch != NULL) {
        /* held: a new configuration during the call must not free the runner */
        PyObject *runner = Py_NewRef(st->adapter_dispatch);
        if (!(e->flags & OP_VIEW)) {
            out = route_adapter(st, runner, e, func, args, kwargs, route, from_factory);
        } else {
            PyObject *guard = normal_view_guard(st, args);
            if (guard != NULL)
                out = leave_guard(guard, route_adapter(st, runner, e, func, args, kwargs, route,
                                                       from_factory));
        }
        Py_DECREF(runner);
        return out;
    }
    if (route == ROUTE_FALLBACK)
        goto fallback;

    if (!st->device_mode) {
        /* Native mode: the tensors are already the chip's own. */
        out = flagos_call_payload(st, route == ROUTE_OVERRIDE ? override : e->call, args, kwargs);
        if (out == NULL && route == ROUTE_OVERRIDE &&
            PyErr_ExceptionMatches(PyExc_NotImplementedError)) {
            PyErr_Clear();
            route = ROUTE_NATIVE;
            out = flagos_call_payload(st, e->call, args, kwargs);
        }
        if (out == NULL)
            goto not_implemented;
        e->calls[route]++;
        return out;
    }

    target = PyLong_FromLong(find_target(st, e, args, kwargs));
    if (target == NULL || PyLong_AsLong(target) == TARGET_ERROR)
        goto error;
    if (unwrap_call(st, e, args, kwargs, !from_factory, &uargs, &ukwargs) < 0)
        goto error;
    out = flagos_call_payload(st, route == ROUTE_OVERRIDE ? override : e->call, uargs, ukwargs);
    if (out == NULL && route == ROUTE_OVERRIDE &&
        PyErr_ExceptionMatches(PyExc_NotImplementedError)) {
        PyErr_Clear();
        route = ROUTE_NATIVE;
        out = flagos_call_payload(st, e->call, uargs, ukwargs);
    }
    Py_CLEAR(uargs);
    Py_CLEAR(ukwargs);
    if (out == NULL)
        goto not_implemented;
    if (!is_traced_value(st, out))
        e->calls[route]++;
    if ((e->flags & OP_RELAYOUT) && flagos_sync_written(st, e, args, kwargs) < 0) {
        Py_DECREF(out);
        goto error;
    }
    if (PyTuple_GET_SIZE(e->write_args) > 0 && PyTuple_GET_SIZE(e->return_alias) > 0)
        out = alias_outputs(e, args, kwargs, out);
    if (e->flags & OP_VIEW)
        out = wrap_view_outputs(st, e, out, target, args);
    else
        out = flagos_wrap_outputs(st, e, out, target);
    Py_DECREF(target);
    return out;

not_implemented:
    /* A chip without a kernel for this op: remember it and take the CPU fallback. */
    if (route != ROUTE_NATIVE || (e->flags & OP_VIEW) ||
        !PyErr_ExceptionMatches(PyExc_NotImplementedError))
        goto error;
    PyErr_Clear();
    if (e->route == ROUTE_NATIVE) { /* an override that declined one call stays in place */
        e->flags |= OP_NOT_IMPLEMENTED;
        e->route = ROUTE_FALLBACK;
    }
fallback:
    Py_CLEAR(target);
    if (check_policy(st, e) < 0)
        return NULL;
    if (st->device_mode) {
        target = PyLong_FromLong(find_target(st, e, args, kwargs));
        if (target == NULL || PyLong_AsLong(target) == TARGET_ERROR)
            goto error;
        if (!from_factory) {
            /* Same argument check as the native route: fallback must not hide a mix-up. */
            if (unwrap_call(st, e, args, kwargs, 1, &uargs, &ukwargs) < 0)
                goto error;
            Py_CLEAR(uargs);
            Py_CLEAR(ukwargs);
        }
    } else {
        target = PyLong_FromLong(TARGET_FOLLOW);
        if (target == NULL)
            goto error;
    }
    if (note_fallback(st, e) < 0)
        goto error;
    out = flagos_run_fallback(st, e, args, kwargs, target);
    if (out != NULL)
        e->calls[ROUTE_FALLBACK]++;
    Py_DECREF(target);
    return out;
error:
    Py_XDECREF(target);
    Py_XDECREF(uargs);
    Py_XDECREF(ukwargs);
    return NULL;
}

static PyObject *route_call(flagos_state *st, PyObject *func, PyObject *args, PyObject *kwargs,
                            int from_factory)
{
    if (!st->configured) {
        PyErr_SetString(PyExc_RuntimeError,
                        "flagos is not active: call flagos.activate() (or set FLAGOS_DEVICE) "
                        "before using the flagos device");
        return NULL;
    }
    if (kwargs == Py_None)
        kwargs = NULL;
    op_entry *e;
    HASH_FIND_PTR(st->table, &func, e);
    if (e == NULL && (e = entry_create(st, func)) == NULL)
        return NULL;
    entry_hold(e);
    PyObject *override = NULL, *out = NULL;
    int route = entry_route(st, e, &override);
    if (route >= 0)
        out = route_entry(st, e, route, override, func, args, kwargs, from_factory);
    Py_XDECREF(override);
    entry_release(e);
    return out;
}

PyObject *flagos_route_call(flagos_state *st, PyObject *func, PyObject *args, PyObject *kwargs,
                            int from_factory)
{
    return route_call(st, func, args, kwargs, from_factory);
}

/* Value of schema argument i as the caller passed it (borrowed), or NULL if absent. */
static PyObject *argument_value(op_entry *e, PyObject *args, PyObject *kwargs, Py_ssize_t i)
{
    if (i < PyTuple_GET_SIZE(args))
        return PyTuple_GET_ITEM(args, i);
    if (kwargs == NULL || i >= PyTuple_GET_SIZE(e->arg_names))
        return NULL;
    return PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(e->arg_names, i));
}

static PyObject *alias_outputs(op_entry *e, PyObject *args, PyObject *kwargs, PyObject *out)
{
    Py_ssize_t nret = PyTuple_GET_SIZE(e->return_alias);
    if (nret == 1) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->return_alias, 0));
        PyObject *orig = i >= 0 ? argument_value(e, args, kwargs, i) : NULL;
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
        PyObject *orig = i >= 0 ? argument_value(e, args, kwargs, i) : NULL;
        if (orig == NULL) {
            PyErr_Clear();
            orig = PyTuple_GET_ITEM(out, r);
        }
        PyTuple_SET_ITEM(res, r, Py_NewRef(orig));
    }
    Py_DECREF(out);
    return res;
}

PyObject *flagos_alias_outputs(op_entry *e, PyObject *args, PyObject *kwargs, PyObject *out)
{
    return alias_outputs(e, args, kwargs, out);
}

/* ---- export ----------------------------------------------------------- */

static PyObject *dtype_list(flagos_state *st, uint64_t mask)
{
    PyObject *l = PyList_New(0);
    if (l == NULL)
        return NULL;
    for (int i = 0; i < st->n_dtypes; i++) {
        if ((mask >> i) & 1u) {
            PyObject *s = PyObject_Str(st->dtypes[i]);
            if (s == NULL || PyList_Append(l, s) < 0) {
                Py_XDECREF(s);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(s);
        }
    }
    return l;
}

/* One export row for an entry; NULL on error. */
static PyObject *export_row(flagos_state *st, op_entry *e)
{
    PyObject *dtypes = dtype_list(st, e->dtype_mask);
    if (dtypes == NULL)
        return NULL;
    const char *route = e->route == ROUTE_UNRESOLVED ? "unresolved" : route_names[e->route];
    return Py_BuildValue(
        "{s:O,s:s,s:{s:K,s:K,s:K},s:K,s:K,s:K,s:N,s:O,s:O}", "op", e->name, "route", route,
        "calls", "override", (unsigned long long)e->calls[ROUTE_OVERRIDE], "native",
        (unsigned long long)e->calls[ROUTE_NATIVE], "fallback",
        (unsigned long long)e->calls[ROUTE_FALLBACK], "fallback_ns",
        (unsigned long long)e->fallback_ns, "bytes_to_host",
        (unsigned long long)e->bytes_to_host, "bytes_to_device",
        (unsigned long long)e->bytes_to_device, "dtypes", dtypes, "site",
        e->site ? e->site : Py_None, "not_implemented",
        (e->flags & OP_NOT_IMPLEMENTED) ? Py_True : Py_False);
}

/* List of dicts, one per op seen (all of them, or only those with a resolved route).
 * Building a row makes Python objects, which can switch threads: the entries are held
 * first, so a table change meanwhile frees none of them. */
PyObject *flagos_table_export(flagos_state *st, int include_routes_only)
{
    PyObject *rows = PyList_New(0);
    if (rows == NULL)
        return NULL;
    size_t n = HASH_COUNT(st->table), held = 0;
    op_entry **entries = PyMem_Malloc((n ? n : 1) * sizeof(*entries));
    if (entries == NULL) {
        Py_DECREF(rows);
        return PyErr_NoMemory();
    }
    op_entry *e, *tmp;
    HASH_ITER(hh, st->table, e, tmp) {
        if (include_routes_only && e->route == ROUTE_UNRESOLVED)
            continue;
        entry_hold(e);
        entries[held++] = e;
    }
    for (size_t i = 0; i < held && rows != NULL; i++) {
        PyObject *row = export_row(st, entries[i]);
        if (row == NULL || PyList_Append(rows, row) < 0)
            Py_CLEAR(rows);
        Py_XDECREF(row);
    }
    for (size_t i = 0; i < held; i++)
        entry_release(entries[i]);
    PyMem_Free(entries);
    return rows;
}
