#include "progress.h"

#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

progress progress_init(const char * prog, bool quiet) {
    progress p = {prog, !quiet && isatty(STDERR_FILENO), false};
    return p;
}

void progress_show(progress * p, const char * fmt, ...) {
    if (!p->on) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "\r\033[K%s: ", p->prog);  // \033[K: erase what a longer line left
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fflush(stderr);
    p->shown = true;
}

void progress_clear(progress * p) {
    if (p->shown) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
        p->shown = false;
    }
}

innerq_status progress_decode(progress * p, innerq_context * ctx, const innerq_token * tokens, int32_t n_tokens,
                              int32_t n_batch) {
    // Too long, or one piece anyway: one call, which also makes the context-full error its own.
    if (n_tokens <= n_batch || innerq_n_past(ctx) + n_tokens > innerq_n_ctx(ctx)) {
        return innerq_decode(ctx, tokens, n_tokens);
    }
    innerq_status st = INNERQ_OK;
    for (int32_t done = 0; done < n_tokens && st == INNERQ_OK; done += n_batch) {
        progress_show(p, "prompt %d/%d tokens", done, n_tokens);
        const int32_t n = n_tokens - done < n_batch ? n_tokens - done : n_batch;
        st = innerq_decode(ctx, tokens + done, n);
    }
    progress_clear(p);
    return st;
}
