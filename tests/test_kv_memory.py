"""KV cache memory through the public API: innerq_kv_bytes_per_token and innerq_cache_size
against docs/DESIGN.md section 3, worked out here.

* Plain types (f32, f16, q8_0, q4_0): a token takes one K row and one V row of head_dim
  elements per layer and KV head, in ggml's block format (sizes from gguf's GGML_QUANT_SIZES),
  in pages of min(256, n_ctx rounded up to 64) tokens: the cache holds whole pages.
* Every cache has a page table: an int32 per page a sequence may hold (plain: its pages;
  quantized: its blocks).
* Quantized types: a token of the quantized region takes (b_k + 32/G + b_v + 32/G) / 8 bytes
  per element (codes plus one fp16 (d, m) pair per group of G), and InnerQ with value row scales
  one byte per token and KV head more, its value row's scale (docs/INNERQ.md). A layer also keeps, whatever
  n_ctx is, the f32 key norms, the f16 sink (S rows) and the f16 recent window (R + G rows:
  it holds R .. R+G-1 tokens between flushes) for K and V; the quantized region holds the
  largest whole number of blocks of G tokens that n_ctx - S - R allows. Each of those seven
  regions may be padded to 64 bytes, and each layer's buffer to 64 bytes: that is the only
  slack allowed.
InnerQ: S = 32, R = 96; KIVI: S = 0, R = 128 (docs/DESIGN.md 3.2, 3.5).

The preset (docs/INNERQ.md, "The preset's layout") takes the bytes of K3/V2 with the
rule-of-thumb windows and, with S 32 and R 96, gives its layers the most code bits of a fixed
order within them: preset_layout below works that out from the rule itself, the sizes of each
candidate layout from the library (whose sizes the tests of explicit layouts check).
"""
from __future__ import annotations

import os

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import tiny_model
from conftest import lib_path
from tiny_model import TinyConfig

ALIGN = 64
PLAIN = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
         "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
BITS = {"innerq2": 2, "innerq3": 3, "innerq4": 4, "innerq5": 5, "kivi2": 2, "kivi4": 4}
WINDOWS = {"iq": (32, 96), "kivi": (0, 128)}  # (S, R); InnerQ's are floors (windows_of)


def windows_of(kind: str, n_ctx: int, vscale: bool = False) -> tuple[int, int]:
    """The default windows: KIVI fixed, InnerQ S = n_ctx/64 within 32 .. 128, R = n_ctx/16 within
    96 .. 512; with value row scales within 32 .. 64 and 96 .. 448."""
    sink, recent = WINDOWS[kind]
    if kind == "kivi":
        return sink, recent
    caps = (64, 448) if vscale else (128, 512)
    return max(sink, min(caps[0], n_ctx // 64)), max(recent, min(caps[1], n_ctx // 16))
# (kv_k, kv_v, groups); "innerq" is the preset innerq3 keys / innerq2 values
CASES = [("f32", "f32", [0]), ("f16", "f16", [0]), ("q8_0", "q8_0", [0]), ("q4_0", "q4_0", [0]),
         ("kivi2", "kivi2", [0]), ("kivi4", "kivi4", [0]), ("innerq2", "innerq2", [32, 64, 128]),
         ("innerq", "innerq", [32, 64, 128]), ("innerq4", "innerq4", [32, 64, 128]),
         ("innerq5", "innerq3", [32, 64])]
PARAMS = [(k, v, g) for k, v, gs in CASES for g in gs]


@pytest.fixture(scope="module")
def api():
    os.environ["INNERQ_LIB"] = lib_path()
    from innerq._ffi import ffi, lib

    return ffi, lib


class Model:
    def __init__(self, api, path):
        self.ffi, self.lib = api
        out = self.ffi.new("innerq_model **")
        mp = self.ffi.new("innerq_model_params *", self.lib.innerq_model_default_params())
        assert self.lib.innerq_model_load(str(path).encode(), mp, out) == self.lib.INNERQ_OK, self.error()
        self.m = out[0]
        self.n_layer = self.lib.innerq_model_n_layer(self.m)
        self.n_kv = self.lib.innerq_model_n_head_kv(self.m)
        self.head_dim = self.lib.innerq_model_head_dim(self.m)

    def error(self) -> str:
        return self.ffi.string(self.lib.innerq_last_error()).decode()

    def params(self, kv_k, kv_v, group, n_ctx=0, vscale=-1, p8=-1):  # kv_value_scales, kv_params8
        p = self.ffi.new("innerq_context_params *", self.lib.innerq_context_default_params())
        p.kv_value_scales = vscale
        p.kv_params8 = p8
        self._names = [self.ffi.new("char[]", n.encode()) if n is not None else self.ffi.NULL for n in (kv_k, kv_v)]
        p.kv_k, p.kv_v = self._names
        p.kv_group, p.n_ctx, p.n_threads = group, n_ctx, 1
        return p

    def bytes_per_token(self, kv_k, kv_v, group) -> float:
        out = self.ffi.new("double *")
        assert self.lib.innerq_kv_bytes_per_token(self.m, self.params(kv_k, kv_v, group), out) == self.lib.INNERQ_OK
        return out[0]

    def cache_size(self, kv_k, kv_v, group, n_ctx) -> int:
        out = self.ffi.new("innerq_context **")
        st = self.lib.innerq_context_init(self.m, self.params(kv_k, kv_v, group, n_ctx), out)
        assert st == self.lib.INNERQ_OK, self.error()
        try:
            return self.lib.innerq_cache_size(out[0])
        finally:
            self.lib.innerq_context_free(out[0])

    def close(self):
        self.lib.innerq_model_free(self.m)


def types_of(kv_k, kv_v):
    return ("innerq3", "innerq2") if kv_k == "innerq" else (kv_k, kv_v)


def row_bytes(t, n):
    blck, size = GGML_QUANT_SIZES[PLAIN[t]]
    return n // blck * size


def expected_per_token(m, kv_k, kv_v, group, vscale=False, layer_bits=None) -> float:
    """Bytes one more token takes in all layers (quantized: in the quantized region; layer_bits:
    each layer's (keys, values) bits instead of the types')."""
    tk, tv = types_of(kv_k, kv_v)
    if tk in PLAIN:
        return m.n_layer * m.n_kv * (row_bytes(tk, m.head_dim) + row_bytes(tv, m.head_dim))
    g = group or 64
    extra = 1 if vscale and not tk.startswith("kivi") else 0  # InnerQ with value row scales: a byte
    bits = layer_bits or [(BITS[tk], BITS[tv])] * m.n_layer
    return sum(m.n_kv * (m.head_dim * (k + 32 / g + v + 32 / g) / 8 + extra) for k, v in bits)


def preset_bits(n_layer, units):
    """The preset's order (docs/INNERQ.md): from K2/V2, keys to 3 and 4, values to 3, keys to 5,
    values to 4 and 5, each step over layers spread evenly where the units cover only e of them."""
    bits = [[2, 2] for _ in range(n_layer)]
    extra = units - 4 * n_layer
    for tensor, b in ((0, 3), (0, 4), (1, 3), (0, 5), (1, 4), (1, 5)):
        e = min(extra, n_layer)
        for i in range(max(e, 0)):
            bits[(2 * i + 1) * n_layer // (2 * e)][tensor] = b
        extra -= max(e, 0)
    return [tuple(x) for x in bits]


def preset_layout(m, group, n_ctx, vscale=False, gpu=False):
    """The preset's layers' bits at n_ctx: the most units of preset_bits whose cache (S 32, R 96)
    takes no more bytes than K3/V2 with the rule's windows (on the device's group and alignment)."""
    g = group or (32 if gpu else 64)
    sink, recent = windows_of("iq", n_ctx, vscale)
    budget = layout_bytes(m, g, n_ctx, None, sink, recent, vscale, gpu)
    for units in range(10 * m.n_layer, 5 * m.n_layer, -1):
        bits = preset_bits(m.n_layer, units)
        if layout_bytes(m, g, n_ctx, bits, 32, 96, vscale, gpu) <= budget:
            return bits
    return preset_bits(m.n_layer, 5 * m.n_layer)


def layout_bytes(m, group, n_ctx, bits, sink, recent, vscale=False, gpu=False) -> int:
    """innerq_kv_memory_of's bytes of an InnerQ cache of the layers' bits (None: K3/V2), windows given."""
    p = m.params("innerq", "innerq", group, n_ctx, vscale=1 if vscale else -1)
    p.kv_sink, p.kv_recent = sink, recent
    if bits is not None:
        spec = m.ffi.new("char[]", ",".join(f"{il}:{k}:{v}" for il, (k, v) in enumerate(bits)).encode())
        p.kv_layer_bits = spec
    out = m.ffi.new("innerq_kv_memory *")
    device = m.lib.INNERQ_DEVICE_GPU if gpu else m.lib.INNERQ_DEVICE_CPU
    assert m.lib.innerq_kv_memory_of(m.m, p, device, out) == m.lib.INNERQ_OK, m.error()
    return out.bytes


def expected_cache(m, kv_k, kv_v, group, n_ctx, vscale=False) -> tuple[float, int]:
    """(bytes without padding, the most padding allowed)."""
    tk, _ = types_of(kv_k, kv_v)
    if tk in PLAIN:
        per_token = expected_per_token(m, kv_k, kv_v, group, vscale)
        page = min(256, -(-n_ctx // 64) * 64)
        pages = -(-n_ctx // page)
        return pages * page * per_token + 4 * pages, m.n_layer * 2 * ALIGN + ALIGN
    g = group or 64
    if kv_k == "innerq" and not vscale and n_ctx <= 32 + 96:
        # the preset at a context its windows hold whole (no block is ever flushed): the f16 cache
        return expected_cache(m, "f16", "f16", group, n_ctx)
    sink, recent = windows_of("kivi" if tk.startswith("kivi") else "iq", n_ctx, vscale)
    layer_bits = None
    if kv_k == "innerq":  # the preset: its own windows and layers
        layer_bits, sink, recent = preset_layout(m, group, n_ctx, vscale), 32, 96
    per_token = expected_per_token(m, kv_k, kv_v, group, vscale, layer_bits)
    hd = m.n_kv * m.head_dim
    windows = hd * 4 + 2 * hd * sink * 2 + 2 * hd * (recent + g) * 2
    blocks = max(0, (n_ctx - sink - recent) // g)
    # InnerQ: the rotation matrix, f32 head_dim x head_dim (docs/INNERQ.md)
    rot = 4 * m.head_dim ** 2 if not tk.startswith("kivi") and m.head_dim & (m.head_dim - 1) == 0 else 0
    table = 4 * max(blocks, 1)
    return m.n_layer * windows + blocks * g * per_token + rot + table, m.n_layer * (7 + 1) * ALIGN + 2 * ALIGN


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, api):
    root = tmp_path_factory.mktemp("kvmem")
    made = {}
    for hd in (64, 128):
        cfg = TinyConfig(head_dim=hd, n_head=4, n_head_kv=2, n_layer=2, seed=hd)
        made[hd] = Model(api, tiny_model.write_tiny_model(root / f"hd{hd}.gguf", cfg))
    yield made
    for m in made.values():
        m.close()


@pytest.fixture(scope="module")
def smol(api, smollm2):
    m = Model(api, smollm2)
    yield m
    m.close()


def check(m, kv_k, kv_v, group, n_ctxs):
    assert m.bytes_per_token(kv_k, kv_v, group) == pytest.approx(expected_per_token(m, kv_k, kv_v, group))
    for n_ctx in n_ctxs:
        size = m.cache_size(kv_k, kv_v, group, n_ctx)
        want, slack = expected_cache(m, kv_k, kv_v, group, n_ctx)
        assert want <= size <= want + slack, (kv_k, kv_v, group, n_ctx, size, want)


@pytest.mark.parametrize("kv_k,kv_v,group", PARAMS)
def test_tiny_model(tiny, kv_k, kv_v, group):
    # n_ctx below S + R (no blocks), not a multiple of G, and a round one
    hd = 128 if group == 128 else 64
    check(tiny[hd], kv_k, kv_v, group, [100, 1000, 4096])


@pytest.mark.parametrize("kv_k,kv_v,group", [p for p in PARAMS if p[2] != 128])
def test_smollm2(smol, kv_k, kv_v, group):
    check(smol, kv_k, kv_v, group, [8192])


def test_group_larger_than_head_dim_is_refused(tiny):
    m = tiny[64]  # InnerQ key groups run along D: G = 128 does not divide D = 64
    out = m.ffi.new("innerq_context **")
    st = m.lib.innerq_context_init(m.m, m.params("innerq3", "innerq2", 128, 512), out)
    assert st == m.lib.INNERQ_ERR_UNSUPPORTED and out[0] == m.ffi.NULL
    assert "group" in m.error()


def test_innerq_is_the_smallest_useful_cache(smol):
    """The reason for the cache: at 8K tokens InnerQ (K3 V2, G 64) takes about a quarter of f16:
    3 of 16 bits per element in the quantized region, and the f16 windows, which by default grow
    with n_ctx (S 128 + R 512 + G 64 tokens at 8192: 0.26 of f16 in all; docs/INNERQ.md)."""
    f16 = smol.cache_size("f16", "f16", 0, 8192)
    iq = smol.cache_size("innerq", "innerq", 64, 8192)
    assert iq < 0.27 * f16


def memory_of(m, kv_k, kv_v, group, n_ctx, gpu=False, kv_bits=0.0):
    """innerq_kv_memory_of: the figure computed without a cache."""
    p = m.params(kv_k, kv_v, group, n_ctx)
    p.kv_bits = kv_bits
    out = m.ffi.new("innerq_kv_memory *")
    device = m.lib.INNERQ_DEVICE_GPU if gpu else m.lib.INNERQ_DEVICE_CPU
    assert m.lib.innerq_kv_memory_of(m.m, p, device, out) == m.lib.INNERQ_OK, m.error()
    return out


def allocated(m, kv_k, kv_v, group, n_ctx, kv_bits=0.0, vscale=-1):
    """(innerq_cache_size, innerq_context_kv_memory) of a real context."""
    p = m.params(kv_k, kv_v, group, n_ctx, vscale)
    p.kv_bits = kv_bits
    ctx = m.ffi.new("innerq_context **")
    assert m.lib.innerq_context_init(m.m, p, ctx) == m.lib.INNERQ_OK, m.error()
    try:
        mem = m.ffi.new("innerq_kv_memory *")
        assert m.lib.innerq_context_kv_memory(ctx[0], mem) == m.lib.INNERQ_OK
        return m.lib.innerq_cache_size(ctx[0]), mem
    finally:
        m.lib.innerq_context_free(ctx[0])


@pytest.mark.parametrize("kv_k,kv_v,group,kv_bits", [("innerq", "innerq", 64, 0.0), ("innerq", "innerq", 32, 0.0),
                                                     ("innerq4", "innerq4", 64, 0.0), ("f16", "f16", 0, 0.0),
                                                     ("q4_0", "q4_0", 0, 0.0), ("kivi2", "kivi2", 32, 0.0),
                                                     ("innerq", "innerq", 64, 4.5), ("innerq", "innerq", 32, 5.0)])
def test_memory_is_the_allocation(smol, kv_k, kv_v, group, kv_bits):
    """The figure computed from the configuration is the buffer a context allocates, and its
    effective bits are those bytes over the keys and values of n_ctx tokens."""
    m = smol
    for n_ctx in (200, 1000, 4096, 8192) if kv_bits == 0.0 else (4096, 8192):  # kv_bits: budgets the windows leave room in
        fig = memory_of(m, kv_k, kv_v, group, n_ctx, kv_bits=kv_bits)
        size, ctx_fig = allocated(m, kv_k, kv_v, group, n_ctx, kv_bits)
        assert fig.bytes == size == ctx_fig.bytes, (kv_k, group, n_ctx)
        assert fig.n_ctx == n_ctx and ctx_fig.bits == fig.bits
        elements = 2 * n_ctx * m.n_layer * m.n_kv * m.head_dim
        assert fig.bits == pytest.approx(8 * size / elements)
        if kv_bits == 0.0:
            want, slack = expected_cache(m, kv_k, kv_v, group, n_ctx)
            assert want <= fig.bytes <= want + slack


def test_memory_on_the_gpu_is_its_layout(smol):
    """gpu: the GPU's group (32) and alignment (256 bytes), computed on any machine. Its preset
    is the CPU's rule on them: the bytes of K3/V2 with the rule's windows, spent with the windows
    at S 32, R 96 (preset_layout); K3/V2 up to n_ctx 1536, where that layout allocated on the CPU
    (the types named) differs by its alignment's padding only."""
    m = smol
    for n_ctx in (1000, 8192, 32768):
        gpu = memory_of(m, "innerq", "innerq", 0, n_ctx, gpu=True)
        assert gpu.group == 32 and (gpu.n_sink, gpu.n_recent) == (32, 96)
        bits = preset_layout(m, 32, n_ctx, gpu=True)
        assert gpu.bytes == layout_bytes(m, 32, n_ctx, bits, 32, 96, gpu=True)
        assert gpu.bytes <= layout_bytes(m, 32, n_ctx, None, *windows_of("iq", n_ctx), gpu=True)
        assert (bits == [(3, 2)] * m.n_layer) == (n_ctx <= 1536)
        if n_ctx <= 1536:
            size, _ = allocated(m, "innerq3", "innerq2", 32, n_ctx, vscale=0)
            want, _ = expected_cache(m, "innerq3", "innerq2", 32, n_ctx, vscale=False)
            assert want <= size <= gpu.bytes <= want + m.n_layer * 8 * 256 + 2 * 256
        assert memory_of(m, "innerq", "innerq", 0, n_ctx).group == 64


def test_python_faces(api, smollm2):
    """Llama.kv_memory is the context's cache; Model.kv_memory computes either device's."""
    from innerq import Llama
    from innerq.gguf_model import Model as GgufModel

    with Llama(str(smollm2), n_ctx=1000, n_threads=1) as llm:
        mem = llm.kv_memory
        assert mem["bytes"] == api[1].innerq_cache_size(llm.ctx) and mem["n_ctx"] == 1000
        assert mem["bits"] == pytest.approx(8 * mem["bytes"] / (2 * 1000 * 30 * 3 * 64))
    with GgufModel(smollm2) as m:
        assert m.kv_memory(n_ctx=1000) == mem
        gpu = m.kv_memory("innerq", "innerq", gpu=True, n_ctx=1000)
        cpu32 = m.kv_memory("innerq", "innerq", n_ctx=1000, kv_group=32, kv_value_scales=0)
        assert gpu["group"] == 32 and gpu["bits"] == pytest.approx(cpu32["bits"], rel=1e-3)


@pytest.mark.parametrize("n_ctx", [32768, 65536, 131072])
def test_default_preset_at_long_contexts(smol, n_ctx):
    """The default windows stop growing at S 128, R 512 (n_ctx 8192), with value row scales at
    S 64, R 448: from 32K on K3/V2 with them, which is the preset's memory, takes at most 3.3
    effective bits per element on the CPU (G 64, with or without the scales) and 3.8 on the GPU
    (G 32), windows included; the windows' rule alone (S n_ctx/64, R n_ctx/16) would take 4.0 and
    4.5. The preset keeps S 32, R 96 and spends the rest on code bits, on either device."""
    cpu = memory_of(smol, "innerq", "innerq", 0, n_ctx)
    gpu = memory_of(smol, "innerq", "innerq", 0, n_ctx, gpu=True)
    assert (cpu.n_sink, cpu.n_recent, cpu.group, gpu.n_sink, gpu.n_recent, gpu.group) == (32, 96, 64, 32, 96, 32)
    assert cpu.bytes <= layout_bytes(smol, 64, n_ctx, None, 128, 512) and cpu.quant_bits > 3.0
    assert gpu.bytes <= layout_bytes(smol, 32, n_ctx, None, 128, 512, gpu=True) and gpu.quant_bits > 3.5
    p = smol.params("innerq", "innerq", 0, n_ctx, vscale=1)
    scaled = smol.ffi.new("innerq_kv_memory *")
    assert smol.lib.innerq_kv_memory_of(smol.m, p, smol.lib.INNERQ_DEVICE_CPU, scaled) == smol.lib.INNERQ_OK
    assert (scaled.n_sink, scaled.n_recent) == (32, 96) and scaled.bits <= 3.3, scaled.bits
    assert scaled.bytes <= layout_bytes(smol, 64, n_ctx, None, 64, 448, vscale=True)
    assert cpu.bits <= 3.3 and gpu.bits <= 3.8, (cpu.bits, gpu.bits)
    rule = smol.params("innerq", "innerq", 64, n_ctx)
    rule.kv_sink, rule.kv_recent = n_ctx // 64, n_ctx // 16
    out = smol.ffi.new("innerq_kv_memory *")
    assert smol.lib.innerq_kv_memory_of(smol.m, rule, smol.lib.INNERQ_DEVICE_CPU, out) == smol.lib.INNERQ_OK
    assert out.bits > 4.0


def test_device_type_picks_the_defaults(tiny):
    """The device type names whose defaults apply: the GPU's own cache where none is named (f16),
    the CPU's InnerQ preset; a value that is no innerq_device_type is an error."""
    m = tiny[64]
    assert memory_of(m, None, None, 0, 256, gpu=True).quant_bits == 0
    assert memory_of(m, None, None, 0, 256).quant_bits > 0
    out = m.ffi.new("innerq_kv_memory *")
    assert m.lib.innerq_kv_memory_of(m.m, m.params(None, None, 0, 256), 7, out) == m.lib.INNERQ_ERR_INVALID_ARGUMENT
    assert "innerq_kv_memory_of: device type 7" in m.error()


def priced_and_allocated(m, p):
    """innerq_kv_memory_of's figure for p on the CPU, checked against the cache a context of p allocates."""
    mem = m.ffi.new("innerq_kv_memory *")
    assert m.lib.innerq_kv_memory_of(m.m, p, m.lib.INNERQ_DEVICE_CPU, mem) == m.lib.INNERQ_OK, m.error()
    ctx = m.ffi.new("innerq_context **")
    assert m.lib.innerq_context_init(m.m, p, ctx) == m.lib.INNERQ_OK, m.error()
    try:
        assert m.lib.innerq_cache_size(ctx[0]) == mem.bytes
    finally:
        m.lib.innerq_context_free(ctx[0])
    return mem


@pytest.mark.parametrize("kv_bits", [0.0, 3.5])
def test_8_bit_group_parameters_take_their_bytes(tiny, kv_bits):
    """With kv_params8 a block's (d, m) take a byte each per group and its references 8 bytes:
    per token and KV head D (b_k + b_v) / 8 + 4 D / G + 16 / G bytes in the quantized region, what
    innerq_kv_bytes_per_token says; a context allocates what innerq_kv_memory_of prices; and a
    kv_bits budget gives the freed bytes to codes (both within it, more code bits with them)."""
    m, G, n_ctx = tiny[64], 64, 4096
    D = m.head_dim
    if kv_bits == 0.0:
        out = m.ffi.new("double *")
        assert m.lib.innerq_kv_bytes_per_token(m.m, m.params("innerq", "innerq", G, p8=1), out) == m.lib.INNERQ_OK
        want = m.n_layer * m.n_kv * (D * (3 + 2) / 8 + 4 * D / G + 16 / G)  # fp16 (d, m): 8 D / G
        assert out[0] == pytest.approx(want)
        assert out[0] < m.bytes_per_token("innerq", "innerq", G)
    fig = {}
    for p8 in (0, 1):
        p = m.params("innerq", "innerq", G, n_ctx, -1, p8)
        p.kv_bits, p.kv_sink, p.kv_recent = kv_bits, 16, 64
        mem = priced_and_allocated(m, p)
        fig[p8] = (mem.bytes, mem.bits, mem.quant_bits)
    if kv_bits == 0.0:  # the same codes in fewer bytes: 0.25 bits less per quantized element, less the references
        assert fig[1][0] < fig[0][0]
        assert fig[0][2] - fig[1][2] == pytest.approx(16 / G - 64 / (G * D), abs=1e-3)
    else:  # the same budget, each within it, and the freed bytes on codes
        assert fig[0][1] <= kv_bits + 1e-6 and fig[1][1] <= kv_bits + 1e-6
        assert fig[1][2] - 16 / G - 64 / (G * D) > fig[0][2] - 32 / G + 0.1


def test_key_levels_take_no_bytes_and_need_the_search(tiny):
    """Keys on the key levels are the same codes and (d, m) bytes: the priced memory and what a
    context allocates are the uniform grid's, with and without a kv_bits budget. The levels are
    the searched quantizer's grid: without kv_search (or kv_hybrid) they are an error that says so."""
    m, G, n_ctx = tiny[64], 64, 4096
    for kv_bits in (0.0, 3.5):
        fig = {}
        for lv in (0, 1):
            p = m.params("innerq", "innerq", G, n_ctx, 1, 1)
            p.kv_key_levels, p.kv_bits, p.kv_sink, p.kv_recent = lv, kv_bits, 16, 64
            mem = priced_and_allocated(m, p)
            fig[lv] = (mem.bytes, mem.bits, mem.quant_bits)
        assert fig[0] == fig[1]
    for field in ("kv_search", "kv_hybrid"):
        p = m.params("innerq", "innerq", G, n_ctx)
        p.kv_key_levels = 1
        setattr(p, field, False)
        ctx = m.ffi.new("innerq_context **")
        assert m.lib.innerq_context_init(m.m, p, ctx) == m.lib.INNERQ_ERR_INVALID_ARGUMENT
        assert "kv_key_levels" in m.error() and "kv_search" in m.error()
    p = m.params("innerq", "innerq", G, n_ctx)
    p.kv_key_levels = 2
    assert m.lib.innerq_context_init(m.m, p, m.ffi.new("innerq_context **")) == m.lib.INNERQ_ERR_INVALID_ARGUMENT
    assert "kv_key_levels = 2 is out of range" in m.error()


def test_layer_bits_count_in_the_bytes_per_token(tiny):
    """kv_layer_bits' layers take their own bits: innerq_kv_bytes_per_token and the memory figure's
    quantized-region bits count them (not the types'), and a context allocates what is priced."""
    m, G, n_ctx = tiny[64], 64, 4096
    D = m.head_dim
    bits = [(4, 3), (5, 2)][:m.n_layer]
    spec = m.ffi.new("char[]", ",".join(f"{il}:{k}:{v}" for il, (k, v) in enumerate(bits)).encode())
    p = m.params("innerq", "innerq", G, n_ctx)
    p.kv_layer_bits = spec
    out = m.ffi.new("double *")
    assert m.lib.innerq_kv_bytes_per_token(m.m, p, out) == m.lib.INNERQ_OK, m.error()
    want = sum(m.n_kv * D * (k + 32 / G + v + 32 / G) / 8 for k, v in bits)
    assert out[0] == pytest.approx(want)
    mem = priced_and_allocated(m, p)
    assert mem.quant_bits == pytest.approx(sum(k + v + 64 / G for k, v in bits) / (2 * len(bits)))


def layers_and_memory(m, p):
    """A context of p: its layers' (bits_k, bits_v) (innerq_cache_layer_info) and its memory."""
    ctx = m.ffi.new("innerq_context **")
    assert m.lib.innerq_context_init(m.m, p, ctx) == m.lib.INNERQ_OK, m.error()
    try:
        info = m.ffi.new("innerq_kv_layer_info *")
        got = []
        for il in range(m.n_layer):
            assert m.lib.innerq_cache_layer_info(ctx[0], il, info) == m.lib.INNERQ_OK
            got.append((info.bits_k, info.bits_v))
        mem = m.ffi.new("innerq_kv_memory *")
        assert m.lib.innerq_context_kv_memory(ctx[0], mem) == m.lib.INNERQ_OK
    finally:
        m.lib.innerq_context_free(ctx[0])
    return got, mem


@pytest.mark.parametrize("n_ctx,n_seq", [(1024, 1), (4096, 1), (8192, 1), (32768, 1), (16384, 4)])
def test_preset_layers_follow_the_rule(smol, n_ctx, n_seq):
    """The CPU preset's layers (innerq_cache_layer_info) are preset_layout's, worked out here
    from the rule: K3/V2 while its windows are at their floors (n_ctx 1536 and less), more bits
    where the rule's windows leave bytes, within K3/V2's bytes with them; a pool of sequences
    (the rule's windows per sequence: n_ctx / n_seq_max) the same way."""
    m = smol
    want = preset_layout(m, 64, n_ctx // n_seq) if n_seq == 1 else None
    p = m.params(None, None, 0, n_ctx)
    p.n_seq_max = n_seq
    got, mem = layers_and_memory(m, p)
    assert (mem.n_sink, mem.n_recent) == (32, 96)
    if n_seq == 1:
        assert got == want
        assert (got == [(3, 2)] * m.n_layer) == (n_ctx <= 1536)
    else:  # 4 sequences of 4096: K3/V2 with S 64, R 256 each is the budget
        rule = m.params("innerq", "innerq", 64, n_ctx)
        rule.n_seq_max, rule.kv_sink, rule.kv_recent = n_seq, 64, 256
        out = m.ffi.new("innerq_kv_memory *")
        assert m.lib.innerq_kv_memory_of(m.m, rule, m.lib.INNERQ_DEVICE_CPU, out) == m.lib.INNERQ_OK, m.error()
        assert mem.bytes <= out.bytes and got.count((4, 2)) + got.count((4, 3)) == m.n_layer


@pytest.mark.parametrize("kv_bits", [3.5, 4.27])
def test_kv_bits_in_a_pool_fills_the_budget_in_the_preset_order(smol, kv_bits):
    """kv_bits with n_seq_max > 1 (no one prompt to choose from): the layers of the preset's
    order with the most code bits whose cache takes at most kv_bits effective bits per element at
    n_ctx, the windows the configuration's; a budget that 2-bit keys and values with the windows
    exceed is a clear error."""
    m, n_ctx, n_seq = smol, 16384, 4
    p = m.params(None, None, 0, n_ctx)
    p.n_seq_max, p.kv_bits, p.kv_sink, p.kv_recent = n_seq, kv_bits, 32, 96
    got, mem = layers_and_memory(m, p)
    assert mem.bits <= kv_bits and (mem.n_sink, mem.n_recent) == (32, 96)

    def pool_bytes(bits):
        q = m.params("innerq", "innerq", 64, n_ctx)
        q.n_seq_max, q.kv_sink, q.kv_recent = n_seq, 32, 96
        spec = m.ffi.new("char[]", ",".join(f"{il}:{k}:{v}" for il, (k, v) in enumerate(bits)).encode())
        q.kv_layer_bits = spec
        out = m.ffi.new("innerq_kv_memory *")
        assert m.lib.innerq_kv_memory_of(m.m, q, m.lib.INNERQ_DEVICE_CPU, out) == m.lib.INNERQ_OK, m.error()
        return out.bytes

    budget = kv_bits * 2 * n_ctx * m.n_layer * m.n_kv * m.head_dim / 8
    units = next(u for u in range(10 * m.n_layer, 4 * m.n_layer - 1, -1) if pool_bytes(preset_bits(m.n_layer, u)) <= budget)
    assert got == preset_bits(m.n_layer, units) and pool_bytes(got) == mem.bytes
    p.kv_bits = 3.0
    ctx = m.ffi.new("innerq_context **")
    assert m.lib.innerq_context_init(m.m, p, ctx) == m.lib.INNERQ_ERR_INVALID_ARGUMENT
    assert "kv_bits 3 cannot be met" in m.error() and "4 sequences" in m.error()


@pytest.mark.parametrize("gpu", [False, True])
def test_preset_held_whole_by_its_windows_is_the_f16_cache(smol, gpu):
    """A sequence the preset's windows (S 32, R 96) hold whole never flushes a block: the preset
    is then the f16 cache (its bytes, no quantized region), from one token more InnerQ; a type or
    an option of the caller's keeps InnerQ. (The GPU's default cache is f16 at any size.)"""
    m, g = smol, 32 if gpu else 64
    for kv in (None, "innerq") if not gpu else ("innerq",):
        for n_ctx in (1, 100, 128):
            mem, f16 = memory_of(m, kv, kv, 0, n_ctx, gpu=gpu), memory_of(m, "f16", "f16", 0, n_ctx, gpu=gpu)
            assert (mem.bytes, mem.quant_bits, mem.group) == (f16.bytes, 0.0, 0), (kv, n_ctx)
        mem = memory_of(m, kv, kv, 0, 129, gpu=gpu)
        assert mem.quant_bits > 0 and mem.group == g and (mem.n_sink, mem.n_recent) == (32, 96)
    assert memory_of(m, "innerq3", "innerq2", 0, 100, gpu=gpu).quant_bits > 0
    # a pool: the windows are one sequence's
    out = m.ffi.new("innerq_kv_memory *")
    device = m.lib.INNERQ_DEVICE_GPU if gpu else m.lib.INNERQ_DEVICE_CPU
    got = []
    for kv in ("innerq", "f16"):
        p = m.params(kv, kv, 0, 4 * 128)
        p.n_seq_max = 4
        assert m.lib.innerq_kv_memory_of(m.m, p, device, out) == m.lib.INNERQ_OK, m.error()
        got.append((out.bytes, out.quant_bits))
    assert got[0] == got[1] and got[0][1] == 0.0
    p = m.params("innerq", "innerq", 0, 4 * 128, vscale=1)  # an option of the caller's
    p.n_seq_max = 4
    assert m.lib.innerq_kv_memory_of(m.m, p, device, out) == m.lib.INNERQ_OK, m.error()
    assert out.quant_bits > 0
