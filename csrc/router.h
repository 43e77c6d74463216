/* The per-op router (router.c): the dispatch table, routes, the fallback policy and counters.
 *
 * One entry per aten overload, created on the first call of that overload and kept until the
 * table is cleared (a new configuration). A call can run Python, which lets another thread
 * change routes or clear the table meanwhile: the call holds its entry (users), a clear leaves
 * an entry in use to its last user, and a route change only marks entries unresolved.
 *
 * The router calls payload.c (unwrap, rewrap, the call on payloads), fallback.c (the CPU
 * round trip) and callsite.c (where an op was called from); none of them calls the router.
 */
#ifndef FLAGOS_ROUTER_H
#define FLAGOS_ROUTER_H

#include "state.h"

/* One op call: func(*args, **kwargs) routed for the active chip. from_factory: no flagos tensor
 * argument (PrivateUse1's fallback for factories), so no mixed-device check. */
/* 0 when configure() has run in this process; else -1 with the error that says why (not active,
 * or a forked child's refusal). */
int flagos_check_configured(flagos_state *st);
PyObject *flagos_route_call(flagos_state *st, PyObject *func, PyObject *args, PyObject *kwargs,
                            int from_factory);
void flagos_table_clear(flagos_state *st);
void flagos_table_invalidate(flagos_state *st);
PyObject *flagos_table_export(flagos_state *st, int include_routes_only);

#endif
