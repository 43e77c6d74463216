/* What the adapter units share (adapter_load.c, adapter_checks.c, adapter_memory.c,
 * adapter_streams.c, adapter_kernels.c): the Adapter and Buffer objects, the checks every
 * adapter call goes through, and the Adapter methods the other units implement for
 * adapter_load.c's method table.
 *
 * Adapter calls are made with the GIL held: that is what keeps the ABI's promise of one call
 * at a time, so an adapter needs no locking of its own.
 */
#ifndef FLAGOS_ADAPTER_INTERNAL_H
#define FLAGOS_ADAPTER_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <flagos/adapter.h>

typedef struct {
    PyObject_HEAD
    void *library;              /* dlopen handle, closed with the object */
    const flagos_adapter *api;  /* the adapter's static table */
    int has_streams;            /* it fills the ABI 1.1 stream/event entries */
    PyObject *path;
    /* per kernel-table row: calls and nanoseconds inside the kernel function (for an
     * asynchronous chip, its launch), owned by the object */
    uint64_t *kernel_calls, *kernel_ns;
} AdapterObject;

typedef struct {
    PyObject_HEAD
    AdapterObject *adapter;     /* strong: the library stays loaded while buffers live */
    int32_t device;
    flagos_buffer buffer;
    uint64_t nbytes;
} BufferObject;

/* Whether obj is a flagos._C.Adapter (adapter_load.c). */
int flagos_is_adapter(PyObject *obj);

/* flagos._C.Buffer (adapter_memory.c). */
extern PyTypeObject flagos_buffer_type;

/* ---- adapter_checks.c: adapter answers ---- */

/* flagos.AdapterError once set_error_types() ran, RuntimeError before (borrowed). */
PyObject *flagos_adapter_error_class(void);
/* The adapter's name for a code; an adapter that names none still gets a readable message. */
const char *flagos_adapter_code_name(const flagos_adapter *api, int32_t code);
/* Raise the flagos form of a failed adapter call: torch.OutOfMemoryError for the chip's
 * out-of-memory code, flagos.DeviceError (chip, code, code_name, hint) for anything else.
 * rc, what the call returned, is the code: an adapter may forget to fill the status. */
void flagos_adapter_raise_status(AdapterObject *a, const char *call, int32_t device, int32_t rc,
                                 const flagos_status *st_in, const char *detail);
/* An adapter answer that breaks the ABI's rules: flagos.AdapterError naming the adapter. */
void flagos_adapter_broken_answer(AdapterObject *a, const char *fmt, ...);
/* A failed call (rc != 0) raises the flagos error for its status; 0 or -1. */
int flagos_adapter_check(AdapterObject *self, int32_t rc, const char *call, int32_t device,
                         const flagos_status *st);
/* device(arg) -> None through an entry (device) -> status; None when the adapter lacks it. */
typedef int32_t (*device_call)(int32_t, flagos_status *);
PyObject *flagos_adapter_call_on_device(AdapterObject *self, PyObject *arg, device_call fn,
                                        const char *name);

/* ---- adapter_checks.c: checked layout arithmetic ---- */

#define MAX_LAYOUT_DIMS 64
#define STORAGE_MAX ((uint64_t)INT64_MAX)

typedef struct {
    int ndim;
    int64_t sizes[MAX_LAYOUT_DIMS];
    int64_t strides[MAX_LAYOUT_DIMS];
    int has_strides;              /* 0: contiguous */
} layout;

/* Fill l from (sizes, strides or None). */
int flagos_parse_layout(PyObject *sizes, PyObject *strides, layout *l);
/* Bytes of storage the layout needs from element `offset` on: PyTorch's computeStorageNbytes
 * (0 when a size is 0). Returns -1 on overflow or a negative size or stride, with no error set. */
int flagos_storage_nbytes(const layout *l, int64_t offset, int64_t itemsize, uint64_t *out);
/* PyTorch's error for a layout whose storage size overflows. */
void flagos_overflow_error(PyObject *sizes, PyObject *strides);
/* The bytes a new tensor of this layout needs, or -1 with PyTorch's error set. */
int flagos_new_tensor_nbytes(PyObject *sizes, PyObject *strides, PyObject *itemsize_obj,
                             uint64_t *nbytes);

/* ---- Adapter methods implemented outside adapter_load.c: Adapter.<name> ---- */

/* adapter_memory.c */
/* A new Buffer of nbytes on device; raises torch.OutOfMemoryError / flagos.DeviceError as
 * Adapter.alloc() does. */
PyObject *flagos_adapter_new_buffer(AdapterObject *self, int device, uint64_t nbytes);
PyObject *flagos_adapter_memory_info(AdapterObject *self, PyObject *arg);
PyObject *flagos_adapter_reset_peak(AdapterObject *self, PyObject *arg);
PyObject *flagos_adapter_empty_cache(AdapterObject *self, PyObject *arg);
PyObject *flagos_adapter_alloc(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_alloc_tensor(AdapterObject *self, PyObject *args);
/* adapter_streams.c */
PyObject *flagos_adapter_synchronize(AdapterObject *self, PyObject *arg);
PyObject *flagos_adapter_stream_create(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_stream_destroy(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_set_stream(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_stream_synchronize(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_stream_query(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_stream_wait_event(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_event_create(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_event_destroy(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_event_record(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_event_synchronize(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_event_query(AdapterObject *self, PyObject *args);
PyObject *flagos_adapter_event_elapsed_ms(AdapterObject *self, PyObject *args);
/* adapter_kernels.c */
/* Call kernel `index` (a valid index) with checked arguments: 0; 1 when the kernel declined
 * them (FLAGOS_STATUS_UNSUPPORTED, no error set, st->message says why); -1 with the flagos
 * error of a failed call set (flagos.DeviceError, torch.OutOfMemoryError). */
int flagos_adapter_call_kernel(AdapterObject *self, int index, const flagos_kernel_args *ka,
                               flagos_status *st);
PyObject *flagos_adapter_kernels(AdapterObject *self, PyObject *arg);
/* [(op, calls, seconds)]: the calls that ran and the time inside the kernel function */
PyObject *flagos_adapter_kernel_times(AdapterObject *self, PyObject *arg);
PyObject *flagos_adapter_run_kernel(AdapterObject *self, PyObject *args);

#endif
