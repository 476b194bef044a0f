// MUL_MAT: dst[n, m] = dot(w row n, x row m), w in any weight type, x f32.
//
// The activation rows are converted once to the weight type's vec_dot_type (into the op's
// scratch), then the output is cut into chunks of weight rows x activation rows that the
// threads take from the pool's counter: small chunks taken on demand balance threads that
// run at different speeds. Inside a chunk, blocks of 16 x 16 keep a block of weight rows in
// cache while every activation row of the block passes over it, up to IQ_VEC_DOT_COLS at a
// time (vec_dot_cols: a weight row's codes unpacked once for them). Where the weight type has
// vec_dot_lanes, the activation rows are also packed 8 to a group (iq_cpu_act_lanes; a last
// group of 4 or fewer in 4 lanes), and a chunk is weight rows x groups: each weight block is
// unpacked once for the whole group. Each output is the same bits however many activation rows
// there are: a token's products do not depend on the batch.
#include "ops.h"

#define MM_BLOCK 16

static const void * mm_activation(const struct iq_tensor * x, const char * converted, size_t row_size, int64_t m) {
    return converted != NULL ? converted + (size_t) m * row_size : iq_cpu_row(x, m);
}

static char * mm_scratch(void * wdata) { return (char *) (((uintptr_t) wdata + 63) & ~(uintptr_t) 63); }

// A converted activation row, then (where vec_dot_cols reads them) its scales as f32, 64-byte
// aligned each.
static size_t mm_align(size_t n) { return (n + 63) & ~(size_t) 63; }
static size_t mm_row_bytes(const struct iq_cpu_type_traits * ct, int64_t K) {
    return mm_align(iq_row_size(ct->vec_dot_type, K));
}
static size_t mm_scales_bytes(const struct iq_cpu_type_traits * ct, int64_t K) {
    return ct->vec_dot_cols != NULL ? mm_align(sizeof(float) * (size_t) iq_cpu_act_scales_size(ct->vec_dot_type, K))
                                    : 0;
}

// Activation rows in groups of 8 columns (lanes), where the weight type has vec_dot_lanes and
// there is more than one row.
#define MM_GROUP 8
static int64_t mm_groups(const struct iq_cpu_type_traits * ct, int64_t nr1) {
    return ct->vec_dot_lanes != NULL && nr1 > 1 ? (nr1 + MM_GROUP - 1) / MM_GROUP : 0;
}
static size_t mm_group_bytes(int64_t K) { return (size_t) (K / 32) * IQ_LANES_BLOCK; }
// Lanes of group g: 8, or 4 for a last group of 4 columns or fewer.
static int mm_group_lanes(int64_t nr1, int64_t g) { return nr1 - g * MM_GROUP > 4 ? 8 : 4; }

size_t iq_cpu_mul_mat_work_size(const struct iq_tensor * dst, int nth) {
    const struct iq_tensor * w = dst->src[0];
    const struct iq_tensor * x = dst->src[1];
    const struct iq_cpu_type_traits * ct = iq_cpu_traits(w->type);
    if (ct == NULL || ct->vec_dot_type == IQ_TYPE_F32) {
        return 0;
    }
    const int64_t nr1 = iq_nrows(x);
    return (size_t) nr1 * (mm_row_bytes(ct, x->ne[0]) + mm_scales_bytes(ct, x->ne[0])) +
           (size_t) mm_groups(ct, nr1) * mm_group_bytes(x->ne[0]) + 64;
}

bool iq_cpu_mul_mat_supports(const struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0];
    const struct iq_cpu_type_traits * ct = iq_cpu_traits(w->type);
    if (ct == NULL) {
        iq_error_set("mul_mat: the CPU backend can't multiply %s weights", iq_type_name(w->type));
        return false;
    }
    if (iq_row_size(ct->vec_dot_type, w->ne[0]) == 0) {
        iq_error_set("mul_mat: rows of %lld elements don't fit %s blocks", (long long) w->ne[0],
                     iq_type_name(ct->vec_dot_type));
        return false;
    }
    return true;
}

// Chunks of output: n0 x n1 pieces of (weight rows) x (activation rows).
static void mm_chunking(int64_t nr0, int64_t nr1, int nth, int64_t * n0, int64_t * n1) {
    const int64_t size = (nr0 == 1 || nr1 == 1) ? 64 : MM_BLOCK;
    *n0 = (nr0 + size - 1) / size;
    *n1 = (nr1 + size - 1) / size;
    if (*n0 * *n1 < 4 * nth) {
        // too few to balance: one piece per thread along the longer side
        *n0 = nr0 > nr1 ? nth : 1;
        *n1 = nr0 > nr1 ? 1 : nth;
    } else if (*n1 == 1) {
        // a single activation row (decode): equal shares when all threads run alike
        *n0 = (*n0 + nth - 1) / nth * nth;
    }
    *n0 = *n0 < nr0 ? *n0 : nr0;
    *n1 = *n1 < nr1 ? *n1 : nr1;
}

// Weight rows [r0_start, r0_end) against groups [g_start, g_end) of the packed activations.
static void mm_chunk_lanes(const struct iq_tensor * w, struct iq_tensor * dst, const struct iq_cpu_type_traits * ct,
                           const char * packs, int64_t nr1, int64_t r0_start, int64_t r0_end, int64_t g_start,
                           int64_t g_end) {
    const int64_t K = w->ne[0];
    for (int64_t b0 = r0_start; b0 < r0_end; b0 += MM_BLOCK) {
        const int64_t e0 = b0 + MM_BLOCK < r0_end ? b0 + MM_BLOCK : r0_end;
        for (int64_t g = g_start; g < g_end; g++) {
            const int64_t m = g * MM_GROUP;
            const int ncols = nr1 - m < MM_GROUP ? (int) (nr1 - m) : MM_GROUP;
            ct->vec_dot_lanes(K, (float *) iq_cpu_row(dst, m) + b0, dst->nb[1] / sizeof(float),
                              (const char *) w->data + b0 * w->nb[1], w->nb[1], (int) (e0 - b0),
                              packs + (size_t) g * mm_group_bytes(K), mm_group_lanes(nr1, g), ncols);
        }
    }
}

void iq_cpu_mul_mat(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0];
    const struct iq_tensor * x = dst->src[1];
    const struct iq_cpu_type_traits * ct = iq_cpu_traits(w->type);
    const int64_t K = w->ne[0], nr0 = w->ne[1], nr1 = iq_nrows(x);

    const char * converted = NULL;
    const float * scales = NULL;
    const char * packs = NULL;
    const size_t row_size = mm_row_bytes(ct, K), scales_size = mm_scales_bytes(ct, K);
    // activation rows in lanes: converted rows and results lie row_size and dst->nb[1] apart
    const int64_t ngroups = iq_is_contiguous(dst) ? mm_groups(ct, nr1) : 0;
    if (ct->vec_dot_type != IQ_TYPE_F32) {
        char * scratch = mm_scratch(p->wdata);
        char * scale_rows = scratch + (size_t) nr1 * row_size;
        char * group_packs = scale_rows + (size_t) nr1 * scales_size;
        for (int64_t m = p->ith; m < nr1; m += p->nth) {
            char * row = scratch + (size_t) m * row_size;
            ct->from_float((const float *) iq_cpu_row(x, m), row, K);
            if (scales_size > 0) {
                iq_cpu_act_scales(ct->vec_dot_type, row, K, (float *) (scale_rows + (size_t) m * scales_size));
            }
            if (ngroups > 0) {
                const int64_t g = m / MM_GROUP;
                iq_cpu_act_lanes(row, K, group_packs + (size_t) g * mm_group_bytes(K), mm_group_lanes(nr1, g),
                                 (int) (m % MM_GROUP));
            }
        }
        iq_threadpool_barrier(p->tp);
        converted = scratch;
        scales = scales_size > 0 ? (const float *) scale_rows : NULL;
        packs = ngroups > 0 ? group_packs : NULL;
    }

    int64_t n0, n1;
    mm_chunking(nr0, packs != NULL ? ngroups : nr1, p->nth, &n0, &n1);
    const iq_vec_dot_fn vec_dot = ct->vec_dot;
    // activation rows several at a time: converted ones lie row_size apart, and so do dst's
    const bool cols = ct->vec_dot_cols != NULL && scales != NULL && iq_is_contiguous(dst);
    for (int64_t c = iq_threadpool_next(p->tp); c < n0 * n1; c = iq_threadpool_next(p->tp)) {
        const int64_t c0 = c % n0, c1 = c / n0;
        const int64_t r0_start = nr0 * c0 / n0, r0_end = nr0 * (c0 + 1) / n0;
        if (packs != NULL) {
            mm_chunk_lanes(w, dst, ct, packs, nr1, r0_start, r0_end, ngroups * c1 / n1, ngroups * (c1 + 1) / n1);
            continue;
        }
        const int64_t r1_start = nr1 * c1 / n1, r1_end = nr1 * (c1 + 1) / n1;
        for (int64_t b1 = r1_start; b1 < r1_end; b1 += MM_BLOCK) {
            const int64_t e1 = b1 + MM_BLOCK < r1_end ? b1 + MM_BLOCK : r1_end;
            for (int64_t b0 = r0_start; b0 < r0_end; b0 += MM_BLOCK) {
                const int64_t e0 = b0 + MM_BLOCK < r0_end ? b0 + MM_BLOCK : r0_end;
                for (int64_t m = b1; m < e1;) {
                    const int ncols = !cols ? 1 : e1 - m < IQ_VEC_DOT_COLS ? (int) (e1 - m) : IQ_VEC_DOT_COLS;
                    const void * y = mm_activation(x, converted, row_size, m);
                    float * out = (float *) iq_cpu_row(dst, m);
                    for (int64_t n = b0; n < e0; n++) {
                        const char * wn = (const char *) w->data + n * w->nb[1];
                        if (ncols > 1) {
                            ct->vec_dot_cols(K, &out[n], dst->nb[1] / sizeof(float), wn, y, row_size,
                                             scales + (size_t) m * (scales_size / sizeof(float)),
                                             scales_size / sizeof(float), ncols);
                        } else {
                            vec_dot(K, &out[n], wn, y);
                        }
                    }
                    m += ncols;
                }
            }
        }
    }
}
