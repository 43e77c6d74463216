/* Adapter streams and events (ABI 1.1; only when the adapter fills them), and the device
 * synchronize every adapter has.
 */
#include "adapter_internal.h"

PyObject *flagos_adapter_synchronize(AdapterObject *self, PyObject *arg)
{
    return flagos_adapter_call_on_device(self, arg, self->api->synchronize, "synchronize");
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
    if (flagos_adapter_check(self, rc, call, device, st) < 0)
        return NULL;
    if (handle == 0) {
        flagos_adapter_broken_answer(self, "%s() on device %d returned success and handle 0", call,
                                     device);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(handle);
}

/* stream_create(device, priority) -> stream handle */
PyObject *flagos_adapter_stream_create(AdapterObject *self, PyObject *args)
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
PyObject *flagos_adapter_event_create(AdapterObject *self, PyObject *args)
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
    if (flagos_adapter_check(self, fn(device, (uint64_t)handle, &st), name, device, &st) < 0)
        return NULL;
    Py_RETURN_NONE;
}

#define ON_HANDLE(f)                                                                  \
    PyObject *flagos_adapter_##f(AdapterObject *self, PyObject *args)                 \
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
    if (flagos_adapter_check(self, fn(device, (uint64_t)handle, &done, &st),
                             events ? "event_query" : "stream_query", device, &st) < 0)
        return NULL;
    return PyBool_FromLong(done != 0);
}

/* stream_query(device, stream) / event_query(device, event) -> whether the work is done */
PyObject *flagos_adapter_stream_query(AdapterObject *self, PyObject *args)
{
    return query(self, args, 0);
}

PyObject *flagos_adapter_event_query(AdapterObject *self, PyObject *args)
{
    return query(self, args, 1);
}

/* stream_wait_event(device, stream, event) / event_record(device, event, stream) */
PyObject *flagos_adapter_stream_wait_event(AdapterObject *self, PyObject *args)
{
    int device;
    unsigned long long stream, event;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iKK", &device, &stream, &event) || need_streams(self) < 0)
        return NULL;
    int32_t rc = self->api->stream_wait_event(device, (flagos_stream)stream, (flagos_event)event, &st);
    if (flagos_adapter_check(self, rc, "stream_wait_event", device, &st) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyObject *flagos_adapter_event_record(AdapterObject *self, PyObject *args)
{
    int device;
    unsigned long long event, stream;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iKK", &device, &event, &stream) || need_streams(self) < 0)
        return NULL;
    int32_t rc = self->api->event_record(device, (flagos_event)event, (flagos_stream)stream, &st);
    if (flagos_adapter_check(self, rc, "event_record", device, &st) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* event_elapsed_ms(device, start, end) -> milliseconds between two completed timing events */
PyObject *flagos_adapter_event_elapsed_ms(AdapterObject *self, PyObject *args)
{
    int device;
    unsigned long long start, end;
    double ms = 0.0;
    flagos_status st = {0};
    if (!PyArg_ParseTuple(args, "iKK", &device, &start, &end) || need_streams(self) < 0)
        return NULL;
    int32_t rc = self->api->event_elapsed_ms(device, (flagos_event)start, (flagos_event)end, &ms, &st);
    if (flagos_adapter_check(self, rc, "event_elapsed_ms", device, &st) < 0)
        return NULL;
    return PyFloat_FromDouble(ms);
}
