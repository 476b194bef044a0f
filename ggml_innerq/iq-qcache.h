// The InnerQ (and KIVI) quantized KV cache of one layer (docs/DESIGN.md section 3): its storage
// layout, the reference group quantizer, what a store does to the storage given its flush
// plan, and the reference attention, which is the specification the CPU and CUDA kernels are
// tested against. The arithmetic itself is in iq-qcache-math.h, shared with CUDA.
//
// Token order. A layer's tokens are [0, n_tokens): sink [0, n_sink), quantized
// [n_sink, n_sink + n_quant), recent [n_sink + n_quant, n_tokens). The sink fills first; then
// tokens enter the recent window, whose oldest G tokens a flush quantizes as one block.
// When to flush is the runtime's policy (src/kv-plan.c: while the window holds >= R + G
// tokens after a store, so it keeps R..R+G-1); the counters are the runtime's bookkeeping,
// which a struct iq_qcache carries as a read-only snapshot of the state before a batch.
//
// Storage: seven regions (enum iq_qregion), tensors of a backend buffer in the runtime
// (src/kv-cache.c), shared by the n_slots sequences of a context: each sequence has its slot of
// the windows and norms, and its quantized blocks are pages of the pool that its page table
// names (block j of the sequence is page pages[j]; iq-kv.h). iq_qcache_layout also lays the
// regions out in one block of iq_qcache_size bytes, each region 64-byte aligned. Each is
// slot-major, then head-major (all of KV head 0, then head 1, ...):
//   norm        f32 [n_slots][n_kv_head][D]        key normalization n_c (1 until the first flush)
//   sink_k/_v   f16 [n_slots][n_kv_head][S][D]     token-major rows
//   recent_k/_v f16 [n_slots][n_kv_head][R+G][D]   oldest first; shifted down by G on a flush
//   quant_k/_v  [n_kv_head][n_pages]               blocks of G tokens x D channels
// A sequence's view (iq_qcache_view) points its regions at its slot, so the kernels see one
// sequence's cache.
//
// Block. A block of G tokens x D channels stores its D*G codes as tiles of 64 codes, then
// d[D] and m[D] (fp16): exactly D groups of G codes whichever way the groups run; a value
// block of a cache with value_scales then one scale code per token (u8[G]). The
// axis of a block says which way its groups run; the other axis is the "lane" axis:
//   IQ_QAXIS_CHANNELS (InnerQ keys, KIVI values): group = G consecutive channels of one
//       token; lane = token (lane_len = G), sub = channel (sub_len = D).
//   IQ_QAXIS_TOKENS (InnerQ values, KIVI keys): group = the G tokens of one channel;
//       lane = channel (lane_len = D), sub = token (sub_len = G).
// Element (lane, sub) is code p = 4*(lane % 16) + sub % 4 of tile
// (lane / 16) * (sub_len / 4) + sub / 4, and belongs to group (sub / G) * lane_len + lane,
// whose parameters are d[group], m[group]. So a 32-bit word of a tile's unpacked codes holds
// four consecutive subs (reduction elements) of one lane: one lane of an integer dot-product
// instruction (vpdpbusd / pmaddubsw), with scores (keys) or outputs (values) vectorized over
// 16 lanes, and a group's (d, m) touched once per group.
// Packing of a tile's 64 codes p = 0..63 (a tile is 8*b bytes; no code straddles a byte):
//   b = 2: 16 bytes, code p in byte p % 16, bits 2*(p / 16).
//   b = 3: that 2-bit plane (low two bits), then 8 bytes: bit 2 of code p is bit p % 8 of
//          byte p / 8.
//   b = 4: 32 bytes, code p in byte p % 32, bits 4*(p / 32).
//   b = 5: that 4-bit plane (low four bits), then 8 bytes: bit 4 of code p is bit p % 8 of
//          byte p / 8 (InnerQ only: innerq5).
// Dequantization: x = d*u + m (3-bit keys of a cache with key_levels: d*L[u] + m, L the key
// levels of iq-qcache-math.h); quantized keys are stored divided by n, so K_tc = (d*u + m)*n_c;
// values with row scales V_tc = (d*u + m)*n_t.
#pragma once

#include "iq-qcache-math.h"
#include "iq-types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IQ_QGROUP_MAX 128          // largest group size G
#define IQ_QCACHE_MAX_HEAD_DIM 256
#define IQ_QCACHE_MAX_GROUPS 8     // key groups per head (IQ_QCACHE_MAX_HEAD_DIM / 32)

// How a group's (d, m) is chosen (docs/DESIGN.md 3.1); hybrid is the default, the others ablations.
enum iq_quant_mode {
    IQ_QUANT_HYBRID = 0,
    IQ_QUANT_ASYM = 1,
    IQ_QUANT_SYM = 2,
    // both grids over a few shrunk ranges, (d, m) refit by least squares, least squared error
    // (iq-qcache-math.h, iq_quant_search_group)
    IQ_QUANT_SEARCH = 3,
};

enum iq_qaxis {
    IQ_QAXIS_CHANNELS = 0,
    IQ_QAXIS_TOKENS = 1,
};

struct iq_qcache_config {
    int32_t bits_k, bits_v;        // 2, 3, 4 or 5 (5: InnerQ only)
    enum iq_qaxis axis_k, axis_v;  // InnerQ: channels, tokens; KIVI: tokens, channels
    int32_t group;                 // G: 32, 64 or 128
    int32_t n_sink;                // S
    int32_t n_recent;              // R
    enum iq_quant_mode mode;
    bool key_norm;
    // Score correction of quantized keys (InnerQ only): a key rounded with step d per group has
    // a score error of variance var_t = sum_g d_tg^2 / 12 * sum_{c in g} qn_c^2, and softmax
    // weighs it by E[exp(s + e)] = exp(s + var_t / 2): each noisy key gains weight, which over
    // thousands of quantized tokens drains the attention the windows should get. The kernels
    // subtract var_t / 2 from the score (one more multiply-add per group, with
    // sum_{c in g} qn_c^2 once per query). docs/ACCURACY.md measures it.
    bool score_correction;
    // Key channels [0, rope_dims) rotate in RoPE pairs (2i, 2i+1) (NORMAL mode): key
    // normalization gives both channels of a pair one n. 0: every channel its own (docs/DESIGN.md 3.3).
    int32_t rope_dims;
    // Value row scales (InnerQ values only, axis_v tokens): each value block carries one byte
    // per token, its row's scale (iq-qcache-math.h, iq_row_scale_code), and holds the rows
    // divided by it; attention weighs each token's probability by its scale.
    bool value_scales;
    // 8-bit group parameters (InnerQ only): each block keeps its groups' (d, m) in a byte each
    // against the block's fp16 references (iq-qcache-math.h), 0.23-0.25 bits less per element.
    bool params8;
    // Key levels (InnerQ keys, the searched quantizer, no score correction): 3-bit key codes
    // stand for Max's non-uniform levels (iq-qcache-math.h, "key levels"), the same bytes.
    bool key_levels;
};

// The format flags of a layer's key or value blocks (IQ_QBLOCK_*).
static inline unsigned iq_qcache_fmt(const struct iq_qcache_config * cfg, bool is_v) {
    return (is_v && cfg->value_scales ? IQ_QBLOCK_ROW_SCALES : 0u) | (cfg->params8 ? IQ_QBLOCK_P8 : 0u) |
           (!is_v && cfg->key_levels ? IQ_QBLOCK_LEVELS : 0u);
}

// The regions of a layer's storage (the layout comment above).
enum iq_qregion {
    IQ_QREGION_NORM = 0,
    IQ_QREGION_SINK_K,
    IQ_QREGION_SINK_V,
    IQ_QREGION_RECENT_K,
    IQ_QREGION_RECENT_V,
    IQ_QREGION_QUANT_K,
    IQ_QREGION_QUANT_V,
    IQ_QREGION_COUNT,
};

// One layer's cache as kernels see it: the layout, where each region's data is, and for one
// sequence its page table and its counters before the batch being run (a snapshot of the
// runtime's; nothing here changes them).
struct iq_qcache {
    struct iq_qcache_config cfg;
    int32_t head_dim, n_kv_head;
    int32_t n_ctx;                 // tokens one sequence may hold
    int32_t n_slots;               // sequences the windows and norms have room for
    int32_t cap_recent;            // R + G
    int32_t cap_blocks;            // pages of the pool: quantized blocks per head
    size_t block_bytes_k, block_bytes_v;
    size_t off[IQ_QREGION_COUNT];  // offsets of the regions laid out in one block ...
    size_t bytes[IQ_QREGION_COUNT];  // ... and their sizes (every slot, every page)
    size_t size;                   // bytes of that block
    uint8_t * region[IQ_QREGION_COUNT];  // the data of each region (NULL: not bound)
    // The sequence: its page table (block j is page pages[j]; NULL: page j) of n_table
    // entries, and its counters: n_tokens = n_sink + n_quant + n_recent.
    const int32_t * pages;
    int32_t n_table;
    int32_t n_tokens, n_sink, n_quant, n_recent;
};

// What storing a batch does to the regions: decided by the runtime's cache policy
// (src/kv-plan.c), carried out by the KV_STORE op with iq_qcache_store_head.
struct iq_qcache_flush {
    int32_t n_sink_new;  // the batch's first tokens that go to the sink
    int32_t n_flush;     // blocks of the window's oldest G tokens the store quantizes
    int32_t set_norms;   // 1: the key normalization is computed from those tokens first
};

// True for the cache types of this module (innerq2 .. innerq5, kivi2 / kivi4).
bool iq_qcache_type_is_quantized(enum iq_type type);

// The configuration of a (type_k, type_v) pair: both InnerQ (S = 32, R = 96, hybrid, key
// normalization) or both KIVI (S = 0, R = 128, asymmetric, no normalization). group 0 picks 64.
// false (+ iq_error_set) for another pair.
bool iq_qcache_config_default(enum iq_type type_k, enum iq_type type_v, int32_t group,
                              struct iq_qcache_config * cfg);

// Fills c's layout for n_slots sequences of at most n_ctx tokens each over a pool of n_pages
// blocks per head (sizes and offsets; no region bound, no page table, counters zero); false (+
// iq_error_set) for an invalid configuration or shape (head_dim must be a multiple of 16 and of
// G for channel-axis tensors, at most 256).
bool iq_qcache_pool_layout(struct iq_qcache * c, const struct iq_qcache_config * cfg, int32_t head_dim,
                           int32_t n_kv_head, int32_t n_ctx, int32_t n_slots, int32_t n_pages);
// The layout of one sequence of n_ctx tokens with pages of its own: n_slots 1 and the blocks
// n_ctx tokens can fill (n_ctx - S - R) / G.
bool iq_qcache_layout(struct iq_qcache * c, const struct iq_qcache_config * cfg, int32_t head_dim,
                      int32_t n_kv_head, int32_t n_ctx);
// The blocks a sequence of n_ctx tokens fills at most: its quantized region, n_ctx - S - R tokens.
int32_t iq_qcache_blocks_max(const struct iq_qcache_config * cfg, int32_t n_ctx);
// Bytes of the one-sequence layout in one block; 0 (+ iq_error_set) for an invalid configuration or shape.
size_t iq_qcache_size(const struct iq_qcache_config * cfg, int32_t head_dim, int32_t n_kv_head, int32_t n_ctx);
// Binds every region to its place in one block at base (iq_qcache_size bytes, 64-byte aligned
// for the kernels' best speed). The caller sets the norms to 1 before the first store.
void iq_qcache_bind(struct iq_qcache * c, void * base);
// Points c (bound to the whole storage) at one sequence: the windows and norms of its slot,
// its page table row (n_table entries; NULL: page j for block j).
void iq_qcache_view(struct iq_qcache * c, int32_t slot, const int32_t * pages, int32_t n_table);
// The shape of a region as a tensor: f32 [D, H, n_slots] norms, f16 [D, S or R+G, H, n_slots]
// windows, bytes [block bytes, pages, H] of the quantized region (ne[3] 1).
void iq_qcache_region_shape(const struct iq_qcache * c, enum iq_qregion r, enum iq_type * type, int64_t ne[4]);
// The cache types of a configuration: innerq<b> for InnerQ axes, kivi<b> for KIVI's.
void iq_qcache_types(const struct iq_qcache_config * cfg, enum iq_type * type_k, enum iq_type * type_v);

// Whether the first n_blocks entries of the sequence's page table are pages of the pool (so
// that reading or writing those blocks stays inside it); false + iq_error_set otherwise.
bool iq_qcache_pages_check(const struct iq_qcache * c, int32_t n_blocks);
// Whether a store of n tokens with this flush plan fits the regions, the counters and the page
// table (so that iq_qcache_store_head stays inside them); false + iq_error_set otherwise.
bool iq_qcache_store_check(const struct iq_qcache * c, const struct iq_qcache_flush * f, int32_t n);
// Stores n tokens of KV head h after the counters and carries out the flush plan: the first
// f->n_sink_new tokens into the sink, the rest into the window, then f->n_flush blocks of the
// window's oldest G tokens quantized (keys divided by the norms, which f->set_norms computes
// first from the flushed keys, docs/DESIGN.md 3.3) and the window shifted down. k, v: f32
// [n][n_kv_head][head_dim] (iq_attention's k, v). Values are rounded to f16 on entry; flushes
// quantize those f16 values, so the result does not depend on how tokens are split into stores
// (except the first flush's norms). Writes only head h's storage: heads may go to threads.
void iq_qcache_store_head(const struct iq_qcache * c, const struct iq_qcache_flush * f, int32_t h, const float * k,
                          const float * v, int32_t n);

// ---- storage access (kernels) ----
static inline const float * iq_qcache_norm(const struct iq_qcache * c, int32_t h) {
    return (const float *) c->region[IQ_QREGION_NORM] + (size_t) h * c->head_dim;
}
static inline iq_fp16_t * iq_qcache_sink(const struct iq_qcache * c, bool is_v, int32_t h) {
    iq_fp16_t * base = (iq_fp16_t *) c->region[is_v ? IQ_QREGION_SINK_V : IQ_QREGION_SINK_K];
    return base + (size_t) h * c->cfg.n_sink * c->head_dim;
}
static inline iq_fp16_t * iq_qcache_recent(const struct iq_qcache * c, bool is_v, int32_t h) {
    iq_fp16_t * base = (iq_fp16_t *) c->region[is_v ? IQ_QREGION_RECENT_V : IQ_QREGION_RECENT_K];
    return base + (size_t) h * c->cap_recent * c->head_dim;
}
// Block j of the sequence: its page of the pool.
static inline uint8_t * iq_qcache_block(const struct iq_qcache * c, bool is_v, int32_t h, int32_t j) {
    const size_t bytes = is_v ? c->block_bytes_v : c->block_bytes_k;
    const int32_t page = c->pages != NULL ? c->pages[j] : j;
    return c->region[is_v ? IQ_QREGION_QUANT_V : IQ_QREGION_QUANT_K] + ((size_t) h * c->cap_blocks + page) * bytes;
}
// The fp16 d[D] and m[D] of a block: after its codes.
static inline const iq_fp16_t * iq_qblock_params(const uint8_t * block, int32_t bits, int32_t head_dim, int32_t group) {
    return (const iq_fp16_t *) (block + iq_qblock_params_offset(bits, head_dim, group));
}

// Splits [0, n_tokens) into n_parts ranges for threads, each boundary inside the quantized
// region on a block edge (so kernels see whole blocks); part in [0, n_parts).
void iq_qcache_split(const struct iq_qcache * c, int32_t n_parts, int32_t part, int32_t * t0, int32_t * t1);

// ---- block format and reference group quantizer (docs/DESIGN.md 3.1; iq-qblock.c) ----
// Quantizes the n values x[0..n) (n = G <= IQ_QGROUP_MAX) to codes u[0..n) in [0, 2^bits - 1] and
// fp16 (d, m) with x ~ d*u + m. Rounding is round half away from zero (C roundf), done with d
// and m already rounded to fp16. Ties in |x| (symmetric mode) pick the first element; hybrid
// compares the L1 errors sum |x - (d*u + m)| computed in double, sequentially (tie: asymmetric).
// A constant group gives d = 0, m = x; a candidate whose fp16 d is 0 has all codes at the
// level that represents m (asymmetric: 0, m = min; symmetric: 2^(bits-1), m = 0). key_levels:
// 3-bit codes of the searched mode on the key levels, x ~ d*L[u] + m, each element on its
// nearest level (iq-qcache-math.h).
void iq_quant_group(const float * x, int32_t n, int32_t bits, enum iq_quant_mode mode, bool key_levels, uint8_t * u,
                    iq_fp16_t * d, iq_fp16_t * m);

// Packs 64 codes (tile order p = 0..63) into 8*bits bytes, and back.
void iq_qtile_pack(const uint8_t * u, int32_t bits, uint8_t * dst);
void iq_qtile_unpack(const uint8_t * src, int32_t bits, uint8_t * u);

// The codes of tokens [a, b) of a block, unpacked token-major: u[(t - a) * head_dim + c].
void iq_qblock_codes(const uint8_t * block, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                     int32_t a, int32_t b, uint8_t * u);
// The searched quantizer (IQ_QUANT_SEARCH) of IQ_QSEARCH_LANES groups of n <= IQ_QGROUP_MAX
// elements at once: x[i * IQ_QSEARCH_LANES + l] is element i of group l; codes into u (the same
// order) and (d[l], m[l]), each group's bits those of iq_quant_group (key_levels as there). The
// CPU backend's vector kernels (cpu/qsearch-lanes.h) are such functions.
#define IQ_QSEARCH_LANES 8
typedef void (*iq_qsearch_fn)(const float * x, int32_t n, int32_t bits, bool key_levels, uint8_t * u, iq_fp16_t * d,
                              iq_fp16_t * m);
// The function iq_qblock_quantize searches with, process-wide (NULL, the start: the scalar
// search, group by group). Any such function gives the same blocks; the CPU backend installs its
// machine's before it stores or measures (cpu: iq_cpu_install_qsearch).
void iq_qblock_set_search(iq_qsearch_fn fn);

// Quantizes G token-major f16 rows [G][head_dim] (divided by norm, unless NULL) into a block of
// format fmt (IQ_QBLOCK_* flags, iq-qcache-math.h): with IQ_QBLOCK_ROW_SCALES each row also by its
// row scale, whose codes follow the parameters; with IQ_QBLOCK_P8 the groups' (d, m) in 8 bits;
// with IQ_QBLOCK_LEVELS 3-bit codes on the key levels.
void iq_qblock_quantize(const iq_fp16_t * rows, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                        enum iq_quant_mode mode, const float * norm, unsigned fmt, uint8_t * block);
// Dequantizes tokens [a, b) of a block of format fmt into f32 rows [b - a][head_dim] (norm: n_c or NULL).
void iq_qblock_dequantize(const uint8_t * block, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                          const float * norm, unsigned fmt, int32_t a, int32_t b, float * rows);
// The fp16 d[D], m[D] of a block of format fmt: in the block, or (8-bit parameters) decoded into buf[2 D].
const iq_fp16_t * iq_qblock_params_of(const uint8_t * block, int32_t bits, int32_t head_dim, int32_t group, unsigned fmt,
                                      iq_fp16_t * buf);

// Key and value of stored token t of KV head h, as attention reads them (f32 [head_dim] each).
void iq_qcache_read_token(const struct iq_qcache * c, int32_t h, int32_t t, float * k, float * v);

// ---- reference attention (iq-qcache-ref.c) ----
// Online-softmax state of one query head, IQ_ATTN_STATE(D) floats: {mx, l, acc[D]} with
// acc = sum_t exp(s_t - mx) v_t and l = sum_t exp(s_t - mx). States of disjoint token ranges
// merge exactly, so threads may split the tokens any way.
#define IQ_ATTN_STATE(head_dim) ((head_dim) + 2)
void iq_attn_state_init(float * st, int32_t n_head, int32_t head_dim);
void iq_attn_state_merge(float * dst, const float * src, int32_t n_head, int32_t head_dim);
// out[n_head][head_dim] = acc / l (zeros where no token was seen).
void iq_attn_state_finish(const float * st, int32_t n_head, int32_t head_dim, float * out);

// Adds stored tokens [t0, t1) of KV head h to the states st[r] of its r query heads
// q[r][head_dim]; s_t = scale * q.K_t.
void iq_qcache_attend_ref(const struct iq_qcache * c, int32_t h, const float * q, int32_t r, float scale,
                          int32_t t0, int32_t t1, float * st);
// The same for n f32 rows k[i*ld .. + head_dim), v[i*ld ..] (a batch's own keys and values).
void iq_attend_rows_ref(const float * k, const float * v, size_t ld, int32_t n, const float * q, int32_t r,
                        int32_t head_dim, float scale, float * st);

// Attention of n_q queries q[n_q][n_head][head_dim] over every stored token and, if k and v
// are not NULL, over the batch's own rows k, v [n_q][n_kv_head][head_dim] with the causal mask
// (query i sees batch rows 0..i). out: [n_q][n_head][head_dim]. false (+ iq_error_set) if
// n_head is not a multiple of n_kv_head.
bool iq_qcache_attention_ref(const struct iq_qcache * c, const float * q, int32_t n_head, const float * k,
                             const float * v, int32_t n_q, float scale, float * out);

#ifdef __cplusplus
}
#endif
