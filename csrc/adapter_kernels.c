/* The op call on an adapter: its kernel table, and run_kernel(), which turns the
 * descriptors flagos/runtime/_adapter_ops.py builds into the ABI's kernel arguments, checks that every
 * tensor lies inside its buffer, and calls the kernel.
 */
#include "adapter_internal.h"

#include <stdio.h>

#include "clock.h"
#include <string.h>

PyObject *flagos_adapter_kernels(AdapterObject *self, PyObject *Py_UNUSED(arg))
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

PyObject *flagos_adapter_kernel_times(AdapterObject *self, PyObject *Py_UNUSED(arg))
{
    PyObject *out = PyList_New(self->api->n_kernels);
    for (int32_t i = 0; out != NULL && i < self->api->n_kernels; i++) {
        PyObject *item = Py_BuildValue("(sKd)", self->api->kernels[i].op,
                                       (unsigned long long)self->kernel_calls[i],
                                       (double)self->kernel_ns[i] * 1e-9);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, item);
    }
    return out;
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
    if (!PyArg_ParseTuple(item, "O!LiO!O!", &flagos_buffer_type, &buf, &offset, &dtype, &PyTuple_Type,
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
        flagos_storage_nbytes(&l, offset, dtype_sizes[dtype], &need) < 0 ||
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

int flagos_adapter_call_kernel(AdapterObject *self, int index, const flagos_kernel_args *ka,
                               flagos_status *st)
{
    const flagos_kernel *k = &self->api->kernels[index];
    uint64_t t0 = flagos_now_ns();
    int32_t rc = k->fn(ka, st);
    if (rc == 0) { /* the time of calls that ran: a declined call is the fallback's */
        self->kernel_ns[index] += flagos_now_ns() - t0;
        self->kernel_calls[index]++;
    }
    if (rc == FLAGOS_STATUS_UNSUPPORTED) {
        st->message[sizeof(st->message) - 1] = '\0';
        return 1;
    }
    if (rc != 0) {
        char call[128];
        snprintf(call, sizeof(call), "kernel %s", k->op);
        flagos_adapter_raise_status(self, call, ka->device, rc, st, NULL);
        return -1;
    }
    return 0;
}

/* run_kernel(index, device, inputs, outputs, scalars, ints) */
PyObject *flagos_adapter_run_kernel(AdapterObject *self, PyObject *args)
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
    int rc = flagos_adapter_call_kernel(self, index, &ka, &st);
    if (rc == 1) {
        PyErr_Format(PyExc_NotImplementedError, "%s: %s", self->api->kernels[index].op, st.message);
        return NULL;
    }
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}
