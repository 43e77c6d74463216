/* The `type_` of flagos's Python device guard, safe to call while a Python error is pending.
 *
 * PyTorch's C++ PythonDeviceGuard (torch._C._acc.DeviceGuard) answers every device query by
 * calling the guard's Python `type_()`, also from the noexcept destructor of the stream guard
 * autograd's engine holds around each backward node. When a Python callable the engine runs (a
 * hook, a saved-tensor unpack, __torch_dispatch__) raises, PyTorch throws a C++ python_error that
 * leaves the Python error pending in the thread while it unwinds through that destructor. Any
 * Python call made then fails CPython's result check ("returned a result with an exception
 * set"), and noexcept turns the failure into std::terminate.
 *
 * A GuardDeviceType answers without failing: before anything else it takes a pending error out
 * of the thread and hands it to its `keep` callable, which keeps it for the caller of backward()
 * (flagos/integrations/_backward_errors.py and flagos/runtime/_guard_errors.py); raise_kept() raises it there as it was (docs/design.md §11).
 * It is a callable object rather than a function: pybind11 takes a builtin function for "not
 * overridden in Python" and calls the pure virtual instead.
 */
#include "guard.h"

typedef struct {
    PyObject_HEAD
    PyObject *device_type;  /* what type_() answers: torch's DeviceType.PrivateUse1 */
    PyObject *keep;         /* keep(exc): takes a pending error aside */
} GuardTypeObject;

/* The pending error as one exception object (with its traceback), the thread's error cleared. */
static PyObject *take_pending_error(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static PyObject *guard_type_call(PyObject *op, PyObject *args, PyObject *kwargs)
{
    GuardTypeObject *self = (GuardTypeObject *)op;
    if (PyErr_Occurred()) {
        PyObject *exc = take_pending_error();
        if (exc != NULL) {
            PyObject *r = PyObject_CallOneArg(self->keep, exc);
            if (r == NULL) /* never fail here: the caller is noexcept */
                PyErr_WriteUnraisable(self->keep);
            Py_XDECREF(r);
            Py_DECREF(exc);
        }
    }
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "type_() takes no arguments");
        return NULL;
    }
    return Py_NewRef(self->device_type);
}

static PyObject *guard_type_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"device_type", "keep", NULL};
    PyObject *device_type, *keep;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:GuardDeviceType", kwlist, &device_type,
                                     &keep))
        return NULL;
    if (!PyCallable_Check(keep)) {
        PyErr_SetString(PyExc_TypeError, "GuardDeviceType(device_type, keep): keep must be callable");
        return NULL;
    }
    GuardTypeObject *self = (GuardTypeObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->device_type = Py_NewRef(device_type);
    self->keep = Py_NewRef(keep);
    return (PyObject *)self;
}

static int guard_type_traverse(PyObject *op, visitproc visit, void *arg)
{
    GuardTypeObject *self = (GuardTypeObject *)op;
    Py_VISIT(self->device_type);
    Py_VISIT(self->keep);
    return 0;
}

static int guard_type_clear(PyObject *op)
{
    GuardTypeObject *self = (GuardTypeObject *)op;
    Py_CLEAR(self->device_type);
    Py_CLEAR(self->keep);
    return 0;
}

static void guard_type_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    guard_type_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyTypeObject GuardType_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flagos._C.GuardDeviceType",
    .tp_doc = "GuardDeviceType(device_type, keep): the device guard's type_(); a Python error "
              "pending when it is called goes to keep(exc).",
    .tp_basicsize = sizeof(GuardTypeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = guard_type_new,
    .tp_call = guard_type_call,
    .tp_traverse = guard_type_traverse,
    .tp_clear = guard_type_clear,
    .tp_dealloc = guard_type_dealloc,
};

/* raise_kept(exc): raise an exception kept by the guard as it was raised, leaving its
 * __context__, __cause__ and traceback as they are (a `raise` statement would chain it to
 * whatever exception is being handled). */
static PyObject *guard_raise_kept(PyObject *Py_UNUSED(module), PyObject *exc)
{
    if (!PyExceptionInstance_Check(exc)) {
        PyErr_SetString(PyExc_TypeError, "raise_kept(exc): exc must be an exception instance");
        return NULL;
    }
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(Py_NewRef(exc));
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), Py_NewRef(exc),
                  PyException_GetTraceback(exc));
#endif
    return NULL;
}

static PyMethodDef guard_methods[] = {
    {"raise_kept", guard_raise_kept, METH_O,
     "raise_kept(exc): raise an exception the device guard kept, unchained."},
    {NULL, NULL, 0, NULL},
};

int flagos_guard_ready(PyObject *module)
{
    if (PyType_Ready(&GuardType_Type) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "GuardDeviceType", (PyObject *)&GuardType_Type) < 0)
        return -1;
    return PyModule_AddFunctions(module, guard_methods);
}
