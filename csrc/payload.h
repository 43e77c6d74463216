/* Between flagos tensors and chip payloads (payload.c): unwrap, rewrap, written arguments and
 * the call of a chip op on payloads, shared by the router's native route and the fallback.
 * Reads the shared state; calls no other router unit.
 */
#ifndef FLAGOS_PAYLOAD_H
#define FLAGOS_PAYLOAD_H

#include "state.h"

/* Where an op's outputs go, from its Device argument: >= 0 a flagos index, or one of these. */
#define TARGET_FOLLOW (-1) /* none given: follow the inputs */
#define TARGET_HOST (-2)   /* a non-flagos device: hand host results out as they are */
#define TARGET_ERROR (-3)  /* an error is set */

/* A new list or tuple (the type of seq) holding fn(ctx, item) for each item; NULL on error.
 * fn returns a new reference. */
typedef PyObject *(*flagos_item_fn)(void *ctx, PyObject *item);
PyObject *flagos_map_sequence(PyObject *seq, flagos_item_fn fn, void *ctx);

/* 1 when obj is a tensor of the active chip (a wrapper in device mode), else 0. */
int flagos_is_chip_tensor(flagos_state *st, PyObject *obj);
/* New reference to the chip tensor behind obj (itself in native mode). */
PyObject *flagos_payload(flagos_state *st, PyObject *obj);

/* The target of this call (see TARGET_*), from the op's Device argument when it has one. */
int flagos_find_target(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs);

/* New args tuple and kwargs dict (NULL when none) with flagos tensors replaced by payloads and
 * flagos devices by chip devices; check: raise on a tensor of another device (the mixed-device
 * check). 0, or -1 with an error set and nothing returned. */
int flagos_unwrap_call(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs,
                       int check, PyObject **out_args, PyObject **out_kwargs);

/* A new wrapper on flagos:index (its payload not set yet): the one way wrappers are made. */
PyObject *flagos_new_wrapper(flagos_state *st, PyObject *shape, PyObject *stride, PyObject *offset,
                             PyObject *dtype, int index);
/* New reference: payload t behind a new flagos tensor on flagos:index (index < 0: the payload's
 * device, flagos:0 for a host tensor), requiring grad where t does. */
PyObject *flagos_wrap_payload(flagos_state *st, PyObject *t, int index);
/* New reference: the op's result as the caller must see it. out is stolen.
 * target: a PyLong holding a flagos index, TARGET_FOLLOW or TARGET_HOST. */
PyObject *flagos_wrap_outputs(flagos_state *st, op_entry *e, PyObject *out, PyObject *target);
/* flagos_wrap_outputs for a view op's results, inside flagos_view_guard(args). */
PyObject *flagos_wrap_view_outputs(flagos_state *st, op_entry *e, PyObject *out, PyObject *target,
                                   PyObject *args);

/* What a view's wrapper needs under torch.inference_mode(): a new reference to an entered
 * torch._C._InferenceMode(False) when the view's base is a normal tensor, Py_None (new
 * reference) when nothing is needed, NULL on error. */
PyObject *flagos_view_guard(flagos_state *st, PyObject *args);
/* Leave the guard (stolen); result is returned, or NULL if it or the exit failed. */
PyObject *flagos_leave_guard(PyObject *guard, PyObject *result);

/* Value of schema argument i as the caller passed it (borrowed), or NULL if absent (or on error:
 * check PyErr_Occurred()). */
PyObject *flagos_argument_value(op_entry *e, PyObject *args, PyObject *kwargs, Py_ssize_t i);

/* After an op that may relayout what it wrote (OP_RELAYOUT): each written wrapper takes its
 * payload's shape, strides and offset. */
int flagos_sync_written(flagos_state *st, op_entry *e, PyObject *args, PyObject *kwargs);

/* In-place and out= ops return the tensor they wrote: hand back the caller's own object,
 * so identity (and autograd's view/version bookkeeping on it) is kept. out is stolen. */
PyObject *flagos_alias_outputs(op_entry *e, PyObject *args, PyObject *kwargs, PyObject *out);

/* Call e's chip op on payloads (fn(*args, **kwargs)), with the conjugate and negative keys on
 * again when a tensor argument is complex or the op is a decomposition that can make
 * conjugate views of complex intermediates from real inputs (OP_MATH_KEYS: fft.hfftn). */
PyObject *flagos_call_payload(flagos_state *st, const op_entry *e, PyObject *fn, PyObject *args,
                              PyObject *kwargs);

#endif
