/* flagos._C's side of chip adapters, as module.c uses it: the loader and the Adapter/Buffer
 * types (adapter_load.c), and the flagos error types adapter calls raise (adapter_checks.c).
 * What the adapter units share among themselves is in adapter_internal.h.
 */
#ifndef FLAGOS_ADAPTER_LOADER_H
#define FLAGOS_ADAPTER_LOADER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *flagos_load_adapter(PyObject *module, PyObject *path);
PyObject *flagos_set_error_types(PyObject *module, PyObject *args);
void flagos_adapter_types_clear(void);
/* In a forked child whose chip does not survive fork: buffers inherited from the parent are
 * dropped without calling the adapter (the driver's threads stayed in the parent). */
void flagos_adapter_forget_buffers(void);
int flagos_adapter_types_ready(PyObject *module);

#endif
