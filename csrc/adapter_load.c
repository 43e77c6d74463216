/* Chip adapters: loading a libflagos_<chip>_adapter.so with dlopen, checking its ABI (entry
 * point, version, table size, required entries, kernel table, init()), and the Adapter type
 * (one loaded library) with its identity and device queries. Its memory, stream and kernel
 * methods live in adapter_memory.c, adapter_streams.c and adapter_kernels.c.
 */
#include "adapter_internal.h"
#include "adapter.h"
#include "state.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

_Static_assert(FLAGOS_MAX_DEVICES == MAX_DEVICES, "the ABI's device limit is the router's");

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
    PyMem_Free(self->kernel_calls);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *adapter_device_count(AdapterObject *self, PyObject *Py_UNUSED(arg))
{
    int32_t n = 0;
    flagos_status st = {0};
    if (flagos_adapter_check(self, self->api->device_count(&n, &st), "device_count", -1, &st) < 0)
        return NULL;
    if (n < 0 || n > FLAGOS_MAX_DEVICES) {
        flagos_adapter_broken_answer(self, "device_count() reported %d devices; flagos drives 0 "
                                     "to %d", (int)n, FLAGOS_MAX_DEVICES);
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
    int32_t rc = self->api->device_props(device, &p, &st);
    if (flagos_adapter_check(self, rc, "device_props", device, &st) < 0)
        return NULL;
    p.name[sizeof(p.name) - 1] = '\0';
    return Py_BuildValue("{s:s,s:K,s:K}", "name", p.name, "total_memory",
                         (unsigned long long)p.total_memory, "native_dtypes",
                         (unsigned long long)p.native_dtypes);
}

static PyObject *adapter_error_name(AdapterObject *self, PyObject *arg)
{
    int code = _PyLong_AsInt(arg);
    if (code == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(flagos_adapter_code_name(self->api, code));
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

/* Adapter.<name>: the loader's own methods here, the others from their units. */
static PyMethodDef adapter_methods[] = {
    {"device_count", (PyCFunction)adapter_device_count, METH_NOARGS, "number of devices"},
    {"props", (PyCFunction)adapter_props, METH_O, "props(device) -> dict"},
    {"memory_info", (PyCFunction)flagos_adapter_memory_info, METH_O, "memory_info(device) -> dict"},
    {"reset_peak", (PyCFunction)flagos_adapter_reset_peak, METH_O, "reset_peak(device)"},
    {"empty_cache", (PyCFunction)flagos_adapter_empty_cache, METH_O, "empty_cache(device)"},
    {"synchronize", (PyCFunction)flagos_adapter_synchronize, METH_O, "synchronize(device)"},
    {"error_name", (PyCFunction)adapter_error_name, METH_O, "error_name(code) -> str"},
    {"kernels", (PyCFunction)flagos_adapter_kernels, METH_NOARGS,
     "[(op, dtype mask)] in table order"},
    {"kernel_times", (PyCFunction)flagos_adapter_kernel_times, METH_NOARGS,
     "[(op, calls, seconds inside the kernel)] in table order, since the library was loaded"},
    {"alloc", (PyCFunction)flagos_adapter_alloc, METH_VARARGS, "alloc(device, nbytes) -> Buffer"},
    {"alloc_tensor", (PyCFunction)flagos_adapter_alloc_tensor, METH_VARARGS,
     "alloc_tensor(device, sizes, strides | None, itemsize) -> Buffer, the layout checked first"},
    {"run_kernel", (PyCFunction)flagos_adapter_run_kernel, METH_VARARGS,
     "run_kernel(index, device, inputs, outputs, scalars, ints)"},
    {"stream_create", (PyCFunction)flagos_adapter_stream_create, METH_VARARGS,
     "stream_create(device, priority) -> stream handle"},
    {"stream_destroy", (PyCFunction)flagos_adapter_stream_destroy, METH_VARARGS,
     "stream_destroy(device, stream)"},
    {"set_stream", (PyCFunction)flagos_adapter_set_stream, METH_VARARGS,
     "set_stream(device, stream): where the device's work goes from now on (0: default)"},
    {"stream_synchronize", (PyCFunction)flagos_adapter_stream_synchronize, METH_VARARGS,
     "stream_synchronize(device, stream)"},
    {"stream_query", (PyCFunction)flagos_adapter_stream_query, METH_VARARGS,
     "stream_query(device, stream) -> bool"},
    {"stream_wait_event", (PyCFunction)flagos_adapter_stream_wait_event, METH_VARARGS,
     "stream_wait_event(device, stream, event)"},
    {"event_create", (PyCFunction)flagos_adapter_event_create, METH_VARARGS,
     "event_create(device, flags) -> event handle"},
    {"event_destroy", (PyCFunction)flagos_adapter_event_destroy, METH_VARARGS,
     "event_destroy(device, event)"},
    {"event_record", (PyCFunction)flagos_adapter_event_record, METH_VARARGS,
     "event_record(device, event, stream)"},
    {"event_synchronize", (PyCFunction)flagos_adapter_event_synchronize, METH_VARARGS,
     "event_synchronize(device, event)"},
    {"event_query", (PyCFunction)flagos_adapter_event_query, METH_VARARGS,
     "event_query(device, event) -> bool"},
    {"event_elapsed_ms", (PyCFunction)flagos_adapter_event_elapsed_ms, METH_VARARGS,
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
        PyErr_Format(flagos_adapter_error_class(), "cannot use chip adapter %U: %U", path, reason);
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
        load_error(path, "its init() failed (%s, code %d): %s", flagos_adapter_code_name(api, rc),
                   (int)rc, st.message[0] ? st.message : "the adapter gave no message");
        dlclose(lib);
        goto done;
    }
    AdapterObject *a = PyObject_New(AdapterObject, &Adapter_Type);
    /* one block: calls in its first half, nanoseconds in its second */
    uint64_t *kernel_stats = PyMem_Calloc(2 * (size_t)api->n_kernels + 1, sizeof(uint64_t));
    if (a == NULL || kernel_stats == NULL) {
        if (a != NULL)
            PyObject_Free(a);
        PyMem_Free(kernel_stats);
        PyErr_NoMemory();
        if (api->shutdown)
            api->shutdown();
        dlclose(lib);
        goto done;
    }
    a->library = lib;
    a->api = api;
    a->has_streams = has_streams;
    a->path = Py_NewRef(path);
    a->kernel_calls = kernel_stats;
    a->kernel_ns = kernel_stats + api->n_kernels;
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
    if (PyType_Ready(&flagos_buffer_type) < 0 || PyType_Ready(&Adapter_Type) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "Buffer", (PyObject *)&flagos_buffer_type) < 0 ||
        PyModule_AddObjectRef(module, "Adapter", (PyObject *)&Adapter_Type) < 0)
        return -1;
    return PyModule_AddIntConstant(module, "ADAPTER_ABI_MAJOR", FLAGOS_ADAPTER_ABI_MAJOR) < 0 ||
                   PyModule_AddIntConstant(module, "ADAPTER_ABI_MINOR", FLAGOS_ADAPTER_ABI_MINOR) < 0 ||
                   PyModule_AddIntConstant(module, "ADAPTER_EVENT_TIMING", FLAGOS_EVENT_TIMING) < 0
               ? -1
               : 0;
}

int flagos_is_adapter(PyObject *obj)
{
    return Py_TYPE(obj) == &Adapter_Type;
}
