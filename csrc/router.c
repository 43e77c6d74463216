/* The per-op router: table lookup, route, policy, count; the unwrap, rewrap and the call on
 * payloads are payload.c's, the CPU round trip fallback.c's.
 *
 * Every aten op on a flagos tensor (device mode) or on any tensor while native
 * mode is active enters flagos_route_call(). The schema facts and the route of
 * an op are computed once, in Python, the first time the op is seen; after
 * that a call costs one hash lookup plus the unwrap/rewrap of its arguments.
 */
#include "router.h"

#include "adapter_fallback.h"
#include "adapter_fast.h"
#include "callsite.h"
#include "fallback.h"
#include "payload.h"

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
 * when none): the entry's cached answer, or the resolver's. *on_device: the override is the
 * device's own kernel, which takes the flagos tensors themselves (OP_DEVICE_KERNEL). The
 * resolver is Python and may let another thread change the routes meanwhile; its answer is
 * then used for this call only, so a change made during the call is not overwritten by the
 * answer from before it. */
static int entry_route(flagos_state *st, op_entry *e, PyObject **override, int *on_device)
{
    if (e->route != ROUTE_UNRESOLVED) {
        *override = Py_XNewRef(e->override);
        *on_device = (e->flags & OP_DEVICE_KERNEL) != 0;
        return e->route;
    }
    uint64_t generation = st->routes_generation;
    PyObject *res = PyObject_CallOneArg(st->resolve, e->name);
    if (res == NULL)
        return -1;
    int route, device_kernel = 0;
    PyObject *kernel;
    if (!PyArg_ParseTuple(res, "iO|p", &route, &kernel, &device_kernel)) {
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
    *on_device = route == ROUTE_OVERRIDE && device_kernel;
    Py_DECREF(res);
    if (st->routes_generation == generation && e->route == ROUTE_UNRESOLVED) {
        PyObject *previous = e->override;
        e->override = Py_XNewRef(*override);
        e->route = route;
        e->flags = *on_device ? e->flags | OP_DEVICE_KERNEL : e->flags & ~OP_DEVICE_KERNEL;
        Py_XDECREF(previous);
    }
    return route;
}

/* ---- the entry point -------------------------------------------------- */

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

/* C-ABI chips: the payload is an adapter buffer, and the Python runner (flagos/runtime/_adapter_ops.py)
 * marshals the op for the adapter's kernel or the host round trip. It returns
 * (result, route taken, bytes to host, bytes to device, fallback ns, dtypes); the table,
 * the counters and the warnings stay here. */
static PyObject *route_adapter(flagos_state *st, PyObject *runner, op_entry *e, PyObject *func,
                               PyObject *args, PyObject *kwargs, int route, int from_factory)
{
    PyObject *uargs = NULL, *ukwargs = NULL;
    if (!from_factory) {
        if (flagos_unwrap_call(st, e, args, kwargs, 1, &uargs, &ukwargs) < 0)
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
 * ops are not counted, the compiled graph's calls are (flagos/integrations/_compile.py). */
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
    if ((e->flags & (OP_SPARSE | OP_NESTED)) && st->device_mode) { /* one test per op */
        if (e->flags & OP_SPARSE)
            PyErr_Format(PyExc_RuntimeError, "%U: sparse tensors are not supported on flagos; "
                         "keep them on the CPU, or use a dense tensor (.to_dense()). A layer "
                         "made with sparse=True (nn.Embedding, nn.EmbeddingBag) makes sparse "
                         "gradients: make it with sparse=False.", e->name);
        else
            PyErr_Format(PyExc_RuntimeError,
                         "%U: nested tensors of the strided layout are not supported on flagos "
                         "(jagged ones, layout=torch.jagged, are). nn.TransformerEncoder makes "
                         "one in eval mode from src_key_padding_mask: build it with "
                         "enable_nested_tensor=False (the same values for the tokens the mask "
                         "keeps). scaled_dot_product_attention over a jagged nested tensor makes "
                         "one where the device has no fused kernel: pad the batch "
                         "(to_padded_tensor) and pass an attn_mask. Or keep nested tensors on "
                         "the CPU.", e->name);
        return NULL;
    }
    if (route == ROUTE_ERROR) {
        raise_route_error(st, e);
        return NULL;
    }
    if (st->adapter_dispatch != NULL) {
        /* A view's wrapper is made under the view guard, by either path. */
        PyObject *guard = NULL;
        if ((e->flags & OP_VIEW) && (guard = flagos_view_guard(st, args)) == NULL)
            return NULL;
        /* The common case of the ops a model repeats runs in C (adapter_fast.c); it declines
         * everything else, and the runner takes it as before. */
        int fast = 0;
        if (route == ROUTE_NATIVE && !from_factory) {
            fast = flagos_adapter_fast_call(st, e, args, kwargs, &out);
            if (fast > 0)
                e->calls[ROUTE_NATIVE]++;
        }
        /* The host round trip of an op the runner has no path of its own for (or one routed
         * to the fallback) runs in C too (adapter_fallback.c), in its common case. */
        if (e->fast_generation != st->fast_generation)
            flagos_adapter_fast_resolve(st, e);
        if (fast == 0 && !from_factory && !(e->flags & OP_VIEW) &&
            ((route == ROUTE_FALLBACK && e->fast_fallback >= FAST_FALLBACK_ROUTED) ||
             (route == ROUTE_NATIVE && e->fast_fallback == FAST_FALLBACK_ALWAYS))) {
            fast = flagos_adapter_fallback(st, e, args, kwargs, check_policy, &out);
            if (fast > 0) {
                e->calls[ROUTE_FALLBACK]++;
                if (note_fallback(st, e) < 0)
                    Py_CLEAR(out);
            }
        }
        if (fast == 0) {
            /* held: a new configuration during the call must not free the runner */
            PyObject *runner = Py_NewRef(st->adapter_dispatch);
            out = route_adapter(st, runner, e, func, args, kwargs, route, from_factory);
            Py_DECREF(runner);
        }
        return guard != NULL ? flagos_leave_guard(guard, out) : out;
    }
    if (route == ROUTE_FALLBACK)
        goto fallback;

    if (!st->device_mode) {
        /* Native mode: the tensors are already the chip's own. */
        out = flagos_call_payload(st, e, route == ROUTE_OVERRIDE ? override : e->call, args, kwargs);
        if (out == NULL && route == ROUTE_OVERRIDE &&
            PyErr_ExceptionMatches(PyExc_NotImplementedError)) {
            PyErr_Clear();
            route = ROUTE_NATIVE;
            out = flagos_call_payload(st, e, e->call, args, kwargs);
        }
        if (out == NULL)
            goto not_implemented;
        e->calls[route]++;
        return out;
    }

    target = PyLong_FromLong(flagos_find_target(st, e, args, kwargs));
    if (target == NULL || PyLong_AsLong(target) == TARGET_ERROR)
        goto error;
    if (flagos_unwrap_call(st, e, args, kwargs, !from_factory, &uargs, &ukwargs) < 0)
        goto error;
    out = flagos_call_payload(st, e, route == ROUTE_OVERRIDE ? override : e->call, uargs, ukwargs);
    if (out == NULL && route == ROUTE_OVERRIDE &&
        PyErr_ExceptionMatches(PyExc_NotImplementedError)) {
        PyErr_Clear();
        route = ROUTE_NATIVE;
        out = flagos_call_payload(st, e, e->call, uargs, ukwargs);
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
        out = flagos_alias_outputs(e, args, kwargs, out);
    if (e->flags & OP_VIEW)
        out = flagos_wrap_view_outputs(st, e, out, target, args);
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
        target = PyLong_FromLong(flagos_find_target(st, e, args, kwargs));
        if (target == NULL || PyLong_AsLong(target) == TARGET_ERROR)
            goto error;
        if (!from_factory) {
            /* Same argument check as the native route: fallback must not hide a mix-up. */
            if (flagos_unwrap_call(st, e, args, kwargs, 1, &uargs, &ukwargs) < 0)
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

/* ---- the downcast policy ----------------------------------------------- */

/* kwargs with `dtype` replaced when it is the downcast dtype and the output is on the flagos
 * device: *out is a new dict then (the warning given at the first one), NULL otherwise. The
 * warning can run Python code, and another thread set_downcast() meanwhile: the substitute is
 * held from before it. */
static int downcast_kwargs(flagos_state *st, PyObject *kwargs, PyObject **out)
{
    *out = NULL;
    PyObject *dtype = PyDict_GetItemWithError(kwargs, fl_names.dtype); /* borrowed */
    if (dtype == NULL || dtype != st->downcast_from)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *device = PyDict_GetItemWithError(kwargs, fl_names.device); /* borrowed */
    if (device == NULL && PyErr_Occurred())
        return -1;
    if (device != NULL && device != Py_None) {
        PyObject *type = PyObject_GetAttr(device, fl_names.type);
        if (type == NULL)
            return -1;
        int same = st->downcast_device_type != NULL &&
                   PyObject_RichCompareBool(type, st->downcast_device_type, Py_EQ);
        Py_DECREF(type);
        if (same <= 0)
            return same; /* another device (a copy to the host): its dtype stays */
    }
    if (st->downcast_to == NULL)
        return 0; /* turned off meanwhile */
    PyObject *to = Py_NewRef(st->downcast_to);
    if (!st->downcast_warned) {
        st->downcast_warned = 1;
        const char *message = PyUnicode_AsUTF8(st->downcast_message);
        if (message == NULL || PyErr_WarnEx(st->downcast_warning, message, 1) < 0) {
            Py_DECREF(to);
            return -1;
        }
    }
    PyObject *copy = PyDict_Copy(kwargs);
    if (copy == NULL || PyDict_SetItem(copy, fl_names.dtype, to) < 0) {
        Py_XDECREF(copy);
        Py_DECREF(to);
        return -1;
    }
    Py_DECREF(to);
    *out = copy;
    return 0;
}

/* Bytes of the tensors in an op's output (a tensor, or a tuple/list of them). */
static int output_nbytes(PyObject *out, uint64_t *total)
{
    if (PyTuple_Check(out) || PyList_Check(out)) {
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(out); i++)
            if (output_nbytes(PySequence_Fast_GET_ITEM(out, i), total) < 0)
                return -1;
        return 0;
    }
    if (!PyObject_HasAttr(out, fl_names.nbytes))
        return 0;
    PyObject *n = PyObject_GetAttr(out, fl_names.nbytes);
    if (n == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(n);
    Py_DECREF(n);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *total += v;
    return 0;
}

static int count_downcast(op_entry *e, PyObject *out)
{
    uint64_t bytes = 0;
    if (output_nbytes(out, &bytes) < 0)
        return -1;
    e->downcast_calls++;
    e->downcast_bytes += bytes;
    return 0;
}

int flagos_check_configured(flagos_state *st)
{
    if (st->configured)
        return 0;
    if (st->refusal != NULL)
        PyErr_SetObject(PyExc_RuntimeError, st->refusal);
    else
        PyErr_SetString(PyExc_RuntimeError, "flagos is not active: call flagos.activate() (or set "
                        "FLAGOS_DEVICE) before using the flagos device");
    return -1;
}

static PyObject *route_call(flagos_state *st, PyObject *func, PyObject *args, PyObject *kwargs,
                            int from_factory)
{
    if (flagos_check_configured(st) < 0)
        return NULL;
    if (kwargs == Py_None)
        kwargs = NULL;
    op_entry *e;
    HASH_FIND_PTR(st->table, &func, e);
    if (e == NULL && (e = entry_create(st, func)) == NULL)
        return NULL;
    entry_hold(e);
    /* Strict (the default) pays one flag test here; the rewrite exists only under downcast.
     * It can run Python code (the warning), so it comes after the entry is held. */
    PyObject *downcast = NULL;
    if ((e->flags & OP_DTYPE_KW) && st->downcast_from != NULL && kwargs != NULL &&
        downcast_kwargs(st, kwargs, &downcast) < 0) {
        entry_release(e);
        return NULL;
    }
    if (downcast != NULL)
        kwargs = downcast;
    PyObject *override = NULL, *out = NULL;
    int on_device = 0;
    int route = entry_route(st, e, &override, &on_device);
    if (route >= 0 && on_device) {
        /* The device's own kernel: its ops on the flagos tensors come back through here. */
        out = PyObject_Call(override, args, kwargs);
        if (out != NULL)
            e->calls[ROUTE_OVERRIDE]++;
    } else if (route >= 0) {
        out = route_entry(st, e, route, override, func, args, kwargs, from_factory);
    }
    Py_XDECREF(override);
    if (out != NULL && downcast != NULL && count_downcast(e, out) < 0)
        Py_CLEAR(out);
    entry_release(e);
    Py_XDECREF(downcast);
    return out;
}

PyObject *flagos_route_call(flagos_state *st, PyObject *func, PyObject *args, PyObject *kwargs,
                            int from_factory)
{
    return route_call(st, func, args, kwargs, from_factory);
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
        "{s:O,s:s,s:{s:K,s:K,s:K},s:K,s:K,s:K,s:N,s:O,s:O,s:K,s:K}", "op", e->name, "route", route,
        "calls", "override", (unsigned long long)e->calls[ROUTE_OVERRIDE], "native",
        (unsigned long long)e->calls[ROUTE_NATIVE], "fallback",
        (unsigned long long)e->calls[ROUTE_FALLBACK], "fallback_ns",
        (unsigned long long)e->fallback_ns, "bytes_to_host",
        (unsigned long long)e->bytes_to_host, "bytes_to_device",
        (unsigned long long)e->bytes_to_device, "dtypes", dtypes, "site",
        e->site ? e->site : Py_None, "not_implemented",
        (e->flags & OP_NOT_IMPLEMENTED) ? Py_True : Py_False, "downcast_calls",
        (unsigned long long)e->downcast_calls, "downcast_bytes",
        (unsigned long long)e->downcast_bytes);
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
