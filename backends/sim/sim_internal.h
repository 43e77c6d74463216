/* Internals shared by the sim adapter's runtime (sim.c) and its kernels (kernels.c). */
#ifndef FLAGOS_SIM_INTERNAL_H
#define FLAGOS_SIM_INTERNAL_H

#include <flagos/adapter.h>

/* Vendor-style error codes, named by sim_error_name(). */
enum sim_error {
    SIM_SUCCESS = 0,
    SIM_ERROR_INVALID_VALUE = 1,
    SIM_ERROR_OUT_OF_MEMORY = 2,
    SIM_ERROR_INVALID_DEVICE = 3,
    SIM_ERROR_INVALID_HANDLE = 4,
    SIM_ERROR_OUT_OF_RANGE = 5,
    SIM_ERROR_DEVICE_LOST = 6,
    SIM_ERROR_NOT_SUPPORTED = 7
};

/* Set status->code and a printf-style message; returns code. */
int32_t sim_fail(flagos_status *status, int32_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int32_t sim_ok(flagos_status *status);

/* Host memory behind a buffer of `device` (NULL and a failed status when the device is
 * invalid or lost, or the handle unknown); *nbytes gets the buffer's size. Only the
 * adapter's own code may see this pointer. */
void *sim_resolve(int32_t device, flagos_buffer buffer, uint64_t *nbytes, flagos_status *status);

/* Kernel table (kernels.c). */
extern const flagos_kernel sim_kernels[];
extern const int32_t sim_n_kernels;

#endif
