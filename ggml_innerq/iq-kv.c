// Cache types (iq-kv.h).
#include "iq-kv.h"

#include "iq-innerq.h"

bool iq_kv_type_is_plain(enum iq_type type) {
    return type == IQ_TYPE_F32 || type == IQ_TYPE_F16 || type == IQ_TYPE_Q8_0 || type == IQ_TYPE_Q4_0;
}

bool iq_kv_type_is_cache(enum iq_type type) { return iq_kv_type_is_plain(type) || iq_qcache_type_is_quantized(type); }
