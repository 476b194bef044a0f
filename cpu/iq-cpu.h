// CPU kernels and their run-time dispatch.
//
// Every kernel has a portable scalar version (the specification) and may have versions for the
// vector extensions of one architecture, in cpu/x86/ (AVX2, AVX-512) and cpu/arm/ (NEON,
// dotprod). The machine's features are read once (cpuid, or the aarch64 HWCAP bits);
// INNERQ_ISA=scalar|avx2|avx512|neon|dotprod|i8mm in the environment lowers them (never above
// what the machine has). Each kernel family takes, for a set of features, the best of its rows
// whose required features are all in the set (cpu/kernel-rows.h). Tests ask for each set's
// kernels explicitly.
#pragma once

#include "iq-backend.h"
#include "iq-types.h"

#ifdef __cplusplus
extern "C" {
#endif

enum iq_cpu_feature {
    IQ_CPU_AVX2 = 1,          // AVX2 + FMA + F16C + BMI2
    IQ_CPU_AVX512 = 2,        // AVX-512 F/BW/VL/DQ
    IQ_CPU_AVX512_VNNI = 4,   // vpdpbusd
    IQ_CPU_GFNI = 8,          // vgf2p8affineqb on zmm
    IQ_CPU_NEON = 16,         // AdvSIMD with fp16 conversions (HWCAP_ASIMD)
    IQ_CPU_DOTPROD = 32,      // sdot / udot (HWCAP_ASIMDDP)
    IQ_CPU_I8MM = 64,         // smmla / usdot (HWCAP2_I8MM)
    IQ_CPU_FEATURE_SETS = 128,  // every set is below this
};
typedef uint32_t iq_cpu_features;

iq_cpu_features iq_cpu_features_detect(void);  // what the machine supports
iq_cpu_features iq_cpu_features_active(void);  // detect(), lowered by INNERQ_ISA
// The INNERQ_ISA name of a set: its best feature's level ("avx512", "dotprod", "scalar"...).
const char * iq_cpu_features_name(iq_cpu_features f);
// Sets the active features (tests, benchmarks); false if the machine lacks one of them.
bool iq_cpu_features_set(iq_cpu_features f);
// Installs the active features' searched quantizer for iq_qblock_quantize (iq_qblock_set_search:
// the vector kernels where the row has them, else the scalar search; the same blocks either way).
void iq_cpu_install_qsearch(void);
// f32 attention arithmetic for the runtime's own measurements (src/kv-auto.c), on the active
// features' kernels (cpu/vec.h): s[j * ss + t] = q_j . k_t and o_j += sum_t p[j * ps + t] v_t
// for query rows q_j = q + j * d (j < nq) and rows k_t = k + t * d, v_t = v + t * d (t < n),
// o_j = o + j * d.
void iq_cpu_scores(int d, int n, const float * k, int nq, const float * q, float * s, int64_t ss);
void iq_cpu_accum(int d, int n, const float * v, int nq, const float * p, int64_t ps, float * o);
// p[j * ss + t] = exp(s_jt - max_t s_jt) / sum_t exp(s_jt - max_t s_jt) in place, for j < nq, t < n.
void iq_cpu_softmax(int n, int nq, float * s, int64_t ss);

// The CPUs this process may use (cpu-count.c): its affinity mask, lowered to its cgroup's CPU
// quota (rounded up) where that allows less; at least 1.
int iq_cpu_count(void);

// The CPU backend (cpu-backend.c): host buffers (wrapping a mapped file in place too) and a
// thread pool of n_threads (0, or more than iq_cpu_count(): iq_cpu_count()).
iq_backend * iq_backend_cpu_init(int n_threads);
void iq_backend_cpu_set_n_threads(iq_backend * be, int n_threads);
bool iq_backend_is_cpu(iq_backend * be);

// s = dot(x, y) over n elements: x is a row of the weight type, y a row of vec_dot_type.
typedef void (*iq_vec_dot_fn)(int64_t n, float * s, const void * x, const void * y);

// s[c * bs] = dot(x, y + c * by) for c < ncols (1 .. IQ_VEC_DOT_COLS): one weight row against
// several activation rows, its codes unpacked once for all of them; each result the same bits
// as vec_dot of the same kernel row gives it. ys + c * bys: activation row c's block scales as f32
// (iq_cpu_act_scales), converted once per row rather than once per weight row that reads it.
typedef void (*iq_vec_dot_cols_fn)(int64_t n, float * s, size_t bs, const void * x, const void * y, size_t by,
                                   const float * ys, size_t bys, int ncols);
#define IQ_VEC_DOT_COLS 4

// Up to 8 activation rows in lanes (vec_dot_type q8_1; iq_cpu_act_lanes writes them): per
// block of 32 elements, IQ_LANES_BLOCK bytes: at 0, `lanes` (4 or 8) loads of 32 bytes, load j
// holding elements 32 / lanes * j .. of each column in turn (32 / lanes bytes each), and at
// IQ_LANES_D and IQ_LANES_S 8 floats, d and s of the column each lane belongs to (column
// c * lanes / 8). nrows weight rows bx apart against `ncols` of the pack's columns:
// s[c * bs + r] = dot(x row r, column c), each the same bits as vec_dot of the same kernel row gives it.
typedef void (*iq_vec_dot_lanes_fn)(int64_t n, float * s, size_t bs, const void * x, size_t bx, int nrows,
                                    const void * y, int lanes, int ncols);
#define IQ_LANES_D 256
#define IQ_LANES_S 288
#define IQ_LANES_BLOCK 320

// Column `lane` of a pack of `lanes` (4 or 8) columns from the q8_1 row y of n elements.
void iq_cpu_act_lanes(const void * y, int64_t n, void * pack, int lanes, int lane);

// The scales of an activation row of n elements in vec_dot_type (q8_0: d; q8_1: d and s) as
// f32, two per block of 32: ys[2 i] = d, ys[2 i + 1] = s (0 for q8_0). Other types: nothing.
void iq_cpu_act_scales(enum iq_type vec_dot_type, const void * y, int64_t n, float * ys);
// Floats iq_cpu_act_scales writes for a row of n elements (0 where vec_dot_cols takes none).
int64_t iq_cpu_act_scales_size(enum iq_type vec_dot_type, int64_t n);

struct iq_cpu_type_traits {
    enum iq_type vec_dot_type;     // the activation format the dot product reads
    iq_from_float_fn from_float;   // f32 -> vec_dot_type (for activations)
    iq_vec_dot_fn vec_dot;
    iq_to_float_fn to_float;       // row dequantization (fast path, same result as reference)
    iq_vec_dot_cols_fn vec_dot_cols;  // NULL: vec_dot column by column
    iq_vec_dot_lanes_fn vec_dot_lanes;  // where not NULL, preferred to vec_dot_cols
};

// Traits of `type` with the features f (each function from the best row that has it, else
// scalar); NULL if the CPU backend can't multiply this type.
const struct iq_cpu_type_traits * iq_cpu_traits_for(enum iq_type type, iq_cpu_features f);
// Same, for the active features.
const struct iq_cpu_type_traits * iq_cpu_traits(enum iq_type type);

#ifdef __cplusplus
}
#endif
