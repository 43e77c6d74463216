/* flagos._C's side of chip adapters: the loader and the Adapter/Buffer types (adapter.c). */
#ifndef FLAGOS_ADAPTER_LOADER_H
#define FLAGOS_ADAPTER_LOADER_H

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
} AdapterObject;

typedef struct {
    PyObject_HEAD
    AdapterObject *adapter;     /* strong: the library stays loaded while buffers live */
    int32_t device;
    flagos_buffer buffer;
    uint64_t nbytes;
} BufferObject;

PyObject *flagos_load_adapter(PyObject *module, PyObject *path);
PyObject *flagos_set_error_types(PyObject *module, PyObject *args);
void flagos_adapter_types_clear(void);
int flagos_adapter_types_ready(PyObject *module);

#endif
