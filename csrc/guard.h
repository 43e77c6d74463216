/* The device guard's type_() that survives a pending Python error (guard.c). */
#ifndef FLAGOS_GUARD_H
#define FLAGOS_GUARD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Adds GuardDeviceType and raise_kept() to flagos._C. */
int flagos_guard_ready(PyObject *module);

#endif
