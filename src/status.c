#include "status.h"

#include "iq.h"

#include <stdarg.h>
#include <stdio.h>

innerq_status innerq_fail(innerq_status status, const char * fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    iq_error_set("%s", msg);
    return status;
}

const char * innerq_last_error(void) { return iq_error_get(); }

const char * innerq_status_name(innerq_status status) {
    switch (status) {
        case INNERQ_OK: return "ok";
        case INNERQ_ERR_INVALID_ARGUMENT: return "invalid argument";
        case INNERQ_ERR_IO: return "i/o error";
        case INNERQ_ERR_FORMAT: return "malformed file";
        case INNERQ_ERR_UNSUPPORTED: return "unsupported";
        case INNERQ_ERR_OUT_OF_MEMORY: return "out of memory";
        case INNERQ_ERR_CONTEXT_FULL: return "context full";
        case INNERQ_ERR_BUFFER_TOO_SMALL: return "buffer too small";
        case INNERQ_ERR_BACKEND: return "backend failure";
        case INNERQ_ERR_STATE_MISMATCH: return "state of another model or cache";
    }
    return "unknown status";
}
