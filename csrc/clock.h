/* The router's clock: monotonic nanoseconds, for the time the report gives to fallbacks and
 * to adapter kernels. */
#ifndef FLAGOS_CLOCK_H
#define FLAGOS_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t flagos_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
