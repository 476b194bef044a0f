// Progress of long work on stderr: one line redrawn in place, shown only on a terminal (a log
// or a pipe gets nothing, so output that is kept stays clean) and never with -q.
#pragma once

#include "innerq.h"

#include <stdbool.h>

typedef struct progress {
    const char * prog;  // the line starts "PROG: "
    bool on;
    bool shown;         // a line is on the screen
} progress;

progress progress_init(const char * prog, bool quiet);
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void progress_show(progress * p, const char * fmt, ...);
// Erases the line, so that what comes next starts on a clean one.
void progress_clear(progress * p);
// innerq_decode of a prompt in pieces of n_batch tokens, showing how many are done when there
// is more than one piece. Evaluates nothing if the tokens do not fit (as innerq_decode).
innerq_status progress_decode(progress * p, innerq_context * ctx, const innerq_token * tokens, int32_t n_tokens,
                              int32_t n_batch);
