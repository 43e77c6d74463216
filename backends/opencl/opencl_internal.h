/* Internals shared by the OpenCL adapter's units: devices and streams (opencl.c), buffers and
 * the caching allocator (memory.c), program builds and their disk cache (program.c) and the
 * kernel table (kernels.c). */
#ifndef FLAGOS_OPENCL_INTERNAL_H
#define FLAGOS_OPENCL_INTERNAL_H

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <flagos/adapter.h>

/* The adapter's own codes are small positive numbers; an OpenCL code c (negative) is
 * reported as OCL_CL_BASE - c, so CL_DEVICE_NOT_FOUND (-1) never reads as
 * FLAGOS_STATUS_UNSUPPORTED (-1). */
enum ocl_error {
    OCL_SUCCESS = 0,
    OCL_ERROR_INVALID_VALUE = 1,
    OCL_ERROR_OUT_OF_MEMORY = 2,     /* an allocation that does not fit the device */
    OCL_ERROR_INVALID_DEVICE = 3,
    OCL_ERROR_INVALID_HANDLE = 4,
    OCL_ERROR_OUT_OF_RANGE = 5,
    OCL_ERROR_BUILD_FAILED = 6,      /* the kernels did not compile for a device */
    OCL_ERROR_CONFIG = 7,            /* FLAGOS_OPENCL_DEVICES / FLAGOS_VISIBLE_DEVICES */
    OCL_ERROR_HOST_MEMORY = 8,
    OCL_CL_BASE = 1000
};

#define OCL_MAX_DEVICES 16
#define OCL_MAX_PROGRAMS 3       /* one per dtype: float32, float16, float64 */

typedef struct ocl_cached_block ocl_cached_block;

typedef struct ocl_device {
    cl_platform_id platform;
    cl_device_id id;
    cl_device_type type;
    cl_context context;
    cl_command_queue default_queue;
    cl_command_queue current;          /* the queue of the current stream */
    cl_event default_last;             /* the last command enqueued on the default queue */
    cl_event *current_last;            /* where the current queue keeps its last command */
    int32_t n_streams;                 /* streams created and not destroyed */
    int32_t machine_index;             /* index in the machine's list of OpenCL devices */
    char name[128];                    /* "device (platform, driver X)" */
    char device_name[64];
    char driver[64];
    uint64_t total_memory;
    uint64_t max_alloc;
    uint64_t native_dtypes;
    /* allocator statistics (memory.c) */
    uint64_t allocated;                /* bytes of live buffers (rounded sizes) */
    uint64_t cached;                   /* bytes kept for reuse */
    uint64_t peak;
    ocl_cached_block *cache;           /* freed buffers kept for reuse */
    int cache_pending;                 /* cache holds buffers queued work may still use */
    /* programs (program.c), by dtype slot */
    cl_program programs[OCL_MAX_PROGRAMS];
} ocl_device;

typedef struct ocl_state {
    int initialized;
    int32_t n_devices;
    ocl_device devices[OCL_MAX_DEVICES];
} ocl_state;

extern ocl_state ocl;

/* Set status->code and a printf-style message; returns code. */
int32_t ocl_fail(flagos_status *status, int32_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int32_t ocl_ok(flagos_status *status);
/* An OpenCL failure of `what`: code OCL_CL_BASE - err, message naming the OpenCL code. */
int32_t ocl_cl_fail(flagos_status *status, cl_int err, const char *what);
const char *ocl_cl_name(cl_int err);
/* Keeps `e` (a command just enqueued on the device's current queue, owned from here) as that
 * queue's last command, which stream_query() asks about; releases the one before. */
void ocl_track(int32_t device, cl_event e);
/* OK when `device` is an initialized device of this process. */
int32_t ocl_check_device(int32_t device, flagos_status *status);

/* memory.c */
/* The cl_mem behind `buffer` of `device` (NULL and a failed status when unknown);
 * *nbytes gets its size as allocated. */
cl_mem ocl_resolve(int32_t device, flagos_buffer buffer, uint64_t *nbytes, flagos_status *status);
void ocl_memory_release_all(void);
int32_t ocl_alloc(int32_t device, uint64_t nbytes, flagos_buffer *buffer, flagos_status *status);
int32_t ocl_free(int32_t device, flagos_buffer buffer, flagos_status *status);
int32_t ocl_memory_info(int32_t device, flagos_memory_info *info, flagos_status *status);
int32_t ocl_reset_peak(int32_t device, flagos_status *status);
int32_t ocl_empty_cache(int32_t device, flagos_status *status);
int32_t ocl_copy_h2d(int32_t device, flagos_buffer dst, uint64_t dst_offset, const void *src,
                     uint64_t nbytes, flagos_status *status);
int32_t ocl_copy_d2h(int32_t device, void *dst, flagos_buffer src, uint64_t src_offset,
                     uint64_t nbytes, flagos_status *status);
int32_t ocl_copy_d2d(int32_t dst_device, flagos_buffer dst, uint64_t dst_offset,
                     int32_t src_device, flagos_buffer src, uint64_t src_offset,
                     uint64_t nbytes, flagos_status *status);
/* Waits for every queue of `device` (the default one and the streams'). */
int32_t ocl_finish_device(int32_t device, flagos_status *status);

/* program.c */
/* The program of `device` for `dtype` (FLAGOS_FLOAT32/FLOAT16/FLOAT64), built once per
 * process, from the disk cache when a valid binary is there. */
cl_program ocl_program(int32_t device, int32_t dtype, flagos_status *status);
void ocl_programs_release(ocl_device *d);

/* kernels.c */
extern const flagos_kernel ocl_kernels[];
extern const int32_t ocl_n_kernels;
void ocl_kernels_release(void);

#endif
