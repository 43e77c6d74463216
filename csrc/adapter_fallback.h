/* The host round trip of a C-ABI chip in C (adapter_fallback.c): the common case of the CPU
 * fallback on such a chip, run from the router without the Python runner.
 */
#ifndef FLAGOS_ADAPTER_FALLBACK_H
#define FLAGOS_ADAPTER_FALLBACK_H

#include "state.h"

/* Run the op on the host when the call is in the common case: copy its flagos tensors' bytes
 * to the host, run it, copy written arguments back and upload new results; counts bytes, time
 * and dtypes in e (the caller counts the call). before(st, e) runs once the call is known to
 * be taken and before anything ran (the fallback policy); its -1 is returned as is.
 * 1 and *out (new reference) when it ran; 0 when the call is not in the common case (nothing
 * ran, no error set: the Python runner takes it); -1 with an error set. */
int flagos_adapter_fallback(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                            int (*before)(flagos_state *, op_entry *), PyObject **out);

#endif
