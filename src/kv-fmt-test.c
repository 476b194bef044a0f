// A cache format for tests (compiled where INNERQ_TEST_FORMATS is defined: the test builds,
// not the wheel): bf16 rows in pages of 64 tokens, one tile of the CPU's attention. Its own
// type, and pages so small that a few hundred tokens span many of them, out of order once
// sequences come and go; the rest is the plain format's. It shows what adding a format takes:
// this file and its row in kv-format.c (tests/test_kv_format.py runs it).
#include "kv-cache.h"

#ifdef INNERQ_TEST_FORMATS

#define KV_TEST_PAGE 64

static bool test_has_type(enum iq_type type) { return type == IQ_TYPE_BF16; }

static void test_shape(struct kv_config * cfg) {
    cfg->page = KV_TEST_PAGE;
    cfg->n_table = (cfg->n_ctx + KV_TEST_PAGE - 1) / KV_TEST_PAGE;
    cfg->n_pages = cfg->n_table + cfg->n_slots - 1;
}

static innerq_status test_configure(const innerq_context_params * p, const struct llama_hparams * hp,
                                    struct kv_config * cfg) {
    return kv_format_plain.configure(p, hp, cfg);
}

static double test_bytes_per_token(const struct kv_config * cfg, const struct llama_hparams * hp) {
    return kv_format_plain.bytes_per_token(cfg, hp);
}

static innerq_status test_layer_init(struct kv_cache * c, int32_t il, size_t * bytes) {
    return kv_format_plain.layer_init(c, il, bytes);
}

static void test_layer_place(struct kv_cache * c, int32_t il, size_t off) { kv_format_plain.layer_place(c, il, off); }

static void test_plan(const struct kv_config * cfg, const struct kv_seq * s, int32_t n, struct iq_kv_seq * row) {
    kv_format_plain.plan(cfg, s, n, row);
}

static int32_t test_pages_after(const struct kv_config * cfg, const struct iq_kv_seq * row) {
    return kv_format_plain.pages_after(cfg, row);
}

static void test_commit(const struct kv_config * cfg, const struct iq_kv_seq * row, struct kv_seq * s) {
    kv_format_plain.commit(cfg, row, s);
}

static int32_t test_until_flush(const struct kv_config * cfg, const struct kv_seq * s) {
    return kv_format_plain.until_flush(cfg, s);
}

static int32_t test_keep(const struct kv_config * cfg, const struct kv_seq * s, int32_t n, struct kv_seq * out) {
    return kv_format_plain.keep(cfg, s, n, out);
}

static int32_t test_exact_fit(const struct kv_config * cfg, const struct kv_seq * s, int32_t lo, int32_t hi) {
    return kv_format_plain.exact_fit(cfg, s, lo, hi);
}

static void test_walk(const struct kv_cache * c, int32_t slot, const struct kv_seq * s, kv_chunk_fn fn, void * arg) {
    kv_format_plain.walk(c, slot, s, fn, arg);
}

const struct kv_format kv_format_test = {
    .name = "test",
    .quantized = false,
    .has_type = test_has_type,
    .configure = test_configure,
    .shape = test_shape,
    .bytes_per_token = test_bytes_per_token,
    .layer_init = test_layer_init,
    .layer_place = test_layer_place,
    .plan = test_plan,
    .pages_after = test_pages_after,
    .commit = test_commit,
    .until_flush = test_until_flush,
    .keep = test_keep,
    .exact_fit = test_exact_fit,
    .walk = test_walk,
};

#endif  // INNERQ_TEST_FORMATS
