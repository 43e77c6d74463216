/* Reusable host staging buffers for the CPU fallback.
 *
 * A fallback copies each chip argument into a host tensor, runs the op there and copies the
 * results back. A fresh host tensor per argument and call costs an allocation (and, for large
 * ones, the page faults of new memory); these buffers are kept between calls instead. One pool
 * per power-of-two size class (4 KiB and up), at most STAGING_PER_CLASS buffers a class, at most
 * FLAGOS_FALLBACK_STAGING bytes in all (default 256M; 0 keeps none). A buffer is out of the pool
 * while a call uses it, so threads never share one; the chip's empty_cache() frees them all.
 *
 * Every pool operation runs under the GIL without calling Python in between, so it is atomic;
 * tensors are created and freed outside those steps.
 */
#include "staging.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <stdlib.h>
#include <string.h>

#define STAGING_MIN_SHIFT 12
#define STAGING_CLASSES 64
#define STAGING_PER_CLASS 8
#define STAGING_DEFAULT_LIMIT ((uint64_t)256 << 20)

static PyObject *kept[STAGING_CLASSES][STAGING_PER_CLASS];
static int n_kept[STAGING_CLASSES];
static uint64_t kept_bytes, hits, misses;

/* Typed host tensors of the small direct copies (flagos_host_tensor_take), kept by dtype and
 * sizes, oldest first: at these sizes torch.empty's argument parsing costs more than the copy. */
#define HOST_TENSORS_KEPT 8
typedef struct host_tensor {
    PyObject *t, *shape, *dtype; /* owned */
    uint64_t nbytes;
} host_tensor;
static host_tensor host_tensors[HOST_TENSORS_KEPT];
static int n_host_tensors;
static uint64_t host_hits, host_misses;
static PyObject *torch_empty, *empty_kwargs; /* torch.empty, {"dtype": torch.uint8} */
static PyTypeObject *buffer_type;             /* the type of the buffers made here */
static PyObject *use_count;                   /* torch._C._storage_Use_Count */
static PyObject *strided;                     /* torch.strided */
static long base_uses = -1;                   /* its answer for a buffer nothing else sees */

/* References to t's storage (its data), or -1 with an error set. */
static long storage_uses(PyObject *t)
{
    PyObject *storage = PyObject_CallMethod(t, "untyped_storage", NULL);
    PyObject *cdata = storage ? PyObject_GetAttrString(storage, "_cdata") : NULL;
    PyObject *n = cdata ? PyObject_CallOneArg(use_count, cdata) : NULL;
    long uses = n ? PyLong_AsLong(n) : -1;
    Py_XDECREF(storage);
    Py_XDECREF(cdata);
    Py_XDECREF(n);
    return uses;
}

static int class_of(uint64_t nbytes)
{
    int k = STAGING_MIN_SHIFT;
    while (k < STAGING_CLASSES - 1 && ((uint64_t)1 << k) < nbytes)
        k++;
    return k;
}

/* FLAGOS_FALLBACK_STAGING: bytes with an optional K, M or G suffix. Read on every call (a
 * getenv and a short parse) so that a change of the variable takes effect at once. */
static int staging_limit(uint64_t *limit)
{
    const char *v = getenv("FLAGOS_FALLBACK_STAGING");
    if (v == NULL || *v == '\0') {
        *limit = STAGING_DEFAULT_LIMIT;
        return 0;
    }
    char *end;
    errno = 0;
    unsigned long long n = isdigit((unsigned char)*v) ? strtoull(v, &end, 10) : 0;
    uint64_t mult = 1;
    int ok = isdigit((unsigned char)*v) && errno == 0;
    if (ok) {
        switch (toupper((unsigned char)*end)) {
        case 'K': mult = 1ull << 10; end++; break;
        case 'M': mult = 1ull << 20; end++; break;
        case 'G': mult = 1ull << 30; end++; break;
        default: break;
        }
        if (toupper((unsigned char)*end) == 'B')
            end++;
        ok = *end == '\0' && n <= UINT64_MAX / mult;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "FLAGOS_FALLBACK_STAGING='%s' is not a size; use bytes with "
                     "an optional K, M or G suffix, e.g. FLAGOS_FALLBACK_STAGING=256M (0 keeps no "
                     "staging buffers)", v);
        return -1;
    }
    *limit = (uint64_t)n * mult;
    return 0;
}

/* torch.empty, {"dtype": torch.uint8}, torch.strided and torch._C._storage_Use_Count, once. */
static int init_torch(void)
{
    if (torch_empty != NULL)
        return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL)
        return -1;
    PyObject *empty = PyObject_GetAttrString(torch, "empty");
    PyObject *uint8 = empty ? PyObject_GetAttrString(torch, "uint8") : NULL;
    PyObject *kw = uint8 ? Py_BuildValue("{s:O}", "dtype", uint8) : NULL;
    PyObject *str = kw ? PyObject_GetAttrString(torch, "strided") : NULL;
    PyObject *tc = str ? PyObject_GetAttrString(torch, "_C") : NULL;
    PyObject *uc = tc ? PyObject_GetAttrString(tc, "_storage_Use_Count") : NULL;
    Py_DECREF(torch);
    Py_XDECREF(uint8);
    Py_XDECREF(tc);
    if (uc == NULL || torch_empty != NULL) { /* failed, or another thread was first */
        Py_XDECREF(empty);
        Py_XDECREF(kw);
        Py_XDECREF(str);
        Py_XDECREF(uc);
        return uc == NULL ? -1 : 0;
    }
    torch_empty = empty;
    empty_kwargs = kw;
    strided = str;
    use_count = uc;
    return 0;
}

static PyObject *new_buffer(uint64_t nbytes)
{
    if (init_torch() < 0)
        return NULL;
    PyObject *size = PyLong_FromUnsignedLongLong(nbytes);
    if (size == NULL)
        return NULL;
    PyObject *args = PyTuple_Pack(1, size);
    Py_DECREF(size);
    if (args == NULL)
        return NULL;
    PyObject *t = PyObject_Call(torch_empty, args, empty_kwargs);
    Py_DECREF(args);
    if (t != NULL && buffer_type == NULL)
        buffer_type = (PyTypeObject *)Py_NewRef(Py_TYPE(t));
    if (t != NULL && base_uses < 0 && (base_uses = storage_uses(t)) < 0)
        Py_CLEAR(t);
    return t;
}

/* The op's own host output and the result's memory are still fresh allocations every call.
 * glibc gives freed blocks at the top of its heap back to the OS once they exceed its trim
 * threshold (twice its dynamic mmap threshold, about 2 MiB after 1 MiB blocks), and serves
 * blocks over the mmap threshold with fresh mappings: either way the next call page-faults
 * the same memory in again, which measured 5-10x the copies at 1 and 16 MiB. At the first
 * staged copy, glibc is asked to keep up to the staging limit of freed heap (M_TRIM_THRESHOLD)
 * and to serve blocks up to 32 MiB from its heap (M_MMAP_THRESHOLD, glibc's own ceiling for
 * its dynamic threshold): the fallback's host memory is then reused like the staging
 * buffers. Once per process, only where a fallback stages (FLAGOS_FALLBACK_STAGING=0: never). */
static void keep_freed_heap(uint64_t limit)
{
#if defined(__GLIBC__)
    static int done;
    if (done || limit == 0)
        return;
    done = 1;
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, limit > (uint64_t)INT_MAX ? INT_MAX : (int)limit);
#else
    (void)limit;
#endif
}

PyObject *flagos_staging_take(uint64_t nbytes)
{
    int k = class_of(nbytes);
    if (n_kept[k] > 0) {
        PyObject *t = kept[k][--n_kept[k]];
        kept[k][n_kept[k]] = NULL;
        kept_bytes -= (uint64_t)1 << k;
        hits++;
        return t;
    }
    uint64_t limit;
    if (staging_limit(&limit) < 0)
        return NULL;
    keep_freed_heap(limit);
    misses++;
    /* a size the pool would never keep gets a buffer of its own size */
    return new_buffer(((uint64_t)1 << k) <= limit ? (uint64_t)1 << k : nbytes);
}

PyObject *flagos_host_bytes(uint64_t nbytes)
{
    return new_buffer(nbytes);
}

PyObject *flagos_host_tensor_take(PyObject *shape, PyObject *dtype)
{
    for (int i = n_host_tensors - 1; i >= 0; i--) {
        host_tensor *h = &host_tensors[i];
        if (h->dtype != dtype || PyTuple_GET_SIZE(h->shape) != PyTuple_GET_SIZE(shape))
            continue;
        int same = PyObject_RichCompareBool(h->shape, shape, Py_EQ); /* ints: no Python code */
        if (same < 0)
            return NULL;
        if (!same)
            continue;
        host_tensor taken = *h;
        memmove(h, h + 1, (size_t)(n_host_tensors - 1 - i) * sizeof(*h));
        n_host_tensors--;
        kept_bytes -= taken.nbytes;
        host_hits++;
        Py_DECREF(taken.shape);
        Py_DECREF(taken.dtype);
        return taken.t;
    }
    host_misses++;
    PyObject *t = flagos_host_empty(shape, dtype);
    if (t != NULL && base_uses < 0 && (base_uses = storage_uses(t)) < 0)
        Py_CLEAR(t);
    return t;
}

void flagos_host_tensor_give(PyObject *t, PyObject *shape, PyObject *dtype, uint64_t nbytes)
{
    PyObject *err_type, *err_value, *err_tb;
    PyErr_Fetch(&err_type, &err_value, &err_tb);
    uint64_t limit = 0;
    long uses = -1;
    if (Py_REFCNT(t) == 1 && base_uses >= 0 && staging_limit(&limit) == 0)
        uses = storage_uses(t);
    PyErr_Clear(); /* not kept: freed below */
    /* the Python calls above are done: from here to the push nothing can run in between.
     * Kept only where nothing else sees the tensor or its memory (an op may keep a view). */
    PyObject *drop[4] = {NULL, NULL, NULL, t};
    if (Py_REFCNT(t) == 1 && uses >= 0 && uses <= base_uses && nbytes <= limit) {
        if (n_host_tensors == HOST_TENSORS_KEPT) { /* the oldest makes room */
            host_tensor *oldest = &host_tensors[0];
            drop[0] = oldest->t;
            drop[1] = oldest->shape;
            drop[2] = oldest->dtype;
            kept_bytes -= oldest->nbytes;
            memmove(oldest, oldest + 1, (HOST_TENSORS_KEPT - 1) * sizeof(*oldest));
            n_host_tensors--;
        }
        if (kept_bytes <= limit - nbytes) {
            host_tensors[n_host_tensors++] = (host_tensor){t, Py_NewRef(shape), Py_NewRef(dtype), nbytes};
            kept_bytes += nbytes;
            drop[3] = NULL;
        }
    }
    for (int i = 0; i < 4; i++) /* after the pool is consistent: a free may run other code */
        Py_XDECREF(drop[i]);
    PyErr_Restore(err_type, err_value, err_tb);
}

PyObject *flagos_host_empty(PyObject *shape, PyObject *dtype)
{
    static PyObject *kwnames; /* ("dtype",), kept for the process */
    if (init_torch() < 0 || (kwnames == NULL && (kwnames = Py_BuildValue("(s)", "dtype")) == NULL))
        return NULL;
    PyObject *argv[3] = {NULL, shape, dtype};
    return PyObject_Vectorcall(torch_empty, argv + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
}

void flagos_staging_give(PyObject *t)
{
    PyObject *err_type, *err_value, *err_tb;
    PyErr_Fetch(&err_type, &err_value, &err_tb); /* callers hand back on their error paths too */
    uint64_t limit = 0, nbytes = 0;
    long uses = -1;
    PyObject *n = PyObject_GetAttrString(t, "nbytes");
    if (n != NULL) {
        nbytes = PyLong_AsUnsignedLongLong(n);
        Py_DECREF(n);
    }
    /* A buffer whose memory something else still sees (a view an op kept, a result that is
     * an input) is never handed out again: it is left to its other owners. */
    if (!PyErr_Occurred() && staging_limit(&limit) == 0)
        uses = storage_uses(t);
    PyErr_Clear(); /* not kept: freed below */
    /* the Python calls above are done: from here to the push nothing can run in between */
    int k = class_of(nbytes);
    int keep = uses >= 0 && uses <= base_uses && nbytes == ((uint64_t)1 << k) &&
               n_kept[k] < STAGING_PER_CLASS && nbytes <= limit && kept_bytes <= limit - nbytes;
    if (keep) {
        kept[k][n_kept[k]++] = t;
        kept_bytes += nbytes;
    } else {
        Py_DECREF(t);
    }
    PyErr_Restore(err_type, err_value, err_tb);
}

/* Whether t's values can be copied into a staging buffer laid out as t is: a dense strided
 * tensor with real memory and no conjugate or negative bit (those keep the _to_copy path,
 * which carries the bits). 1 yes, 0 no, -1 error. */
static int fits(PyObject *t)
{
    static const char *const must_be_false[] = {"is_quantized", "is_meta"};
    static const char *const calls[][2] = {{"is_contiguous", "1"}, {"is_neg", "0"},
                                           {"is_conj", "0"}, {"_is_zerotensor", "0"}};
    PyObject *layout = PyObject_GetAttrString(t, "layout");
    if (layout == NULL)
        return -1;
    Py_DECREF(layout); /* torch.strided is a singleton: identity after the drop is safe */
    if (layout != strided)
        return 0;
    for (size_t i = 0; i < sizeof(must_be_false) / sizeof(*must_be_false); i++) {
        PyObject *v = PyObject_GetAttrString(t, must_be_false[i]);
        int truth = v ? PyObject_IsTrue(v) : -1;
        Py_XDECREF(v);
        if (truth != 0)
            return truth < 0 ? -1 : 0;
    }
    for (size_t i = 0; i < sizeof(calls) / sizeof(*calls); i++) {
        PyObject *v = PyObject_CallMethod(t, calls[i][0], NULL);
        int truth = v ? PyObject_IsTrue(v) : -1;
        Py_XDECREF(v);
        if (truth < 0)
            return -1;
        if (truth != (calls[i][1][0] == '1'))
            return 0;
    }
    return 1;
}

PyObject *flagos_staging_copy(PyObject *src, uint64_t nbytes, PyObject *dtype, PyObject **flat)
{
    *flat = NULL;
    if (nbytes < FLAGOS_STAGING_MIN_BYTES || init_torch() < 0)
        return nbytes < FLAGOS_STAGING_MIN_BYTES ? Py_NewRef(Py_None) : NULL;
    int f = fits(src);
    if (f <= 0)
        return f < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *buf = flagos_staging_take(nbytes);
    if (buf == NULL)
        return NULL;
    PyObject *typed = PyObject_CallMethod(buf, "view", "O", dtype);
    PyObject *size = typed ? PyObject_CallMethod(src, "size", NULL) : NULL;
    PyObject *stride = size ? PyObject_CallMethod(src, "stride", NULL) : NULL;
    PyObject *host = stride ? PyObject_CallMethod(typed, "as_strided", "OO", size, stride) : NULL;
    PyObject *r = host ? PyObject_CallMethod(host, "copy_", "O", src) : NULL;
    Py_XDECREF(typed);
    Py_XDECREF(size);
    Py_XDECREF(stride);
    if (r == NULL) {
        Py_XDECREF(host);
        flagos_staging_give(buf);
        return NULL;
    }
    Py_DECREF(r);
    *flat = buf;
    return host;
}

static void release_buffers(void)
{
    PyObject *drop[STAGING_CLASSES * STAGING_PER_CLASS + 3 * HOST_TENSORS_KEPT];
    int n = 0;
    for (int k = 0; k < STAGING_CLASSES; k++) {
        while (n_kept[k] > 0) {
            drop[n++] = kept[k][--n_kept[k]];
            kept[k][n_kept[k]] = NULL;
        }
    }
    while (n_host_tensors > 0) {
        host_tensor *h = &host_tensors[--n_host_tensors];
        drop[n++] = h->t;
        drop[n++] = h->shape;
        drop[n++] = h->dtype;
        *h = (host_tensor){0};
    }
    kept_bytes = 0;
    for (int i = 0; i < n; i++) /* after the pool is consistent: a free may run other code */
        Py_DECREF(drop[i]);
}

void flagos_staging_clear(void)
{
    release_buffers();
    Py_CLEAR(torch_empty);
    Py_CLEAR(empty_kwargs);
    Py_CLEAR(buffer_type);
    Py_CLEAR(use_count);
    Py_CLEAR(strided);
    base_uses = -1;
}

PyObject *flagos_staging_take_py(PyObject *Py_UNUSED(module), PyObject *arg)
{
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "staging_take: a byte count is non-negative, got %lld", n);
        return NULL;
    }
    return flagos_staging_take((uint64_t)n);
}

PyObject *flagos_staging_give_py(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (buffer_type == NULL || Py_TYPE(arg) != buffer_type) {
        PyErr_SetString(PyExc_TypeError, "staging_give takes a tensor from staging_take");
        return NULL;
    }
    flagos_staging_give(Py_NewRef(arg));
    Py_RETURN_NONE;
}

PyObject *flagos_staging_release_py(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(arg))
{
    release_buffers();
    Py_RETURN_NONE;
}

PyObject *flagos_staging_stats_py(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(arg))
{
    int buffers = 0;
    for (int k = 0; k < STAGING_CLASSES; k++)
        buffers += n_kept[k];
    uint64_t limit;
    if (staging_limit(&limit) < 0)
        return NULL;
    return Py_BuildValue("{s:K,s:i,s:K,s:K,s:K,s:i,s:K,s:K}", "kept_bytes",
                         (unsigned long long)kept_bytes, "kept_buffers", buffers, "limit",
                         (unsigned long long)limit, "hits", (unsigned long long)hits, "misses",
                         (unsigned long long)misses, "kept_host_tensors", n_host_tensors,
                         "host_tensor_hits", (unsigned long long)host_hits,
                         "host_tensor_misses", (unsigned long long)host_misses);
}
