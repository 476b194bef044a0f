// The vec.h kernels for AVX-512 (16 lanes, 32 registers).
#include <immintrin.h>

#define V __m512
#define VL 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VLOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (p)))
#define VSTOREH(p, v) _mm256_storeu_si256((__m256i *) (p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#define VSET1(x) _mm512_set1_ps(x)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VDIV(a, b) _mm512_div_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VFNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define VROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VSCALE(p, n) _mm512_scalef_ps(p, n)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VHMAX(v) _mm512_reduce_max_ps(v)
#define SCORES_J 4
#define ACCUM_J 4
#define ACCUM_W 4
#define VEC_TABLE iq_vec_fns_avx512
#define VEC_QSEARCH iq_qsearch_avx512  // qsearch-avx512.c

static inline __m128 avx512_fold4(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// {sum a, sum b, sum c, sum e}: one transpose tree for the four (unpack, shuffle, then two folds),
// 13 instructions where four folds and three hadds took some 25. The tree's first half leaves, in
// each 128-bit chunk, the chunk's sums of the four (avx512_part4); the folds add chunks 0 + 2 and
// 1 + 3, then the two.
static inline __m512 avx512_part4(__m512 a, __m512 b, __m512 c, __m512 e) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 ce = _mm512_add_ps(_mm512_unpacklo_ps(c, e), _mm512_unpackhi_ps(c, e));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, ce, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(ab, ce, _MM_SHUFFLE(3, 2, 3, 2)));
}

static inline __m128 avx512_hsum4(__m512 a, __m512 b, __m512 c, __m512 e) { return avx512_fold4(avx512_part4(a, b, c, e)); }

// The sums of 16 rows from the avx512_part4 of their four blocks of four, in row order: the
// folds of avx512_hsum4 (chunks 0 + 2 and 1 + 3, then the two) done for the four at once.
static inline __m512 avx512_fold16(const __m512 * y) {
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xee));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u, w, 0x88), _mm512_shuffle_f32x4(u, w, 0xdd));
}
#define VHSUM4(a, b, c, e) avx512_hsum4(a, b, c, e)
#define VPART4(a, b, c, e) avx512_part4(a, b, c, e)
#define VFOLD_ROWS(y) avx512_fold16(y)

#define VSTORE4(p, x) _mm_storeu_ps(p, x)
#define VFIRST(x) _mm_cvtss_f32(x)

#include "vec-simd.h"
