// Failing with a message: every public function that fails goes through innerq_fail, so
// innerq_last_error() always says why.
#pragma once

#include "innerq.h"

innerq_status innerq_fail(innerq_status status, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
