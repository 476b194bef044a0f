// The KV cache's storage: its tensors in one backend buffer as the format lays them out, the
// rotation, the key norms, the page table, copies of pages, and the automatic layout, which
// re-lays the quantized regions once its choice is made (kv-cache.h, kv-auto.h).
#include "kv-cache-impl.h"

#include "status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// ---- the automatic layout's arena ----

// The arena of the automatic layout: the quantized blocks of every layer at a total of `units`
// code bits (a block's bytes are linear in its bits: codes G*D*b/8, then (d, m) or their 8-bit
// codes, and the values' row scales), each region aligned.
static size_t kv_auto_bytes(const struct kv_cache * c) {
    const int32_t d = c->head_dim, g = c->cfg.qcfg.group;
    const unsigned fk = iq_qcache_fmt(&c->cfg.qcfg, false), fv = iq_qcache_fmt(&c->cfg.qcfg, true);
    const size_t per_bit = iq_qblock_bytes_fmt(3, d, g, 0) - iq_qblock_bytes_fmt(2, d, g, 0);
    const size_t fixed = iq_qblock_bytes_fmt(2, d, g, fk) + iq_qblock_bytes_fmt(2, d, g, fv) - 4 * per_bit;  // (d, m), scales
    const size_t per_head = per_bit * (size_t) c->cfg.units + fixed * (size_t) c->n_layer;
    return (size_t) c->n_kv_head * c->cfg.n_pages * per_head + 2 * (size_t) c->n_layer * c->align;
}

// Gives the arena `units` code bits: its size and what follows it in the buffer (the rotation).
static void kv_auto_resize(struct kv_cache * c, int32_t units) {
    const size_t before = align_up(c->auto_size, c->align);
    c->cfg.units = units;
    c->auto_size = kv_auto_bytes(c);
    const size_t after = align_up(c->auto_size, c->align);
    c->rot_off[0] = c->rot[0] != NULL ? c->rot_off[0] + after - before : 0;
    c->dev_size[0] = c->dev_size[0] + after - before;
    c->size = c->size + after - before;
}

innerq_status kv_layout_budget(struct kv_cache * c) {
    const double elements = 2.0 * c->cfg.n_ctx * c->n_layer * c->n_kv_head * c->head_dim;
    const double budget = c->cfg.kv_bits * elements / 8.0;
    const int32_t lo = 2 * KV_AUTO_BITS_MIN * c->n_layer, hi = 2 * KV_AUTO_BITS_MAX * c->n_layer;
    kv_auto_resize(c, lo);
    if ((double) c->size > budget) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_bits %g cannot be met at n_ctx %d: the f16 windows (sink %d, "
                           "recent %d + %d tokens) with the smallest layout (2-bit keys and values) already take %.3f "
                           "bits per element; ask for more bits, a longer context or smaller windows (kv_sink, kv_recent)",
                           c->cfg.kv_bits, c->cfg.n_ctx, c->cfg.qcfg.n_sink, c->cfg.qcfg.n_recent, c->cfg.qcfg.group,
                           8.0 * (double) c->size / elements);
    }
    int32_t units = lo;
    while (units < hi) {  // the size grows with the units: the last that fits (a budget past 5-bit everything: that)
        kv_auto_resize(c, units + 1);
        if ((double) c->size > budget) {
            kv_auto_resize(c, units);
            break;
        }
        units++;
    }
    return INNERQ_OK;
}

// Places the quantized regions of every layer in the arena, in order.
static void kv_auto_place(struct kv_cache * c) {
    size_t off = c->auto_off;
    for (int32_t il = 0; il < c->n_layer; il++) {
        for (int r = IQ_QREGION_QUANT_K; r <= IQ_QREGION_QUANT_V; r++) {
            iq_tensor_place(c->layers[il].region[r], c->buf[0], off);  // one device (kv_cache_make)
            off += align_up(iq_nbytes(c->layers[il].region[r]), c->align);
        }
    }
}

// Gives every layer the bits bits[il] (keys, values; NULL: the smallest format, as before the
// automatic layout's choice): its configuration, types and quantized regions' shapes, then
// places them in the arena (units bounds the total).
void kv_layout_set(struct kv_cache * c, const int32_t (*bits)[2]) {
    for (int32_t il = 0; il < c->n_layer; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        l->qcfg.bits_k = bits ? bits[il][0] : KV_AUTO_BITS_MIN;
        l->qcfg.bits_v = bits ? bits[il][1] : KV_AUTO_BITS_MIN;
        iq_qcache_types(&l->qcfg, &l->type_k, &l->type_v);
        struct iq_qcache lay;
        iq_qcache_pool_layout(&lay, &l->qcfg, c->head_dim, c->n_kv_head, c->cfg.n_ctx, c->cfg.n_slots,
                              c->cfg.n_pages);  // checked at init
        for (int r = IQ_QREGION_QUANT_K; r <= IQ_QREGION_QUANT_V; r++) {
            enum iq_type type;
            int64_t ne[4];
            iq_qcache_region_shape(&lay, (enum iq_qregion) r, &type, ne);
            iq_tensor_set_shape(l->region[r], 4, ne);  // a leaf of type I8: cannot fail
        }
    }
    kv_auto_place(c);
    c->layout_ready = bits != NULL;
}

// ---- the rotation ----

// A fixed sign of channel i, +1 or -1 (bit 16 of Knuth's multiplicative hash of i).
static int kv_rot_sign(int32_t i) { return ((uint32_t) i * 2654435761u >> 16) & 1 ? -1 : 1; }

// The rotation of order n (a power of two): R = S H S, H the orthonormal Sylvester-Hadamard
// matrix (H_ij = (-1)^popcount(i & j) / sqrt(n)) and S = diag(kv_rot_sign). R is orthonormal
// and symmetric, so it is its own inverse as H is; the signs keep the rows of H (the first is
// all ones) from lining up with structure the keys have after RoPE (docs/INNERQ.md).
static void kv_rotation(float * r, int32_t n) {
    const float s = 1.0f / sqrtf((float) n);
    for (int32_t i = 0; i < n; i++) {
        for (int32_t j = 0; j < n; j++) {
            const int sign = (__builtin_popcount((unsigned) (i & j)) % 2 ? -1 : 1) * kv_rot_sign(i) * kv_rot_sign(j);
            r[(size_t) i * n + j] = sign < 0 ? -s : s;
        }
    }
}

// ---- storage ----

// Key normalization of 1 in sequence `slot` (no flush has set it): KIVI reads it as is, InnerQ
// until its first flush.
innerq_status kv_norms_reset(struct kv_cache * c, int32_t slot) {
    if (!c->cfg.fmt->quantized) {
        return INNERQ_OK;
    }
    const struct iq_tensor * t = c->layers[0].region[IQ_QREGION_NORM];
    const size_t n = (size_t) t->ne[0] * t->ne[1];  // [D, H] of one slot
    float * ones = malloc(n * sizeof(float));
    if (ones == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory clearing the KV cache");
    }
    for (size_t i = 0; i < n; i++) {
        ones[i] = 1.0f;
    }
    for (int32_t il = 0; il < c->n_layer; il++) {
        struct iq_tensor * norm = c->layers[il].region[IQ_QREGION_NORM];
        iq_tensor_set(norm, ones, (size_t) slot * norm->nb[2], n * sizeof(float));
    }
    free(ones);
    return INNERQ_OK;
}

// Every layer's tensors (each in its device's buffer), then in each buffer its page table, the
// automatic layout's arena (one device) and the rotation: their places and the buffers' sizes,
// before any memory of a backend is taken.
innerq_status kv_storage_plan(struct kv_cache * c) {
    const int32_t n_layer = c->n_layer, d = c->head_dim;
    c->ctx = iq_context_init((size_t) (IQ_QREGION_COUNT * n_layer + 2 * KV_MAX_DEVICES + 2) * iq_tensor_overhead());
    c->layer_off = malloc(sizeof(size_t) * (size_t) n_layer);
    if (c->ctx == NULL || c->layer_off == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    size_t * total = c->dev_size, bytes = 0;
    innerq_status st = INNERQ_OK;
    for (int32_t il = 0; il < n_layer && st == INNERQ_OK; il++) {
        const int32_t dev = c->layer_dev[il];
        iq_context_set_backend_id(c->ctx, dev);
        st = c->cfg.fmt->layer_init(c, il, &bytes);
        c->layer_off[il] = total[dev];
        total[dev] += align_up(bytes, c->align);
    }
    const int32_t n_table = c->cfg.n_table > 0 ? c->cfg.n_table : 1;
    for (int32_t dev = 0; dev < c->n_dev && st == INNERQ_OK; dev++) {
        iq_context_set_backend_id(c->ctx, dev);
        if ((c->pages[dev] = iq_new_tensor_2d(c->ctx, IQ_TYPE_I32, n_table, c->cfg.n_slots)) == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache: %s", iq_error_get());
        }
        iq_set_name(c->pages[dev], "cache_pages");
        c->pages_off[dev] = total[dev];
        total[dev] += align_up(iq_nbytes(c->pages[dev]), c->align);
        if (c->cfg.kv_bits > 0.0) {
            c->auto_off = total[dev];
            c->auto_size = kv_auto_bytes(c);
            total[dev] += align_up(c->auto_size, c->align);
        }
        if (c->cfg.rot_k || c->cfg.rot_v) {
            if ((c->rot[dev] = iq_new_tensor_2d(c->ctx, IQ_TYPE_F32, d, d)) == NULL) {
                return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache: %s", iq_error_get());
            }
            iq_set_name(c->rot[dev], "cache_rot");
            c->rot[dev]->flags |= IQ_FLAG_HADAMARD;  // kv_rotation's S H S is T H T with T = s_0 S
            c->rot_off[dev] = total[dev];
            total[dev] += align_up(iq_nbytes(c->rot[dev]), c->align);
        }
    }
    c->size = 0;
    for (int32_t dev = 0; dev < c->n_dev; dev++) {
        c->size += total[dev];
    }
    return st;
}

// The storage may be device memory: it is written and read through the buffers (iq_tensor_set
// and _get: the norms here, states, rewinds), never through host pointers.
innerq_status kv_storage_alloc(struct kv_cache * c, iq_backend * const * be) {
    for (int32_t dev = 0; dev < c->n_dev; dev++) {
        if ((c->buf[dev] = iq_backend_alloc_buffer(be[dev], c->dev_size[dev])) == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache of %.1f MiB on %s: %s", c->dev_size[dev] / 1048576.0,
                               iq_backend_name(be[dev]), iq_error_get());
        }
    }
    for (int32_t il = 0; il < c->n_layer; il++) {
        c->cfg.fmt->layer_place(c, il, c->layer_off[il]);
    }
    for (int32_t dev = 0; dev < c->n_dev; dev++) {
        iq_tensor_place(c->pages[dev], c->buf[dev], c->pages_off[dev]);
    }
    if (c->cfg.kv_bits > 0.0) {
        kv_auto_place(c);
    }
    // unwritten rows are never read, but start from zeros so a bug can't read garbage
    for (int32_t dev = 0; dev < c->n_dev; dev++) {
        iq_buffer_clear(c->buf[dev], 0);
    }
    innerq_status st = INNERQ_OK;
    for (int32_t slot = 0; slot < c->cfg.n_slots && st == INNERQ_OK; slot++) {
        st = kv_norms_reset(c, slot);
    }
    float * h = st == INNERQ_OK && c->rot[0] != NULL ? malloc(iq_nbytes(c->rot[0])) : NULL;
    if (st == INNERQ_OK && c->rot[0] != NULL && h == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    for (int32_t dev = 0; h != NULL && dev < c->n_dev; dev++) {
        iq_tensor_place(c->rot[dev], c->buf[dev], c->rot_off[dev]);
        kv_rotation(h, c->head_dim);
        iq_tensor_set(c->rot[dev], h, 0, iq_nbytes(c->rot[dev]));
    }
    free(h);
    return st;
}

// Bytes [off, off + size) of tensor `from` to the same bytes' place at `to_off` of tensor `to`,
// through the host (the storage may be device memory).
static bool kv_bytes_copy(struct iq_tensor * from, size_t off, struct iq_tensor * to, size_t to_off, size_t size,
                          uint8_t * tmp) {
    iq_tensor_get(from, tmp, off, size);
    iq_tensor_set(to, tmp, to_off, size);
    return true;
}

bool kv_page_copy(struct kv_cache * c, int32_t from, int32_t to, int32_t rows) {
    const struct iq_tensor * k0 = c->layers[0].k;
    uint8_t * tmp = malloc((size_t) rows * (k0->nb[1] > c->layers[0].v->nb[1] ? k0->nb[1] : c->layers[0].v->nb[1]));
    if (tmp == NULL) {
        iq_error_set("out of memory copying a page of the KV cache");
        return false;
    }
    for (int32_t il = 0; il < c->n_layer; il++) {
        for (int x = 0; x < 2; x++) {
            struct iq_tensor * t = x ? c->layers[il].v : c->layers[il].k;
            for (int64_t h = 0; h < t->ne[2]; h++) {
                const size_t base = (size_t) h * t->nb[2], page = (size_t) c->cfg.page * t->nb[1];
                kv_bytes_copy(t, base + (size_t) from * page, t, base + (size_t) to * page, (size_t) rows * t->nb[1], tmp);
            }
        }
    }
    free(tmp);
    return true;
}

bool kv_slot_copy(struct kv_cache * c, int32_t from, int32_t to, int32_t n_sink, int32_t n_recent) {
    const struct iq_tensor * r0 = c->layers[0].region[IQ_QREGION_RECENT_K];
    uint8_t * tmp = malloc(r0->nb[3] > c->layers[0].region[IQ_QREGION_NORM]->nb[2] ? r0->nb[3]
                                                                                   : c->layers[0].region[IQ_QREGION_NORM]->nb[2]);
    if (tmp == NULL) {
        iq_error_set("out of memory copying a sequence of the KV cache");
        return false;
    }
    for (int32_t il = 0; il < c->n_layer; il++) {
        struct iq_tensor * const * reg = c->layers[il].region;
        const size_t nb = reg[IQ_QREGION_NORM]->nb[2];
        kv_bytes_copy(reg[IQ_QREGION_NORM], (size_t) from * nb, reg[IQ_QREGION_NORM], (size_t) to * nb, nb, tmp);
        const int32_t rows[] = {n_sink, n_sink, n_recent, n_recent};
        for (int r = IQ_QREGION_SINK_K; r <= IQ_QREGION_RECENT_V; r++) {
            const struct iq_tensor * t = reg[r];
            for (int64_t h = 0; h < t->ne[2] && rows[r - IQ_QREGION_SINK_K] > 0; h++) {
                kv_bytes_copy(reg[r], (size_t) from * t->nb[3] + (size_t) h * t->nb[2], reg[r],
                              (size_t) to * t->nb[3] + (size_t) h * t->nb[2], (size_t) rows[r - IQ_QREGION_SINK_K] * t->nb[1],
                              tmp);
            }
        }
    }
    free(tmp);
    return true;
}

// ---- the automatic layout's choice (kv-auto.h) ----

// Where the automatic layout is chosen: before the token that makes the first flush (the
// windows then hold S + R + G - 1 tokens).
static int32_t kv_layout_pos(const struct kv_cache * c) {
    return c->cfg.qcfg.n_sink + c->cfg.qcfg.n_recent + c->cfg.qcfg.group - 1;
}

// The positions whose queries the choice is measured with: [kv_probe_first, kv_layout_pos).
int32_t kv_probe_first(const struct kv_cache * c) {
    return kv_layout_pos(c) > KV_AUTO_PROBE ? kv_layout_pos(c) - KV_AUTO_PROBE : 0;
}

size_t kv_probe_row(const struct kv_cache * c) { return (size_t) c->n_head * c->head_dim; }

float * kv_probe_at(const struct kv_cache * c, int32_t il, int32_t pos) {
    return c->probe + ((size_t) il * KV_AUTO_PROBE + (size_t) (pos - kv_probe_first(c))) * kv_probe_row(c);
}

// The queries a state keeps for the automatic layout's pending choice (per layer, rows of
// kv_probe_row floats from kv_probe_first): those of the n_past tokens stored.
int32_t kv_probe_kept(const struct kv_cache * c, int32_t n_past, bool ready) {
    if (c->cfg.kv_bits <= 0.0 || ready) {
        return 0;
    }
    const int32_t hi = n_past < kv_layout_pos(c) ? n_past : kv_layout_pos(c);
    return hi > kv_probe_first(c) ? hi - kv_probe_first(c) : 0;
}

int32_t kv_cache_until_layout(const struct kv_cache * c, int32_t slot) {
    return c->cfg.kv_bits > 0.0 && !c->layout_ready ? kv_cache_until_flush(c, slot) - 1 : INT32_MAX;
}

bool kv_cache_probing(const struct kv_cache * c, int32_t slot, int32_t n) {
    const int32_t n_past = c->seqs[slot].n_past;
    return c->cfg.kv_bits > 0.0 && !c->layout_ready && n_past < kv_layout_pos(c) && n_past + n > kv_probe_first(c);
}

void kv_cache_probe_save(struct kv_cache * c, struct iq_tensor * const * q, int32_t row0, int32_t n_past, int32_t n) {
    const int32_t lo = n_past > kv_probe_first(c) ? n_past : kv_probe_first(c);
    const int32_t hi = n_past + n < kv_layout_pos(c) ? n_past + n : kv_layout_pos(c);
    for (int32_t il = 0; il < c->n_layer && lo < hi; il++) {
        // q: f32 [head_dim, n_head, n_tokens] as attention gets it; the sequence's rows from row0
        iq_tensor_get(q[il], kv_probe_at(c, il, lo), (size_t) (row0 + lo - n_past) * q[il]->nb[2],
                      sizeof(float) * kv_probe_row(c) * (size_t) (hi - lo));
    }
}

// One layer's rows for the choice, on the host: the slot's sink rows as stored, the window's
// n_recent rows per head followed by the n rows ahead (f16, [n_kv_head][n_recent + n][head_dim]),
// and the last n_probe queries ([n_probe][n_head][head_dim] f32) of the saved ones and those ahead.
static void layout_rows(const struct kv_cache * c, int32_t slot, int32_t il, const struct iq_qcache * lay,
                        int32_t n_recent, const struct kv_ahead * ahead, int32_t n_probe, uint8_t * at,
                        float * scratch, struct kv_auto_rows * out) {
    struct iq_tensor * const * reg = c->layers[il].region;
    const size_t d = (size_t) c->head_dim, kvh = (size_t) c->n_kv_head, row = d * sizeof(iq_fp16_t);
    const size_t sink = reg[IQ_QREGION_SINK_K]->nb[3], window = reg[IQ_QREGION_RECENT_K]->nb[3];
    const int32_t m = ahead != NULL ? ahead->n : 0, n = n_recent + m;
    iq_fp16_t * sk = (iq_fp16_t *) at, * sv = (iq_fp16_t *) (at + sink);
    iq_fp16_t * rk = (iq_fp16_t *) (at + 2 * sink), * rv = rk + kvh * (size_t) n * d;
    float * q = (float *) (rv + kvh * (size_t) n * d);
    iq_tensor_get(reg[IQ_QREGION_SINK_K], sk, (size_t) slot * sink, sink);
    iq_tensor_get(reg[IQ_QREGION_SINK_V], sv, (size_t) slot * sink, sink);
    for (int e = 0; e < 2; e++) {
        iq_fp16_t * dst = e == 0 ? rk : rv;
        iq_tensor_get(reg[e == 0 ? IQ_QREGION_RECENT_K : IQ_QREGION_RECENT_V], scratch, (size_t) slot * window, window);
        for (size_t h = 0; h < kvh; h++) {
            memcpy(dst + h * (size_t) n * d, (const iq_fp16_t *) scratch + h * (size_t) lay->cap_recent * d,
                   row * (size_t) n_recent);
        }
        if (m > 0) {
            iq_tensor_get(e == 0 ? ahead->k[il] : ahead->v[il], scratch, 0, sizeof(float) * d * kvh * (size_t) m);
            for (int32_t j = 0; j < m; j++) {
                for (size_t h = 0; h < kvh; h++) {
                    for (size_t i = 0; i < d; i++) {
                        dst[(h * (size_t) n + (size_t) (n_recent + j)) * d + i] = iq_fp32_to_fp16(scratch[((size_t) j * kvh + h) * d + i]);
                    }
                }
            }
        }
    }
    // the queries: the last n_probe of the saved ones (positions kv_probe_first ..) then those ahead
    const size_t qrow = kv_probe_row(c);
    const int32_t from_ahead = m < n_probe ? m : n_probe, saved = n_probe - from_ahead;
    const int32_t kept = kv_layout_pos(c) - kv_probe_first(c);
    memcpy(q, kv_probe_at(c, il, kv_probe_first(c) + kept - saved), sizeof(float) * qrow * (size_t) saved);
    if (from_ahead > 0) {
        iq_tensor_get(ahead->q[il], q + qrow * (size_t) saved, sizeof(float) * qrow * (size_t) (m - from_ahead),
                      sizeof(float) * qrow * (size_t) from_ahead);
    }
    *out = (struct kv_auto_rows) { .sink_k = sk, .sink_v = sv, .recent_k = rk, .recent_v = rv, .q = q };
}

innerq_status kv_cache_layout_choose(struct kv_cache * c, int32_t slot, int32_t n_threads, const struct kv_ahead * ahead) {
    const struct kv_seq * s = &c->seqs[slot];
    struct iq_qcache lay;
    iq_qcache_pool_layout(&lay, &c->cfg.qcfg, c->head_dim, c->n_kv_head, c->cfg.n_ctx, c->cfg.n_slots,
                          c->cfg.n_pages);  // checked at init
    const int32_t n_recent = s->n_past - s->q.n_sink - s->q.n_quant, m = ahead != NULL ? ahead->n : 0;
    const int32_t kept = s->n_past - kv_probe_first(c), n_probe = kept + m < KV_AUTO_PROBE ? kept + m : KV_AUTO_PROBE;
    const struct kv_auto_shape shape = {
        .head_dim = c->head_dim, .n_kv_head = c->n_kv_head, .n_head = c->n_head, .n_sink = s->q.n_sink,
        .n_recent = n_recent + m, .cap_recent = n_recent + m, .n_probe = n_probe, .scale = c->kq_scale,
    };
    // every layer's rows of the slot on the host (read here, on one thread: they may be device memory)
    const struct iq_tensor * sk = c->layers[0].region[IQ_QREGION_SINK_K], * rk = c->layers[0].region[IQ_QREGION_RECENT_K];
    const size_t sink = sk->nb[3], window = rk->nb[3], d = (size_t) c->head_dim;
    const size_t per_layer = 2 * sink + 2 * sizeof(iq_fp16_t) * (size_t) c->n_kv_head * (size_t) (n_recent + m) * d +
                             sizeof(float) * kv_probe_row(c) * (size_t) n_probe;
    size_t scratch = window;
    if (m > 0) {
        const size_t wide = sizeof(float) * (size_t) m * kv_probe_row(c);  // n_head >= n_kv_head
        scratch = scratch > wide ? scratch : wide;
    }
    uint8_t * host = malloc(per_layer * (size_t) c->n_layer);
    float * tmp = malloc(scratch);
    struct kv_auto_rows * rows = malloc(sizeof(*rows) * (size_t) c->n_layer);
    int32_t (*bits)[2] = malloc(sizeof(*bits) * (size_t) c->n_layer);
    if (host == NULL || tmp == NULL || rows == NULL || bits == NULL) {
        free(host), free(tmp), free(rows), free(bits);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory choosing the KV cache's layout");
    }
    for (int32_t il = 0; il < c->n_layer; il++) {
        layout_rows(c, slot, il, &lay, n_recent, ahead, n_probe, host + per_layer * (size_t) il, tmp, &rows[il]);
    }
    kv_auto_measure_layers(&c->cfg.qcfg, &shape, rows, c->n_layer, n_threads, c->err);
    kv_auto_allocate(c->n_layer, (const double (*)[2][KV_AUTO_CANDIDATES]) c->err, c->cfg.units, bits);
    kv_layout_set(c, (const int32_t (*)[2]) bits);
    free(host), free(tmp), free(rows), free(bits);
    return INNERQ_OK;
}

// The share of the groups of a sequence's first n_blocks blocks per head (pages in table) whose
// (d, m) is the symmetric grid's (m = -c d, d != 0, c its centre: iq_grid_centre), or -1 if none.
static float kv_sym_share(const struct iq_tensor * t, const int32_t * table, int32_t bits, int32_t head_dim,
                          int32_t group, unsigned fmt, int32_t n_blocks) {
    uint8_t * block = n_blocks > 0 ? malloc(t->nb[1]) : NULL;
    if (block == NULL) {
        return -1.0f;
    }
    int64_t sym = 0, all = 0;
    for (int64_t h = 0; h < t->ne[2]; h++) {
        for (int32_t j = 0; j < n_blocks; j++) {
            iq_tensor_get(t, block, (size_t) h * t->nb[2] + (size_t) table[j] * t->nb[1], t->nb[1]);
            iq_fp16_t buf[2 * IQ_QCACHE_MAX_HEAD_DIM];
            const iq_fp16_t * d = iq_qblock_params_of(block, bits, head_dim, group, fmt, buf);
            const float centre = iq_grid_centre(1 << bits, iq_qblock_levels(bits, fmt));
            for (int32_t gi = 0; gi < head_dim; gi++, all++) {
                const float df = iq_fp16_to_fp32(d[gi]);
                sym += df != 0.0f && d[head_dim + gi] == iq_fp32_to_fp16(-centre * df);
            }
        }
    }
    free(block);
    return (float) ((double) sym / (double) all);
}

innerq_status kv_cache_layer_info(const struct kv_cache * c, int32_t slot, int32_t il, innerq_kv_layer_info * out) {
    if (il < 0 || il >= c->n_layer) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "layer %d is not in 0 .. %d", il, c->n_layer - 1);
    }
    *out = (innerq_kv_layer_info) { .sym_k = -1.0f, .sym_v = -1.0f };
    if (!c->cfg.fmt->quantized) {
        return INNERQ_OK;
    }
    const struct iq_kv_layer * l = &c->layers[il];
    const struct kv_seq * s = &c->seqs[slot];
    // a window-only layer keeps no blocks (kv_config_window_only): nothing quantized to show
    const int32_t g = l->qcfg.group, n_blocks = l->n_pages > 0 ? s->q.n_quant / g : 0;
    const int32_t * table = c->table + (size_t) slot * c->cfg.n_table;
    out->bits_k = l->qcfg.bits_k;
    out->bits_v = l->qcfg.bits_v;
    out->n_quant = n_blocks * g;
    out->sym_k = kv_sym_share(l->region[IQ_QREGION_QUANT_K], table, l->qcfg.bits_k, l->head_dim, g,
                              iq_qcache_fmt(&l->qcfg, false), n_blocks);
    out->sym_v = kv_sym_share(l->region[IQ_QREGION_QUANT_V], table, l->qcfg.bits_v, l->head_dim, g,
                              iq_qcache_fmt(&l->qcfg, true), n_blocks);
    _Static_assert(KV_AUTO_CANDIDATES == sizeof(out->err_k) / sizeof(out->err_k[0]), "one error per candidate");
    for (int32_t b = 0; b < KV_AUTO_CANDIDATES && c->err != NULL && c->layout_ready; b++) {
        out->err_k[b] = (float) c->err[il][0][b];
        out->err_v[b] = (float) c->err[il][1][b];
    }
    return INNERQ_OK;
}
