"""The tensor library and the CPU backend, op by op, against numpy oracles.

Each test builds a small graph in an iq_context (ggml_innerq/iq.h), places it with the graph
allocator (iq-alloc.h), computes it on the CPU backend with 1 and 2 threads and compares with
numpy written from the op's definition. Quantized data is made and read back with gguf.quants,
the independent implementation of ggml's block formats. Vector kernels are checked on every
instruction set the machine has (the scalar kernels are the specification).
"""
from __future__ import annotations

import cffi
import gguf
import numpy as np
import pytest

from conftest import ISA_LEVELS, isa_levels, lib_path

CDEF = """
struct iq_tensor {
    int type; int op;
    int64_t ne[4]; size_t nb[4];
    struct iq_tensor * src[12];
    int32_t op_params[16];
    struct iq_tensor * view_src;
    size_t view_offs;
    void * data;
    void * buffer;
    int32_t flags;
    char name[64];
};
struct iq_cgraph { int n_nodes, max_nodes; struct iq_tensor ** nodes; int n_leafs; struct iq_tensor ** leafs; };
struct iq_qcache_config { int32_t bits_k, bits_v; int axis_k, axis_v; int32_t group, n_sink, n_recent; int mode;
                          bool key_norm; bool score_correction; int32_t rope_dims; bool value_scales; };
struct iq_kv_layer { int type_k, type_v; int32_t head_dim, n_kv_head, n_ctx, page, n_pages, n_slots, window;
                     struct iq_tensor * k; struct iq_tensor * v; struct iq_qcache_config qcfg;
                     struct iq_tensor * region[7]; };
struct iq_cpu_type_traits { int vec_dot_type; void * from_float; void * vec_dot; void * to_float; };

struct iq_context * iq_context_init(size_t mem_size);
void iq_context_free(struct iq_context * ctx);
struct iq_tensor * iq_new_tensor(struct iq_context * ctx, int type, int n_dims, const int64_t * ne);
struct iq_tensor * iq_new_tensor_1d(struct iq_context * ctx, int type, int64_t ne0);
struct iq_tensor * iq_new_tensor_2d(struct iq_context * ctx, int type, int64_t ne0, int64_t ne1);
struct iq_tensor * iq_new_tensor_3d(struct iq_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2);
size_t iq_nbytes(const struct iq_tensor * t);
void iq_set_input(struct iq_tensor * t);
void iq_set_output(struct iq_tensor * t);
struct iq_tensor * iq_reshape_2d(struct iq_context * ctx, struct iq_tensor * a, int64_t ne0, int64_t ne1);
struct iq_tensor * iq_reshape_3d(struct iq_context * ctx, struct iq_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2);
struct iq_tensor * iq_view_rows(struct iq_context * ctx, struct iq_tensor * a, int64_t i0, int64_t n);
struct iq_tensor * iq_get_rows(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * ids);
struct iq_tensor * iq_rms_norm(struct iq_context * ctx, struct iq_tensor * a, float eps);
struct iq_tensor * iq_mul(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * b);
struct iq_tensor * iq_add(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * b);
struct iq_tensor * iq_mul_mat(struct iq_context * ctx, struct iq_tensor * w, struct iq_tensor * x);
struct iq_tensor * iq_swiglu(struct iq_context * ctx, struct iq_tensor * gate, struct iq_tensor * up);
struct iq_tensor * iq_geglu(struct iq_context * ctx, struct iq_tensor * gate, struct iq_tensor * up);
struct iq_tensor * iq_rope(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * pos,
                           struct iq_tensor * freq_factors, int n_rot, float freq_base, float mscale);
struct iq_tensor * iq_attention(struct iq_context * ctx, struct iq_tensor * q, struct iq_tensor * k,
                                struct iq_tensor * v, const struct iq_kv_layer * layer, struct iq_tensor * seqs,
                                struct iq_tensor * pages, float scale);
struct iq_tensor * iq_kv_store(struct iq_context * ctx, struct iq_tensor * after, struct iq_tensor * k,
                               struct iq_tensor * v, const struct iq_kv_layer * layer, struct iq_tensor * seqs,
                               struct iq_tensor * pages);
struct iq_cgraph * iq_new_graph(struct iq_context * ctx, int max_nodes);
bool iq_graph_expand(struct iq_cgraph * g, struct iq_tensor * t);
const char * iq_error_get(void);

typedef struct iq_backend iq_backend;
typedef struct iq_buffer iq_buffer;
typedef struct iq_gallocr iq_gallocr;
iq_backend * iq_backend_cpu_init(int n_threads);
void iq_backend_free(iq_backend * be);
void iq_backend_cpu_set_n_threads(iq_backend * be, int n_threads);
int iq_backend_graph_compute(iq_backend * be, struct iq_cgraph * g);
iq_buffer * iq_backend_alloc_buffer(iq_backend * be, size_t size);
void iq_buffer_free(iq_buffer * buf);
void iq_tensor_place(struct iq_tensor * t, iq_buffer * buf, size_t offset);
void iq_tensor_set(struct iq_tensor * t, const void * data, size_t offset, size_t size);
void iq_tensor_get(const struct iq_tensor * t, void * data, size_t offset, size_t size);
iq_gallocr * iq_gallocr_new(iq_backend * be);
void iq_gallocr_free(iq_gallocr * ga);
bool iq_gallocr_alloc_graph(iq_gallocr * ga, struct iq_cgraph * g);
size_t iq_gallocr_buffer_size(const iq_gallocr * ga);

unsigned iq_cpu_features_detect(void);
unsigned iq_cpu_features_active(void);
bool iq_cpu_features_set(unsigned f);
const struct iq_cpu_type_traits * iq_cpu_traits(int type);
"""

Q = gguf.GGMLQuantizationType
F32, F16, Q8_0, Q4_0, Q4_1, I32 = 0, 1, 8, 2, 3, 26


@pytest.fixture(scope="module")
def api():
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    return ffi, ffi.dlopen(lib_path())


@pytest.fixture(scope="module", params=[1, 2], ids=["t1", "t2"])
def backend(request, api):
    ffi, lib = api
    be = lib.iq_backend_cpu_init(request.param)
    assert be != ffi.NULL
    yield be
    lib.iq_backend_free(be)


@pytest.fixture(params=list(ISA_LEVELS))
def isa(request, api):
    """Runs the test with the kernels of one INNERQ_ISA level, if the machine has it."""
    ffi, lib = api
    levels = dict(isa_levels(lib.iq_cpu_features_detect()))
    if request.param not in levels:
        pytest.skip(f"no {request.param} on this machine")
    before = lib.iq_cpu_features_active()
    assert lib.iq_cpu_features_set(levels[request.param])
    yield request.param
    lib.iq_cpu_features_set(before)


def error(api) -> str:
    ffi, lib = api
    return ffi.string(lib.iq_error_get()).decode()


class Graph:
    """A context, the tensors made in it, and a run on a backend."""

    def __init__(self, api, mem=1 << 20):
        self.ffi, self.lib = api
        self.ctx = self.lib.iq_context_init(mem)
        self.inputs = []   # (tensor, bytes) set after allocation
        self.keep = []     # cffi objects that must outlive the graph

    def close(self):
        self.lib.iq_context_free(self.ctx)

    def input(self, arr: np.ndarray, type_=None, shape=None):
        """A new input tensor holding arr (f32 / i32) or raw block bytes of `type_`."""
        if type_ is None:
            type_ = {np.dtype(np.float32): F32, np.dtype(np.int32): I32}[arr.dtype]
        ne = list(reversed(arr.shape)) if shape is None else list(shape)
        new = [None, self.lib.iq_new_tensor_1d, self.lib.iq_new_tensor_2d, self.lib.iq_new_tensor_3d][len(ne)]
        t = new(self.ctx, type_, *ne)
        assert t != self.ffi.NULL, error((self.ffi, self.lib))
        self.lib.iq_set_input(t)
        self.inputs.append((t, np.ascontiguousarray(arr).tobytes()))
        return t

    def compute(self, be, out, ga=None):
        """Allocates, sets the inputs, runs; returns out's data as f32 in numpy order."""
        return self.compute_all(be, [out], ga)[0]

    def compute_all(self, be, outs, ga=None):
        """The same for several outputs (in this order in the graph, each kept for the host)."""
        g = self.lib.iq_new_graph(self.ctx, 256)
        for out in outs:
            if len(outs) > 1:
                self.lib.iq_set_output(out)
            assert self.lib.iq_graph_expand(g, out), error((self.ffi, self.lib))
        own = ga is None
        ga = self.lib.iq_gallocr_new(be) if own else ga
        try:
            assert self.lib.iq_gallocr_alloc_graph(ga, g), error((self.ffi, self.lib))
            for t, data in self.inputs:
                assert self.lib.iq_nbytes(t) == len(data)
                self.lib.iq_tensor_set(t, data, 0, len(data))
            assert self.lib.iq_backend_graph_compute(be, g) == 0, error((self.ffi, self.lib))
            return [read_f32(self.ffi, self.lib, out) for out in outs]
        finally:
            if own:
                self.lib.iq_gallocr_free(ga)


def kv_rows(rng, nt, n_kv, hd):
    """k and v of nt tokens (in this order from rng): [nt, n_kv, hd] f32 each."""
    return tuple(rng.standard_normal((nt, n_kv, hd)).astype(np.float32) for _ in range(2))


def read_f32(ffi, lib, t) -> np.ndarray:
    n = lib.iq_nbytes(t)
    buf = ffi.new("char[]", n)
    lib.iq_tensor_get(t, buf, 0, n)
    shape = [t.ne[i] for i in range(4)]
    while len(shape) > 1 and shape[-1] == 1:
        shape.pop()
    return np.frombuffer(ffi.buffer(buf), dtype=np.float32).reshape(list(reversed(shape))).copy()


@pytest.fixture
def graph(api):
    g = Graph(api)
    yield g
    g.close()


def quant(x: np.ndarray, type_: int) -> tuple[np.ndarray, np.ndarray]:
    """(bytes of x in `type_`, x as those bytes read back), rows along the last axis."""
    x = x.astype(np.float32)
    if type_ == F32:
        return x, x
    raw = gguf.quants.quantize(x, Q(type_))
    return raw, gguf.quants.dequantize(raw, Q(type_)).astype(np.float32)


# ---- construction ----


def test_bad_shapes_return_null_with_a_message(api, graph):
    ffi, lib = api
    a = lib.iq_new_tensor_2d(graph.ctx, F32, 8, 3)
    b = lib.iq_new_tensor_2d(graph.ctx, F32, 4, 3)
    assert lib.iq_add(graph.ctx, a, b) == ffi.NULL and "add" in error(api)
    assert lib.iq_mul(graph.ctx, a, b) == ffi.NULL and "broadcast" in error(api)
    assert lib.iq_mul_mat(graph.ctx, a, b) == ffi.NULL and "mul_mat" in error(api)
    assert lib.iq_reshape_2d(graph.ctx, a, 5, 5) == ffi.NULL and "reshape" in error(api)
    assert lib.iq_view_rows(graph.ctx, a, 2, 2) == ffi.NULL
    assert lib.iq_new_tensor_1d(graph.ctx, Q4_0, 33) == ffi.NULL and "block" in error(api)
    assert lib.iq_get_rows(graph.ctx, a, b) == ffi.NULL  # ids must be i32
    assert lib.iq_rms_norm(graph.ctx, ffi.NULL, 1e-5) == ffi.NULL
    assert lib.iq_add(graph.ctx, a, ffi.NULL) == ffi.NULL


def test_context_full_returns_null(api):
    ffi, lib = api
    ctx = lib.iq_context_init(1024)
    made = [lib.iq_new_tensor_1d(ctx, F32, 4) for _ in range(20)]
    assert made[0] != ffi.NULL and made[-1] == ffi.NULL
    assert "full" in error(api)
    lib.iq_context_free(ctx)


def test_graph_expand_visits_each_tensor_once(api, graph):
    ffi, lib = api
    x = lib.iq_new_tensor_1d(graph.ctx, F32, 8)
    w = lib.iq_new_tensor_1d(graph.ctx, F32, 8)
    a = lib.iq_mul(graph.ctx, x, w)
    b = lib.iq_add(graph.ctx, a, a)  # a diamond: a reached twice
    c = lib.iq_add(graph.ctx, b, a)
    g = lib.iq_new_graph(graph.ctx, 8)
    assert lib.iq_graph_expand(g, c)
    assert lib.iq_graph_expand(g, c)  # again: nothing added
    nodes = [g.nodes[i] for i in range(g.n_nodes)]
    assert nodes == [a, b, c]
    assert sorted(int(ffi.cast("uintptr_t", g.leafs[i])) for i in range(g.n_leafs)) == sorted(
        int(ffi.cast("uintptr_t", t)) for t in (x, w))
    small = lib.iq_new_graph(graph.ctx, 2)
    assert not lib.iq_graph_expand(small, c) and "graph full" in error(api)


# ---- small ops ----


@pytest.mark.parametrize("type_", [F32, F16, Q8_0, Q4_0, Q4_1])
def test_get_rows(api, graph, backend, type_):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((10, 64)).astype(np.float32)
    raw, deq = quant(table, type_)
    if type_ == F16:
        raw, deq = table.astype(np.float16), table.astype(np.float16).astype(np.float32)
    t = graph.input(raw.view(np.uint8), type_, shape=[64, 10])
    ids = np.array([3, 0, 9, 3], dtype=np.int32)
    out = graph.compute(backend, graph.lib.iq_get_rows(graph.ctx, t, graph.input(ids)))
    np.testing.assert_array_equal(out, deq[ids])


def test_get_rows_bad_id_fails(api, graph, backend):
    t = graph.input(np.zeros((4, 32), np.float32))
    out = graph.lib.iq_get_rows(graph.ctx, t, graph.input(np.array([1, 7], np.int32)))
    with pytest.raises(AssertionError, match="outside"):
        graph.compute(backend, out)


def test_rms_norm(api, graph, backend):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 576)).astype(np.float32) * 3
    out = graph.compute(backend, graph.lib.iq_rms_norm(graph.ctx, graph.input(x), 1e-5))
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["mul", "add"])
@pytest.mark.parametrize("brows", [1, 7])
def test_binary_broadcasts_rows(api, graph, backend, brows, op):
    """b's rows repeat over a's (a norm's weight, a bias)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((7, 40)).astype(np.float32)
    b = rng.standard_normal((brows, 40)).astype(np.float32)
    out = graph.compute(backend, getattr(graph.lib, f"iq_{op}")(graph.ctx, graph.input(a), graph.input(b)))
    np.testing.assert_array_equal(out, a * b if op == "mul" else a + b)


def test_add(api, graph, backend):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((2, 6, 33)).astype(np.float32)
    out = graph.compute(backend, graph.lib.iq_add(graph.ctx, graph.input(a), graph.input(b)))
    np.testing.assert_array_equal(out, a + b)



GLU_REF = {  # act(gate) * up in float64, and the absolute tolerance
    "swiglu": (lambda g: g / (1 + np.exp(-g)), 1e-30),
    "geglu": (lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))), 1e-6),  # tanh form
}


@pytest.mark.parametrize("op", GLU_REF)
def test_glu(api, graph, backend, isa, op):
    rng = np.random.default_rng(5)
    g = (rng.standard_normal((3, 100)) * 6).astype(np.float32)
    g[0, :4] = [-100.0, 100.0, 0.0, -88.0]
    u = rng.standard_normal((3, 100)).astype(np.float32)
    out = graph.compute(backend, getattr(graph.lib, f"iq_{op}")(graph.ctx, graph.input(g), graph.input(u)))
    act, atol = GLU_REF[op]
    np.testing.assert_allclose(out, act(g.astype(np.float64)) * u, rtol=1e-5, atol=atol)


# mscale: YaRN's / LongRoPE's scale of cos and sin, on the rotated channels only (Phi-4-mini's 96 of 128)
@pytest.mark.parametrize("n_rot,ff,mscale", [(64, False, 1.0), (32, False, 1.0), (64, True, 1.0), (48, True, 1.19)])
def test_rope(api, graph, backend, n_rot, ff, mscale):
    rng = np.random.default_rng(6)
    hd, nh, nt, base = 64, 3, 5, 10000.0
    x = rng.standard_normal((nt, nh, hd)).astype(np.float32)
    pos = np.array([0, 1, 17, 100, 511], dtype=np.int32)
    factors = (1.0 + rng.random(n_rot // 2) * 8).astype(np.float32)
    lib = graph.lib
    ft = graph.input(factors) if ff else graph.ffi.NULL
    out = graph.compute(backend, lib.iq_rope(graph.ctx, graph.input(x), graph.input(pos), ft, n_rot, base, mscale))
    i = np.arange(n_rot // 2)
    theta = pos[:, None].astype(np.float64) * base ** (-2.0 * i / n_rot)
    if ff:
        theta = theta / factors
    c, s = mscale * np.cos(theta)[:, None, :], mscale * np.sin(theta)[:, None, :]
    ref = x.astype(np.float64).copy()
    x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    ref[..., 0:n_rot:2] = x0 * c - x1 * s
    ref[..., 1:n_rot:2] = x0 * s + x1 * c
    # angles are formed in float as ggml does: error grows with the position
    np.testing.assert_allclose(out, ref, atol=2e-4)


# ---- mul_mat ----


def activation_as_read(api, wtype, x):
    """x as the weight type's dot product reads it (gguf's q8_0 for q8_0 / q8_1 activations)."""
    ffi, lib = api
    vdt = lib.iq_cpu_traits(wtype).vec_dot_type
    if vdt == F32:
        return x, 1e-5
    assert vdt in (Q8_0, 9), vdt  # q8_1 holds the same codes as q8_0, plus a sum
    return quant(x, Q8_0)[1], 2e-3


@pytest.mark.parametrize("type_", [F32, F16, Q8_0, Q4_0, Q4_1])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_mul_mat(api, graph, backend, type_, m):
    rng = np.random.default_rng(7)
    k, n = 256, 72
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    raw, wd = quant(w, type_)
    if type_ == F16:
        raw, wd = w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    wt = graph.input(raw.view(np.uint8) if type_ != F32 else raw, type_, shape=[k, n])
    out = graph.compute(backend, graph.lib.iq_mul_mat(graph.ctx, wt, graph.input(x))).reshape(-1, n)
    xr, tol = activation_as_read(api, type_, x)
    ref = xr.astype(np.float64) @ wd.T.astype(np.float64)
    scale = np.abs(xr) @ np.abs(wd).T
    assert out.shape == (m, n)
    assert np.all(np.abs(out - ref) <= tol * scale + 1e-5)


# ---- attention and the KV cache ----


PAGE = 64  # tokens per page of the test caches (one tile of the CPU's attention)


class Cache:
    """One layer's plain KV cache (iq-kv.h layout): n_slots sequences over a pool of pages,
    each sequence's pages in a shuffled order (its page table), with random contents. k / v
    give each sequence's rows in position order, [n_slots][n_kv][n_ctx][hd], as stored."""

    def __init__(self, graph, be, type_, hd, n_kv, n_ctx, rng, n_slots=1, shuffle=True):
        ffi, lib = graph.ffi, graph.lib
        self.ffi, self.lib = ffi, lib
        self.layer = ffi.new("struct iq_kv_layer *")
        L = self.layer
        L.type_k = L.type_v = type_
        self.n_table = -(-n_ctx // PAGE)
        L.head_dim, L.n_kv_head, L.n_ctx, L.page = hd, n_kv, n_ctx, PAGE
        L.n_pages, L.n_slots = self.n_table * n_slots, n_slots
        rows = PAGE * L.n_pages
        L.k = lib.iq_new_tensor_3d(graph.ctx, type_, hd, rows, n_kv)
        L.v = lib.iq_new_tensor_3d(graph.ctx, type_, hd, rows, n_kv)
        self.pages = lib.iq_new_tensor_2d(graph.ctx, I32, self.n_table, n_slots)
        nbytes = lib.iq_nbytes(L.k)
        self.buf = lib.iq_backend_alloc_buffer(be, 2 * nbytes + lib.iq_nbytes(self.pages))
        lib.iq_tensor_place(L.k, self.buf, 0)
        lib.iq_tensor_place(L.v, self.buf, nbytes)
        lib.iq_tensor_place(self.pages, self.buf, 2 * nbytes)
        order = rng.permutation(L.n_pages) if shuffle else np.arange(L.n_pages)  # the GPU reads pages in order
        self.table = order.astype(np.int32).reshape(n_slots, self.n_table)
        tb = self.table.tobytes()
        lib.iq_tensor_set(self.pages, tb, 0, len(tb))
        self.type, self.hd, self.n_kv, self.n_ctx, self.rows = type_, hd, n_kv, n_ctx, rows
        self.k = self.fill(L.k, rng.standard_normal((n_kv, rows, hd)))
        self.v = self.fill(L.v, rng.standard_normal((n_kv, rows, hd)))

    def row_of(self, slot, t):
        return self.table[slot][t // PAGE] * PAGE + t % PAGE

    def seq_rows(self, x, slot):
        """A sequence's rows of the pool's x [n_kv][rows][hd], in position order."""
        idx = [self.row_of(slot, t) for t in range(self.n_table * PAGE)]
        return x[:, idx]

    def encode(self, x):
        if self.type == F16:
            return x.astype(np.float16).view(np.uint8), x.astype(np.float16).astype(np.float32)
        raw, deq = quant(x.astype(np.float32), self.type)
        return raw.view(np.uint8), deq

    def fill(self, t, x):
        raw, deq = self.encode(x)
        data = np.ascontiguousarray(raw).tobytes()
        self.lib.iq_tensor_set(t, data, 0, len(data))
        return deq

    def read(self, t):
        n = self.lib.iq_nbytes(t)
        buf = self.ffi.new("char[]", n)
        self.lib.iq_tensor_get(t, buf, 0, n)
        raw = np.frombuffer(self.ffi.buffer(buf), dtype=np.uint8).reshape(self.n_kv, self.rows, -1)
        if self.type == F16:
            return raw.view(np.float16).astype(np.float32).reshape(self.n_kv, self.rows, self.hd)
        if self.type == F32:
            return raw.view(np.float32).reshape(self.n_kv, self.rows, self.hd)
        return gguf.quants.dequantize(raw, Q(self.type)).astype(np.float32)

    def free(self):
        self.lib.iq_buffer_free(self.buf)


IQ_KV_S_COUNT = 9  # the fields of a step's row (struct iq_kv_seq, ggml_innerq/iq-kv.h)


def seqs_input(graph, parts):
    """A step's rows for parts [(slot, n_past, n_tokens)], the sequences' tokens one after the other."""
    rows, t0 = [], 0
    for slot, n_past, n in parts:
        rows.append([slot, t0, n, n_past, 0, 0, 0, 0, 0])
        t0 += n
    return graph.input(np.array(rows, dtype=np.int32), I32, (IQ_KV_S_COUNT, len(parts)))


def attention_ref(q, k, v, ck, cv, n_past, scale, window=0):
    """softmax(q k^T scale) v with the causal mask; q [nt, nh, hd], k/v [nt, nkv, hd],
    cache ck/cv [nkv, n_ctx, hd]. Returns [nt, nh * hd]. window > 0: query i (position
    n_past + i) sees positions n_past + i - window < p <= n_past + i only."""
    nt, nh, hd = q.shape
    nkv = k.shape[1]
    r = nh // nkv
    out = np.zeros((nt, nh, hd))
    for h in range(nh):
        g = h // r
        keys = np.concatenate([ck[g, :n_past], k[:, g]]).astype(np.float64)
        vals = np.concatenate([cv[g, :n_past], v[:, g]]).astype(np.float64)
        for i in range(nt):
            p1 = n_past + i + 1
            p0 = max(0, p1 - window) if window > 0 else 0
            s = keys[p0:p1] @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ vals[p0:p1] / p.sum()
    return out.reshape(nt, nh * hd)


ATTN_CASES = [
    # type, head_dim, n_kv_head, r, n_tokens, n_past
    (F32, 64, 3, 3, 1, 37),
    (F16, 64, 3, 3, 1, 1000),   # decode over a long cache: split stretches, exact merge
    (F16, 128, 2, 1, 7, 70),
    (Q8_0, 64, 3, 3, 30, 100),  # several query blocks
    (Q4_0, 128, 1, 3, 5, 64),
    (F16, 64, 3, 3, 12, 0),     # a first prompt chunk: the batch alone
    (F32, 80, 2, 3, 3, 20),     # head_dim the SIMD kernels leave to the scalar ones
]


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention(api, graph, backend, isa, case):
    type_, hd, n_kv, r, nt, n_past = case
    rng = np.random.default_rng(hash(case) % 2**32)
    nh = n_kv * r
    cache = Cache(graph, backend, type_, hd, n_kv, n_past + nt + 3, rng)
    try:
        q = rng.standard_normal((nt, nh, hd)).astype(np.float32)
        k, v = kv_rows(rng, nt, n_kv, hd)
        scale = 1.0 / np.sqrt(hd)
        lib = graph.lib
        out = lib.iq_attention(graph.ctx, graph.input(q), graph.input(k), graph.input(v), cache.layer,
                               seqs_input(graph, [(0, n_past, nt)]), cache.pages, scale)
        got = graph.compute(backend, out)
        ref = attention_ref(q, k, v, cache.seq_rows(cache.k, 0), cache.seq_rows(cache.v, 0), n_past, scale)
        np.testing.assert_allclose(got.reshape(ref.shape), ref, atol=2e-5, rtol=1e-4)
    finally:
        cache.free()


@pytest.mark.parametrize("type_", [F16, Q8_0])
def test_attention_of_several_sequences(api, backend, isa, type_):
    """One op over four sequences of a shared pool (decoding ones and a prompt chunk, pages in
    any order): each sequence gets the numpy reference over its own rows, and the same bits as
    the op of that sequence alone."""
    rng = np.random.default_rng(21)
    hd, n_kv, r = 64, 2, 3
    parts = [(2, 300, 1), (0, 0, 9), (3, 130, 1), (1, 64, 5)]  # (slot, n_past, n_tokens)
    nt = sum(p[2] for p in parts)
    g = Graph(api)
    cache = Cache(g, backend, type_, hd, n_kv, 320, rng, n_slots=4)
    q = rng.standard_normal((nt, n_kv * r, hd)).astype(np.float32)
    k, v = kv_rows(rng, nt, n_kv, hd)
    try:
        lib = g.lib
        got = g.compute(backend, lib.iq_attention(g.ctx, g.input(q), g.input(k), g.input(v), cache.layer,
                                                  seqs_input(g, parts), cache.pages, 0.125))
        got = got.reshape(nt, -1)
        t0 = 0
        for slot, n_past, n in parts:
            sl = slice(t0, t0 + n)
            ref = attention_ref(q[sl], k[sl], v[sl], cache.seq_rows(cache.k, slot), cache.seq_rows(cache.v, slot),
                                n_past, 0.125)
            np.testing.assert_allclose(got[sl].reshape(ref.shape), ref, atol=2e-5, rtol=1e-4)
            alone = Graph(api)
            one = alone.compute(backend, lib.iq_attention(alone.ctx, alone.input(q[sl]), alone.input(k[sl]),
                                                          alone.input(v[sl]), cache.layer,
                                                          seqs_input(alone, [(slot, n_past, n)]), cache.pages, 0.125))
            alone.close()
            np.testing.assert_array_equal(got[sl], one.reshape(n, -1))
            t0 += n
    finally:
        cache.free()
        g.close()


@pytest.mark.parametrize("type_", [F32, F16, Q8_0, Q4_0])
def test_kv_store_round_trip(api, graph, backend, isa, type_):
    rng = np.random.default_rng(11)
    hd, n_kv, nt, n_past = 64, 3, 4, 62  # the new rows cross a page edge
    cache = Cache(graph, backend, type_, hd, n_kv, 128, rng, n_slots=2)
    try:
        before_k, before_v = cache.read(cache.layer.k), cache.read(cache.layer.v)
        k, v = kv_rows(rng, nt, n_kv, hd)
        after = rng.standard_normal((nt, 32)).astype(np.float32)
        lib = graph.lib
        out = lib.iq_kv_store(graph.ctx, graph.input(after), graph.input(k), graph.input(v), cache.layer,
                              seqs_input(graph, [(1, n_past, nt)]), cache.pages)
        np.testing.assert_array_equal(graph.compute(backend, out), after)  # a view of `after`
        rows = [cache.row_of(1, t) for t in range(n_past, n_past + nt)]
        for t, x, before in ((cache.layer.k, k, before_k), (cache.layer.v, v, before_v)):
            stored = cache.read(t)
            want = before.copy()
            want[:, rows] = cache.encode(x.transpose(1, 0, 2))[1]
            np.testing.assert_allclose(stored, want, rtol=0, atol=1e-6)  # nothing else changed
    finally:
        cache.free()


def test_attention_reads_what_kv_store_wrote(api, backend):
    """Decoding token by token through kv_store + attention equals one causal pass."""
    rng = np.random.default_rng(12)
    hd, n_kv, r, n = 64, 2, 3, 6
    q = rng.standard_normal((n, n_kv * r, hd)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    cache_graph = Graph(api)
    cache = Cache(cache_graph, backend, F16, hd, n_kv, 8, rng)
    k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    try:
        for i in range(n):
            g = Graph(api)
            lib = g.lib
            ki, vi = g.input(k[i:i + 1]), g.input(v[i:i + 1])
            seqs = seqs_input(g, [(0, i, 1)])
            a = lib.iq_attention(g.ctx, g.input(q[i:i + 1]), ki, vi, cache.layer, seqs, cache.pages, 0.125)
            got = g.compute(backend, lib.iq_kv_store(g.ctx, a, ki, vi, cache.layer, seqs, cache.pages))
            g.close()
            ref = attention_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], k16.transpose(1, 0, 2), v16.transpose(1, 0, 2),
                                i, 0.125)
            np.testing.assert_allclose(got.reshape(ref.shape), ref, atol=2e-5, rtol=1e-4)
    finally:
        cache.free()
        cache_graph.close()


def test_attention_rejects_rows_outside_the_cache(api, graph, backend):
    """A step's rows are data: a slot, a page or a token range outside the cache fails the run
    with a message, never a read or write outside it."""
    rng = np.random.default_rng(17)
    cache = Cache(graph, backend, F16, 64, 2, 128, rng)
    lib = graph.lib
    try:
        for parts, word in (([(1, 0, 1)], "slot"), ([(0, 128, 1)], "fit"), ([(0, 5, 2), (0, 9, 1)], "twice")):
            g = Graph(api)
            nt = sum(p[2] for p in parts)
            x = g.input(rng.standard_normal((nt, 2, 64)).astype(np.float32))
            out = lib.iq_attention(g.ctx, g.input(rng.standard_normal((nt, 2, 64)).astype(np.float32)), x, x,
                                   cache.layer, seqs_input(g, parts), cache.pages, 0.125)
            lib.iq_set_output(out)
            gr = lib.iq_new_graph(g.ctx, 8)
            assert lib.iq_graph_expand(gr, out)
            ga = lib.iq_gallocr_new(backend)
            assert lib.iq_gallocr_alloc_graph(ga, gr)
            for t in g.inputs:
                lib.iq_tensor_set(t[0], t[1], 0, len(t[1]))
            assert lib.iq_backend_graph_compute(backend, gr) == -1
            assert word in error(api), error(api)
            lib.iq_gallocr_free(ga)
            g.close()
    finally:
        cache.free()


# ---- the allocator ----


def test_allocator_reuses_memory(api, graph, backend):
    """A chain of 12 intermediates fits in a few of them, and still computes right."""
    ffi, lib = api
    rng = np.random.default_rng(13)
    n = 4096
    x = rng.standard_normal(n).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    t = graph.input(x)
    wt = graph.input(w)
    ref = x.astype(np.float64)
    for i in range(6):
        t = lib.iq_mul(graph.ctx, lib.iq_add(graph.ctx, t, t), wt)
        ref = (ref + ref) * w
    view = lib.iq_reshape_2d(graph.ctx, t, 64, 64)  # a view keeps its source alive
    norm = lib.iq_rms_norm(graph.ctx, view, 1e-6)
    t = lib.iq_add(graph.ctx, lib.iq_mul(graph.ctx, norm, norm), view)
    lib.iq_set_output(t)
    ref = ref.reshape(64, 64)
    ref = (ref / np.sqrt((ref ** 2).mean(axis=1, keepdims=True) + 1e-6)) ** 2 + ref
    ga = lib.iq_gallocr_new(backend)
    try:
        out = graph.compute(backend, t, ga)
        size = lib.iq_gallocr_buffer_size(ga)
    finally:
        lib.iq_gallocr_free(ga)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    intermediates = 14 * n * 4
    inputs = 2 * n * 4
    assert size <= inputs + 4 * n * 4 < inputs + intermediates


def test_allocator_grows_its_buffer(api, backend):
    """One allocator for a small graph, then a larger one: the buffer grows and both compute."""
    ffi, lib = api
    ga = lib.iq_gallocr_new(backend)
    try:
        sizes = []
        for n in (64, 4096):
            g = Graph(api)
            x = np.arange(n, dtype=np.float32)
            t = g.input(x)
            out = g.compute(backend, lib.iq_add(g.ctx, lib.iq_mul(g.ctx, t, t), t), ga)
            np.testing.assert_array_equal(out, x * x + x)
            sizes.append(lib.iq_gallocr_buffer_size(ga))
            g.close()
        assert sizes[1] >= 3 * 4096 * 4 > sizes[0]
    finally:
        lib.iq_gallocr_free(ga)


def test_view_rows_and_reshape(api, graph, backend):
    ffi, lib = api
    rng = np.random.default_rng(14)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    t = lib.iq_add(graph.ctx, graph.input(x), graph.input(x))  # computed, so the view waits for it
    rows = lib.iq_view_rows(graph.ctx, t, 2, 3)
    flat = lib.iq_reshape_2d(graph.ctx, rows, 4, 6)
    out = graph.compute(backend, lib.iq_mul(graph.ctx, flat, flat))
    np.testing.assert_array_equal(out, ((2 * x[2:5]) ** 2).reshape(6, 4))


def test_compute_without_allocation_fails(api, graph, backend):
    ffi, lib = api
    a = lib.iq_new_tensor_1d(graph.ctx, F32, 8)
    out = lib.iq_add(graph.ctx, a, a)
    g = lib.iq_new_graph(graph.ctx, 4)
    assert lib.iq_graph_expand(g, out)
    assert lib.iq_backend_graph_compute(backend, g) == -1
    assert "memory" in error(api) or "no data" in error(api)


def test_thread_count_can_change(api):
    """A backend re-sized between runs gives the same result (split work and merges)."""
    ffi, lib = api
    rng = np.random.default_rng(15)
    w = rng.standard_normal((300, 128)).astype(np.float32)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    be = lib.iq_backend_cpu_init(1)
    try:
        outs = []
        for n in (1, 3, 2):
            lib.iq_backend_cpu_set_n_threads(be, n)
            g = Graph(api)
            outs.append(g.compute(be, lib.iq_mul_mat(g.ctx, g.input(w), g.input(x))))
            g.close()
    finally:
        lib.iq_backend_free(be)
    for o in outs:
        np.testing.assert_allclose(o, x @ w.T, rtol=1e-4, atol=1e-4)


def test_output_view_keeps_its_source(api, graph, backend):
    """An output read through a view is not overwritten by tensors allocated after it."""
    ffi, lib = api
    rng = np.random.default_rng(16)
    x = rng.standard_normal(1024).astype(np.float32)
    xt = graph.input(x)
    sq = lib.iq_reshape_2d(graph.ctx, lib.iq_mul(graph.ctx, xt, xt), 32, 32)
    lib.iq_set_output(sq)
    t = lib.iq_reshape_2d(graph.ctx, sq, 1024, 1)
    for _ in range(4):  # later intermediates of the same size, free to reuse released memory
        t = lib.iq_add(graph.ctx, lib.iq_mul(graph.ctx, t, t), t)
    ga = lib.iq_gallocr_new(backend)
    try:
        last = graph.compute(backend, t, ga)
        np.testing.assert_array_equal(read_f32(ffi, lib, sq), (x * x).reshape(32, 32))
    finally:
        lib.iq_gallocr_free(ga)
    assert np.isfinite(last).all()
