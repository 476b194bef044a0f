// What every face of innerq shares about parameters: the default length of a generation and
// the default thread count (the defaults without a params struct of their own; the others are
// the *_default_params functions), and the check of context parameters that needs no model,
// so that innerq-cli, the tools and the Python binding reject a bad cache type before they
// load anything.
#include "innerq.h"

#include "device.h"
#include "iq-cpu.h"
#include "kv-config.h"
#include "status.h"

// Bounded, as llama-cpp-python's completions are (max_tokens) and llama-cli's -1 is not: a
// prompt given without a limit ends, and the command-line faces say how to get more.
#define DEFAULT_N_PREDICT 128
#define MAX_CTX (1 << 22)
#define MAX_SEQ 1024
// Decoding reads every weight once per token: past a few cores memory bandwidth, not
// arithmetic, bounds it, and more threads only meet at more crowded barriers.
#define MAX_DEFAULT_THREADS 8
// Four times the text of the largest context (4M tokens of about 4 bytes): a prompt file, or a text
// innerq-perplexity scores chunk by chunk. Reading it takes well under a second.
#define MAX_TEXT_BYTES ((int64_t) 64 << 20)

int32_t innerq_default_n_predict(void) { return DEFAULT_N_PREDICT; }

int64_t innerq_max_text_bytes(void) { return MAX_TEXT_BYTES; }

int32_t innerq_default_n_threads(void) {
    const int n = iq_cpu_count();
    return n < MAX_DEFAULT_THREADS ? n : MAX_DEFAULT_THREADS;
}

innerq_status innerq_context_params_check(const innerq_context_params * p) {
    if (p == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_context_params_check: params is NULL");
    }
    if (p->n_ctx < 0 || p->n_ctx > MAX_CTX) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "n_ctx = %d is out of range (1 .. %d, or 0: the model's)",
                           p->n_ctx, MAX_CTX);
    }
    if (p->n_seq_max < 1 || p->n_seq_max > MAX_SEQ) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "n_seq_max = %d is out of range (1 .. %d)", p->n_seq_max, MAX_SEQ);
    }
    if (p->n_batch < 1 || p->n_batch > 8192) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "n_batch = %d is out of range (1 .. 8192)", p->n_batch);
    }
    if (p->n_threads < 0 || p->n_threads > 512) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "n_threads = %d is out of range (1 .. 512, or 0: the CPUs "
                           "this process may use)", p->n_threads);
    }
    if (p->kv_group != 0 && p->kv_group != 32 && p->kv_group != 64 && p->kv_group != 128) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_group = %d: the group size must be 32, 64 or 128", p->kv_group);
    }
    if (p->kv_sink < -1 || p->kv_recent < -1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_sink and kv_recent must be >= 0 (or -1 for the default)");
    }
    if (p->kv_params8 < -1 || p->kv_params8 > 1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_params8 = %d is out of range (-1: the default, 0 off, 1 on)",
                           p->kv_params8);
    }
    if (p->kv_key_levels < -1 || p->kv_key_levels > 1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_key_levels = %d is out of range (-1: the default, 0 off, "
                           "1 on)", p->kv_key_levels);
    }
    if (p->kv_value_scales < -1 || p->kv_value_scales > 1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_value_scales = %d is out of range (-1: the device's "
                           "default, 0 off, 1 on)", p->kv_value_scales);
    }
    if (p->kv_rot < -1 || p->kv_rot > 3) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_rot = %d is out of range (-1: the default, 0 none, "
                           "1 keys, 2 values, 3 both)", p->kv_rot);
    }
    if (p->pooling < INNERQ_POOLING_UNSPECIFIED || p->pooling > INNERQ_POOLING_LAST) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "pooling = %d is not an innerq_pooling (-1 .. 3)", p->pooling);
    }
    // the names and whether they pair; whether the group divides head_dim is the model's question
    struct kv_config cfg;
    return kv_config_make(p, NULL, device_kind_of(INNERQ_DEVICE_CPU), 0, p->n_seq_max, &cfg);
}
