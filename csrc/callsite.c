/* First call site in user code: the innermost frame whose file is outside
 * torch and flagos. Captured once per op, when the op is first seen, so the
 * report can say where a fallback came from without a per-call cost.
 */
#include "callsite.h"

#include <frameobject.h>

static int is_library_file(flagos_state *st, PyObject *filename)
{
    Py_ssize_t n = PyTuple_GET_SIZE(st->skip_prefixes);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t r = PyUnicode_Tailmatch(filename, PyTuple_GET_ITEM(st->skip_prefixes, i), 0,
                                           PY_SSIZE_T_MAX, -1);
        if (r != 0)
            return (int)r; /* 1: a library file, -1: error */
    }
    return 0;
}

PyObject *flagos_user_call_site(flagos_state *st)
{
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed */
    Py_XINCREF(frame);
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame); /* new reference */
        PyObject *filename = code->co_filename;
        int lib = is_library_file(st, filename);
        if (lib < 0) {
            Py_DECREF(code);
            Py_DECREF(frame);
            return NULL;
        }
        if (!lib) {
            PyObject *site = PyUnicode_FromFormat("%U:%d", filename, PyFrame_GetLineNumber(frame));
            Py_DECREF(code);
            Py_DECREF(frame);
            return site;
        }
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(frame); /* new reference */
        Py_DECREF(frame);
        frame = back;
    }
    Py_RETURN_NONE;
}
