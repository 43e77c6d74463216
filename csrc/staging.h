/* Reusable host staging buffers for the CPU fallback (staging.c). */
#ifndef FLAGOS_STAGING_H
#define FLAGOS_STAGING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Smaller copies get a host tensor of their own, or of their dtype and shape
 * (flagos_host_tensor_take): a small malloc is cheaper than retyping a staging buffer, and it
 * comes from the heap, not fresh pages (glibc's default mmap threshold is 128 KiB). */
#define FLAGOS_STAGING_MIN_BYTES ((uint64_t)128 << 10)

/* New reference: a 1-dim uint8 host tensor of at least nbytes bytes, from the pool or new; the
 * caller owns it until it hands it back with flagos_staging_give. NULL with an error set. */
PyObject *flagos_staging_take(uint64_t nbytes);

/* New reference: a 1-dim uint8 host tensor of exactly nbytes bytes, of its own (not from the
 * pool: for copies under FLAGOS_STAGING_MIN_BYTES). NULL with an error set. */
PyObject *flagos_host_bytes(uint64_t nbytes);

/* New reference: torch.empty(shape, dtype=dtype), a host tensor of its own. NULL with an
 * error set. */
PyObject *flagos_host_empty(PyObject *shape, PyObject *dtype);

/* New reference: a host tensor like torch.empty(shape, dtype=dtype), of its own until handed
 * back: one kept from an earlier call when one of that dtype and shape is (its values are
 * stale: the caller overwrites all of them), else new. NULL with an error set. */
PyObject *flagos_host_tensor_take(PyObject *shape, PyObject *dtype);

/* Hand back a tensor from flagos_host_tensor_take (steals the reference), with the shape and
 * dtype it was taken for and its size: kept for the next call while nothing else sees it or
 * its memory and the pool is within its bound (FLAGOS_FALLBACK_STAGING), else freed. Only for
 * a tensor no op wrote to or resized. */
void flagos_host_tensor_give(PyObject *t, PyObject *shape, PyObject *dtype, uint64_t nbytes);

/* Hand back a tensor from flagos_staging_take (steals the reference): kept for the next call
 * while the pool is within its bound and the tensor still owns its whole buffer, else freed.
 * Call it only once nothing else can see the tensor's memory. */
void flagos_staging_give(PyObject *t);

/* New reference: a host tensor with src's values, sizes and strides in a staging buffer, whose
 * reference goes to *flat (hand it back with flagos_staging_give once the host tensor and
 * everything made from it are gone); Py_None (and *flat NULL) when src does not fit one (not
 * dense, math bits, under FLAGOS_STAGING_MIN_BYTES); NULL with an error set. */
PyObject *flagos_staging_copy(PyObject *src, uint64_t nbytes, PyObject *dtype, PyObject **flat);

/* Python: _C.staging_take(nbytes), _C.staging_give(t), _C.staging_release(), _C.staging_stats() */
PyObject *flagos_staging_take_py(PyObject *module, PyObject *arg);
PyObject *flagos_staging_give_py(PyObject *module, PyObject *arg);
PyObject *flagos_staging_release_py(PyObject *module, PyObject *arg);
PyObject *flagos_staging_stats_py(PyObject *module, PyObject *arg);

/* Free every kept buffer and the references to torch (module teardown). */
void flagos_staging_clear(void);

#endif
