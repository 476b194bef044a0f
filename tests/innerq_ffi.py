"""cffi (ABI mode) over the quantized KV cache's C headers, for the InnerQ tests.

The declarations are read from ggml_innerq/iq-qcache.h, ggml_innerq/iq-kv.h, src/kv-plan.h and
cpu/qcache.h themselves (plus the enums and the fp16 typedef they use), so the tests
cannot drift from the C code.
"""
from __future__ import annotations

import re
from functools import lru_cache

import cffi
import numpy as np

from conftest import ROOT, lib_path


def _logical_lines(text: str) -> list[str]:
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)  # the extern "C" wrapper
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return text.replace("\\\n", " ").splitlines()


def _drop_inline_bodies(text: str) -> str:
    """Removes `static inline ... { ... }` definitions (cffi parses declarations only)."""
    out, i = [], 0
    while True:
        j = text.find("static inline", i)
        if j < 0:
            return "".join(out) + text[i:]
        out.append(text[i:j])
        k, depth = text.index("{", j), 0
        while True:
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            k += 1
            if depth == 0:
                break
        i = k


def cdef_from_header(text: str) -> str:
    keep = []
    for ln in _logical_lines(text):
        s = ln.strip()
        m = re.match(r"#define\s+(\w+)\s+\(?(-?\d+)\)?\s*$", s)
        if m:
            keep.append(f"#define {m.group(1)} {m.group(2)}")
        elif s.startswith("#"):
            continue
        else:
            keep.append(ln)
    text = _drop_inline_bodies("\n".join(keep))
    # cffi treats `extern const` objects as constants it cannot read from a dlopen()ed library
    return re.sub(r"extern const (struct \w+ \w+;)", r"extern \1", text)


def _enum(text: str, name: str) -> str:
    return re.search(r"enum %s \{.*?\};" % name, re.sub(r"//[^\n]*", "", text), flags=re.S).group(0)


def config_cdef() -> str:
    """The declarations of struct iq_qcache_config (and its enums), for another FFI that
    declares struct iq_kv_layer."""
    text = re.sub(r"//[^\n]*", "", (ROOT / "ggml_innerq" / "iq-qcache.h").read_text())
    return "\n".join(re.search(p, text, flags=re.S).group(0) for p in
                     (r"enum iq_quant_mode \{.*?\};", r"enum iq_qaxis \{.*?\};", r"struct iq_qcache_config \{.*?\};"))


@lru_cache(maxsize=None)
def load():
    """(ffi, lib) for the library under test."""
    types = (ROOT / "ggml_innerq" / "iq-types.h").read_text()
    cpu = (ROOT / "cpu" / "iq-cpu.h").read_text()
    ffi = cffi.FFI()
    ffi.cdef("typedef uint16_t iq_fp16_t;\n" + _enum(types, "iq_type") + "\n" + _enum(cpu, "iq_cpu_feature") + """
        typedef uint32_t iq_cpu_features;
        iq_cpu_features iq_cpu_features_detect(void);
        float iq_fp16_to_fp32(iq_fp16_t h);
        iq_fp16_t iq_fp32_to_fp16(float f);
        const char * iq_error_get(void);
    """)
    ffi.cdef(cdef_from_header((ROOT / "ggml_innerq" / "iq-qcache.h").read_text()))
    ffi.cdef("struct iq_tensor;")
    ffi.cdef(cdef_from_header((ROOT / "ggml_innerq" / "iq-kv.h").read_text()))
    ffi.cdef(cdef_from_header((ROOT / "src" / "kv-plan.h").read_text()))
    ffi.cdef(cdef_from_header((ROOT / "cpu" / "qcache.h").read_text()))
    return ffi, ffi.dlopen(lib_path())


def fptr(ffi, a: np.ndarray, ctype: str = "float *"):
    return ffi.cast(ctype, ffi.from_buffer(a))


class QCache:
    """A layer's cache over a numpy buffer, with the runtime's bookkeeping (src/kv-plan.h):
    stores plan their flushes as the runtime does, carry the plan out head by head as the
    KV_STORE op does, and commit the counters after. Views of the regions for the oracles."""

    def __init__(self, cfg: dict, head_dim: int, n_kv_head: int, n_ctx: int):
        self.ffi, self.lib = load()
        ffi, lib = self.ffi, self.lib
        self.c = ffi.new("struct iq_qcache *")
        assert lib.iq_qcache_layout(self.c, ffi.new("struct iq_qcache_config *", cfg), head_dim, n_kv_head, n_ctx), \
            ffi.string(lib.iq_error_get()).decode()
        self.cfg = ffi.addressof(self.c, "cfg")
        self.buf = np.zeros(self.c.size, np.uint8)
        lib.iq_qcache_bind(self.c, ffi.from_buffer(self.buf))
        self.qstate = ffi.new("struct kv_qstate *")
        self.D, self.H, self.G = head_dim, n_kv_head, cfg["group"]
        self.clear()

    def clear(self):
        """Forgets every token and the key normalization, as the runtime's kv_cache_clear."""
        self.qstate.n_sink = self.qstate.n_quant = 0
        self.qstate.norms_ready = False
        self.c.n_tokens = self.c.n_sink = self.c.n_quant = self.c.n_recent = 0
        self.norms()[:] = 1.0

    def plan(self, n: int):
        """The runtime's snapshot and flush plan of a batch of n tokens (None if they don't fit)."""
        b = self.ffi.new("struct iq_kv_seq *")
        return b if self.lib.kv_qplan(self.cfg, self.c.n_ctx, self.c.n_tokens, self.qstate, n, b) else None

    def commit(self, b, n: int):
        """The bookkeeping after the batch of plan b ran."""
        self.lib.kv_qcommit(self.cfg, b, self.qstate)
        c = self.c
        c.n_tokens, c.n_sink, c.n_quant = b.n_past + n, self.qstate.n_sink, self.qstate.n_quant
        c.n_recent = c.n_tokens - c.n_sink - c.n_quant

    def store(self, k: np.ndarray, v: np.ndarray) -> bool:
        k = np.ascontiguousarray(k, np.float32)
        v = np.ascontiguousarray(v, np.float32)
        n = k.shape[0]
        b = self.plan(n)
        if b is None:
            return False
        for h in range(self.H):
            self.lib.iq_qcache_store_head(self.c, self.ffi.addressof(b, "flush"), h, fptr(self.ffi, k),
                                          fptr(self.ffi, v), n)
        self.commit(b, n)
        return True

    def until_flush(self) -> int:
        return self.lib.kv_quntil_flush(self.cfg, self.c.n_tokens, self.qstate)

    @property
    def norms_ready(self) -> bool:
        return bool(self.qstate.norms_ready)

    def state(self) -> tuple[int, int, int, int]:
        c = self.c
        return c.n_tokens, c.n_sink, c.n_quant, c.n_recent

    def region(self, r: int, dtype) -> np.ndarray:
        off, n = self.c.off[r], self.c.bytes[r]
        return self.buf[off:off + n].view(dtype)

    def norms(self) -> np.ndarray:
        return self.region(self.lib.IQ_QREGION_NORM, np.float32).reshape(self.H, self.D)

    def sink(self, is_v: bool) -> np.ndarray:
        r = self.lib.IQ_QREGION_SINK_V if is_v else self.lib.IQ_QREGION_SINK_K
        return self.region(r, np.float16).reshape(self.H, self.c.cfg.n_sink, self.D)

    def recent(self, is_v: bool) -> np.ndarray:
        r = self.lib.IQ_QREGION_RECENT_V if is_v else self.lib.IQ_QREGION_RECENT_K
        return self.region(r, np.float16).reshape(self.H, self.c.cap_recent, self.D)

    def block_bytes(self, is_v: bool, h: int, j: int) -> np.ndarray:
        c = self.c
        nb = c.block_bytes_v if is_v else c.block_bytes_k
        off = c.off[self.lib.IQ_QREGION_QUANT_V if is_v else self.lib.IQ_QREGION_QUANT_K] + (h * c.cap_blocks + j) * nb
        return self.buf[off:off + nb]
