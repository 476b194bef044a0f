// The automatic layout of an InnerQ cache (kv-auto.h).
#include "kv-auto.h"

#include "iq-cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

// (d, m) per element: two fp16 per group of G codes, or a byte each (8-bit parameters)
static double params_bits(int32_t group, bool params8) { return (params8 ? 16.0 : 32.0) / group; }

double kv_auto_bits_min(int32_t group, bool params8) { return KV_AUTO_BITS_MIN + params_bits(group, params8); }
double kv_auto_bits_max(int32_t group, bool params8) { return KV_AUTO_BITS_MAX + params_bits(group, params8); }

int32_t kv_auto_units(double kv_bits, int32_t group, bool params8, int32_t n_layer) {
    // a little slack so that 3.0 at G 64 is 2.5 exactly
    const double codes = floor(2.0 * n_layer * (kv_bits - params_bits(group, params8)) + 1e-6);
    const double lo = 2.0 * KV_AUTO_BITS_MIN * n_layer, hi = 2.0 * KV_AUTO_BITS_MAX * n_layer;
    return (int32_t) (codes < lo ? lo : codes > hi ? hi : codes);  // every tensor 2 to 4 bits, whatever the rounding
}

// Softmax weights, in place, of the nq rows of scores s[j * ld ..] (their first n) times scale
// (f32 sums and the vector exp: the candidates differ by far more than their rounding).
static void probe_softmax(float * s, int32_t nq, int32_t n, int64_t ld, float scale) {
    for (int32_t j = 0; j < nq; j++) {
        for (int32_t t = 0; t < n; t++) {
            s[j * ld + t] *= scale;
        }
    }
    iq_cpu_softmax(n, nq, s, ld);
}

// The attention outputs o[nq][d] of the nq queries q (rows of d) over the first n rows of keys
// k and values v ([n][d] each): scores and sums on the CPU's vector kernels; s: [nq][ld] scratch.
static void probe_attend(const float * q, int32_t nq, const float * k, const float * v, int32_t n, int32_t d, float scale,
                         float * s, int64_t ld, float * o) {
    iq_cpu_scores(d, n, k, nq, q, s, ld);
    probe_softmax(s, nq, n, ld, scale);
    memset(o, 0, sizeof(float) * (size_t) nq * d);
    iq_cpu_accum(d, n, v, nq, s, ld, o);
}

static double probe_dist2(const float * a, const float * b, int32_t d) {
    double e = 0.0;
    for (int32_t c = 0; c < d; c++) {
        e += (double) (a[c] - b[c]) * (a[c] - b[c]);
    }
    return e;
}

static void rows_to_f32(const iq_fp16_t * src, int32_t n, int32_t d, float * dst) {
    for (size_t i = 0; i < (size_t) n * d; i++) {
        dst[i] = iq_fp16_to_fp32(src[i]);
    }
}

// The window's whole blocks of one KV head through a candidate format and back: rows [n][d]
// (f16 source, stride d) into out (f32), as a flush would store and attention read them.
static void probe_roundtrip(const iq_fp16_t * src, int32_t n_blocks, enum iq_qaxis axis, int32_t bits,
                            const struct iq_qcache_config * cfg, int32_t d, const float * norm, unsigned fmt,
                            uint8_t * block, float * out) {
    const int32_t g = cfg->group;
    for (int32_t j = 0; j < n_blocks; j++) {
        iq_qblock_quantize(src + (size_t) j * g * d, axis, bits, d, g, cfg->mode, norm, fmt, block);
        iq_qblock_dequantize(block, axis, bits, d, g, norm, fmt, 0, g, out + (size_t) j * g * d);
    }
}

// The key normalization a first flush of these rows sets (iq-qcache.c): per channel (or RoPE
// pair) the square root of the largest magnitude.
static void probe_norms(const iq_fp16_t * rows, int32_t n, int32_t d, int32_t rope_dims, float * norm) {
    float mx[IQ_QCACHE_MAX_HEAD_DIM] = {0};
    for (int32_t t = 0; t < n; t++) {
        for (int32_t c = 0; c < d; c++) {
            const float x = fabsf(iq_fp16_to_fp32(rows[(size_t) t * d + c]));
            mx[c] = x > mx[c] ? x : mx[c];
        }
    }
    for (int32_t c = 0; c < d; c++) {
        norm[c] = iq_qcache_norm_of(mx, rope_dims, c);
    }
}

void kv_auto_measure(const struct iq_qcache_config * cfg, const struct kv_auto_shape * sh,
                     const struct kv_auto_rows * rows, double err[2][KV_AUTO_CANDIDATES]) {
    const int32_t d = sh->head_dim, s = sh->n_sink, g = cfg->group, r = sh->n_head / sh->n_kv_head;
    const int32_t n_blocks = sh->n_recent / g, n = s + sh->n_recent;  // n: tokens stored
    memset(err, 0, sizeof(double) * 2 * KV_AUTO_CANDIDATES);
    if (n_blocks == 0 || sh->n_probe == 0) {
        return;
    }
    // per candidate (and exact) the keys and values of every token, token-major [n][d]
    const size_t all = (size_t) n * d;
    float * k = malloc(sizeof(float) * all * (1 + KV_AUTO_CANDIDATES) * 2);
    // the r query heads' weights (exact keys, then a candidate's) and outputs (exact, a candidate's)
    float * p = malloc(sizeof(float) * (size_t) r * n * 2);
    float * out = malloc(sizeof(float) * (size_t) r * d * 2);
    uint8_t * block = malloc(iq_qblock_bytes_fmt(KV_AUTO_BITS_MAX, d, g, IQ_QBLOCK_ROW_SCALES));
    if (k == NULL || p == NULL || out == NULL || block == NULL) {  // no measure: every candidate looks alike
        free(k), free(p), free(out), free(block);
        return;
    }
    float * v = k + all * (1 + KV_AUTO_CANDIDATES);
    double norm2 = 0.0;
    for (int32_t h = 0; h < sh->n_kv_head; h++) {
        const iq_fp16_t * rk = rows->recent_k + (size_t) h * sh->cap_recent * d;
        const iq_fp16_t * rv = rows->recent_v + (size_t) h * sh->cap_recent * d;
        rows_to_f32(rows->sink_k + (size_t) h * s * d, s, d, k);
        rows_to_f32(rows->sink_v + (size_t) h * s * d, s, d, v);
        rows_to_f32(rk, sh->n_recent, d, k + (size_t) s * d);
        rows_to_f32(rv, sh->n_recent, d, v + (size_t) s * d);
        float norm[IQ_QCACHE_MAX_HEAD_DIM];
        if (cfg->key_norm) {
            probe_norms(rk, n_blocks * g, d, cfg->rope_dims, norm);
        }
        for (int32_t b = 0; b < KV_AUTO_CANDIDATES; b++) {
            float * kb = k + all * (1 + b), * vb = v + all * (1 + b);
            memcpy(kb, k, sizeof(float) * all);
            memcpy(vb, v, sizeof(float) * all);
            probe_roundtrip(rk, n_blocks, cfg->axis_k, KV_AUTO_BITS_MIN + b, cfg, d, cfg->key_norm ? norm : NULL,
                            iq_qcache_fmt(cfg, false), block, kb + (size_t) s * d);
            probe_roundtrip(rv, n_blocks, cfg->axis_v, KV_AUTO_BITS_MIN + b, cfg, d, NULL, iq_qcache_fmt(cfg, true), block,
                            vb + (size_t) s * d);
        }
        for (int32_t i = 0; i < sh->n_probe; i++) {
            const int32_t n_vis = n - sh->n_probe + i + 1;  // the causal mask: the query's own position last
            // the r query heads of KV head h at this position, rows of d
            const float * q = rows->q + ((size_t) i * sh->n_head + (size_t) h * r) * d;
            float * o = out, * ob = out + (size_t) r * d;
            probe_attend(q, r, k, v, n_vis, d, sh->scale, p, n, o);
            for (int32_t c = 0; c < r * d; c++) {
                norm2 += (double) o[c] * o[c];
            }
            for (int32_t b = 0; b < KV_AUTO_CANDIDATES; b++) {
                memset(ob, 0, sizeof(float) * (size_t) r * d);
                iq_cpu_accum(d, n_vis, v + all * (1 + b), r, p, n, ob);  // the exact weights, candidate values
                err[1][b] += probe_dist2(o, ob, r * d);
                probe_attend(q, r, k + all * (1 + b), v, n_vis, d, sh->scale, p + (size_t) r * n, n, ob);
                err[0][b] += probe_dist2(o, ob, r * d);
            }
        }
    }
    for (int32_t b = 0; b < KV_AUTO_CANDIDATES; b++) {
        err[0][b] = norm2 > 0.0 ? err[0][b] / norm2 : 0.0;
        err[1][b] = norm2 > 0.0 ? err[1][b] / norm2 : 0.0;
    }
    free(k), free(p), free(out), free(block);
}

struct measure_job {
    const struct iq_qcache_config * cfg;
    const struct kv_auto_shape * shape;
    const struct kv_auto_rows * rows;
    double (*err)[2][KV_AUTO_CANDIDATES];
    int32_t n_layer;
    atomic_int next;
};

static void * measure_worker(void * arg) {
    struct measure_job * j = arg;
    for (int32_t il; (il = atomic_fetch_add(&j->next, 1)) < j->n_layer;) {
        kv_auto_measure(j->cfg, j->shape, &j->rows[il], j->err[il]);
    }
    return NULL;
}

void kv_auto_measure_layers(const struct iq_qcache_config * cfg, const struct kv_auto_shape * shape,
                            const struct kv_auto_rows * rows, int32_t n_layer, int32_t n_threads,
                            double (*err)[2][KV_AUTO_CANDIDATES]) {
    iq_cpu_install_qsearch();  // the candidates' round trips search as a flush does, on the host
    struct measure_job job = { .cfg = cfg, .shape = shape, .rows = rows, .err = err, .n_layer = n_layer };
    atomic_init(&job.next, 0);
    enum { MAX_HELPERS = 63 };
    pthread_t helper[MAX_HELPERS];
    int32_t started = 0;
    n_threads = n_threads < n_layer ? n_threads : n_layer;
    while (started < n_threads - 1 && started < MAX_HELPERS &&
           pthread_create(&helper[started], NULL, measure_worker, &job) == 0) {
        started++;  // a thread that cannot start leaves its layers to the others
    }
    measure_worker(&job);
    for (int32_t i = 0; i < started; i++) {
        pthread_join(helper[i], NULL);
    }
}

void kv_auto_allocate(int32_t n_layer, const double (*err)[2][KV_AUTO_CANDIDATES], int32_t units,
                      int32_t (*bits)[2]) {
    const int32_t lo = 2 * KV_AUTO_BITS_MIN * n_layer, hi = 2 * KV_AUTO_BITS_MAX * n_layer;
    units = units < lo ? lo : units > hi ? hi : units;  // kv_auto_units' range, for any caller
    for (int32_t il = 0; il < n_layer; il++) {
        bits[il][0] = bits[il][1] = KV_AUTO_BITS_MIN;
    }
    for (int32_t left = units - lo; left > 0; left--) {
        int32_t best_l = -1, best_x = 0;
        double best = -INFINITY;
        for (int32_t il = 0; il < n_layer; il++) {
            for (int32_t x = 0; x < 2; x++) {
                const int32_t b = bits[il][x] - KV_AUTO_BITS_MIN;
                if (b + 1 < KV_AUTO_CANDIDATES && err[il][x][b] - err[il][x][b + 1] > best) {
                    best = err[il][x][b] - err[il][x][b + 1];
                    best_l = il;
                    best_x = x;
                }
            }
        }
        bits[best_l][best_x]++;  // units <= hi: some tensor is below the top
    }
}
