// The InnerQ attention kernels for aarch64, written once over the int8 dot product of 16 lanes
// (IQ_ARM_DOT, as in quants-arm.h). Included by qcache-neon.c and qcache-dotprod.c after they
// define IQ_ARM_DOT and IQ_INNERQ_TABLE (the table's name) and IQ_INNERQ_NAME.
// A block's codes are unpacked token-major by the portable iq_qblock_codes, as the scalar
// kernel does; the key products (int8 query x codes) go through IQ_ARM_DOT, the value products
// (u8 probabilities x codes, up to 255 x 31) through u16 multiply-adds of 8 tokens at a time,
// widened to u32. The integer sums are exact and the rest of the kernel is the scalar one's
// (iq_innerq_block_run, qcache-block.h), so the results are the scalar kernel's. Key codes on
// the key levels become their levels by one table lookup (tbl) per 16 codes. KIVI blocks
// run the scalar kernel; the f16 windows and f32 batch rows run the NEON attention tiles
// (vec-neon.c).
#include "arm-kernels.h"
#include "qcache-block.h"

#include <arm_neon.h>

// sum_{c < n} q8[c] u[c], n a multiple of 16 (codes below 2^5, levels below 2^6: read as int8).
static inline int32_t arm_dot_codes(const int8_t * q8, const uint8_t * u, int32_t n) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int32_t c = 0; c < n; c += 16) {
        acc = IQ_ARM_DOT(acc, vld1q_s8(q8 + c), vreinterpretq_s8_u8(vld1q_u8(u + c)));
    }
    return vaddvq_s32(acc);
}

// isum[c] = sum_{t < n} p8[t] u[t * dim + c] for the 16 channels c from u on.
static inline void arm_dot_probs(const uint8_t * p8, const uint8_t * u, int32_t dim, int32_t n, uint32_t * isum) {
    uint32x4_t acc[4] = {vdupq_n_u32(0), vdupq_n_u32(0), vdupq_n_u32(0), vdupq_n_u32(0)};
    for (int32_t t0 = 0; t0 < n; t0 += 8) {
        uint16x8_t lo = vdupq_n_u16(0), hi = vdupq_n_u16(0);  // 8 x 255 x 31 < 2^16
        for (int32_t t = t0; t < n && t < t0 + 8; t++) {
            const uint8x16_t codes = vld1q_u8(u + (size_t) t * dim);
            lo = vmlal_u8(lo, vget_low_u8(codes), vdup_n_u8(p8[t]));
            hi = vmlal_high_u8(hi, codes, vdupq_n_u8(p8[t]));
        }
        acc[0] = vaddw_u16(acc[0], vget_low_u16(lo));
        acc[1] = vaddw_high_u16(acc[1], lo);
        acc[2] = vaddw_u16(acc[2], vget_low_u16(hi));
        acc[3] = vaddw_high_u16(acc[3], hi);
    }
    for (int k = 0; k < 4; k++) {
        vst1q_u32(isum + 4 * k, acc[k]);
    }
}

// u[i] = lv[u[i]] for i < n, n a multiple of 16.
static void arm_levels(const uint8_t * lv, uint8_t * u, size_t n) {
    const uint8x16_t t = vld1q_u8(lv);
    for (size_t i = 0; i < n; i += 16) {
        vst1q_u8(u + i, vqtbl1q_u8(t, vld1q_u8(u + i)));
    }
}

// iq_innerq_block_scalar with its integer sums in vectors.
static void arm_innerq_block(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                             const struct iq_innerq_query * q, float * st) {
    iq_innerq_block_run(c, iq_innerq_block_get(c, h, j), a, b, q, st, arm_dot_codes, arm_dot_probs, arm_levels);
}

static void arm_innerq_block_p8(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                const struct iq_innerq_query * q, float * st) {
    iq_innerq_block_run(c, iq_innerq_block_get_p8(c, h, j, iq_p8_decode_block), a, b, q, st, arm_dot_codes,
                        arm_dot_probs, arm_levels);
}

static void arm_innerq_rows_f16(const void * k, const void * v, size_t ld, int32_t n, const struct iq_innerq_query * q,
                                float * st) {
    iq_innerq_rows_vec(&iq_vec_fns_neon, k, v, ld, n, true, q, st);
}

static void arm_innerq_rows_f32(const void * k, const void * v, size_t ld, int32_t n, const struct iq_innerq_query * q,
                                float * st) {
    iq_innerq_rows_vec(&iq_vec_fns_neon, k, v, ld, n, false, q, st);
}

const struct iq_innerq_kernels IQ_INNERQ_TABLE = {
    IQ_INNERQ_NAME, arm_innerq_rows_f16, arm_innerq_rows_f32, arm_innerq_block, arm_innerq_block_p8,
    iq_innerq_kivi_block_scalar,
};
