// A monotonic clock for timing runs (innerq-cli's speed lines, innerq-bench's samples).
#pragma once

#include <stdint.h>
#include <time.h>

static inline int64_t tool_time_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}
