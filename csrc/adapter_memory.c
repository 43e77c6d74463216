/* Adapter device memory: the Buffer type (one device allocation, freed with its last Python
 * reference), its copies to and from the host and between devices, and the Adapter methods
 * that allocate and report memory.
 *
 * Host memory is exchanged through DLPack capsules (torch.utils.dlpack.to_dlpack), which
 * carry bfloat16, strides and the device, so the copy functions can check what they get.
 */
#include "adapter_internal.h"

#include <stddef.h>
#include <stdio.h>

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

/* ---- Buffer -------------------------------------------------------------- */

static int buffers_forgotten; /* a forked child: the adapter's buffers belong to the parent */

void flagos_adapter_forget_buffers(void)
{
    buffers_forgotten = 1;
}

static void buffer_dealloc(BufferObject *self)
{
    if (self->adapter != NULL && self->buffer != 0 && !buffers_forgotten) {
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
        flagos_adapter_raise_status(self->adapter, to_host ? "copy to host" : "copy from host",
                                    self->device, rc, &st, NULL);
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


/* copy_from(src, dst_offset, src_offset, nbytes): device to device, possibly across devices. */
static PyObject *buffer_copy_from(BufferObject *self, PyObject *args)
{
    BufferObject *src;
    PyObject *o[3];
    uint64_t dst_offset, src_offset, nbytes;
    if (!PyArg_ParseTuple(args, "O!OOO", &flagos_buffer_type, &src, &o[0], &o[1], &o[2]) ||
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
        flagos_adapter_raise_status(self->adapter, "device copy", self->device, rc, &st, NULL);
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
        flagos_parse_layout(sizes, strides, &l) < 0)
        return NULL;
    if (offset < 0) {
        PyErr_Format(PyExc_RuntimeError, "Tensor: invalid storage offset %lld", offset);
        return NULL;
    }
    if (flagos_storage_nbytes(&l, offset, itemsize, &need) < 0) {
        flagos_overflow_error(sizes, strides);
        return NULL;
    }
    if (need > self->nbytes) {
        /* strides None: the contiguous layout (flagos_parse_layout's reading of it) */
        PyObject *a = PySequence_List(sizes),
                 *b = a == NULL ? NULL
                      : strides == Py_None ? PyUnicode_FromString("contiguous") : PySequence_List(strides);
        if (b != NULL)
            PyErr_Format(PyExc_RuntimeError, "setStorage: sizes %R, strides %S, storage offset %lld, "
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

PyTypeObject flagos_buffer_type = {
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

/* ---- Adapter methods: memory --------------------------------------------- */

PyObject *flagos_adapter_memory_info(AdapterObject *self, PyObject *arg)
{
    int device = _PyLong_AsInt(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    flagos_memory_info m = {.struct_size = sizeof(m)};
    flagos_status st = {0};
    int32_t rc = self->api->memory_info(device, &m, &st);
    if (flagos_adapter_check(self, rc, "memory_info", device, &st) < 0)
        return NULL;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K}", "total", (unsigned long long)m.total, "free",
                         (unsigned long long)m.free, "allocated", (unsigned long long)m.allocated,
                         "peak_allocated", (unsigned long long)m.peak_allocated, "reserved",
                         (unsigned long long)m.reserved);
}

PyObject *flagos_adapter_reset_peak(AdapterObject *self, PyObject *arg)
{
    return flagos_adapter_call_on_device(self, arg, self->api->reset_peak, "reset_peak");
}

PyObject *flagos_adapter_empty_cache(AdapterObject *self, PyObject *arg)
{
    return flagos_adapter_call_on_device(self, arg, self->api->empty_cache, "empty_cache");
}

PyObject *flagos_adapter_new_buffer(AdapterObject *self, int device, uint64_t nbytes)
{
    flagos_buffer handle = 0;
    flagos_status st = {0};
    int32_t rc = self->api->alloc(device, nbytes, &handle, &st);
    if (rc != 0) {
        char detail[160] = "";
        flagos_memory_info m = {.struct_size = sizeof(m)};
        flagos_status st2 = {0};
        if (rc == self->api->out_of_memory_code && self->api->memory_info(device, &m, &st2) == 0)
            snprintf(detail, sizeof(detail), " Requested %llu bytes, %llu bytes free of %llu.",
                     (unsigned long long)nbytes, (unsigned long long)m.free,
                     (unsigned long long)m.total);
        flagos_adapter_raise_status(self, "alloc", device, rc, &st, detail);
        return NULL;
    }
    if (handle == 0) { /* "success" without a buffer: nothing to free, nothing to keep */
        flagos_adapter_broken_answer(self, "alloc() of %llu bytes on device %d returned success "
                                     "and buffer 0", (unsigned long long)nbytes, device);
        return NULL;
    }
    BufferObject *b = PyObject_New(BufferObject, &flagos_buffer_type);
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
PyObject *flagos_adapter_alloc(AdapterObject *self, PyObject *args)
{
    int device;
    PyObject *n;
    uint64_t nbytes;
    if (!PyArg_ParseTuple(args, "iO", &device, &n) || parse_bytes(n, &nbytes) < 0)
        return NULL;
    return flagos_adapter_new_buffer(self, device, nbytes);
}

/* alloc_tensor(device, sizes, strides | None, itemsize) -> Buffer: the storage of a new tensor,
 * its layout checked first (None: contiguous). */
PyObject *flagos_adapter_alloc_tensor(AdapterObject *self, PyObject *args)
{
    int device;
    PyObject *sizes, *strides, *itemsize;
    uint64_t nbytes;
    if (!PyArg_ParseTuple(args, "iOOO", &device, &sizes, &strides, &itemsize) ||
        flagos_new_tensor_nbytes(sizes, strides, itemsize, &nbytes) < 0)
        return NULL;
    return flagos_adapter_new_buffer(self, device, nbytes);
}
