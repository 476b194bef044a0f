// The vec.h kernels for NEON (4 lanes, 32 registers).
#include <arm_neon.h>

#define V float32x4_t
#define VL 4
#define VZERO() vdupq_n_f32(0.0f)
#define VLOAD(p) vld1q_f32(p)
#define VSTORE(p, v) vst1q_f32(p, v)
#define VLOADH(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *) (p))))
#define VSTOREH(p, v) vst1_u16((uint16_t *) (p), vreinterpret_u16_f16(vcvt_f16_f32(v)))
#define VSET1(x) vdupq_n_f32(x)
#define VADD(a, b) vaddq_f32(a, b)
#define VSUB(a, b) vsubq_f32(a, b)
#define VMUL(a, b) vmulq_f32(a, b)
#define VDIV(a, b) vdivq_f32(a, b)
#define VMIN(a, b) vminq_f32(a, b)
#define VMAX(a, b) vmaxq_f32(a, b)
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VFNMA(a, b, c) vfmsq_f32(c, a, b)
#define VROUND(x) vrndnq_f32(x)
#define VHSUM(v) vaddvq_f32(v)
#define VHMAX(v) vmaxvq_f32(v)
#define SCORES_J 4
#define ACCUM_J 4
#define ACCUM_W 4
#define VEC_TABLE iq_vec_fns_neon

// p * 2^n through the exponent field (n is within the normal range after clamping).
static inline float32x4_t neon_scale(float32x4_t p, float32x4_t n) {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
#define VSCALE(p, n) neon_scale(p, n)

// {sum a, sum b, sum c, sum e}: two rounds of pairwise adds.
static inline float32x4_t neon_hsum4(float32x4_t a, float32x4_t b, float32x4_t c, float32x4_t e) {
    return vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, e));
}
#define VHSUM4(a, b, c, e) neon_hsum4(a, b, c, e)
#define VSTORE4(p, x) vst1q_f32(p, x)
#define VFIRST(x) vgetq_lane_f32(x, 0)

#include "arm-kernels.h"
#include "vec-simd.h"
