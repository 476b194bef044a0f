// Cache types (iq-kv.h).
#include "iq-kv.h"

bool iq_kv_type_is_plain(enum iq_type type) {
    return type == IQ_TYPE_F32 || type == IQ_TYPE_F16 || type == IQ_TYPE_Q8_0 || type == IQ_TYPE_Q4_0;
}
