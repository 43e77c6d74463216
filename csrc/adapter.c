/* Chip adapters: loading a libflagos_<chip>_adapter.so with dlopen, checking its ABI, and
 * the two Python types that use it: Adapter (one loaded library) and Buffer (one device
 * allocation, freed when the last Python reference goes).
 *
 * Adapter calls are made with the GIL held: that is what keeps the ABI's promise of one call
 * at a time, so an adapter needs no locking of its own.
 *
 * Host memory is exchanged through DLPack capsules (torch.utils.dlpack.to_dlpack), which
 * carry bfloat16, strides and the device, so the copy functions can check what they get.
 */
#include "adapter.h"
#include "router.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* ---- DLPack (the subset flagos reads; layout of DLPack 0.x "dltensor" capsules) ---- */

typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
#define DL_CPU 1

/* Host memory of a contiguous CPU tensor behind a capsule (borrowed from the capsule). */
static int host_region(PyObject *capsule, void **data, uint64_t *nbytes)
{
    DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (m == NULL)
        return -1;
    DLTensor *t = &m->dl_tensor;
    if (t->device.device_type != DL_CPU) {
        PyErr_SetString(PyExc_ValueError, "adapter copies take host (CPU) tensors");
        return -1;
    }
    uint64_t n = (uint64_t)t->dtype.bits / 8 * t->dtype.lanes;
    int64_t expected = 1;
    for (int32_t i = t->ndim - 1; i >= 0; i--) {
        if (t->strides != NULL && t->shape[i] > 1 && t->strides[i] != expected) {
            PyErr_SetString(PyExc_ValueError, "adapter copies take contiguous host tensors");
            return -1;
        }
        expected *= t->shape[i];
    }
    *nbytes = n * (uint64_t)expected;
    if (t->data == NULL && *nbytes > 0) { /* a storage-less tensor (e.g. an efficient zero) */
        PyErr_SetString(PyExc_ValueError, "adapter copies take host tensors with storage");
        return -1;
    }
    *data = *nbytes ? (char *)t->data + t->byte_offset : NULL;
    return 0;
}

/* ---- errors ------------------------------------------------------------ */

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

/* The adapter's name for a code; an adapter that names none still gets a readable message. */
static const char *code_name(const flagos_adapter *api, int32_t code)
{
    const char *name = api->error_name(code);
    return name != NULL ? name : "unnamed error";
}

/* Raise the flagos form of a failed adapter call: torch.OutOfMemoryError for the chip's
 * out-of-memory code, flagos.DeviceError (chip, code, code_name, hint) for anything else.
 * rc, what the call returned, is the code: an adapter may forget to fill the status. */
static void raise_status(AdapterObject *a, const char *call, int32_t device, int32_t rc,
                         const flagos_status *st_in, const char *detail)
{
    flagos_status copy = *st_in; /* an adapter may fill the whole message without a NUL */
    copy.message[sizeof(copy.message) - 1] = '\0';
    copy.code = rc;
    if (copy.message[0] == '\0')
        snprintf(copy.message, sizeof(copy.message), "the adapter gave no message");
    const flagos_status *st = &copy;
    const char *name = code_name(a->api, st->code);
    const char *chip = a->api->name;
    if (st->code == a->api->out_of_memory_code) {
        PyErr_Format(error_type(oom_error_type),
                     "%s device %d is out of memory%s (%s, code %d): %s. Free tensors you no "
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
static void broken_answer(AdapterObject *a, const char *fmt, ...)
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

/* ---- checked layout arithmetic ------------------------------------------------ */

/* Sizes, strides and byte counts are checked here, with overflow-safe arithmetic, before any
 * of them reaches an adapter; the messages are the ones PyTorch gives on the CPU. */

#define MAX_LAYOUT_DIMS 64

_Static_assert(FLAGOS_MAX_DEVICES == MAX_DEVICES, "the ABI's device limit is the router's");
#define STORAGE_MAX ((uint64_t)INT64_MAX)

typedef struct {
    int ndim;
    int64_t sizes[MAX_LAYOUT_DIMS];
    int64_t strides[MAX_LAYOUT_DIMS];
    int has_strides;              /* 0: contiguous */
} layout;

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
static int parse_layout(PyObject *sizes, PyObject *strides, layout *l)
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
static int storage_nbytes(const layout *l, int64_t offset, int64_t itemsize, uint64_t *out)
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

static void overflow_error(PyObject *sizes, PyObject *strides)
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
static int new_tensor_nbytes(PyObject *sizes, PyObject *strides, PyObject *itemsize_obj,
                             uint64_t *nbytes)
{
    layout l;
    long long itemsize = PyLong_AsLongLong(itemsize_obj);
    if ((itemsize == -1 && PyErr_Occurred()) || parse_layout(sizes, strides, &l) < 0)
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
    if (storage_nbytes(&l, 0, itemsize, nbytes) < 0) {
        overflow_error(sizes, strides);
        return -1;
    }
    return 0;
}

/* ---- Buffer -------------------------------------------------------------- */

static void buffer_dealloc(BufferObject *self)
{
    if (self->adapter != NULL && self->buffer != 0) {
        flagos_status st = {0};
        /* A failed free (e.g. a lost device) has nowhere to go from a destructor. */
        self->adapter->api->free(self->device, self->buffer, &st);
    }
    Py_XDECREF(self->adapter);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A byte offset or count from Python: a non-negative int that fits in 63 bits. */
static int parse_bytes(PyObject *obj, uint64_t *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "byte offsets and counts are non-negative, got %lld", v);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* Whether [offset, offset + nbytes) lies inside the buffer; raises when it does not, so an
 * adapter never sees a copy outside an allocation. */
static int check_range(BufferObject *b, uint64_t offset, uint64_t nbytes, const char *what)
{
    if (offset > b->nbytes || nbytes > b->nbytes - offset) {
        PyErr_Format(PyExc_RuntimeError, "%s of %llu bytes at offset %llu is outside the %llu-byte "
                     "buffer", what, (unsigned long long)nbytes, (unsigned long long)offset,
                     (unsigned long long)b->nbytes);
        return -1;
    }
    return 0;
}

/* read(capsule, offset) / write(capsule, offset): one contiguous copy between the buffer
 * (at a byte offset) and a host tensor; returns the bytes copied. */
static PyObject *buffer_transfer(BufferObject *self, PyObject *args, int to_host)
{
    PyObject *capsule, *offset_obj;
    uint64_t offset;
    if (!PyArg_ParseTuple(args, "OO", &capsule, &offset_obj) || parse_bytes(offset_obj, &offset) < 0)
        return NULL;
    void *data;
    uint64_t nbytes;
    if (host_region(capsule, &data, &nbytes) < 0)
        return NULL;
    if (check_range(self, offset, nbytes, to_host ? "a copy to host" : "a copy from host") < 0)
        return NULL;
    if (nbytes == 0)
        return PyLong_FromLong(0);
    const flagos_adapter *api = self->adapter->api;
    flagos_status st = {0};
    int32_t rc;
    rc = to_host ? api->copy_d2h(self->device, data, self->buffer, offset, nbytes, &st)
                 : api->copy_h2d(self->device, self->buffer, offset, data, nbytes, &st);
    if (rc != 0) {
        raise_status(self->adapter, to_host ? "copy to host" : "copy from host", self->device, rc,
                     &st, NULL);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(nbytes);
}

static PyObject *buffer_read(BufferObject *self, PyObject *args)
{
    return buffer_transfer(self, args, 1);
}

static PyObject *buffer_write(BufferObject *self, PyObject *args)
{
    return buffer_transfer(self, args, 0);
}

static PyTypeObject Buffer_Type;

/* copy_from(src, dst_offset, src_offset, nbytes): device to device, possibly across devices. */
static PyObject *buffer_copy_from(BufferObject *self, PyObject *args)
{
    BufferObject *src;
    PyObject *o[3];
    uint64_t dst_offset, src_offset, nbytes;
    if (!PyArg_ParseTuple(args, "O!OOO", &Buffer_Type, &src, &o[0], &o[1], &o[2]) ||
        parse_bytes(o[0], &dst_offset) < 0 || parse_bytes(o[1], &src_offset) < 0 ||
        parse_bytes(o[2], &nbytes) < 0)
        return NULL;
    if (src->adapter != self->adapter) {
        PyErr_SetString(PyExc_ValueError, "device copies stay within one adapter");
        return NULL;
    }
    if (check_range(self, dst_offset, nbytes, "a device copy") < 0 ||
        check_range(src, src_offset, nbytes, "a device copy") < 0)
        return NULL;
    if (nbytes == 0)
        Py_RETURN_NONE;
    flagos_status st = {0};
    int32_t rc;
    rc = self->adapter->api->copy_d2d(self->device, self->buffer, dst_offset, src->device,
                                      src->buffer, src_offset, nbytes, &st);
    if (rc != 0) {
        raise_status(self->adapter, "device copy", self->device, rc, &st, NULL);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* check_view(sizes, strides, offset, itemsize): raise PyTorch's out-of-bounds error unless a
 * view with this layout lies inside the buffer. */
static PyObject *buffer_check_view(BufferObject *self, PyObject *args)
{
    PyObject *sizes, *strides;
    long long offset, itemsize;
    layout l;
    uint64_t need;
    if (!PyArg_ParseTuple(args, "OOLL", &sizes, &strides, &offset, &itemsize) ||
        parse_layout(sizes, strides, &l) < 0)
        return NULL;
    if (offset < 0) {
        PyErr_Format(PyExc_RuntimeError, "Tensor: invalid storage offset %lld", offset);
        return NULL;
    }
    if (storage_nbytes(&l, offset, itemsize, &need) < 0) {
        overflow_error(sizes, strides);
        return NULL;
    }
    if (need > self->nbytes) {
        PyObject *a = PySequence_List(sizes), *b = a ? PySequence_List(strides) : NULL;
        if (b != NULL)
            PyErr_Format(PyExc_RuntimeError, "setStorage: sizes %R, strides %R, storage offset %lld, "
                         "and itemsize %lld requiring a storage size of %llu are out of bounds for "
                         "storage of size %llu", a, b, offset, itemsize, (unsigned long long)need,
                         (unsigned long long)self->nbytes);
        Py_XDECREF(a);
        Py_XDECREF(b);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *buffer_repr(BufferObject *self)
{
    return PyUnicode_FromFormat("<flagos %s buffer %llu: %llu bytes on device %d>",
                                self->adapter->api->name, (unsigned long long)self->buffer,
                                (unsigned long long)self->nbytes, self->device);
}

static PyMethodDef buffer_methods[] = {
    {"read", (PyCFunction)buffer_read, METH_VARARGS,
     "read(dlpack_capsule, offset): copy bytes at offset into a contiguous host tensor."},
    {"write", (PyCFunction)buffer_write, METH_VARARGS,
     "write(dlpack_capsule, offset): copy a contiguous host tensor to bytes at offset."},
    {"copy_from", (PyCFunction)buffer_copy_from, METH_VARARGS,
     "copy_from(src, dst_offset, src_offset, nbytes): device-to-device copy."},
    {"check_view", (PyCFunction)buffer_check_view, METH_VARARGS,
     "check_view(sizes, strides, offset, itemsize): raise unless the view fits in the buffer."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef buffer_members[] = {
    {"device", T_INT, offsetof(BufferObject, device), READONLY, "device index"},
    {"nbytes", T_ULONGLONG, offsetof(BufferObject, nbytes), READONLY, "size in bytes"},
    {"handle", T_ULONGLONG, offsetof(BufferObject, buffer), READONLY, "the adapter's handle"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject Buffer_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flagos._C.Buffer",
    .tp_doc = "One allocation in a chip adapter's device memory; freed with its last reference.",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)buffer_dealloc,
    .tp_repr = (reprfunc)buffer_repr,
    .tp_methods = buffer_methods,
    .tp_members = buffer_members,
};

/* ---- Adapter ------------------------------------------------------------- */

/* One Adapter object per loaded library: dlopen of the same file returns the same handle and
 * the same static table, and init()/shutdown() must run once each. Borrowed pointers; an object
 * leaves the list in its dealloc. */
#define MAX_ADAPTERS 32
static AdapterObject *open_adapters[MAX_ADAPTERS];

static AdapterObject *find_open(void *library)
{
    for (int i = 0; i < MAX_ADAPTERS; i++)
        if (open_adapters[i] != NULL && open_adapters[i]->library == library)
            return open_adapters[i];
    return NULL;
}

static void adapter_dealloc(AdapterObject *self)
{
    for (int i = 0; i < MAX_ADAPTERS; i++)
        if (open_adapters[i] == self)
            open_adapters[i] = NULL;
    if (self->api != NULL && self->api->shutdown != NULL)
        self->api->shutdown();
    if (self->library != NULL)
        dlclose(self->library);
    Py_XDECREF(self->path);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int adapter_check(AdapterObject *self, int32_t rc, const char *call, int32_t device,
                         const flagos_status *st)
{
    if (rc == 0)
        return 0;
    raise_status(self, call, device, rc, st, NULL);
    return -1;
}

static PyObject *adapter_device_count(AdapterObject *self, PyObject *Py_UNUSED(arg))
{
    int32_t n = 0;
    flagos_status st = {0};
    if (adapter_check(self, self->api->device_count(&n, &st), "device_count", -1, &st) < 0)
        return NULL;
    if (n < 0 || n > FLAGOS_MAX_DEVICES) {
        broken_answer(self, "device_count() reported %d devices; flagos drives 0 to %d",
                      (int)n, FLAGOS_MAX_DEVICES);
        return NULL;
    }
    return PyLong_FromLong(n);
}

static PyObject *adapter_props(AdapterObject *self, PyObject *arg)
{
    int device = _PyLong_AsInt(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    flagos_device_props p = {.struct_size = sizeof(p)};
    flagos_status st = {0};
    if (adapter_check(self, self->api->device_props(device, &p, &st), "device_props", device, &st) < 0)
        return NULL;
    p.name[sizeof(p.name) - 1] = '\0';
    return Py_BuildValue("{s:s,s:K,s:K}", "name", p.name, "total_memory",
                         (unsigned long long)p.total_memory, "native_dtypes",
                         (unsigned long long)p.native_dtypes);
}

static PyObject *adapter_memory_info(AdapterObject *self, PyObject *arg)
{
    int device = _PyLong_AsInt(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    flagos_memory_info m = {.struct_size = sizeof(m)};
    flagos_status st = {0};
    if (adapter_check(self, self->api->memory_info(device, &m, &st), "memory_info", device, &st) < 0)
        return NULL;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K}", "total", (unsigned long long)m.total, "free",
                         (unsigned long long)m.free, "allocated", (unsigned long long)m.allocated,
                         "peak_allocated", (unsigned long long)m.peak_allocated, "reserved",
                         (unsigned long long)m.reserved);
}

typedef int32_t (*device_call)(int32_t, flagos_status *);

static PyObject *call_on_device(AdapterObject *self, PyObject *arg, device_call fn, const char *name)
{
    int device = _PyLong_AsInt(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    if (fn == NULL) /* optional entry the adapter does not have */
        Py_RETURN_NONE;
    flagos_status st = {0};
    int32_t rc;
    rc = fn(device, &st);
    if (adapter_check(self, rc, name, device, &st) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *adapter_synchronize(AdapterObject *self, PyObject *arg)
{
    return call_on_device(self, arg, self->api->synchronize, "synchronize");
}

static PyObject *adapter_reset_peak(AdapterObject *self, PyObject *arg)
{
    return call_on_device(self, arg, self->api->reset_peak, "reset_peak");
}

static PyObject *adapter_empty_cache(AdapterObject *self, PyObject *arg)
{
    return call_on_device(self, arg, self->api->empty_cache, "empty_cache");
}

static PyObject *adapter_error_name(AdapterObject *self, PyObject *arg)
{
    int code = _PyLong_AsInt(arg);
    if (code == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(code_name(self->api, code));
}

static PyObject *adapter_kernels(AdapterObject *self, PyObject *Py_UNUSED(arg))
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (int32_t i = 0; i < self->api->n_kernels; i++) {
        const flagos_kernel *k = &self->api->kernels[i];
        PyObject *item = Py_BuildValue("(sK)", k->op, (unsigned long long)k->dtypes);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *new_buffer(AdapterObject *self, int device, uint64_t nbytes)
{
    flagos_buffer handle = 0;
    flagos_status st = {0};
    int32_t rc = self->api->alloc(device, nbytes, &handle, &st);
    if (rc != 0) {
        char detail[160] = "";
        flagos_memory_info m = {.struct_size = sizeof(m)};
        flagos_status st2 = {0};
        if (rc == self->api->out_of_memory_code && self->api->memory_info(device, &m, &st2) == 0)
            snprintf(detail, sizeof(detail), ": requested %llu bytes, %llu bytes free of %llu",
                     (unsigned long long)nbytes, (unsigned long long)m.free,
                     (unsigned long long)m.total);
        raise_status(self, "alloc", device, rc, &st, detail);
        return NULL;
    }
    if (handle == 0) { /* "success" without a buffer: nothing to free, nothing to keep */
        broken_answer(self, "alloc() of %llu bytes on device %d returned success and buffer 0",
                      (unsigned long long)nbytes, device);
        return NULL;
    }
    BufferObject *b = PyObject_New(BufferObject, &Buffer_Type);
    if (b == NULL) {
        self->api->free(device, handle, &st);
        return NULL;
    }
    b->adapter = (AdapterObject *)Py_NewRef(self);
    b->device = device;
    b->buffer = handle;
    b->nbytes = nbytes;
    return (PyObject *)b;
}

/* alloc(device, nbytes) -> Buffer */
static PyObject *adapter_alloc(AdapterObject *self, PyObject *args)
{
    int device;
    PyObject *n;
    uint64_t nbytes;
    if (!PyArg_ParseTuple(args, "iO", &device, &n) || parse_bytes(n, &nbytes) < 0)
        return NULL;
    return new_buffer(self, device, nbytes);
}

/* alloc_tensor(device, sizes, strides | None, itemsize) -> Buffer: the storage of a new tensor,
 * its layout checked first (None: contiguous). */
static PyObject *adapter_alloc_tensor(AdapterObject *self, PyObject *args)
{
    int device;
    PyObject *sizes, *strides, *itemsize;
    uint64_t nbytes;
    if (!PyArg_ParseTuple(args, "iOOO", &device, &sizes, &strides, &itemsize) ||
        new_tensor_nbytes(sizes, strides, itemsize, &nbytes) < 0)
        return NULL;
    return new_buffer(self, device, nbytes);
}

/* One kernel tensor from (buffer | None, offset, dtype, sizes, strides). */
static const int64_t dtype_sizes[FLAGOS_N_DTYPES] = {4, 2, 2, 8, 8, 4, 2, 1, 1, 1};

static int parse_tensor(AdapterObject *self, PyObject *item, flagos_tensor *t)
{
    memset(t, 0, sizeof(*t));
    if (item == Py_None) {
        t->ndim = -1;
        return 0;
    }
    PyObject *buf, *sizes, *strides;
    long long offset;
    int dtype;
    if (!PyArg_ParseTuple(item, "O!LiO!O!", &Buffer_Type, &buf, &offset, &dtype, &PyTuple_Type,
                          &sizes, &PyTuple_Type, &strides))
        return -1;
    Py_ssize_t nd = PyTuple_GET_SIZE(sizes);
    if (nd > FLAGOS_MAX_DIMS || PyTuple_GET_SIZE(strides) != nd) {
        PyErr_Format(PyExc_ValueError, "kernel tensors have at most %d dims, sizes and strides "
                     "of equal length", FLAGOS_MAX_DIMS);
        return -1;
    }
    if (((BufferObject *)buf)->adapter != self) {
        PyErr_SetString(PyExc_ValueError, "a kernel takes buffers of its own adapter only");
        return -1;
    }
    t->buffer = ((BufferObject *)buf)->buffer;
    t->offset = offset;
    t->dtype = dtype;
    t->ndim = (int32_t)nd;
    layout l = {.ndim = (int)nd, .has_strides = 1};
    for (Py_ssize_t i = 0; i < nd; i++) {
        l.sizes[i] = t->sizes[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, i));
        l.strides[i] = t->strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, i));
    }
    if (PyErr_Occurred())
        return -1;
    /* The ABI promises a kernel views inside its buffers: non-negative sizes and strides. */
    uint64_t need;
    if (dtype < 0 || dtype >= FLAGOS_N_DTYPES ||
        storage_nbytes(&l, offset, dtype_sizes[dtype], &need) < 0 ||
        need > ((BufferObject *)buf)->nbytes) {
        PyErr_SetString(PyExc_ValueError, "a kernel tensor lies outside its buffer");
        return -1;
    }
    return 0;
}

#define MAX_KERNEL_TENSORS 8
#define MAX_KERNEL_VALUES 16

static int parse_tensors(AdapterObject *self, PyObject *seq, flagos_tensor *out, int32_t *n)
{
    if (!PyList_Check(seq) || PyList_GET_SIZE(seq) > MAX_KERNEL_TENSORS) {
        PyErr_Format(PyExc_ValueError, "kernel tensors: a list of at most %d", MAX_KERNEL_TENSORS);
        return -1;
    }
    *n = (int32_t)PyList_GET_SIZE(seq);
    for (int32_t i = 0; i < *n; i++)
        if (parse_tensor(self, PyList_GET_ITEM(seq, i), &out[i]) < 0)
            return -1;
    return 0;
}

/* run_kernel(index, device, inputs, outputs, scalars, ints) */
static PyObject *adapter_run_kernel(AdapterObject *self, PyObject *args)
{
    int index, device;
    PyObject *ins, *outs, *scalars, *ints;
    if (!PyArg_ParseTuple(args, "iiOOO!O!", &index, &device, &ins, &outs, &PyTuple_Type, &scalars,
                          &PyTuple_Type, &ints))
        return NULL;
    if (index < 0 || index >= self->api->n_kernels) {
        PyErr_Format(PyExc_IndexError, "kernel %d does not exist", index);
        return NULL;
    }
    flagos_tensor inputs[MAX_KERNEL_TENSORS], outputs[MAX_KERNEL_TENSORS];
    double svals[MAX_KERNEL_VALUES];
    int64_t ivals[MAX_KERNEL_VALUES];
    int32_t n_in = 0, n_out = 0;
    if (parse_tensors(self, ins, inputs, &n_in) < 0 || parse_tensors(self, outs, outputs, &n_out) < 0)
        return NULL;
    Py_ssize_t ns = PyTuple_GET_SIZE(scalars), ni = PyTuple_GET_SIZE(ints);
    if (ns > MAX_KERNEL_VALUES || ni > MAX_KERNEL_VALUES) {
        PyErr_Format(PyExc_ValueError, "at most %d scalars and ints", MAX_KERNEL_VALUES);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < ns; i++)
        svals[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(scalars, i));
    for (Py_ssize_t i = 0; i < ni; i++)
        ivals[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(ints, i));
    if (PyErr_Occurred())
        return NULL;
    flagos_kernel_args ka = {
        .struct_size = sizeof(ka), .device = device, .n_inputs = n_in, .inputs = inputs,
        .n_outputs = n_out, .outputs = outputs, .n_scalars = (int32_t)ns, .scalars = svals,
        .n_ints = (int32_t)ni, .ints = ivals,
    };
    flagos_status st = {0};
    const flagos_kernel *k = &self->api->kernels[index];
    int32_t rc;
    rc = k->fn(&ka, &st);
    if (rc == FLAGOS_STATUS_UNSUPPORTED) {
        st.message[sizeof(st.message) - 1] = '\0';
        PyErr_Format(PyExc_NotImplementedError, "%s: %s", k->op, st.message);
        return NULL;
    }
    if (rc != 0) {
        char call[128];
        snprintf(call, sizeof(call), "kernel %s", k->op);
        raise_status(self, call, device, rc, &st, NULL);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- streams and events (ABI 1.1; only when the adapter fills them) -------- */

static int need_streams(AdapterObject *self)
{
    if (self->has_streams)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "chip adapter %s has no stream/event entries (adapter ABI "
                 "1.1): its devices run synchronously; check Adapter.has_streams first",
                 self->api->name);
    return -1;
}

/* The result of a call that returns a new handle: 0 is not one (the default stream, or
 * nothing), so a "success" with 0 breaks the ABI. */
static PyObject *new_handle(AdapterObject *self, int32_t rc, const char *call, int device,
                            const flagos_status *st, uint64_t handle)
{
    if (adapter_check(self, rc, call, device, st) < 0)
        return NULL;
    if (handle == 0) {
        broken_answer(self, "%s() on device %d returned success and handle 0", call, device);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(handle);
}

/* stream_create(device, priority) -> stream handle */
static PyObject *adapter_stream_create(AdapterObject *self, PyObject *args)
{
    int device, priority;
    flagos_stream stream = 0;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "ii", &device, &priority) || need_streams(self) < 0)
        return NULL;
    int32_t rc = self->api->stream_create(device, priority, &stream, &st);
    return new_handle(self, rc, "stream_create", device, &st, stream);
}

/* event_create(device, flags) -> event handle */
static PyObject *adapter_event_create(AdapterObject *self, PyObject *args)
{
    int device;
    unsigned int flags;
    flagos_event event = 0;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iI", &device, &flags) || need_streams(self) < 0)
        return NULL;
    int32_t rc = self->api->event_create(device, (uint32_t)flags, &event, &st);
    return new_handle(self, rc, "event_create", device, &st, event);
}

typedef int32_t (*handle_call)(int32_t, uint64_t, flagos_status *);

/* The calls (device, handle) -> status: destroy, set_stream, synchronize. */
static PyObject *on_handle(AdapterObject *self, PyObject *args, handle_call fn, const char *name)
{
    int device;
    unsigned long long handle;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iK", &device, &handle))
        return NULL;
    if (adapter_check(self, fn(device, (uint64_t)handle, &st), name, device, &st) < 0)
        return NULL;
    Py_RETURN_NONE;
}

#define ON_HANDLE(f)                                                                  \
    static PyObject *adapter_##f(AdapterObject *self, PyObject *args)                 \
    {                                                                                 \
        /* a 1.0 table ends before these fields: never read them without the group */ \
        if (need_streams(self) < 0)                                                   \
            return NULL;                                                              \
        return on_handle(self, args, self->api->f, #f);                               \
    }
ON_HANDLE(stream_destroy)
ON_HANDLE(set_stream)
ON_HANDLE(stream_synchronize)
ON_HANDLE(event_destroy)
ON_HANDLE(event_synchronize)
#undef ON_HANDLE

typedef int32_t (*query_call)(int32_t, uint64_t, int32_t *, flagos_status *);

static PyObject *query(AdapterObject *self, PyObject *args, int events)
{
    int device;
    unsigned long long handle;
    int32_t done = 0;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iK", &device, &handle) || need_streams(self) < 0)
        return NULL;
    query_call fn = events ? self->api->event_query : self->api->stream_query;
    if (adapter_check(self, fn(device, (uint64_t)handle, &done, &st),
                      events ? "event_query" : "stream_query", device, &st) < 0)
        return NULL;
    return PyBool_FromLong(done != 0);
}

/* stream_query(device, stream) / event_query(device, event) -> whether the work is done */
static PyObject *adapter_stream_query(AdapterObject *self, PyObject *args)
{
    return query(self, args, 0);
}

static PyObject *adapter_event_query(AdapterObject *self, PyObject *args)
{
    return query(self, args, 1);
}

/* stream_wait_event(device, stream, event) / event_record(device, event, stream) */
static PyObject *adapter_stream_wait_event(AdapterObject *self, PyObject *args)
{
    int device;
    unsigned long long stream, event;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iKK", &device, &stream, &event) || need_streams(self) < 0)
        return NULL;
    int32_t rc = self->api->stream_wait_event(device, (flagos_stream)stream, (flagos_event)event, &st);
    if (adapter_check(self, rc, "stream_wait_event", device, &st) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *adapter_event_record(AdapterObject *self, PyObject *args)
{
    int device;
    unsigned long long event, stream;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iKK", &device, &event, &stream) || need_streams(self) < 0)
        return NULL;
    int32_t rc = self->api->event_record(device, (flagos_event)event, (flagos_stream)stream, &st);
    if (adapter_check(self, rc, "event_record", device, &st) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* event_elapsed_ms(device, start, end) -> milliseconds between two completed timing events */
static PyObject *adapter_event_elapsed_ms(AdapterObject *self, PyObject *args)
{
    int device;
    unsigned long long start, end;
    double ms = 0.0;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iKK", &device, &start, &end) || need_streams(self) < 0)
        return NULL;
    int32_t rc = self->api->event_elapsed_ms(device, (flagos_event)start, (flagos_event)end, &ms, &st);
    if (adapter_check(self, rc, "event_elapsed_ms", device, &st) < 0)
        return NULL;
    return PyFloat_FromDouble(ms);
}

static PyObject *adapter_get_has_streams(AdapterObject *self, void *Py_UNUSED(c))
{
    return PyBool_FromLong(self->has_streams);
}

static PyObject *adapter_get_name(AdapterObject *self, void *Py_UNUSED(c))
{
    return PyUnicode_FromString(self->api->name);
}

static PyObject *adapter_get_vendor(AdapterObject *self, void *Py_UNUSED(c))
{
    return PyUnicode_FromString(self->api->vendor ? self->api->vendor : "");
}

static PyObject *adapter_get_abi(AdapterObject *self, void *Py_UNUSED(c))
{
    return Py_BuildValue("(II)", self->api->abi_major, self->api->abi_minor);
}

static PyObject *adapter_get_path(AdapterObject *self, void *Py_UNUSED(c))
{
    return Py_NewRef(self->path);
}

static PyGetSetDef adapter_getset[] = {
    {"name", (getter)adapter_get_name, NULL, "chip name", NULL},
    {"vendor", (getter)adapter_get_vendor, NULL, "vendor", NULL},
    {"abi", (getter)adapter_get_abi, NULL, "(major, minor) the adapter was built for", NULL},
    {"path", (getter)adapter_get_path, NULL, "the shared library", NULL},
    {"has_streams", (getter)adapter_get_has_streams, NULL,
     "whether it fills the stream/event entries (ABI 1.1); without them it runs synchronously", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef adapter_methods[] = {
    {"device_count", (PyCFunction)adapter_device_count, METH_NOARGS, "number of devices"},
    {"props", (PyCFunction)adapter_props, METH_O, "props(device) -> dict"},
    {"memory_info", (PyCFunction)adapter_memory_info, METH_O, "memory_info(device) -> dict"},
    {"reset_peak", (PyCFunction)adapter_reset_peak, METH_O, "reset_peak(device)"},
    {"empty_cache", (PyCFunction)adapter_empty_cache, METH_O, "empty_cache(device)"},
    {"synchronize", (PyCFunction)adapter_synchronize, METH_O, "synchronize(device)"},
    {"error_name", (PyCFunction)adapter_error_name, METH_O, "error_name(code) -> str"},
    {"kernels", (PyCFunction)adapter_kernels, METH_NOARGS, "[(op, dtype mask)] in table order"},
    {"alloc", (PyCFunction)adapter_alloc, METH_VARARGS, "alloc(device, nbytes) -> Buffer"},
    {"alloc_tensor", (PyCFunction)adapter_alloc_tensor, METH_VARARGS,
     "alloc_tensor(device, sizes, strides | None, itemsize) -> Buffer, the layout checked first"},
    {"run_kernel", (PyCFunction)adapter_run_kernel, METH_VARARGS,
     "run_kernel(index, device, inputs, outputs, scalars, ints)"},
    {"stream_create", (PyCFunction)adapter_stream_create, METH_VARARGS,
     "stream_create(device, priority) -> stream handle"},
    {"stream_destroy", (PyCFunction)adapter_stream_destroy, METH_VARARGS, "stream_destroy(device, stream)"},
    {"set_stream", (PyCFunction)adapter_set_stream, METH_VARARGS,
     "set_stream(device, stream): where the device's work goes from now on (0: default)"},
    {"stream_synchronize", (PyCFunction)adapter_stream_synchronize, METH_VARARGS,
     "stream_synchronize(device, stream)"},
    {"stream_query", (PyCFunction)adapter_stream_query, METH_VARARGS,
     "stream_query(device, stream) -> bool"},
    {"stream_wait_event", (PyCFunction)adapter_stream_wait_event, METH_VARARGS,
     "stream_wait_event(device, stream, event)"},
    {"event_create", (PyCFunction)adapter_event_create, METH_VARARGS,
     "event_create(device, flags) -> event handle"},
    {"event_destroy", (PyCFunction)adapter_event_destroy, METH_VARARGS, "event_destroy(device, event)"},
    {"event_record", (PyCFunction)adapter_event_record, METH_VARARGS,
     "event_record(device, event, stream)"},
    {"event_synchronize", (PyCFunction)adapter_event_synchronize, METH_VARARGS,
     "event_synchronize(device, event)"},
    {"event_query", (PyCFunction)adapter_event_query, METH_VARARGS, "event_query(device, event) -> bool"},
    {"event_elapsed_ms", (PyCFunction)adapter_event_elapsed_ms, METH_VARARGS,
     "event_elapsed_ms(device, start, end) -> float"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject Adapter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flagos._C.Adapter",
    .tp_doc = "A loaded chip adapter library.",
    .tp_basicsize = sizeof(AdapterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)adapter_dealloc,
    .tp_methods = adapter_methods,
    .tp_getset = adapter_getset,
};

/* ---- loading ------------------------------------------------------------- */

/* The table entries every adapter must fill; NULL in any of them is a clear error. */
static const struct { const char *name; size_t offset; } required[] = {
#define REQ(f) {#f, offsetof(flagos_adapter, f)}
    REQ(init), REQ(device_count), REQ(device_props), REQ(alloc), REQ(free), REQ(memory_info),
    REQ(copy_h2d), REQ(copy_d2h), REQ(copy_d2d), REQ(synchronize), REQ(error_name),
#undef REQ
};

/* The optional stream/event entries of ABI 1.1: all of them or none. */
static const struct { const char *name; size_t offset; } stream_group[] = {
#define OPT(f) {#f, offsetof(flagos_adapter, f)}
    OPT(stream_create), OPT(stream_destroy), OPT(set_stream), OPT(stream_synchronize),
    OPT(stream_query), OPT(stream_wait_event), OPT(event_create), OPT(event_destroy),
    OPT(event_record), OPT(event_synchronize), OPT(event_query), OPT(event_elapsed_ms),
#undef OPT
};
#define SIZE_1_1 (offsetof(flagos_adapter, event_elapsed_ms) + sizeof(void (*)(void)))
#define N_STREAM_ENTRIES (sizeof(stream_group) / sizeof(stream_group[0]))
static const char *missing_entry = "";

/* Sets *has to whether the table fills the stream group; -1 (missing_entry set) when it
 * fills only part of it. A table too short to hold the group has none of it. */
static int stream_entries(const flagos_adapter *api, int *has)
{
    size_t filled = 0;
    *has = 0;
    if (api->struct_size < SIZE_1_1)
        return 0;
    for (size_t i = 0; i < N_STREAM_ENTRIES; i++) {
        void *fn;
        memcpy(&fn, (const char *)api + stream_group[i].offset, sizeof(fn));
        if (fn != NULL)
            filled++;
        else
            missing_entry = stream_group[i].name;
    }
    if (filled != 0 && filled != N_STREAM_ENTRIES)
        return -1;
    *has = filled == N_STREAM_ENTRIES;
    return 0;
}

static PyObject *load_error(PyObject *path, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *reason = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (reason != NULL) {
        PyErr_Format(error_type(adapter_error_type), "cannot use chip adapter %U: %U", path, reason);
        Py_DECREF(reason);
    }
    return NULL;
}

/* load_adapter(path) -> Adapter */
PyObject *flagos_load_adapter(PyObject *Py_UNUSED(module), PyObject *path_obj)
{
    PyObject *path = NULL, *bytes = NULL, *result = NULL;
    if (!PyUnicode_FSDecoder(path_obj, &path))    /* str, bytes or os.PathLike */
        return NULL;
    if ((bytes = PyUnicode_EncodeFSDefault(path)) == NULL)
        goto done;
    void *lib = dlopen(PyBytes_AS_STRING(bytes), RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        load_error(path, "the library does not load (%s)", why ? why : "unknown reason");
        goto done;
    }
    AdapterObject *open = find_open(lib);
    if (open != NULL) { /* loaded already (maybe under another spelling of its path) */
        dlclose(lib);   /* drop the reference this dlopen added */
        result = Py_NewRef((PyObject *)open);
        goto done;
    }
    flagos_adapter_get_fn get = (flagos_adapter_get_fn)(uintptr_t)dlsym(lib, FLAGOS_ADAPTER_ENTRY);
    const flagos_adapter *api = get ? get() : NULL;
    if (get == NULL) {
        load_error(path, "it exports no %s() (is it a flagos adapter? see docs/adapters.md)",
                   FLAGOS_ADAPTER_ENTRY);
        dlclose(lib);
        goto done;
    }
    if (api == NULL || api->struct_size < offsetof(flagos_adapter, abi_minor) + sizeof(uint32_t)) {
        load_error(path, "%s() returned no adapter table", FLAGOS_ADAPTER_ENTRY);
        dlclose(lib);
        goto done;
    }
    /* Every message is formatted before dlclose(): the table and its strings live in the library. */
    if (api->abi_major != FLAGOS_ADAPTER_ABI_MAJOR) {
        load_error(path, "it was built for adapter ABI %u.%u, and this flagos speaks %d.%d; "
                   "rebuild it against this flagos's csrc/include/flagos/adapter.h",
                   api->abi_major, api->abi_minor, FLAGOS_ADAPTER_ABI_MAJOR, FLAGOS_ADAPTER_ABI_MINOR);
        dlclose(lib);
        goto done;
    }
    /* A table must hold every field of the minor it claims (1.0's at least); fields of later
     * minors than flagos knows are never read. */
    unsigned minor = api->abi_minor < FLAGOS_ADAPTER_ABI_MINOR ? api->abi_minor : FLAGOS_ADAPTER_ABI_MINOR;
    size_t needed = minor >= 1 ? SIZE_1_1 : FLAGOS_ADAPTER_SIZE_1_0;
    if (api->struct_size < needed) {
        load_error(path, "its adapter table is %zu bytes, shorter than ABI %d.%u requires (%zu)",
                   api->struct_size, FLAGOS_ADAPTER_ABI_MAJOR, minor, needed);
        dlclose(lib);
        goto done;
    }
    int has_streams = 0;
    if (stream_entries(api, &has_streams) < 0) {
        load_error(path, "it fills some of the optional stream/event entries but not '%s'; fill "
                   "all of them or none (see the ABI 1.1 section of adapter.h)", missing_entry);
        dlclose(lib);
        goto done;
    }
    for (size_t i = 0; i < sizeof(required) / sizeof(required[0]); i++) {
        void *fn;
        memcpy(&fn, (const char *)api + required[i].offset, sizeof(fn));
        if (fn == NULL) {
            load_error(path, "its adapter table has no '%s' entry point (required)", required[i].name);
            dlclose(lib);
            goto done;
        }
    }
    if (api->name == NULL || (api->n_kernels > 0 && api->kernels == NULL) || api->n_kernels < 0) {
        load_error(path, "its adapter table has no name or an inconsistent kernel table");
        dlclose(lib);
        goto done;
    }
    for (int32_t i = 0; i < api->n_kernels; i++) {
        if (api->kernels[i].op == NULL || api->kernels[i].fn == NULL) {
            load_error(path, "kernel %d of its kernel table has no op name or no function", (int)i);
            dlclose(lib);
            goto done;
        }
    }
    flagos_status st = {0};
    int32_t rc = api->init(&st);
    if (rc != 0) {
        st.message[sizeof(st.message) - 1] = '\0';
        load_error(path, "its init() failed (%s, code %d): %s", code_name(api, rc), (int)rc,
                   st.message[0] ? st.message : "the adapter gave no message");
        dlclose(lib);
        goto done;
    }
    AdapterObject *a = PyObject_New(AdapterObject, &Adapter_Type);
    if (a == NULL) {
        if (api->shutdown)
            api->shutdown();
        dlclose(lib);
        goto done;
    }
    a->library = lib;
    a->api = api;
    a->has_streams = has_streams;
    a->path = Py_NewRef(path);
    for (int i = 0; i < MAX_ADAPTERS; i++) {
        if (open_adapters[i] == NULL) {
            open_adapters[i] = a;
            break;
        }
    }
    result = (PyObject *)a;
done:
    Py_XDECREF(bytes);
    Py_XDECREF(path);
    return result;
}

int flagos_adapter_types_ready(PyObject *module)
{
    if (PyType_Ready(&Buffer_Type) < 0 || PyType_Ready(&Adapter_Type) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "Buffer", (PyObject *)&Buffer_Type) < 0 ||
        PyModule_AddObjectRef(module, "Adapter", (PyObject *)&Adapter_Type) < 0)
        return -1;
    return PyModule_AddIntConstant(module, "ADAPTER_ABI_MAJOR", FLAGOS_ADAPTER_ABI_MAJOR) < 0 ||
                   PyModule_AddIntConstant(module, "ADAPTER_ABI_MINOR", FLAGOS_ADAPTER_ABI_MINOR) < 0 ||
                   PyModule_AddIntConstant(module, "ADAPTER_EVENT_TIMING", FLAGOS_EVENT_TIMING) < 0
               ? -1
               : 0;
}
