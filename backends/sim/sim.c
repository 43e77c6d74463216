/* sim: the emulated accelerator, flagos's reference adapter.
 *
 * Each device has a memory pool of its own (capacity FLAGOS_SIM_MEMORY, FLAGOS_SIM_DEVICES
 * devices), reachable only through opaque buffer handles and the copy functions. It fails
 * like hardware does: out of memory past its capacity, and, for tests, on the program's Nth
 * allocation (FLAGOS_SIM_FAIL_ALLOC_AT) or with a device in a sticky failed state
 * (FLAGOS_SIM_FAIL_DEVICE). Kernels for a subset of aten live in kernels.c.
 *
 * FLAGOS_VISIBLE_DEVICES=2,0 shows the process only those of the FLAGOS_SIM_DEVICES devices, in
 * that order (device 0 of the process is device 2 of the machine), as a GPU driver honours
 * CUDA_VISIBLE_DEVICES: the device name and FLAGOS_SIM_FAIL_DEVICE speak of the machine's index.
 *
 * Streams and events (adapter ABI 1.1) are real handles with the ABI's checks, but sim runs
 * all work synchronously, on the calling thread: a stream is complete as soon as a call
 * returns, and an event's timestamp is taken when it is recorded. sim counts the calls of
 * each stream/event entry and the copies each stream received, and exports them
 * (flagos_sim_calls, flagos_sim_stream_copies) so tests can see that flagos used them.
 */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uthash.h>

#include "sim_internal.h"

#define SIM_MAX_DEVICES 16
#define SIM_DEFAULT_DEVICES 2
/* A pool the size of a small real card: the memory is the host's, allocated on demand, and
 * libraries size their work by it (transformers' allocator warm-up asks for total - 1.2 GiB). */
#define SIM_DEFAULT_MEMORY (4ull * 1024 * 1024 * 1024)

typedef struct sim_allocation {
    flagos_buffer handle; /* key */
    int32_t device;
    uint64_t nbytes;
    void *memory;
    UT_hash_handle hh;
} sim_allocation;

typedef struct sim_device {
    uint64_t capacity;
    uint64_t allocated;
    uint64_t peak;
    int failed; /* sticky: every later call on this device fails */
    flagos_stream current; /* where work goes (set_stream); 0: the default stream */
    uint64_t default_copies;
    int32_t physical; /* the machine's index of the device (FLAGOS_VISIBLE_DEVICES) */
} sim_device;

/* A stream or an event: one handle space for both, never reused. */
typedef struct sim_object {
    uint64_t handle; /* key */
    int32_t device;
    int is_event;
    uint32_t flags;      /* events: FLAGOS_EVENT_TIMING */
    int recorded;        /* events */
    struct timespec when; /* events: when recorded */
    uint64_t copies;     /* streams: copies issued on it */
    UT_hash_handle hh;
} sim_object;

/* The entries whose calls sim counts, in the order of sim.calls[]. */
static const char *const counted[] = {
    "stream_create", "stream_destroy", "set_stream", "stream_synchronize", "stream_query",
    "stream_wait_event", "event_create", "event_destroy", "event_record", "event_synchronize",
    "event_query", "event_elapsed_ms",
};
enum { N_COUNTED = sizeof(counted) / sizeof(counted[0]) };

static struct {
    pthread_mutex_t lock;
    int initialized;
    int users;              /* init() calls not yet matched by shutdown() */
    int32_t n_devices;
    sim_device devices[SIM_MAX_DEVICES];
    sim_allocation *allocations;
    flagos_buffer next_handle;
    uint64_t alloc_calls;   /* allocations counted for FLAGOS_SIM_FAIL_ALLOC_AT */
    int counting_allocs;    /* flagos_sim_count_allocations() was called */
    uint64_t fail_alloc_at; /* 0: never */
    const char *fail_alloc_by; /* what armed it, for the error text */
    uint64_t native_dtypes;
    sim_object *objects;
    uint64_t calls[N_COUNTED];
} sim = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* ---- status ------------------------------------------------------------ */

int32_t sim_fail(flagos_status *status, int32_t code, const char *fmt, ...)
{
    if (status != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(status->message, sizeof(status->message), fmt, ap);
        va_end(ap);
        status->code = code;
    }
    return code;
}

int32_t sim_ok(flagos_status *status)
{
    if (status != NULL) {
        status->code = SIM_SUCCESS;
        status->message[0] = '\0';
    }
    return SIM_SUCCESS;
}

static const char *sim_error_name(int32_t code)
{
    switch (code) {
    case SIM_SUCCESS: return "SIM_SUCCESS";
    case SIM_ERROR_INVALID_VALUE: return "SIM_ERROR_INVALID_VALUE";
    case SIM_ERROR_OUT_OF_MEMORY: return "SIM_ERROR_OUT_OF_MEMORY";
    case SIM_ERROR_INVALID_DEVICE: return "SIM_ERROR_INVALID_DEVICE";
    case SIM_ERROR_INVALID_HANDLE: return "SIM_ERROR_INVALID_HANDLE";
    case SIM_ERROR_OUT_OF_RANGE: return "SIM_ERROR_OUT_OF_RANGE";
    case SIM_ERROR_DEVICE_LOST: return "SIM_ERROR_DEVICE_LOST";
    case SIM_ERROR_NOT_SUPPORTED: return "SIM_ERROR_NOT_SUPPORTED";
    default: return "SIM_ERROR_UNKNOWN";
    }
}

/* ---- configuration ----------------------------------------------------- */

/* strtoull and strtol skip leading spaces and take a sign (" -1" is 2^64-1 to strtoull):
 * a value must start with a digit. */
static int starts_with_digit(const char *text)
{
    return isdigit((unsigned char)text[0]);
}

/* "512M", "1G", "65536": bytes with an optional K/M/G suffix (powers of 1024). */
static int parse_size(const char *text, uint64_t *out)
{
    char *end;
    errno = 0;
    if (!starts_with_digit(text))
        return -1;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno != 0 || end == text)
        return -1;
    uint64_t mult = 1;
    switch (toupper((unsigned char)*end)) {
    case '\0': break;
    case 'K': mult = 1024ull; end++; break;
    case 'M': mult = 1024ull * 1024; end++; break;
    case 'G': mult = 1024ull * 1024 * 1024; end++; break;
    default: return -1;
    }
    if (toupper((unsigned char)*end) == 'B')
        end++;
    if (*end != '\0' || v > UINT64_MAX / mult)
        return -1;
    *out = (uint64_t)v * mult;
    return 0;
}

static int parse_count(const char *text, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    if (!starts_with_digit(text))
        return -1;
    long v = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static const struct { const char *name; flagos_dtype dtype; } dtype_names[] = {
    {"float32", FLAGOS_FLOAT32}, {"float16", FLAGOS_FLOAT16}, {"bfloat16", FLAGOS_BFLOAT16},
    {"float64", FLAGOS_FLOAT64}, {"int64", FLAGOS_INT64}, {"int32", FLAGOS_INT32},
    {"int16", FLAGOS_INT16}, {"int8", FLAGOS_INT8}, {"uint8", FLAGOS_UINT8}, {"bool", FLAGOS_BOOL},
};

/* "float32,float16": the dtypes sim computes in natively (bf16 is not, by default). */
static int parse_dtypes(const char *text, uint64_t *out, flagos_status *status)
{
    uint64_t mask = 0;
    const char *p = text;
    while (*p) {
        size_t len = strcspn(p, ",");
        size_t i;
        for (i = 0; i < sizeof(dtype_names) / sizeof(dtype_names[0]); i++)
            if (strlen(dtype_names[i].name) == len && strncmp(p, dtype_names[i].name, len) == 0)
                break;
        if (i == sizeof(dtype_names) / sizeof(dtype_names[0]))
            return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                            "FLAGOS_SIM_DTYPES=%s: unknown dtype '%.*s'; use a comma-separated "
                            "list of float32, float16, bfloat16, float64, int64, int32, int16, "
                            "int8, uint8, bool", text, (int)len, p);
        mask |= FLAGOS_DTYPE_BIT(dtype_names[i].dtype);
        p += len;
        if (*p == ',')
            p++;
    }
    *out = mask;
    return SIM_SUCCESS;
}

/* FLAGOS_VISIBLE_DEVICES: distinct indices below `devices`, comma-separated, at least one. */
static int32_t parse_visible(const char *text, long devices, int32_t *physical, int32_t *n,
                             flagos_status *status)
{
    char item[32];
    const char *p = text;
    *n = 0;
    for (;;) {
        size_t len = strcspn(p, ",");
        long v;
        if (len == 0 || len >= sizeof(item))
            goto bad;
        memcpy(item, p, len);
        item[len] = '\0';
        if (parse_count(item, 0, devices - 1, &v) < 0 || *n >= SIM_MAX_DEVICES)
            goto bad;
        for (int32_t i = 0; i < *n; i++)
            if (physical[i] == (int32_t)v)
                goto bad;
        physical[(*n)++] = (int32_t)v;
        p += len;
        if (*p == '\0')
            return SIM_SUCCESS;
        p++;
    }
bad:
    return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                    "FLAGOS_VISIBLE_DEVICES='%s' is not valid for sim; use distinct device indices "
                    "from 0 to %ld separated by commas (FLAGOS_SIM_DEVICES=%ld), e.g. "
                    "FLAGOS_VISIBLE_DEVICES=%ld", text, devices - 1, devices, devices - 1);
}

static int32_t read_config(flagos_status *status)
{
    const char *v;
    uint64_t memory = SIM_DEFAULT_MEMORY;
    long devices = SIM_DEFAULT_DEVICES, fail_at = 0, fail_device = -1;
    if ((v = getenv("FLAGOS_SIM_MEMORY")) && *v && parse_size(v, &memory) < 0)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "FLAGOS_SIM_MEMORY='%s' is not a size; use bytes with an optional K, M "
                        "or G suffix (digits only: no spaces or sign), e.g. "
                        "FLAGOS_SIM_MEMORY=512M", v);
    if ((v = getenv("FLAGOS_SIM_DEVICES")) && *v &&
        parse_count(v, 1, SIM_MAX_DEVICES, &devices) < 0)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "FLAGOS_SIM_DEVICES='%s' is not valid; use a whole number from 1 to %d, "
                        "e.g. FLAGOS_SIM_DEVICES=2", v, SIM_MAX_DEVICES);
    if ((v = getenv("FLAGOS_SIM_FAIL_ALLOC_AT")) && *v && parse_count(v, 1, 1L << 40, &fail_at) < 0)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "FLAGOS_SIM_FAIL_ALLOC_AT='%s' is not valid; use a whole number N >= 1 to "
                        "fail the Nth allocation, e.g. FLAGOS_SIM_FAIL_ALLOC_AT=3", v);
    int32_t physical[SIM_MAX_DEVICES], n_visible = (int32_t)devices;
    for (int32_t i = 0; i < n_visible; i++)
        physical[i] = i;
    if ((v = getenv("FLAGOS_VISIBLE_DEVICES")) && *v &&
        parse_visible(v, devices, physical, &n_visible, status) != SIM_SUCCESS)
        return status->code;
    if ((v = getenv("FLAGOS_SIM_FAIL_DEVICE")) && *v &&
        parse_count(v, 0, devices - 1, &fail_device) < 0)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "FLAGOS_SIM_FAIL_DEVICE='%s' is not valid; use a device index from 0 to "
                        "%ld, e.g. FLAGOS_SIM_FAIL_DEVICE=%ld", v, devices - 1, devices - 1);
    uint64_t dtypes = FLAGOS_DTYPE_BIT(FLAGOS_FLOAT32) | FLAGOS_DTYPE_BIT(FLAGOS_FLOAT16);
    if ((v = getenv("FLAGOS_SIM_DTYPES")) && *v && parse_dtypes(v, &dtypes, status) != SIM_SUCCESS)
        return status->code;

    sim.n_devices = n_visible;
    for (int32_t i = 0; i < sim.n_devices; i++) {
        sim.devices[i] = (sim_device){.capacity = memory, .physical = physical[i]};
        sim.devices[i].failed = (physical[i] == fail_device);
    }
    sim.fail_alloc_at = (uint64_t)fail_at;
    sim.fail_alloc_by = "FLAGOS_SIM_FAIL_ALLOC_AT";
    sim.native_dtypes = dtypes;
    return sim_ok(status);
}

/* ---- lifecycle --------------------------------------------------------- */

static void free_all(void)
{
    sim_allocation *a, *tmp;
    HASH_ITER(hh, sim.allocations, a, tmp) {
        HASH_DEL(sim.allocations, a);
        free(a->memory);
        free(a);
    }
    sim_object *o, *otmp;
    HASH_ITER(hh, sim.objects, o, otmp) {
        HASH_DEL(sim.objects, o);
        free(o);
    }
}

static int32_t sim_init(flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = SIM_SUCCESS;
    if (!sim.initialized) {
        rc = read_config(status);
        if (rc == SIM_SUCCESS) {
            sim.initialized = 1;
            if (sim.next_handle == 0)
                sim.next_handle = 1; /* handles are never reused, even across re-inits */
        }
    } else {
        rc = sim_ok(status);
    }
    if (rc == SIM_SUCCESS)
        sim.users++;
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static void sim_shutdown(void)
{
    pthread_mutex_lock(&sim.lock);
    if (sim.users > 0 && --sim.users == 0) { /* the last user is gone */
        free_all();
        sim.initialized = 0;
    }
    pthread_mutex_unlock(&sim.lock);
}

/* Caller holds the lock. */
static int32_t check_device(int32_t device, flagos_status *status)
{
    if (!sim.initialized)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE, "sim is not initialized");
    if (device < 0 || device >= sim.n_devices)
        return sim_fail(status, SIM_ERROR_INVALID_DEVICE,
                        "sim device %d does not exist (%d devices)", device, sim.n_devices);
    if (sim.devices[device].failed)
        return sim_fail(status, SIM_ERROR_DEVICE_LOST,
                        "sim device %d is in a failed state and accepts no more work", device);
    return SIM_SUCCESS;
}

static int32_t sim_device_count(int32_t *count, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    *count = sim.initialized ? sim.n_devices : 0;
    pthread_mutex_unlock(&sim.lock);
    return sim_ok(status);
}

/* A failed device still answers queries, as a driver lists a lost device. */
static int32_t sim_device_props(int32_t device, flagos_device_props *props, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = SIM_SUCCESS;
    if (device < 0 || device >= sim.n_devices) {
        rc = sim_fail(status, SIM_ERROR_INVALID_DEVICE, "sim device %d does not exist", device);
    } else {
        snprintf(props->name, sizeof(props->name), "flagos sim device %d", sim.devices[device].physical);
        props->total_memory = sim.devices[device].capacity;
        props->native_dtypes = sim.native_dtypes;
        rc = sim_ok(status);
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

/* ---- memory ------------------------------------------------------------ */

static int32_t sim_alloc(int32_t device, uint64_t nbytes, flagos_buffer *buffer, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = check_device(device, status);
    if (rc != SIM_SUCCESS)
        goto done;
    sim_device *d = &sim.devices[device];
    if (sim.counting_allocs)
        sim.alloc_calls++;
    if (sim.counting_allocs && sim.fail_alloc_at != 0 && sim.alloc_calls == sim.fail_alloc_at) {
        rc = sim_fail(status, SIM_ERROR_OUT_OF_MEMORY,
                      "injected failure of allocation #%llu (%s)",
                      (unsigned long long)sim.alloc_calls, sim.fail_alloc_by);
        goto done;
    }
    if (nbytes > d->capacity - d->allocated) {
        rc = sim_fail(status, SIM_ERROR_OUT_OF_MEMORY,
                      "cannot allocate %llu bytes on sim device %d: %llu of %llu bytes free",
                      (unsigned long long)nbytes, device,
                      (unsigned long long)(d->capacity - d->allocated),
                      (unsigned long long)d->capacity);
        goto done;
    }
    sim_allocation *a = calloc(1, sizeof(*a));
    void *memory = malloc(nbytes ? nbytes : 1);
    if (a == NULL || memory == NULL) {
        free(a);
        free(memory);
        rc = sim_fail(status, SIM_ERROR_OUT_OF_MEMORY, "host memory behind sim device %d ran out",
                      device);
        goto done;
    }
    a->handle = sim.next_handle++;
    a->device = device;
    a->nbytes = nbytes;
    a->memory = memory;
    HASH_ADD(hh, sim.allocations, handle, sizeof(a->handle), a);
    d->allocated += nbytes;
    if (d->allocated > d->peak)
        d->peak = d->allocated;
    *buffer = a->handle;
    rc = sim_ok(status);
done:
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

/* Caller holds the lock. */
static sim_allocation *find(int32_t device, flagos_buffer buffer, flagos_status *status)
{
    if (check_device(device, status) != SIM_SUCCESS)
        return NULL;
    sim_allocation *a;
    HASH_FIND(hh, sim.allocations, &buffer, sizeof(buffer), a);
    if (a == NULL || a->device != device) {
        sim_fail(status, SIM_ERROR_INVALID_HANDLE, "buffer %llu is not a live allocation of "
                 "sim device %d", (unsigned long long)buffer, device);
        return NULL;
    }
    return a;
}

static int32_t sim_free(int32_t device, flagos_buffer buffer, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc;
    sim_allocation *a = find(device, buffer, status);
    if (a == NULL && status->code == SIM_ERROR_DEVICE_LOST && device >= 0 && device < sim.n_devices) {
        /* Memory of a lost device is gone with it: release the host side quietly. */
        HASH_FIND(hh, sim.allocations, &buffer, sizeof(buffer), a);
        if (a != NULL && a->device != device)
            a = NULL;
    }
    if (a == NULL) {
        rc = status->code;
    } else {
        HASH_DEL(sim.allocations, a);
        sim.devices[a->device].allocated -= a->nbytes;
        free(a->memory);
        free(a);
        rc = sim.devices[device].failed ? status->code : sim_ok(status);
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

void *sim_resolve(int32_t device, flagos_buffer buffer, uint64_t *nbytes, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    sim_allocation *a = find(device, buffer, status);
    void *p = a ? a->memory : NULL;
    if (a && nbytes)
        *nbytes = a->nbytes;
    pthread_mutex_unlock(&sim.lock);
    return p;
}

static int32_t sim_memory_info(int32_t device, flagos_memory_info *info, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = check_device(device, status);
    if (rc == SIM_SUCCESS) {
        sim_device *d = &sim.devices[device];
        info->total = d->capacity;
        info->free = d->capacity - d->allocated;
        info->allocated = d->allocated;
        info->peak_allocated = d->peak;
        info->reserved = d->allocated; /* no caching: what is allocated is what is held */
        rc = sim_ok(status);
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_reset_peak(int32_t device, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = check_device(device, status);
    if (rc == SIM_SUCCESS) {
        sim.devices[device].peak = sim.devices[device].allocated;
        rc = sim_ok(status);
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_empty_cache(int32_t device, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = check_device(device, status);
    pthread_mutex_unlock(&sim.lock);
    return rc == SIM_SUCCESS ? sim_ok(status) : rc; /* nothing is cached */
}

/* ---- copies ------------------------------------------------------------ */

/* Caller holds the lock; the device is valid. A copy is work of the device's current stream. */
static void count_copy(int32_t device)
{
    flagos_stream current = sim.devices[device].current;
    sim_object *o = NULL;
    if (current != 0)
        HASH_FIND(hh, sim.objects, &current, sizeof(current), o);
    if (o != NULL)
        o->copies++;
    else
        sim.devices[device].default_copies++;
}

static int32_t range_check(const sim_allocation *a, uint64_t offset, uint64_t nbytes,
                           flagos_status *status)
{
    if (offset > a->nbytes || nbytes > a->nbytes - offset)
        return sim_fail(status, SIM_ERROR_OUT_OF_RANGE,
                        "copy of %llu bytes at offset %llu exceeds buffer %llu of %llu bytes",
                        (unsigned long long)nbytes, (unsigned long long)offset,
                        (unsigned long long)a->handle, (unsigned long long)a->nbytes);
    return SIM_SUCCESS;
}

static int32_t sim_copy_h2d(int32_t device, flagos_buffer dst, uint64_t dst_offset, const void *src,
                            uint64_t nbytes, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc;
    sim_allocation *a = find(device, dst, status);
    if (a == NULL)
        rc = status->code;
    else if ((rc = range_check(a, dst_offset, nbytes, status)) == SIM_SUCCESS) {
        if (nbytes)
            memcpy((char *)a->memory + dst_offset, src, nbytes);
        count_copy(device);
        rc = sim_ok(status);
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_copy_d2h(int32_t device, void *dst, flagos_buffer src, uint64_t src_offset,
                            uint64_t nbytes, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc;
    sim_allocation *a = find(device, src, status);
    if (a == NULL)
        rc = status->code;
    else if ((rc = range_check(a, src_offset, nbytes, status)) == SIM_SUCCESS) {
        if (nbytes)
            memcpy(dst, (const char *)a->memory + src_offset, nbytes);
        count_copy(device);
        rc = sim_ok(status);
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_copy_d2d(int32_t dst_device, flagos_buffer dst, uint64_t dst_offset,
                            int32_t src_device, flagos_buffer src, uint64_t src_offset,
                            uint64_t nbytes, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc;
    sim_allocation *d = find(dst_device, dst, status);
    sim_allocation *s = d ? find(src_device, src, status) : NULL;
    if (d == NULL || s == NULL)
        rc = status->code;
    else if ((rc = range_check(d, dst_offset, nbytes, status)) == SIM_SUCCESS &&
             (rc = range_check(s, src_offset, nbytes, status)) == SIM_SUCCESS) {
        if (nbytes)
            memmove((char *)d->memory + dst_offset, (const char *)s->memory + src_offset, nbytes);
        count_copy(dst_device);
        rc = sim_ok(status);
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_synchronize(int32_t device, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = check_device(device, status); /* work is synchronous: nothing to wait for */
    pthread_mutex_unlock(&sim.lock);
    return rc == SIM_SUCCESS ? sim_ok(status) : rc;
}

/* ---- streams and events (synchronous) ------------------------------------ */

enum {
    C_STREAM_CREATE, C_STREAM_DESTROY, C_SET_STREAM, C_STREAM_SYNCHRONIZE, C_STREAM_QUERY,
    C_STREAM_WAIT_EVENT, C_EVENT_CREATE, C_EVENT_DESTROY, C_EVENT_RECORD, C_EVENT_SYNCHRONIZE,
    C_EVENT_QUERY, C_EVENT_ELAPSED_MS,
};

/* Caller holds the lock: count the call, check the device. */
static int32_t enter(int which, int32_t device, flagos_status *status)
{
    sim.calls[which]++;
    return check_device(device, status);
}

/* Caller holds the lock. The stream or event `handle` of `device` (NULL and a failed status
 * when there is none); a stream of 0 is the default stream and gives NULL with success. */
static sim_object *lookup(int32_t device, uint64_t handle, int is_event, flagos_status *status)
{
    sim_object *o = NULL;
    if (!is_event && handle == 0) {
        sim_ok(status);
        return NULL;
    }
    HASH_FIND(hh, sim.objects, &handle, sizeof(handle), o);
    if (o == NULL || o->device != device || o->is_event != is_event) {
        sim_fail(status, SIM_ERROR_INVALID_HANDLE, "%s %llu is not a live %s of sim device %d",
                 is_event ? "event" : "stream", (unsigned long long)handle,
                 is_event ? "event" : "stream", device);
        return NULL;
    }
    sim_ok(status);
    return o;
}

static int32_t new_object(int which, int32_t device, int is_event, uint32_t flags,
                          uint64_t *handle, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = enter(which, device, status);
    if (rc == SIM_SUCCESS && (flags & ~FLAGOS_EVENT_TIMING))
        rc = sim_fail(status, SIM_ERROR_INVALID_VALUE, "event_create: unknown flags 0x%x (the ABI "
                      "defines FLAGOS_EVENT_TIMING only; the other bits must be 0)",
                      (unsigned)(flags & ~FLAGOS_EVENT_TIMING));
    if (rc == SIM_SUCCESS) {
        sim_object *o = calloc(1, sizeof(*o));
        if (o == NULL) {
            rc = sim_fail(status, SIM_ERROR_OUT_OF_MEMORY, "host memory behind sim ran out");
        } else {
            o->handle = sim.next_handle++; /* shared with buffers: never 0, never reused */
            o->device = device;
            o->is_event = is_event;
            o->flags = flags;
            HASH_ADD(hh, sim.objects, handle, sizeof(o->handle), o);
            *handle = o->handle;
            rc = sim_ok(status);
        }
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t destroy_object(int which, int32_t device, uint64_t handle, int is_event,
                              flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = enter(which, device, status);
    if (rc == SIM_SUCCESS && !is_event && handle == 0)
        rc = sim_fail(status, SIM_ERROR_INVALID_HANDLE, "the default stream cannot be destroyed");
    if (rc == SIM_SUCCESS) {
        sim_object *o = lookup(device, handle, is_event, status);
        if (o == NULL) {
            rc = status->code;
        } else if (!is_event && sim.devices[device].current == handle) {
            rc = sim_fail(status, SIM_ERROR_INVALID_VALUE, "stream %llu is the current stream "
                          "of sim device %d; set another first", (unsigned long long)handle, device);
        } else {
            HASH_DEL(sim.objects, o);
            free(o);
        }
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

/* The calls that only check their handle: work is synchronous, so nothing is pending. */
/* With sim.lock held: count the call, check the device and the stream (0: the default one). */
static int32_t enter_on_stream(int which, int32_t device, flagos_stream stream,
                               flagos_status *status)
{
    int32_t rc = enter(which, device, status);
    if (rc == SIM_SUCCESS && lookup(device, stream, 0, status) == NULL && status->code != 0)
        rc = status->code;
    return rc;
}

static int32_t check_object(int which, int32_t device, uint64_t handle, int is_event,
                            int32_t *done, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = enter(which, device, status);
    if (rc == SIM_SUCCESS && lookup(device, handle, is_event, status) == NULL && status->code != 0)
        rc = status->code;
    if (rc == SIM_SUCCESS && done != NULL)
        *done = 1;
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_stream_create(int32_t device, int32_t priority, flagos_stream *stream,
                                 flagos_status *status)
{
    (void)priority; /* one queue runs everything in order, whatever its priority */
    return new_object(C_STREAM_CREATE, device, 0, 0, stream, status);
}

static int32_t sim_stream_destroy(int32_t device, flagos_stream stream, flagos_status *status)
{
    return destroy_object(C_STREAM_DESTROY, device, stream, 0, status);
}

static int32_t sim_set_stream(int32_t device, flagos_stream stream, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = enter_on_stream(C_SET_STREAM, device, stream, status);
    if (rc == SIM_SUCCESS)
        sim.devices[device].current = stream;
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_stream_synchronize(int32_t device, flagos_stream stream, flagos_status *status)
{
    return check_object(C_STREAM_SYNCHRONIZE, device, stream, 0, NULL, status);
}

static int32_t sim_stream_query(int32_t device, flagos_stream stream, int32_t *done,
                                flagos_status *status)
{
    return check_object(C_STREAM_QUERY, device, stream, 0, done, status);
}

static int32_t sim_stream_wait_event(int32_t device, flagos_stream stream, flagos_event event,
                                     flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = enter_on_stream(C_STREAM_WAIT_EVENT, device, stream, status);
    if (rc == SIM_SUCCESS && lookup(device, event, 1, status) == NULL)
        rc = status->code;
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_event_create(int32_t device, uint32_t flags, flagos_event *event,
                                flagos_status *status)
{
    return new_object(C_EVENT_CREATE, device, 1, flags, event, status);
}

static int32_t sim_event_destroy(int32_t device, flagos_event event, flagos_status *status)
{
    return destroy_object(C_EVENT_DESTROY, device, event, 1, status);
}

static int32_t sim_event_record(int32_t device, flagos_event event, flagos_stream stream,
                                flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = enter_on_stream(C_EVENT_RECORD, device, stream, status);
    sim_object *o = NULL;
    if (rc == SIM_SUCCESS && (o = lookup(device, event, 1, status)) == NULL)
        rc = status->code;
    if (rc == SIM_SUCCESS) {
        clock_gettime(CLOCK_MONOTONIC, &o->when); /* the stream's work is already done */
        o->recorded = 1;
    }
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

static int32_t sim_event_synchronize(int32_t device, flagos_event event, flagos_status *status)
{
    return check_object(C_EVENT_SYNCHRONIZE, device, event, 1, NULL, status);
}

static int32_t sim_event_query(int32_t device, flagos_event event, int32_t *done,
                               flagos_status *status)
{
    return check_object(C_EVENT_QUERY, device, event, 1, done, status);
}

static int32_t sim_event_elapsed_ms(int32_t device, flagos_event start, flagos_event end,
                                    double *ms, flagos_status *status)
{
    pthread_mutex_lock(&sim.lock);
    int32_t rc = enter(C_EVENT_ELAPSED_MS, device, status);
    sim_object *a = NULL, *b = NULL;
    if (rc == SIM_SUCCESS && ((a = lookup(device, start, 1, status)) == NULL ||
                              (b = lookup(device, end, 1, status)) == NULL))
        rc = status->code;
    if (rc == SIM_SUCCESS && !((a->flags & b->flags) & FLAGOS_EVENT_TIMING))
        rc = sim_fail(status, SIM_ERROR_INVALID_VALUE, "both events must be created with timing "
                      "enabled (FLAGOS_EVENT_TIMING)");
    else if (rc == SIM_SUCCESS && !(a->recorded && b->recorded))
        rc = sim_fail(status, SIM_ERROR_INVALID_VALUE, "both events must be recorded before "
                      "the time between them is asked");
    if (rc == SIM_SUCCESS)
        *ms = (double)(b->when.tv_sec - a->when.tv_sec) * 1e3 +
              (double)(b->when.tv_nsec - a->when.tv_nsec) / 1e6;
    pthread_mutex_unlock(&sim.lock);
    return rc;
}

/* flagos calls this (with ctypes, flagos/chips/sim.py) once activate() is done: from then on
 * allocations count for FLAGOS_SIM_FAIL_ALLOC_AT, so N means the program's Nth allocation and
 * not one made by activation's own checks. */
void flagos_sim_count_allocations(void)
{
    pthread_mutex_lock(&sim.lock);
    sim.counting_allocs = 1;
    pthread_mutex_unlock(&sim.lock);
}

/* For tests (ctypes): the nth allocation from now fails as FLAGOS_SIM_FAIL_ALLOC_AT's does
 * (n = 0 disarms). One process can then check several failures, each of which must leave it
 * working, instead of starting a process per failure. */
void flagos_sim_fail_allocation(uint64_t n)
{
    pthread_mutex_lock(&sim.lock);
    sim.counting_allocs = 1;
    sim.fail_alloc_at = n == 0 ? 0 : sim.alloc_calls + n;
    sim.fail_alloc_by = "flagos_sim_fail_allocation";
    pthread_mutex_unlock(&sim.lock);
}

/* For tests (read with ctypes): how often flagos called a stream/event entry, by name
 * ("stream_create"); 0 for a name sim does not count. */
uint64_t flagos_sim_calls(const char *entry)
{
    uint64_t n = 0;
    pthread_mutex_lock(&sim.lock);
    for (int i = 0; i < N_COUNTED; i++)
        if (entry != NULL && strcmp(entry, counted[i]) == 0)
            n = sim.calls[i];
    pthread_mutex_unlock(&sim.lock);
    return n;
}

/* For tests: copies made while `stream` was the current stream of `device` (0: default). */
uint64_t flagos_sim_stream_copies(int32_t device, uint64_t stream)
{
    uint64_t n = 0;
    pthread_mutex_lock(&sim.lock);
    if (device >= 0 && device < sim.n_devices) {
        sim_object *o = NULL;
        if (stream != 0)
            HASH_FIND(hh, sim.objects, &stream, sizeof(stream), o);
        if (stream == 0)
            n = sim.devices[device].default_copies;
        else if (o != NULL && !o->is_event)
            n = o->copies;
    }
    pthread_mutex_unlock(&sim.lock);
    return n;
}

/* ---- the adapter table ------------------------------------------------- */

static flagos_adapter sim_adapter = {
    .struct_size = sizeof(flagos_adapter),
    .abi_major = FLAGOS_ADAPTER_ABI_MAJOR,
    .abi_minor = FLAGOS_ADAPTER_ABI_MINOR,
    .name = "sim",
    .vendor = "flagos (emulated accelerator)",
    .init = sim_init,
    .shutdown = sim_shutdown,
    .device_count = sim_device_count,
    .device_props = sim_device_props,
    .alloc = sim_alloc,
    .free = sim_free,
    .memory_info = sim_memory_info,
    .reset_peak = sim_reset_peak,
    .empty_cache = sim_empty_cache,
    .copy_h2d = sim_copy_h2d,
    .copy_d2h = sim_copy_d2h,
    .copy_d2d = sim_copy_d2d,
    .synchronize = sim_synchronize,
    .error_name = sim_error_name,
    .out_of_memory_code = SIM_ERROR_OUT_OF_MEMORY,
    .device_lost_code = SIM_ERROR_DEVICE_LOST,
    .stream_create = sim_stream_create,
    .stream_destroy = sim_stream_destroy,
    .set_stream = sim_set_stream,
    .stream_synchronize = sim_stream_synchronize,
    .stream_query = sim_stream_query,
    .stream_wait_event = sim_stream_wait_event,
    .event_create = sim_event_create,
    .event_destroy = sim_event_destroy,
    .event_record = sim_event_record,
    .event_synchronize = sim_event_synchronize,
    .event_query = sim_event_query,
    .event_elapsed_ms = sim_event_elapsed_ms,
};

const flagos_adapter *flagos_adapter_get(void)
{
    sim_adapter.n_kernels = sim_n_kernels;
    sim_adapter.kernels = sim_kernels;
    return &sim_adapter;
}
