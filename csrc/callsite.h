/* The first call site in user code (callsite.c). */
#ifndef FLAGOS_CALLSITE_H
#define FLAGOS_CALLSITE_H

#include "state.h"

/* New reference: "file:line" of the innermost frame outside torch and flagos, or None. */
PyObject *flagos_user_call_site(flagos_state *st);

#endif
