/* What crosses the adapter ABI, checked: an adapter's answers (a failed status becomes the
 * flagos error for it; an answer that breaks the ABI's rules, flagos.AdapterError), and the
 * sizes, strides and byte counts flagos computes before any of them reaches an adapter.
 * Calls no other adapter unit.
 */
#include "adapter_internal.h"
#include "adapter.h"

#include <stdarg.h>
#include <stdio.h>

/* ---- adapter answers ---------------------------------------------------- */

static PyObject *adapter_error_type = NULL; /* set by set_error_types() */
static PyObject *oom_error_type = NULL;
static PyObject *device_error_type = NULL;

PyObject *flagos_set_error_types(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *adapter_error, *oom, *device_error;
    if (!PyArg_ParseTuple(args, "OOO", &adapter_error, &oom, &device_error))
        return NULL;
    Py_XSETREF(adapter_error_type, Py_NewRef(adapter_error));
    Py_XSETREF(oom_error_type, Py_NewRef(oom));
    Py_XSETREF(device_error_type, Py_NewRef(device_error));
    Py_RETURN_NONE;
}

void flagos_adapter_types_clear(void)
{
    Py_CLEAR(adapter_error_type);
    Py_CLEAR(oom_error_type);
    Py_CLEAR(device_error_type);
}

static PyObject *error_type(PyObject *t)
{
    return t ? t : PyExc_RuntimeError;
}

PyObject *flagos_adapter_error_class(void)
{
    return error_type(adapter_error_type);
}

/* The adapter's name for a code; an adapter that names none still gets a readable message. */
const char *flagos_adapter_code_name(const flagos_adapter *api, int32_t code)
{
    const char *name = api->error_name(code);
    return name != NULL ? name : "unnamed error";
}

/* Raise the flagos form of a failed adapter call: torch.OutOfMemoryError for the chip's
 * out-of-memory code, flagos.DeviceError (chip, code, code_name, hint) for anything else.
 * rc, what the call returned, is the code: an adapter may forget to fill the status. */
void flagos_adapter_raise_status(AdapterObject *a, const char *call, int32_t device, int32_t rc,
                                 const flagos_status *st_in, const char *detail)
{
    flagos_status copy = *st_in; /* an adapter may fill the whole message without a NUL */
    copy.message[sizeof(copy.message) - 1] = '\0';
    copy.code = rc;
    if (copy.message[0] == '\0')
        snprintf(copy.message, sizeof(copy.message), "the adapter gave no message");
    const flagos_status *st = &copy;
    const char *name = flagos_adapter_code_name(a->api, st->code);
    const char *chip = a->api->name;
    if (st->code == a->api->out_of_memory_code) {
        /* "<device> out of memory." first, as CUDA, HIP and XPU word it: libraries find an
         * out-of-memory error by that text (accelerate's find_executable_batch_size, and with
         * it transformers' auto_find_batch_size, retry with a smaller batch). */
        PyErr_Format(error_type(oom_error_type),
                     "%s device %d out of memory.%s %s (code %d): %s. Free tensors you no "
                     "longer need (del, gc.collect()) or use smaller batches; "
                     "torch.flagos.memory_allocated() shows what flagos holds.",
                     chip, device, detail ? detail : "", name, st->code, st->message);
        return;
    }
    const char *hint = st->code == a->api->device_lost_code
                           ? "the device is in a failed state; other devices keep working, and "
                             "a new process is needed to use this one again"
                           : "check the arguments of the call; set FLAGOS_LOG_LEVEL=debug for "
                             "more";
    PyObject *msg = PyUnicode_FromFormat("%s device %d: %s failed (%s, code %d): %s", chip, device,
                                         call, name, st->code, st->message);
    if (msg == NULL)
        return;
    if (device_error_type == NULL) { /* flagos's types not set up: keep the message at least */
        PyErr_SetObject(PyExc_RuntimeError, msg);
        Py_DECREF(msg);
        return;
    }
    PyObject *kw = Py_BuildValue("{s:s,s:i,s:s,s:s}", "chip", chip, "code", st->code, "code_name",
                                 name, "hint", hint);
    PyObject *args = kw ? PyTuple_Pack(1, msg) : NULL;
    PyObject *exc = args ? PyObject_Call(device_error_type, args, kw) : NULL;
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_DECREF(msg);
}

/* An adapter answer that breaks the ABI's rules: flagos.AdapterError naming the adapter. */
void flagos_adapter_broken_answer(AdapterObject *a, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *what = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (what != NULL) {
        PyErr_Format(error_type(adapter_error_type), "chip adapter %s (%U) broke the adapter ABI: "
                     "%U; see csrc/include/flagos/adapter.h", a->api->name, a->path, what);
        Py_DECREF(what);
    }
}

/* A failed call (rc != 0) raises the flagos error for its status; 0 or -1. */
int flagos_adapter_check(AdapterObject *self, int32_t rc, const char *call, int32_t device,
                         const flagos_status *st)
{
    if (rc == 0)
        return 0;
    flagos_adapter_raise_status(self, call, device, rc, st, NULL);
    return -1;
}

PyObject *flagos_adapter_call_on_device(AdapterObject *self, PyObject *arg, device_call fn,
                                        const char *name)
{
    int device = _PyLong_AsInt(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    if (fn == NULL) /* optional entry the adapter does not have */
        Py_RETURN_NONE;
    flagos_status st = {0};
    int32_t rc;
    rc = fn(device, &st);
    if (flagos_adapter_check(self, rc, name, device, &st) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- checked layout arithmetic ------------------------------------------------ */

/* Sizes, strides and byte counts are checked here, with overflow-safe arithmetic, before any
 * of them reaches an adapter; the messages are the ones PyTorch gives on the CPU. */

static int parse_dims(PyObject *seq, int64_t *out, int *n)
{
    PyObject *fast = PySequence_Fast(seq, "sizes and strides are sequences of ints");
    if (fast == NULL)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    if (len > MAX_LAYOUT_DIMS) {
        PyErr_Format(PyExc_RuntimeError, "flagos tensors have at most %d dimensions, got %zd",
                     MAX_LAYOUT_DIMS, len);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    *n = (int)len;
    Py_DECREF(fast);
    return 0;
}

/* Fill l from (sizes, strides or None). */
int flagos_parse_layout(PyObject *sizes, PyObject *strides, layout *l)
{
    l->has_strides = strides != Py_None;
    if (parse_dims(sizes, l->sizes, &l->ndim) < 0)
        return -1;
    if (!l->has_strides)
        return 0;
    int n;
    if (parse_dims(strides, l->strides, &n) < 0)
        return -1;
    if (n != l->ndim) {
        PyErr_Format(PyExc_RuntimeError, "mismatch in length of strides and shape");
        return -1;
    }
    return 0;
}

/* Bytes of storage the layout needs from element `offset` on: PyTorch's computeStorageNbytes
 * (0 when a size is 0). Returns -1 on overflow or a negative size or stride, with no error set. */
int flagos_storage_nbytes(const layout *l, int64_t offset, int64_t itemsize, uint64_t *out)
{
    uint64_t n;
    if (offset < 0 || itemsize <= 0)
        return -1;
    if (!l->has_strides) {
        n = 1;
        for (int i = 0; i < l->ndim; i++)
            if (l->sizes[i] < 0 || __builtin_mul_overflow(n, (uint64_t)l->sizes[i], &n))
                return -1;
        if (__builtin_add_overflow(n, (uint64_t)offset, &n))
            return -1;
    } else {
        n = (uint64_t)offset + 1;
        for (int i = 0; i < l->ndim; i++) {
            if (l->sizes[i] < 0 || l->strides[i] < 0)
                return -1;
            if (l->sizes[i] == 0) {
                *out = 0;
                return 0;
            }
            uint64_t extent;
            if (__builtin_mul_overflow((uint64_t)l->strides[i], (uint64_t)(l->sizes[i] - 1), &extent) ||
                __builtin_add_overflow(n, extent, &n))
                return -1;
        }
    }
    if (__builtin_mul_overflow(n, (uint64_t)itemsize, &n) || n > STORAGE_MAX)
        return -1;
    *out = n;
    return 0;
}

void flagos_overflow_error(PyObject *sizes, PyObject *strides)
{
    PyObject *a = PySequence_List(sizes);
    PyObject *b = a && strides != Py_None ? PySequence_List(strides) : NULL;
    if (a != NULL && strides == Py_None)
        PyErr_Format(PyExc_RuntimeError, "Storage size calculation overflowed with sizes=%R", a);
    else if (b != NULL)
        PyErr_Format(PyExc_RuntimeError,
                     "Storage size calculation overflowed with sizes=%R and strides=%R", a, b);
    Py_XDECREF(a);
    Py_XDECREF(b);
}

/* The bytes a new tensor of this layout needs, or -1 with PyTorch's error set. */
int flagos_new_tensor_nbytes(PyObject *sizes, PyObject *strides, PyObject *itemsize_obj,
                             uint64_t *nbytes)
{
    layout l;
    long long itemsize = PyLong_AsLongLong(itemsize_obj);
    if (itemsize == -1 && PyErr_Occurred())
        return -1;
    if (strides != Py_None) { /* empty_strided's own words; a view's are parse_layout's */
        Py_ssize_t n_sizes = PySequence_Size(sizes), n_strides = PySequence_Size(strides);
        if (n_sizes < 0 || n_strides < 0)
            return -1;
        if (n_sizes != n_strides) {
            PyErr_Format(PyExc_RuntimeError, "dimensionality of sizes (%zd) must match "
                         "dimensionality of strides (%zd)", n_sizes, n_strides);
            return -1;
        }
    }
    if (flagos_parse_layout(sizes, strides, &l) < 0)
        return -1;
    for (int i = 0; i < l.ndim; i++) {
        if (l.sizes[i] < 0) {
            PyObject *list = PySequence_List(sizes);
            if (list != NULL)
                PyErr_Format(PyExc_RuntimeError, "Trying to create tensor with negative dimension "
                             "%lld: %R", (long long)l.sizes[i], list);
            Py_XDECREF(list);
            return -1;
        }
    }
    if (flagos_storage_nbytes(&l, 0, itemsize, nbytes) < 0) {
        flagos_overflow_error(sizes, strides);
        return -1;
    }
    return 0;
}
