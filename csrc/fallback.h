/* The CPU fallback route (fallback.c). Calls payload.c only. */
#ifndef FLAGOS_FALLBACK_H
#define FLAGOS_FALLBACK_H

#include "state.h"

/* Run the op on the host, copying chip tensors there and back; counts bytes, dtypes and time
 * in e. target: a PyLong as for flagos_wrap_outputs. New reference, or NULL on error. */
PyObject *flagos_run_fallback(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                              PyObject *target);

/* Record that the op's fallback saw this dtype (a torch.dtype object). */
void flagos_note_dtype(flagos_state *st, op_entry *e, PyObject *dtype);

#endif
