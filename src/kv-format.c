// The table of cache formats (kv-format.h).
#include "kv-format.h"

#include "status.h"

static const struct kv_format * const kv_formats[] = {
    &kv_format_plain,
    &kv_format_innerq,
    &kv_format_kivi,
#ifdef INNERQ_TEST_FORMATS
    &kv_format_test,
#endif
};

#define KV_N_FORMATS (sizeof(kv_formats) / sizeof(kv_formats[0]))

bool kv_format_has_type(enum iq_type type) {
    for (size_t i = 0; i < KV_N_FORMATS; i++) {
        if (kv_formats[i]->has_type(type)) {
            return true;
        }
    }
    return false;
}

const struct kv_format * kv_format_of(enum iq_type type_k, enum iq_type type_v) {
    for (size_t i = 0; i < KV_N_FORMATS; i++) {
        if (kv_formats[i]->has_type(type_k) && kv_formats[i]->has_type(type_v)) {
            return kv_formats[i];
        }
    }
    innerq_fail(INNERQ_ERR_UNSUPPORTED, "KV cache %s/%s: keys and values must both be quantized the same way (InnerQ "
                "or KIVI) or both plain", iq_type_name(type_k), iq_type_name(type_v));
    return NULL;
}
