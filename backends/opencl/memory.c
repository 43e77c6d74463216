/* Buffers of the OpenCL adapter and its caching allocator.
 *
 * A flagos_buffer is a handle (never 0, never reused) into a table of cl_mem objects. Sizes
 * are rounded up to size classes (512-byte steps up to 1 MiB, 1 MiB steps above) and a freed
 * buffer is kept in its device's cache for the next allocation of the same class, as
 * PyTorch's CUDA allocator does; empty_cache() releases the cache. memory_info() counts
 * rounded sizes: `allocated` for live buffers, `reserved` for those and the cache.
 *
 * free() may come while queued work still uses the buffer. Releasing a cl_mem is always safe
 * (OpenCL keeps it until its commands finish); reusing one from the cache is safe without a
 * wait only when all of the device's work runs on one in-order queue. With other streams in
 * use, the cache is marked pending and the device's queues are finished before a reuse.
 */
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

#include "opencl_internal.h"

typedef struct ocl_allocation {
    flagos_buffer handle; /* key */
    int32_t device;
    uint64_t nbytes;      /* as asked */
    uint64_t rounded;     /* its size class: what it holds of the device */
    cl_mem mem;
    UT_hash_handle hh;
} ocl_allocation;

struct ocl_cached_block {
    uint64_t rounded;
    cl_mem mem;
    ocl_cached_block *next;
};

static ocl_allocation *allocations;
static flagos_buffer next_handle = 1;

static uint64_t size_class(uint64_t nbytes)
{
    const uint64_t small = 512, large = 1024 * 1024;
    uint64_t step = nbytes <= large ? small : large;
    if (nbytes == 0)
        return small;
    if (nbytes > UINT64_MAX - step)
        return UINT64_MAX;
    return (nbytes + step - 1) / step * step;
}

static void release_cache(ocl_device *d)
{
    ocl_cached_block *b = d->cache;
    while (b != NULL) {
        ocl_cached_block *next = b->next;
        clReleaseMemObject(b->mem);
        free(b);
        b = next;
    }
    d->cache = NULL;
    d->cached = 0;
    d->cache_pending = 0;
}

/* A cached buffer of class `rounded` taken out of the cache into *mem (NULL when there is
 * none); fails only when waiting for the device's queued work fails. */
static int32_t take_cached(int32_t device, uint64_t rounded, cl_mem *mem, flagos_status *status)
{
    ocl_device *d = &ocl.devices[device];
    ocl_cached_block **link = &d->cache;
    *mem = NULL;
    while (*link != NULL && (*link)->rounded != rounded)
        link = &(*link)->next;
    if (*link == NULL)
        return OCL_SUCCESS;
    if (d->cache_pending) {
        int32_t rc = ocl_finish_device(device, status);
        if (rc != OCL_SUCCESS)
            return rc;
    }
    ocl_cached_block *b = *link;
    *link = b->next;
    *mem = b->mem;
    d->cached -= b->rounded;
    free(b);
    return OCL_SUCCESS;
}

int32_t ocl_alloc(int32_t device, uint64_t nbytes, flagos_buffer *buffer, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    ocl_device *d = &ocl.devices[device];
    uint64_t rounded = size_class(nbytes);
    if (rounded > d->max_alloc || rounded > d->total_memory)
        return ocl_fail(status, OCL_ERROR_OUT_OF_MEMORY,
                        "cannot allocate %llu bytes on opencl device %d (%s): one buffer may "
                        "hold at most %llu bytes (CL_DEVICE_MAX_MEM_ALLOC_SIZE) of %llu",
                        (unsigned long long)nbytes, device, d->device_name,
                        (unsigned long long)d->max_alloc, (unsigned long long)d->total_memory);
    ocl_allocation *a = calloc(1, sizeof *a);
    if (a == NULL)
        return ocl_fail(status, OCL_ERROR_HOST_MEMORY, "host memory ran out");
    cl_mem mem = NULL;
    rc = take_cached(device, rounded, &mem, status);
    if (rc != OCL_SUCCESS) {
        free(a);
        return rc;
    }
    if (mem == NULL) {
        uint64_t reserved = d->allocated + d->cached;
        if (rounded > d->total_memory - reserved) /* the cache goes before memory runs out */
            release_cache(d);
        reserved = d->allocated + d->cached;
        if (rounded > d->total_memory - reserved) {
            free(a);
            return ocl_fail(status, OCL_ERROR_OUT_OF_MEMORY,
                            "cannot allocate %llu bytes on opencl device %d (%s): %llu of %llu "
                            "bytes free", (unsigned long long)nbytes, device, d->device_name,
                            (unsigned long long)(d->total_memory - reserved),
                            (unsigned long long)d->total_memory);
        }
        cl_int err;
        mem = clCreateBuffer(d->context, CL_MEM_READ_WRITE, rounded, NULL, &err);
        if (mem == NULL) {
            free(a);
            if (err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_RESOURCES ||
                err == CL_INVALID_BUFFER_SIZE)
                return ocl_fail(status, OCL_ERROR_OUT_OF_MEMORY,
                                "cannot allocate %llu bytes on opencl device %d (%s): "
                                "clCreateBuffer failed with %s", (unsigned long long)nbytes,
                                device, d->device_name, ocl_cl_name(err));
            return ocl_cl_fail(status, err, "clCreateBuffer");
        }
    }
    a->handle = next_handle++;
    a->device = device;
    a->nbytes = nbytes;
    a->rounded = rounded;
    a->mem = mem;
    HASH_ADD(hh, allocations, handle, sizeof a->handle, a);
    d->allocated += rounded;
    if (d->allocated > d->peak)
        d->peak = d->allocated;
    *buffer = a->handle;
    return ocl_ok(status);
}

static ocl_allocation *find(int32_t device, flagos_buffer buffer, flagos_status *status)
{
    if (ocl_check_device(device, status) != OCL_SUCCESS)
        return NULL;
    ocl_allocation *a;
    HASH_FIND(hh, allocations, &buffer, sizeof buffer, a);
    if (a == NULL || a->device != device) {
        ocl_fail(status, OCL_ERROR_INVALID_HANDLE, "buffer %llu is not a live allocation of "
                 "opencl device %d", (unsigned long long)buffer, device);
        return NULL;
    }
    return a;
}

cl_mem ocl_resolve(int32_t device, flagos_buffer buffer, uint64_t *nbytes, flagos_status *status)
{
    ocl_allocation *a = find(device, buffer, status);
    if (a == NULL)
        return NULL;
    if (nbytes != NULL)
        *nbytes = a->nbytes;
    return a->mem;
}

int32_t ocl_free(int32_t device, flagos_buffer buffer, flagos_status *status)
{
    ocl_allocation *a = find(device, buffer, status);
    if (a == NULL)
        return status->code;
    ocl_device *d = &ocl.devices[device];
    ocl_cached_block *b = malloc(sizeof *b);
    if (b == NULL) {
        clReleaseMemObject(a->mem); /* safe while queued work uses it */
    } else {
        b->rounded = a->rounded;
        b->mem = a->mem;
        b->next = d->cache;
        d->cache = b;
        d->cached += a->rounded;
        if (d->n_streams > 0)
            d->cache_pending = 1;
    }
    d->allocated -= a->rounded;
    HASH_DEL(allocations, a);
    free(a);
    return ocl_ok(status);
}

void ocl_memory_release_all(void)
{
    ocl_allocation *a, *tmp;
    HASH_ITER(hh, allocations, a, tmp) {
        HASH_DEL(allocations, a);
        clReleaseMemObject(a->mem);
        free(a);
    }
    for (int32_t i = 0; i < ocl.n_devices; i++) {
        release_cache(&ocl.devices[i]);
        ocl.devices[i].allocated = ocl.devices[i].peak = 0;
    }
}

int32_t ocl_memory_info(int32_t device, flagos_memory_info *info, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    const ocl_device *d = &ocl.devices[device];
    uint64_t reserved = d->allocated + d->cached;
    info->total = d->total_memory;
    info->reserved = reserved;
    info->free = d->total_memory - reserved;
    info->allocated = d->allocated;
    info->peak_allocated = d->peak;
    return ocl_ok(status);
}

int32_t ocl_reset_peak(int32_t device, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    ocl.devices[device].peak = ocl.devices[device].allocated;
    return ocl_ok(status);
}

int32_t ocl_empty_cache(int32_t device, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    release_cache(&ocl.devices[device]);
    return ocl_ok(status);
}

/* ---- copies ------------------------------------------------------------ */

static int32_t range_check(const ocl_allocation *a, uint64_t offset, uint64_t nbytes,
                           flagos_status *status)
{
    if (offset > a->nbytes || nbytes > a->nbytes - offset)
        return ocl_fail(status, OCL_ERROR_OUT_OF_RANGE,
                        "copy of %llu bytes at offset %llu exceeds buffer %llu of %llu bytes",
                        (unsigned long long)nbytes, (unsigned long long)offset,
                        (unsigned long long)a->handle, (unsigned long long)a->nbytes);
    return OCL_SUCCESS;
}

/* Host copies block, and the current stream's in-order queue puts them after its work. */
int32_t ocl_copy_h2d(int32_t device, flagos_buffer dst, uint64_t dst_offset, const void *src,
                     uint64_t nbytes, flagos_status *status)
{
    ocl_allocation *a = find(device, dst, status);
    if (a == NULL)
        return status->code;
    int32_t rc = range_check(a, dst_offset, nbytes, status);
    if (rc != OCL_SUCCESS || nbytes == 0)
        return rc == OCL_SUCCESS ? ocl_ok(status) : rc;
    cl_int err = clEnqueueWriteBuffer(ocl.devices[device].current, a->mem, CL_TRUE, dst_offset,
                                      nbytes, src, 0, NULL, NULL);
    return err == CL_SUCCESS ? ocl_ok(status) : ocl_cl_fail(status, err, "clEnqueueWriteBuffer");
}

int32_t ocl_copy_d2h(int32_t device, void *dst, flagos_buffer src, uint64_t src_offset,
                     uint64_t nbytes, flagos_status *status)
{
    ocl_allocation *a = find(device, src, status);
    if (a == NULL)
        return status->code;
    int32_t rc = range_check(a, src_offset, nbytes, status);
    if (rc != OCL_SUCCESS || nbytes == 0)
        return rc == OCL_SUCCESS ? ocl_ok(status) : rc;
    cl_int err = clEnqueueReadBuffer(ocl.devices[device].current, a->mem, CL_TRUE, src_offset,
                                     nbytes, dst, 0, NULL, NULL);
    return err == CL_SUCCESS ? ocl_ok(status) : ocl_cl_fail(status, err, "clEnqueueReadBuffer");
}

/* Devices have contexts of their own: a copy between two devices goes through the host. */
int32_t ocl_copy_d2d(int32_t dst_device, flagos_buffer dst, uint64_t dst_offset,
                     int32_t src_device, flagos_buffer src, uint64_t src_offset,
                     uint64_t nbytes, flagos_status *status)
{
    ocl_allocation *d = find(dst_device, dst, status);
    ocl_allocation *s = d ? find(src_device, src, status) : NULL;
    if (d == NULL || s == NULL)
        return status->code;
    int32_t rc = range_check(d, dst_offset, nbytes, status);
    if (rc == OCL_SUCCESS)
        rc = range_check(s, src_offset, nbytes, status);
    if (rc != OCL_SUCCESS || nbytes == 0)
        return rc == OCL_SUCCESS ? ocl_ok(status) : rc;
    cl_int err;
    if (dst_device == src_device) {
        if (d == s && (src_offset < dst_offset + nbytes && dst_offset < src_offset + nbytes)) {
            /* clEnqueueCopyBuffer refuses overlapping ranges of one buffer */
            void *staging = malloc(nbytes);
            if (staging == NULL)
                return ocl_fail(status, OCL_ERROR_HOST_MEMORY, "host memory ran out");
            rc = ocl_copy_d2h(src_device, staging, src, src_offset, nbytes, status);
            if (rc == OCL_SUCCESS)
                rc = ocl_copy_h2d(dst_device, dst, dst_offset, staging, nbytes, status);
            free(staging);
            return rc;
        }
        cl_event done = NULL;
        err = clEnqueueCopyBuffer(ocl.devices[dst_device].current, s->mem, d->mem, src_offset,
                                  dst_offset, nbytes, 0, NULL, &done);
        if (err != CL_SUCCESS)
            return ocl_cl_fail(status, err, "clEnqueueCopyBuffer");
        ocl_track(dst_device, done);
        return ocl_ok(status);
    }
    void *staging = malloc(nbytes);
    if (staging == NULL)
        return ocl_fail(status, OCL_ERROR_HOST_MEMORY, "host memory ran out");
    rc = ocl_copy_d2h(src_device, staging, src, src_offset, nbytes, status);
    if (rc == OCL_SUCCESS)
        rc = ocl_copy_h2d(dst_device, dst, dst_offset, staging, nbytes, status);
    free(staging);
    return rc;
}
