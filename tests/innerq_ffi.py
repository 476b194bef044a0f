"""cffi (ABI mode) over the quantized KV cache's C headers, for the InnerQ tests.

The declarations are read from ggml_innerq/iq-innerq.h and cpu/iq-innerq-cpu.h themselves
(plus the two enums and the fp16 typedef they use), so the tests cannot drift from the C code.
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


@lru_cache(maxsize=None)
def load():
    """(ffi, lib) for the library under test."""
    types = (ROOT / "ggml_innerq" / "iq-types.h").read_text()
    isa = (ROOT / "cpu" / "iq-cpu.h").read_text()
    ffi = cffi.FFI()
    ffi.cdef("typedef uint16_t iq_fp16_t;\n" + _enum(types, "iq_type") + "\n" + _enum(isa, "iq_cpu_isa") + """
        enum iq_cpu_isa iq_cpu_isa_detect(void);
        bool iq_cpu_has_avx512_vnni(void);
        bool iq_cpu_has_avx512_gfni(void);
        float iq_fp16_to_fp32(iq_fp16_t h);
        iq_fp16_t iq_fp32_to_fp16(float f);
        const char * iq_error_get(void);
    """)
    ffi.cdef(cdef_from_header((ROOT / "ggml_innerq" / "iq-innerq.h").read_text()))
    ffi.cdef(cdef_from_header((ROOT / "cpu" / "iq-innerq-cpu.h").read_text()))
    return ffi, ffi.dlopen(lib_path())


def fptr(ffi, a: np.ndarray, ctype: str = "float *"):
    return ffi.cast(ctype, ffi.from_buffer(a))


class QCache:
    """A layer's cache over a numpy buffer, plus views of its regions for the oracles."""

    def __init__(self, cfg: dict, head_dim: int, n_kv_head: int, n_ctx: int):
        self.ffi, self.lib = load()
        ffi, lib = self.ffi, self.lib
        self.cfg = ffi.new("struct iq_qcache_config *", cfg)
        size = lib.iq_qcache_size(self.cfg, head_dim, n_kv_head, n_ctx)
        assert size > 0, ffi.string(lib.iq_error_get()).decode()
        self.buf = np.zeros(size, np.uint8)
        self.c = ffi.new("struct iq_qcache *")
        assert lib.iq_qcache_init(self.c, self.cfg, head_dim, n_kv_head, n_ctx, ffi.from_buffer(self.buf), size)
        self.D, self.H, self.G = head_dim, n_kv_head, cfg["group"]

    def store(self, k: np.ndarray, v: np.ndarray) -> bool:
        k = np.ascontiguousarray(k, np.float32)
        v = np.ascontiguousarray(v, np.float32)
        return bool(self.lib.iq_qcache_store(self.c, fptr(self.ffi, k), fptr(self.ffi, v), k.shape[0]))

    def state(self) -> tuple[int, int, int, int]:
        c = self.c
        return c.n_tokens, c.n_sink, c.n_quant, c.n_recent

    def region(self, off: int, count: int, dtype) -> np.ndarray:
        n = count * np.dtype(dtype).itemsize
        return self.buf[off:off + n].view(dtype)

    def norms(self) -> np.ndarray:
        return self.region(self.c.off_norm, self.H * self.D, np.float32).reshape(self.H, self.D)

    def sink(self, is_v: bool) -> np.ndarray:
        S = self.c.cfg.n_sink
        off = self.c.off_sink_v if is_v else self.c.off_sink_k
        return self.region(off, self.H * S * self.D, np.float16).reshape(self.H, S, self.D)

    def recent(self, is_v: bool) -> np.ndarray:
        cap = self.c.cap_recent
        off = self.c.off_recent_v if is_v else self.c.off_recent_k
        return self.region(off, self.H * cap * self.D, np.float16).reshape(self.H, cap, self.D)

    def block_bytes(self, is_v: bool, h: int, j: int) -> np.ndarray:
        c = self.c
        nb = c.block_bytes_v if is_v else c.block_bytes_k
        off = (c.off_quant_v if is_v else c.off_quant_k) + (h * c.cap_blocks + j) * nb
        return self.buf[off:off + nb]
