/* opencl: every OpenCL device of the machine as a flagos chip.
 *
 * Devices come from every platform the ICD loader knows, in a stable order (platforms as
 * clGetPlatformIDs lists them, then each platform's devices); FLAGOS_OPENCL_DEVICES chooses
 * among them and FLAGOS_VISIBLE_DEVICES narrows the choice further, as sim does. Each device
 * has a context of its own and an in-order, profiling command queue for its default stream;
 * every stream of ABI 1.1 is another such queue, and events are markers in them.
 *
 * Buffers and the caching allocator live in memory.c, program builds and their disk cache in
 * program.c, the kernel table in kernels.c (the OpenCL C source is kernels.cl).
 */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

#include "opencl_internal.h"

#define MACHINE_MAX_DEVICES 64

ocl_state ocl;

/* A stream (a command queue) or an event (the marker it last recorded). */
typedef struct ocl_object {
    uint64_t handle; /* key; never 0, never reused */
    int32_t device;
    int is_event;
    uint32_t flags;          /* events: FLAGOS_EVENT_TIMING */
    cl_command_queue queue;  /* streams */
    cl_event marker;         /* events: NULL until recorded */
    cl_event last;           /* streams: the last command enqueued (kernels, device copies,
                              * waits for events) */
    cl_event captured;       /* events: the stream's last command when recorded (NULL: none) */
    UT_hash_handle hh;
} ocl_object;

static ocl_object *objects;
static uint64_t next_object = 1;

/* ---- status ------------------------------------------------------------ */

int32_t ocl_fail(flagos_status *status, int32_t code, const char *fmt, ...)
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

int32_t ocl_ok(flagos_status *status)
{
    if (status != NULL) {
        status->code = OCL_SUCCESS;
        status->message[0] = '\0';
    }
    return OCL_SUCCESS;
}

const char *ocl_cl_name(cl_int err)
{
    switch (err) {
#define NAME(c) case c: return #c;
    NAME(CL_SUCCESS) NAME(CL_DEVICE_NOT_FOUND) NAME(CL_DEVICE_NOT_AVAILABLE)
    NAME(CL_COMPILER_NOT_AVAILABLE) NAME(CL_MEM_OBJECT_ALLOCATION_FAILURE)
    NAME(CL_OUT_OF_RESOURCES) NAME(CL_OUT_OF_HOST_MEMORY) NAME(CL_PROFILING_INFO_NOT_AVAILABLE)
    NAME(CL_MEM_COPY_OVERLAP) NAME(CL_IMAGE_FORMAT_MISMATCH) NAME(CL_IMAGE_FORMAT_NOT_SUPPORTED)
    NAME(CL_BUILD_PROGRAM_FAILURE) NAME(CL_MAP_FAILURE) NAME(CL_MISALIGNED_SUB_BUFFER_OFFSET)
    NAME(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST) NAME(CL_COMPILE_PROGRAM_FAILURE)
    NAME(CL_LINKER_NOT_AVAILABLE) NAME(CL_LINK_PROGRAM_FAILURE) NAME(CL_DEVICE_PARTITION_FAILED)
    NAME(CL_KERNEL_ARG_INFO_NOT_AVAILABLE) NAME(CL_INVALID_VALUE) NAME(CL_INVALID_DEVICE_TYPE)
    NAME(CL_INVALID_PLATFORM) NAME(CL_INVALID_DEVICE) NAME(CL_INVALID_CONTEXT)
    NAME(CL_INVALID_QUEUE_PROPERTIES) NAME(CL_INVALID_COMMAND_QUEUE) NAME(CL_INVALID_HOST_PTR)
    NAME(CL_INVALID_MEM_OBJECT) NAME(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR)
    NAME(CL_INVALID_IMAGE_SIZE) NAME(CL_INVALID_SAMPLER) NAME(CL_INVALID_BINARY)
    NAME(CL_INVALID_BUILD_OPTIONS) NAME(CL_INVALID_PROGRAM) NAME(CL_INVALID_PROGRAM_EXECUTABLE)
    NAME(CL_INVALID_KERNEL_NAME) NAME(CL_INVALID_KERNEL_DEFINITION) NAME(CL_INVALID_KERNEL)
    NAME(CL_INVALID_ARG_INDEX) NAME(CL_INVALID_ARG_VALUE) NAME(CL_INVALID_ARG_SIZE)
    NAME(CL_INVALID_KERNEL_ARGS) NAME(CL_INVALID_WORK_DIMENSION)
    NAME(CL_INVALID_WORK_GROUP_SIZE) NAME(CL_INVALID_WORK_ITEM_SIZE)
    NAME(CL_INVALID_GLOBAL_OFFSET) NAME(CL_INVALID_EVENT_WAIT_LIST) NAME(CL_INVALID_EVENT)
    NAME(CL_INVALID_OPERATION) NAME(CL_INVALID_GL_OBJECT) NAME(CL_INVALID_BUFFER_SIZE)
    NAME(CL_INVALID_MIP_LEVEL) NAME(CL_INVALID_GLOBAL_WORK_SIZE) NAME(CL_INVALID_PROPERTY)
    NAME(CL_INVALID_IMAGE_DESCRIPTOR) NAME(CL_INVALID_COMPILER_OPTIONS)
    NAME(CL_INVALID_LINKER_OPTIONS) NAME(CL_INVALID_DEVICE_PARTITION_COUNT)
#undef NAME
    case -1001: return "CL_PLATFORM_NOT_FOUND_KHR";
    default: return "CL_UNKNOWN_ERROR";
    }
}

int32_t ocl_cl_fail(flagos_status *status, cl_int err, const char *what)
{
    return ocl_fail(status, OCL_CL_BASE - err, "%s failed: %s (%d)", what, ocl_cl_name(err),
                    (int)err);
}

static const char *ocl_error_name(int32_t code)
{
    switch (code) {
    case OCL_SUCCESS: return "OPENCL_SUCCESS";
    case OCL_ERROR_INVALID_VALUE: return "OPENCL_ADAPTER_INVALID_VALUE";
    case OCL_ERROR_OUT_OF_MEMORY: return "OPENCL_ADAPTER_OUT_OF_MEMORY";
    case OCL_ERROR_INVALID_DEVICE: return "OPENCL_ADAPTER_INVALID_DEVICE";
    case OCL_ERROR_INVALID_HANDLE: return "OPENCL_ADAPTER_INVALID_HANDLE";
    case OCL_ERROR_OUT_OF_RANGE: return "OPENCL_ADAPTER_OUT_OF_RANGE";
    case OCL_ERROR_BUILD_FAILED: return "OPENCL_ADAPTER_BUILD_FAILED";
    case OCL_ERROR_CONFIG: return "OPENCL_ADAPTER_BAD_CONFIGURATION";
    case OCL_ERROR_HOST_MEMORY: return "OPENCL_ADAPTER_HOST_OUT_OF_MEMORY";
    default:
        if (code > OCL_CL_BASE)
            return ocl_cl_name(OCL_CL_BASE - code);
        return "OPENCL_ADAPTER_UNKNOWN_ERROR";
    }
}

/* ---- the machine's devices ------------------------------------------------ */

typedef struct machine_device {
    cl_platform_id platform;
    cl_device_id id;
    cl_device_type type;
} machine_device;

static int32_t list_machine(machine_device *out, int32_t *n, flagos_status *status)
{
    cl_platform_id platforms[16];
    cl_uint n_platforms = 0;
    *n = 0;
    cl_int err = clGetPlatformIDs(16, platforms, &n_platforms);
    if (err == -1001 /* CL_PLATFORM_NOT_FOUND_KHR: no driver installed */ || n_platforms == 0)
        return ocl_ok(status);
    if (err != CL_SUCCESS)
        return ocl_cl_fail(status, err, "clGetPlatformIDs");
    if (n_platforms > 16)
        n_platforms = 16;
    for (cl_uint p = 0; p < n_platforms; p++) {
        cl_device_id ids[MACHINE_MAX_DEVICES];
        cl_uint count = 0;
        err = clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, MACHINE_MAX_DEVICES, ids, &count);
        if (err == CL_DEVICE_NOT_FOUND)
            continue;
        if (err != CL_SUCCESS)
            return ocl_cl_fail(status, err, "clGetDeviceIDs");
        if (count > MACHINE_MAX_DEVICES)
            count = MACHINE_MAX_DEVICES;
        for (cl_uint i = 0; i < count && *n < MACHINE_MAX_DEVICES; i++) {
            cl_device_type type = 0;
            clGetDeviceInfo(ids[i], CL_DEVICE_TYPE, sizeof type, &type, NULL);
            out[*n].platform = platforms[p];
            out[*n].id = ids[i];
            out[*n].type = type;
            (*n)++;
        }
    }
    return ocl_ok(status);
}

static const char *type_word(cl_device_type type)
{
    if (type & CL_DEVICE_TYPE_GPU)
        return "gpu";
    if (type & CL_DEVICE_TYPE_ACCELERATOR)
        return "accelerator";
    if (type & CL_DEVICE_TYPE_CPU)
        return "cpu";
    return "other";
}

/* "0 = pthread-haswell (cpu), 1 = ..." for error messages. */
static void describe_machine(const machine_device *m, int32_t n, char *out, size_t size)
{
    size_t used = 0;
    out[0] = '\0';
    if (n == 0)
        snprintf(out, size, "none");
    for (int32_t i = 0; i < n && used < size; i++) {
        char name[64] = "";
        clGetDeviceInfo(m[i].id, CL_DEVICE_NAME, sizeof name - 1, name, NULL);
        int w = snprintf(out + used, size - used, "%s%d = %s (%s)", i ? ", " : "", i, name,
                         type_word(m[i].type));
        if (w < 0)
            break;
        used += (size_t)w;
    }
}

static int parse_index(const char *text, size_t len, long limit, long *out)
{
    char item[24];
    if (len == 0 || len >= sizeof item)
        return -1;
    memcpy(item, text, len);
    item[len] = '\0';
    if (!isdigit((unsigned char)item[0]))
        return -1;
    char *end;
    errno = 0;
    long v = strtol(item, &end, 10);
    if (errno != 0 || *end != '\0' || v < 0 || v >= limit)
        return -1;
    *out = v;
    return 0;
}

static int word_is(const char *p, size_t len, const char *word)
{
    return strlen(word) == len && strncmp(p, word, len) == 0;
}

static int32_t add_choice(int32_t *chosen, int32_t *n, int32_t index)
{
    for (int32_t i = 0; i < *n; i++)
        if (chosen[i] == index)
            return -1;
    if (*n >= OCL_MAX_DEVICES)
        return -1;
    chosen[(*n)++] = index;
    return 0;
}

/* FLAGOS_OPENCL_DEVICES: comma-separated items, each `all`, `gpu`, `cpu`, `accelerator` or a
 * machine index; unset or empty: the GPUs and accelerators when there are any, else all. */
static int32_t choose_devices(const machine_device *m, int32_t n_machine, int32_t *chosen,
                              int32_t *n, flagos_status *status)
{
    const char *text = getenv("FLAGOS_OPENCL_DEVICES");
    char machine[512];
    *n = 0;
    if (text == NULL || *text == '\0') {
        for (int32_t i = 0; i < n_machine; i++)
            if (m[i].type & (CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR))
                add_choice(chosen, n, i);
        for (int32_t i = 0; *n == 0 && i < n_machine && i < OCL_MAX_DEVICES; i++)
            add_choice(chosen, n, i);
        return ocl_ok(status);
    }
    const char *p = text;
    for (;;) {
        size_t len = strcspn(p, ",");
        cl_device_type want = 0;
        long index = -1;
        if (word_is(p, len, "all"))
            want = CL_DEVICE_TYPE_ALL;
        else if (word_is(p, len, "gpu"))
            want = CL_DEVICE_TYPE_GPU;
        else if (word_is(p, len, "cpu"))
            want = CL_DEVICE_TYPE_CPU;
        else if (word_is(p, len, "accelerator"))
            want = CL_DEVICE_TYPE_ACCELERATOR;
        else if (parse_index(p, len, n_machine, &index) < 0)
            goto bad;
        int32_t before = *n;
        for (int32_t i = 0; i < n_machine; i++) {
            int match = index >= 0 ? i == index : (m[i].type & want) != 0;
            if (match && add_choice(chosen, n, i) < 0)
                goto bad;
        }
        if (*n == before) {
            describe_machine(m, n_machine, machine, sizeof machine);
            return ocl_fail(status, OCL_ERROR_CONFIG,
                            "FLAGOS_OPENCL_DEVICES='%s': no OpenCL device is a '%.*s' here; "
                            "this machine has: %s. Use all, gpu, cpu, accelerator or device "
                            "indices separated by commas, or unset it", text, (int)len, p,
                            machine);
        }
        p += len;
        if (*p == '\0')
            return ocl_ok(status);
        p++;
    }
bad:
    describe_machine(m, n_machine, machine, sizeof machine);
    return ocl_fail(status, OCL_ERROR_CONFIG,
                    "FLAGOS_OPENCL_DEVICES='%s' is not valid; use all, gpu, cpu, accelerator or "
                    "distinct device indices from this machine's list, separated by commas "
                    "(e.g. FLAGOS_OPENCL_DEVICES=0); this machine has: %s", text, machine);
}

/* FLAGOS_VISIBLE_DEVICES: distinct indices into the chosen devices, as sim honours it. */
static int32_t apply_visible(int32_t *chosen, int32_t *n, flagos_status *status)
{
    const char *text = getenv("FLAGOS_VISIBLE_DEVICES");
    if (text == NULL || *text == '\0')
        return ocl_ok(status);
    int32_t picked[OCL_MAX_DEVICES], n_picked = 0;
    const char *p = text;
    for (;;) {
        size_t len = strcspn(p, ",");
        long v;
        if (parse_index(p, len, *n, &v) < 0 || add_choice(picked, &n_picked, (int32_t)v) < 0)
            return ocl_fail(status, OCL_ERROR_CONFIG,
                            "FLAGOS_VISIBLE_DEVICES='%s' is not valid for opencl; use distinct "
                            "indices from 0 to %d (the devices FLAGOS_OPENCL_DEVICES chose) "
                            "separated by commas, e.g. FLAGOS_VISIBLE_DEVICES=0", text, *n - 1);
        p += len;
        if (*p == '\0')
            break;
        p++;
    }
    for (int32_t i = 0; i < n_picked; i++)
        picked[i] = chosen[picked[i]];
    memcpy(chosen, picked, sizeof(int32_t) * (size_t)n_picked);
    *n = n_picked;
    return ocl_ok(status);
}

static int has_extension(cl_device_id id, const char *name)
{
    size_t size = 0;
    if (clGetDeviceInfo(id, CL_DEVICE_EXTENSIONS, 0, NULL, &size) != CL_SUCCESS || size == 0)
        return 0;
    char *text = malloc(size + 1);
    if (text == NULL)
        return 0;
    int found = 0;
    if (clGetDeviceInfo(id, CL_DEVICE_EXTENSIONS, size, text, NULL) == CL_SUCCESS) {
        text[size] = '\0';
        size_t len = strlen(name);
        for (const char *p = strstr(text, name); p != NULL && !found; p = strstr(p + 1, name))
            found = (p == text || p[-1] == ' ') && (p[len] == ' ' || p[len] == '\0');
    }
    free(text);
    return found;
}

/* FLAGOS_OPENCL_FP16: `auto` (unset): float16 is native where the device has cl_khr_fp16;
 * `on`: everywhere (the kernels compute in float and only load and store half, with
 * vload_half/vstore_half, which every OpenCL 1.2 device has); `off`: nowhere. */
static int32_t read_fp16_mode(int *mode, flagos_status *status)
{
    const char *v = getenv("FLAGOS_OPENCL_FP16");
    *mode = -1;
    if (v == NULL || *v == '\0' || strcmp(v, "auto") == 0)
        return ocl_ok(status);
    if (strcmp(v, "on") == 0 || strcmp(v, "off") == 0) {
        *mode = strcmp(v, "on") == 0;
        return ocl_ok(status);
    }
    return ocl_fail(status, OCL_ERROR_CONFIG, "FLAGOS_OPENCL_FP16='%s' is not valid; use auto "
                    "(float16 where the device has cl_khr_fp16), on or off, e.g. "
                    "FLAGOS_OPENCL_FP16=on", v);
}

static int32_t open_device(ocl_device *d, const machine_device *m, int32_t machine_index,
                           int fp16_mode, flagos_status *status)
{
    cl_int err;
    char platform[64] = "";
    memset(d, 0, sizeof *d);
    d->platform = m->platform;
    d->id = m->id;
    d->type = m->type;
    d->machine_index = machine_index;
    char device_name[sizeof d->device_name] = "", driver[sizeof d->driver] = "";
    clGetDeviceInfo(m->id, CL_DEVICE_NAME, sizeof device_name - 1, device_name, NULL);
    clGetDeviceInfo(m->id, CL_DRIVER_VERSION, sizeof driver - 1, driver, NULL);
    clGetPlatformInfo(m->platform, CL_PLATFORM_NAME, sizeof platform - 1, platform, NULL);
    memcpy(d->device_name, device_name, sizeof device_name);
    memcpy(d->driver, driver, sizeof driver);
    snprintf(d->name, sizeof d->name, "%.56s (%.36s, driver %.20s)", device_name, platform,
             driver);
    cl_ulong total = 0, max_alloc = 0;
    clGetDeviceInfo(m->id, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof total, &total, NULL);
    clGetDeviceInfo(m->id, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof max_alloc, &max_alloc, NULL);
    d->total_memory = total;
    d->max_alloc = max_alloc;
    d->native_dtypes = FLAGOS_DTYPE_BIT(FLAGOS_FLOAT32);
    if (fp16_mode == 1 || (fp16_mode == -1 && has_extension(m->id, "cl_khr_fp16")))
        d->native_dtypes |= FLAGOS_DTYPE_BIT(FLAGOS_FLOAT16);
    if (has_extension(m->id, "cl_khr_fp64"))
        d->native_dtypes |= FLAGOS_DTYPE_BIT(FLAGOS_FLOAT64);
    d->context = clCreateContext(NULL, 1, &m->id, NULL, NULL, &err);
    if (d->context == NULL)
        return ocl_cl_fail(status, err, "clCreateContext");
    d->default_queue = clCreateCommandQueue(d->context, m->id, CL_QUEUE_PROFILING_ENABLE, &err);
    if (d->default_queue == NULL) {
        clReleaseContext(d->context);
        d->context = NULL;
        return ocl_cl_fail(status, err, "clCreateCommandQueue");
    }
    d->current = d->default_queue;
    d->current_last = &d->default_last;
    return ocl_ok(status);
}

static void close_device(ocl_device *d)
{
    if (d->default_queue != NULL) {
        clFinish(d->default_queue);
        clReleaseCommandQueue(d->default_queue);
    }
    if (d->default_last != NULL)
        clReleaseEvent(d->default_last);
    ocl_programs_release(d);
    if (d->context != NULL)
        clReleaseContext(d->context);
    memset(d, 0, sizeof *d);
}

static void release_objects(void)
{
    ocl_object *o, *tmp;
    HASH_ITER(hh, objects, o, tmp) {
        HASH_DEL(objects, o);
        if (o->queue != NULL) {
            clFinish(o->queue);
            clReleaseCommandQueue(o->queue);
        }
        if (o->marker != NULL)
            clReleaseEvent(o->marker);
        if (o->last != NULL)
            clReleaseEvent(o->last);
        if (o->captured != NULL)
            clReleaseEvent(o->captured);
        free(o);
    }
}

static void close_all(void)
{
    ocl_kernels_release();
    ocl_memory_release_all();
    release_objects();
    for (int32_t i = 0; i < ocl.n_devices; i++)
        close_device(&ocl.devices[i]);
    ocl.n_devices = 0;
    ocl.initialized = 0;
}

static int32_t ocl_init(flagos_status *status)
{
    if (ocl.initialized)
        return ocl_ok(status);
    machine_device machine[MACHINE_MAX_DEVICES];
    int32_t n_machine = 0, chosen[OCL_MAX_DEVICES], n_chosen = 0;
    int fp16_mode = -1;
    int32_t rc = read_fp16_mode(&fp16_mode, status);
    if (rc == OCL_SUCCESS)
        rc = list_machine(machine, &n_machine, status);
    if (rc == OCL_SUCCESS)
        rc = choose_devices(machine, n_machine, chosen, &n_chosen, status);
    if (rc == OCL_SUCCESS)
        rc = apply_visible(chosen, &n_chosen, status);
    if (rc != OCL_SUCCESS)
        return rc;
    for (int32_t i = 0; i < n_chosen; i++) {
        rc = open_device(&ocl.devices[i], &machine[chosen[i]], chosen[i], fp16_mode, status);
        if (rc != OCL_SUCCESS) {
            close_all();
            return rc;
        }
        ocl.n_devices = i + 1;
    }
    ocl.initialized = 1;
    return ocl_ok(status);
}

static void ocl_shutdown(void)
{
    close_all();
}

int32_t ocl_check_device(int32_t device, flagos_status *status)
{
    if (!ocl.initialized)
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "the opencl adapter is not initialized");
    if (device < 0 || device >= ocl.n_devices)
        return ocl_fail(status, OCL_ERROR_INVALID_DEVICE, "opencl device %d does not exist "
                        "(%d devices)", device, ocl.n_devices);
    return OCL_SUCCESS;
}

void ocl_track(int32_t device, cl_event e)
{
    cl_event *slot = ocl.devices[device].current_last;
    if (*slot != NULL)
        clReleaseEvent(*slot);
    *slot = e;
}

static int32_t ocl_device_count(int32_t *count, flagos_status *status)
{
    *count = ocl.initialized ? ocl.n_devices : 0;
    return ocl_ok(status);
}

static int32_t ocl_device_props(int32_t device, flagos_device_props *props, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    const ocl_device *d = &ocl.devices[device];
    snprintf(props->name, sizeof props->name, "%s", d->name);
    props->total_memory = d->total_memory;
    props->native_dtypes = d->native_dtypes;
    return ocl_ok(status);
}

static int32_t ocl_synchronize(int32_t device, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    return rc != OCL_SUCCESS ? rc : ocl_finish_device(device, status);
}

int32_t ocl_finish_device(int32_t device, flagos_status *status)
{
    ocl_device *d = &ocl.devices[device];
    cl_int err = clFinish(d->default_queue);
    if (err != CL_SUCCESS)
        return ocl_cl_fail(status, err, "clFinish");
    if (d->n_streams > 0) {
        ocl_object *o, *tmp;
        HASH_ITER(hh, objects, o, tmp) {
            if (!o->is_event && o->device == device && (err = clFinish(o->queue)) != CL_SUCCESS)
                return ocl_cl_fail(status, err, "clFinish");
        }
    }
    d->cache_pending = 0;
    return ocl_ok(status);
}

/* ---- streams and events ---------------------------------------------------- */

/* The stream or event `handle` of `device`; a stream of 0 is the default stream (NULL with
 * success). */
static ocl_object *lookup(int32_t device, uint64_t handle, int is_event, flagos_status *status)
{
    ocl_object *o = NULL;
    if (!is_event && handle == 0) {
        ocl_ok(status);
        return NULL;
    }
    HASH_FIND(hh, objects, &handle, sizeof handle, o);
    if (o == NULL || o->device != device || o->is_event != is_event) {
        ocl_fail(status, OCL_ERROR_INVALID_HANDLE, "%s %llu is not a live %s of opencl device %d",
                 is_event ? "event" : "stream", (unsigned long long)handle,
                 is_event ? "event" : "stream", device);
        return NULL;
    }
    ocl_ok(status);
    return o;
}

/* The queue of stream `handle` (0: the default queue); NULL with a failed status. */
static cl_command_queue stream_queue(int32_t device, uint64_t handle, flagos_status *status)
{
    if (ocl_check_device(device, status) != OCL_SUCCESS)
        return NULL;
    if (handle == 0) {
        ocl_ok(status);
        return ocl.devices[device].default_queue;
    }
    ocl_object *o = lookup(device, handle, 0, status);
    return o != NULL ? o->queue : NULL;
}

static int32_t add_object(ocl_object *o, uint64_t *handle, flagos_status *status)
{
    o->handle = next_object++;
    HASH_ADD(hh, objects, handle, sizeof o->handle, o);
    *handle = o->handle;
    return ocl_ok(status);
}

static int32_t ocl_stream_create(int32_t device, int32_t priority, flagos_stream *stream,
                                 flagos_status *status)
{
    (void)priority; /* OpenCL 1.2 queues have no priorities */
    int32_t rc = ocl_check_device(device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    ocl_device *d = &ocl.devices[device];
    ocl_object *o = calloc(1, sizeof *o);
    if (o == NULL)
        return ocl_fail(status, OCL_ERROR_HOST_MEMORY, "host memory ran out");
    cl_int err;
    o->queue = clCreateCommandQueue(d->context, d->id, CL_QUEUE_PROFILING_ENABLE, &err);
    if (o->queue == NULL) {
        free(o);
        return ocl_cl_fail(status, err, "clCreateCommandQueue");
    }
    o->device = device;
    d->n_streams++;
    return add_object(o, stream, status);
}

static int32_t ocl_stream_destroy(int32_t device, flagos_stream stream, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    if (stream == 0)
        return ocl_fail(status, OCL_ERROR_INVALID_HANDLE, "the default stream cannot be destroyed");
    ocl_object *o = lookup(device, stream, 0, status);
    if (o == NULL)
        return status->code;
    if (ocl.devices[device].current == o->queue)
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "stream %llu is the current stream of "
                        "opencl device %d; set another first", (unsigned long long)stream, device);
    /* its queued work still runs; buffers freed meanwhile wait for it (memory.c) */
    clFinish(o->queue);
    clReleaseCommandQueue(o->queue);
    if (o->last != NULL)
        clReleaseEvent(o->last);
    HASH_DEL(objects, o);
    free(o);
    ocl.devices[device].n_streams--;
    return ocl_ok(status);
}

static int32_t ocl_set_stream(int32_t device, flagos_stream stream, flagos_status *status)
{
    cl_command_queue q = stream_queue(device, stream, status);
    if (q == NULL)
        return status->code;
    ocl_device *d = &ocl.devices[device];
    d->current = q;
    d->current_last = stream == 0 ? &d->default_last : &lookup(device, stream, 0, status)->last;
    return ocl_ok(status);
}

static int32_t ocl_stream_synchronize(int32_t device, flagos_stream stream, flagos_status *status)
{
    cl_command_queue q = stream_queue(device, stream, status);
    if (q == NULL)
        return status->code;
    cl_int err = clFinish(q);
    return err == CL_SUCCESS ? ocl_ok(status) : ocl_cl_fail(status, err, "clFinish");
}

static int32_t event_done(cl_event e, int32_t *done, flagos_status *status)
{
    cl_int state = CL_COMPLETE;
    cl_int err = e == NULL ? CL_SUCCESS
                           : clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof state,
                                            &state, NULL);
    if (err != CL_SUCCESS)
        return ocl_cl_fail(status, err, "clGetEventInfo");
    if (state < 0)
        return ocl_cl_fail(status, state, "queued work");
    *done = state == CL_COMPLETE;
    return ocl_ok(status);
}

static int32_t ocl_stream_query(int32_t device, flagos_stream stream, int32_t *done,
                                flagos_status *status)
{
    /* Host copies block; kernels and device copies are tracked: the queue is done when its
     * last command is (markers and barriers of events only order, they compute nothing). */
    cl_command_queue q = stream_queue(device, stream, status);
    if (q == NULL)
        return status->code;
    clFlush(q);
    cl_event last = stream == 0 ? ocl.devices[device].default_last
                                : lookup(device, stream, 0, status)->last;
    return event_done(last, done, status);
}

static int32_t ocl_event_create(int32_t device, uint32_t flags, flagos_event *event,
                                flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    ocl_object *o = calloc(1, sizeof *o);
    if (o == NULL)
        return ocl_fail(status, OCL_ERROR_HOST_MEMORY, "host memory ran out");
    o->device = device;
    o->is_event = 1;
    o->flags = flags;
    return add_object(o, event, status);
}

static int32_t ocl_event_destroy(int32_t device, flagos_event event, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    ocl_object *o = rc == OCL_SUCCESS ? lookup(device, event, 1, status) : NULL;
    if (o == NULL)
        return status->code;
    if (o->marker != NULL)
        clReleaseEvent(o->marker);
    if (o->captured != NULL)
        clReleaseEvent(o->captured);
    HASH_DEL(objects, o);
    free(o);
    return ocl_ok(status);
}

static int32_t ocl_event_record(int32_t device, flagos_event event, flagos_stream stream,
                                flagos_status *status)
{
    cl_command_queue q = stream_queue(device, stream, status);
    if (q == NULL)
        return status->code;
    ocl_object *o = lookup(device, event, 1, status);
    if (o == NULL)
        return status->code;
    cl_event marker = NULL;
    cl_int err = clEnqueueMarkerWithWaitList(q, 0, NULL, &marker);
    if (err != CL_SUCCESS)
        return ocl_cl_fail(status, err, "clEnqueueMarkerWithWaitList");
    clFlush(q);
    if (o->marker != NULL)
        clReleaseEvent(o->marker);
    o->marker = marker;
    if (o->captured != NULL)
        clReleaseEvent(o->captured);
    o->captured = stream == 0 ? ocl.devices[device].default_last
                              : lookup(device, stream, 0, status)->last;
    if (o->captured != NULL)
        clRetainEvent(o->captured);
    return ocl_ok(status);
}

static int32_t ocl_stream_wait_event(int32_t device, flagos_stream stream, flagos_event event,
                                     flagos_status *status)
{
    cl_command_queue q = stream_queue(device, stream, status);
    if (q == NULL)
        return status->code;
    ocl_object *o = lookup(device, event, 1, status);
    if (o == NULL)
        return status->code;
    if (o->marker == NULL) /* never recorded: complete, nothing to wait for */
        return ocl_ok(status);
    cl_event barrier = NULL;
    cl_int err = clEnqueueBarrierWithWaitList(q, 1, &o->marker, &barrier);
    if (err != CL_SUCCESS)
        return ocl_cl_fail(status, err, "clEnqueueBarrierWithWaitList");
    cl_event *last = stream == 0 ? &ocl.devices[device].default_last
                                 : &lookup(device, stream, 0, status)->last;
    if (*last != NULL)
        clReleaseEvent(*last);
    *last = barrier; /* the stream is done only once the event is */
    return ocl_ok(status);
}

static int32_t ocl_event_synchronize(int32_t device, flagos_event event, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    ocl_object *o = rc == OCL_SUCCESS ? lookup(device, event, 1, status) : NULL;
    if (o == NULL)
        return status->code;
    cl_int err = o->marker != NULL ? clWaitForEvents(1, &o->marker) : CL_SUCCESS;
    return err == CL_SUCCESS ? ocl_ok(status) : ocl_cl_fail(status, err, "clWaitForEvents");
}

static int32_t ocl_event_query(int32_t device, flagos_event event, int32_t *done,
                               flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    ocl_object *o = rc == OCL_SUCCESS ? lookup(device, event, 1, status) : NULL;
    if (o == NULL)
        return status->code;
    /* complete once the work it captured is, even while its marker waits in the queue */
    return event_done(o->captured, done, status);
}

/* When a recorded event became true: when it was recorded, or when the work it captured
 * finished, whichever is later (its marker's own end adds the queue's scheduling delay). */
static cl_int event_time(const ocl_object *o, cl_ulong *when)
{
    cl_ulong queued = 0, finished = 0;
    cl_int err = clGetEventProfilingInfo(o->marker, CL_PROFILING_COMMAND_QUEUED, sizeof queued,
                                         &queued, NULL);
    if (err == CL_SUCCESS && o->captured != NULL)
        err = clGetEventProfilingInfo(o->captured, CL_PROFILING_COMMAND_END, sizeof finished,
                                      &finished, NULL);
    *when = queued > finished ? queued : finished;
    return err;
}

static int32_t ocl_event_elapsed_ms(int32_t device, flagos_event start, flagos_event end,
                                    double *ms, flagos_status *status)
{
    int32_t rc = ocl_check_device(device, status);
    ocl_object *a = NULL, *b = NULL;
    if (rc != OCL_SUCCESS || (a = lookup(device, start, 1, status)) == NULL ||
        (b = lookup(device, end, 1, status)) == NULL)
        return status->code;
    if (!((a->flags & b->flags) & FLAGOS_EVENT_TIMING))
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "both events must be created with "
                        "timing enabled (FLAGOS_EVENT_TIMING)");
    if (a->marker == NULL || b->marker == NULL)
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "both events must be recorded before "
                        "the time between them is asked");
    int32_t done_a = 0, done_b = 0;
    if (event_done(a->marker, &done_a, status) != OCL_SUCCESS ||
        event_done(b->marker, &done_b, status) != OCL_SUCCESS)
        return status->code;
    if (!done_a || !done_b)
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "both events must be complete before "
                        "the time between them is asked; synchronize one first");
    cl_ulong t0 = 0, t1 = 0;
    cl_int err = event_time(a, &t0);
    if (err == CL_SUCCESS)
        err = event_time(b, &t1);
    if (err != CL_SUCCESS)
        return ocl_cl_fail(status, err, "clGetEventProfilingInfo");
    *ms = ((double)t1 - (double)t0) / 1e6;
    return ocl_ok(status);
}

/* For flagos/chips/opencl.py (read with ctypes): the CL_DEVICE_TYPE bits of a device of this
 * process (CL_DEVICE_TYPE_CPU 2, GPU 4, ACCELERATOR 8), 0 for none. `auto` picks opencl only
 * for a device that is not a CPU. */
uint64_t flagos_opencl_device_type(int32_t device)
{
    if (!ocl.initialized || device < 0 || device >= ocl.n_devices)
        return 0;
    return (uint64_t)ocl.devices[device].type;
}

/* For `flagos diagnose`: the machine's index of a device of this process, -1 for none. */
int32_t flagos_opencl_machine_index(int32_t device)
{
    if (!ocl.initialized || device < 0 || device >= ocl.n_devices)
        return -1;
    return ocl.devices[device].machine_index;
}

/* ---- the adapter table ------------------------------------------------- */

static flagos_adapter ocl_adapter = {
    .struct_size = sizeof(flagos_adapter),
    .abi_major = FLAGOS_ADAPTER_ABI_MAJOR,
    .abi_minor = FLAGOS_ADAPTER_ABI_MINOR,
    .name = "opencl",
    .vendor = "OpenCL (Khronos ICD)",
    .init = ocl_init,
    .shutdown = ocl_shutdown,
    .device_count = ocl_device_count,
    .device_props = ocl_device_props,
    .alloc = ocl_alloc,
    .free = ocl_free,
    .memory_info = ocl_memory_info,
    .reset_peak = ocl_reset_peak,
    .empty_cache = ocl_empty_cache,
    .copy_h2d = ocl_copy_h2d,
    .copy_d2h = ocl_copy_d2h,
    .copy_d2d = ocl_copy_d2d,
    .synchronize = ocl_synchronize,
    .error_name = ocl_error_name,
    .out_of_memory_code = OCL_ERROR_OUT_OF_MEMORY,
    .device_lost_code = OCL_CL_BASE - CL_DEVICE_NOT_AVAILABLE,
    .stream_create = ocl_stream_create,
    .stream_destroy = ocl_stream_destroy,
    .set_stream = ocl_set_stream,
    .stream_synchronize = ocl_stream_synchronize,
    .stream_query = ocl_stream_query,
    .stream_wait_event = ocl_stream_wait_event,
    .event_create = ocl_event_create,
    .event_destroy = ocl_event_destroy,
    .event_record = ocl_event_record,
    .event_synchronize = ocl_event_synchronize,
    .event_query = ocl_event_query,
    .event_elapsed_ms = ocl_event_elapsed_ms,
};

const flagos_adapter *flagos_adapter_get(void)
{
    ocl_adapter.n_kernels = ocl_n_kernels;
    ocl_adapter.kernels = ocl_kernels;
    return &ocl_adapter;
}
