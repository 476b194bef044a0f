// The vec.h kernels for AVX2 + FMA (8 lanes, 16 registers).
#include <immintrin.h>

#define V __m256
#define VL 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VLOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p)))
#define VSTOREH(p, v) _mm_storeu_si128((__m128i *) (p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#define VSET1(x) _mm256_set1_ps(x)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VFNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define VROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define SCORES_J 2
#define ACCUM_J 2
#define ACCUM_W 4
#define VEC_TABLE iq_vec_fns_avx2
#define VEC_QSEARCH iq_qsearch_avx2  // qsearch-avx2.c

// p * 2^n through the exponent field (n is within the normal range after clamping).
static inline __m256 avx2_scale(__m256 p, __m256 n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#define VSCALE(p, n) avx2_scale(p, n)

static inline __m128 avx2_fold4(__m256 v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }

static inline float avx2_hsum(__m256 v) {
    __m128 x = avx2_fold4(v);
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#define VHSUM(v) avx2_hsum(v)

static inline float avx2_hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#define VHMAX(v) avx2_hmax(v)

// {sum a, sum b, sum c, sum e}: one transpose tree for the four (unpack, shuffle, one fold).
static inline __m128 avx2_hsum4(__m256 a, __m256 b, __m256 c, __m256 e) {
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 ce = _mm256_add_ps(_mm256_unpacklo_ps(c, e), _mm256_unpackhi_ps(c, e));
    const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(ab, ce, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, ce, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}
#define VHSUM4(a, b, c, e) avx2_hsum4(a, b, c, e)

#define VSTORE4(p, x) _mm_storeu_ps(p, x)
#define VFIRST(x) _mm_cvtss_f32(x)

#include "vec-simd.h"
