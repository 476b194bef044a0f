// The KV cache's configuration: the one place where the context parameters become a cache
// format, its types, its quantizer's options, its windows, its rotation and the pool's size
// (the defaults of docs/DEFAULTS.md that concern the cache, the device's among them).
#pragma once

#include "innerq.h"
#include "iq-qcache.h"

struct llama_hparams;
struct kv_format;
struct device_kind;

#define KV_PLAIN_PAGE 256  // tokens per page of a plain cache (a multiple of the CPU's tiles, 64)

struct kv_config {
    const struct kv_format * fmt;  // the format's row (kv-format.h)
    enum iq_type type_k, type_v;   // quantized types with kv_bits: the smallest until the layout is chosen
    struct iq_qcache_config qcfg;  // quantized formats
    bool rot_k, rot_v;             // Hadamard rotation along head_dim of keys (and queries), values (and output)
    bool value_scales;             // InnerQ value row scales (the params' choice, else the device's default)
    bool params8;                  // InnerQ 8-bit group parameters (the params' choice)
    bool key_levels;               // InnerQ keys on the key levels (the params' choice)
    double kv_bits;                // the automatic layout's budget (0: off): effective bits at n_ctx
    int32_t units;                 // its code bits over the layers (b_k + b_v summed), once n_ctx fixes them;
                                   // with kv_layer_bits those layers' bits summed
    // The InnerQ preset with its windows left to it, on a device that spends their bytes on code
    // bits (device_kind.kv_preset_budget): the windows it takes then (their floors), kv-cache.c
    // making the layers' bits (kv_preset_layout)
    bool preset_budget;
    int32_t preset_sink, preset_recent;
    bool auto_ahead;               // kv_bits: the device's measuring step (device_kind.kv_auto_ahead)
    // kv_bits with n_seq_max > 1: the budget (effective bits at n_ctx) that kv_preset_layout
    // fills in the preset's order from K2/V2, the windows the configuration's (kv_bits stays 0)
    double pool_bits;
    int32_t n_ctx;                 // tokens the pool holds (and one sequence at most)
    int32_t n_slots;               // sequences
    int32_t page;                  // tokens per page
    int32_t n_pages;               // pages of the pool
    int32_t n_table;               // entries of a sequence's page table
    // Window-only layers (kv_config_window_only) hold no quantized blocks. Once a sequence has
    // blocks its recent window keeps at least swa_rows rows (the n_swa - 1 positions before a
    // query that a sliding-window layer reads), so a rewind that would leave fewer goes back to
    // the sink (kv-fmt-quant.c). 0: no such layer.
    int32_t swa_rows;
};

// The configuration of a cache for params (kv_k / kv_v: a type name, the preset "innerq"
// (innerq3 keys, innerq2 values; on a device with kv_preset_budget kv-cache.c then gives its
// layers more bits, preset_budget), or NULL: the default cache of the device; kv_group 0 is the
// device's group) on a model of hp, with n_ctx tokens for n_slots sequences (0, 0: the shape
// is not needed: names, types and options only), on a device of kind dev (device.h).
innerq_status kv_config_make(const innerq_context_params * params, const struct llama_hparams * hp,
                             const struct device_kind * dev, int32_t n_ctx, int32_t n_slots, struct kv_config * cfg);
// Whether layer il of a cache of cfg is window-only: a sliding-window layer of a quantized
// format whose recent window holds the whole sliding window (R >= n_swa, the default), so every
// position its queries see is in the f16 sink or window and its flushed blocks would never be
// read: it stores none (n_pages 0, docs/DESIGN.md 3.6). Not with kv_bits (its arena spans every layer).
bool kv_config_window_only(const struct kv_config * cfg, const struct llama_hparams * hp, int32_t il);
// The layers of hp that are not window-only.
int32_t kv_config_block_layers(const struct kv_config * cfg, const struct llama_hparams * hp);
// Test switch (libinnerq_test.so): window-only layers keep their blocks as the others do (the
// logits must not change: a window-only layer never reads them).
void kv_test_window_blocks(bool keep);
// Bytes of cache one more token takes in all layers (quantized types: in the quantized region,
// b + 32/G bits per element; with kv_bits the code bits its budget left after the windows
// (units), or kv_bits itself before n_ctx fixes them; the windows are a fixed cost on top).
double kv_config_bytes_per_token(const struct kv_config * cfg, const struct llama_hparams * hp);
// The memory figures of a cache of cfg on a model of hp whose buffer takes `bytes` (innerq.h).
void kv_config_memory(const struct kv_config * cfg, const struct llama_hparams * hp, uint64_t bytes,
                      innerq_kv_memory * out);
// Checks params->kv_layer_bits ("IL:K:V,..."; NULL or "": none) and, with n_layer > 0, fills
// bits[il] (keys, values) of the layers it names (the others are left as they are).
innerq_status kv_layer_bits_parse(const char * spec, int32_t n_layer, int32_t (*bits)[2]);
// Writes bits (n_layer layers' keys and values) as kv_layer_bits ("0:4:2,1:4:3,..."): at most
// n_layer * 16 + 1 bytes.
void kv_layer_bits_format(int32_t n_layer, const int32_t (*bits)[2], char * spec);
// Whether the Hadamard rotation fits head_dim (a power of two, 16..256).
bool kv_rot_supported(int32_t head_dim);
