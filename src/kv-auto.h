// The automatic layout of an InnerQ cache (kv_bits, docs/INNERQ.md "Automatic layout"): the
// code bits of each layer's keys and values, chosen once per sequence from the prompt itself
// at the cache's first flush, within an average budget of bits per element. The cache
// (kv-cache.c) hands over host copies of each layer's f16 windows and of the last queries;
// this module measures what every format candidate does to the attention output and spends
// the budget where it removes the most error per bit.
#pragma once

#include "iq-qcache.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifndef KV_AUTO_PROBE  // (a study build may set it)
#define KV_AUTO_PROBE 64  // queries the choice is measured with: the last tokens before the first flush
#endif
#ifndef KV_AUTO_AHEAD  // (a study build may set it)
// tokens past the first flush that a measuring step adds to the choice (decode.c), at most n_batch:
// with S 16, R 64 and G 64 the choice sees the first 527 tokens, 7 blocks a layer, instead of 143
#define KV_AUTO_AHEAD 384
#endif
// tokens a kept measuring step evaluates at most (decode.c, without decode semantics): the whole
// batch after the choice where n_batch is at most this, the batches a plain evaluation would cut;
// its keys, values and queries are outputs of the step's graph until they are stored
#define KV_AUTO_KEEP 512
#define KV_AUTO_BITS_MIN 2
#define KV_AUTO_BITS_MAX 5
#define KV_AUTO_CANDIDATES (KV_AUTO_BITS_MAX - KV_AUTO_BITS_MIN + 1)

// One layer at the first flush, as the cache holds it: S sink rows and n_recent window rows
// per KV head (f16, token-major [n_kv_head][rows][head_dim]; the window's stride is cap_recent
// rows), and n_probe queries [n_probe][n_head][head_dim] (f32, as attention gets them) of the
// last positions before the flush, which see every token stored.
struct kv_auto_rows {
    const iq_fp16_t * sink_k, * sink_v;
    const iq_fp16_t * recent_k, * recent_v;
    const float * q;
};

struct kv_auto_shape {
    int32_t head_dim, n_kv_head, n_head;
    int32_t n_sink, n_recent, cap_recent, n_probe;
    float scale;  // of q.k
};

// The relative attention-output error of each candidate on one layer: err[0][b - 2] with the
// keys of the window's whole blocks quantized at b bits (values exact), err[1][b - 2] with the
// values quantized (keys exact); sum over probe queries and heads of |o' - o|^2 / sum |o|^2.
// cfg: the cache's configuration (group, quantizer mode, key normalization); its bits are not read.
void kv_auto_measure(const struct iq_qcache_config * cfg, const struct kv_auto_shape * shape,
                     const struct kv_auto_rows * rows, double err[2][KV_AUTO_CANDIDATES]);

// kv_auto_measure of n_layer layers (rows[il], err[il]) on n_threads threads.
void kv_auto_measure_layers(const struct iq_qcache_config * cfg, const struct kv_auto_shape * shape,
                            const struct kv_auto_rows * rows, int32_t n_layer, int32_t n_threads,
                            double (*err)[2][KV_AUTO_CANDIDATES]);

// The code bits a budget of kv_bits per element buys over n_layer layers of keys and values at
// group size G ((d, m) costs 32/G bits per element): the sum of b_k + b_v over the layers,
// within [4 n_layer, 8 n_layer] (kv_bits is checked to be in [kv_auto_bits_min, _max]).
int32_t kv_auto_units(double kv_bits, int32_t group, bool params8, int32_t n_layer);
double kv_auto_bits_min(int32_t group, bool params8);
double kv_auto_bits_max(int32_t group, bool params8);

// Greedy allocation: every layer's keys and values start at 2 bits; each further bit goes to
// the (layer, keys or values) whose error it lowers most, until units are spent (units is
// clamped to [4 n_layer, 8 n_layer]). bits[il][0] keys, bits[il][1] values.
void kv_auto_allocate(int32_t n_layer, const double (*err)[2][KV_AUTO_CANDIDATES], int32_t units,
                      int32_t (*bits)[2]);

#ifdef __cplusplus
}
#endif
