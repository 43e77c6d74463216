/* The C-ABI hot path (adapter_fast.c): the common case of the kernel-table ops, their
 * in-place forms and views on a C-ABI chip, run from the router without the Python runner.
 */
#ifndef FLAGOS_ADAPTER_FAST_H
#define FLAGOS_ADAPTER_FAST_H

#include "state.h"

/* What configure() reads from the runner's `c_fast` attribute; filled by
 * flagos_adapter_fast_parse, installed into the state by flagos_adapter_fast_install. */
typedef struct adapter_fast_spec {
    PyObject *adapter;            /* new reference, or NULL: the runner has no c_fast */
    PyObject *dtypes;             /* new reference (tuple), or NULL */
    PyObject *runner_ops;         /* new reference (frozenset), or NULL: no round trip in C */
    PyObject *kernel_ops;         /* new reference (frozenset), NULL with runner_ops */
    uint64_t native[MAX_DEVICES];
    int n_devices;
} adapter_fast_spec;

/* Read runner.c_fast = (Adapter, tuple of native dtype masks per device, tuple of the
 * torch.dtype of each flagos_dtype code[, frozenset of the op names the runner always handles
 * itself, frozenset of those it tries a kernel for when routed native]; without the two, the
 * host round trip stays in the runner). runner NULL or without the attribute: an empty spec.
 * 0, or -1 with a TypeError naming what is wrong (nothing held then). */
int flagos_adapter_fast_parse(PyObject *runner, adapter_fast_spec *spec);
/* Replace the state's fast-path configuration with spec (its references move to the state);
 * the old references go to *old_adapter / *old_dtypes for the caller to drop once the whole
 * configuration is in place. */
void flagos_adapter_fast_install(flagos_state *st, adapter_fast_spec *spec, PyObject **old_adapter,
                                 PyObject **old_dtypes, PyObject **old_runner_ops,
                                 PyObject **old_kernel_ops);

/* op_entry.fast_fallback: when adapter_fallback.c may take the op's host round trip */
#define FAST_FALLBACK_NEVER 0   /* the runner handles it itself (or no runner sets were given) */
#define FAST_FALLBACK_ROUTED 1  /* when routed to the fallback (native: the runner's kernel) */
#define FAST_FALLBACK_ALWAYS 2  /* routed to the fallback or native: the runner has no path */

/* The op's fast-path answer (kind, kernel, whether the C round trip may take it), looked up
 * again after a configure(). */
void flagos_adapter_fast_resolve(flagos_state *st, op_entry *e);

/* A new wrapper of (shape, strides, offset) over buf on flagos:device, its dtype the torch
 * dtype of flagos code `code`; shape_obj: the shape as a tuple when the caller has one
 * (borrowed), else NULL. NULL with an error set. */
PyObject *flagos_adapter_wrap(flagos_state *st, PyObject *buf, PyObject *shape_obj,
                              const int64_t *shape, const int64_t *strides, int ndim,
                              int64_t offset, int code, int device);

/* Run one op in C when it is in the fast case: 1 and *out (a new flagos tensor) when it ran;
 * 0 when it is not in the fast case (nothing ran, no error set: the Python runner takes it);
 * -1 with the error the runner would raise (out of memory, a failed kernel). */
int flagos_adapter_fast_call(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                             PyObject **out);

#endif
