"""The tensor table of a GGUF file (names, shapes, types), for `innerq info`.

The C API reports a model's metadata but not its tensor list, so this reads the header
directly: magic, version, counts, the key/value section (skipped), then the tensor infos.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

# ggml type ids as GGUF stores them.
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
}

# GGUF metadata value types: fixed sizes, 8 = string, 9 = array.
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne[0] first
    type_id: int

    @property
    def type_name(self) -> str:
        return GGML_TYPE_NAMES.get(self.type_id, f"type{self.type_id}")

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Reader:
    def __init__(self, f):
        self.f = f

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF file")
        return struct.unpack(fmt, data)

    def string(self) -> bytes:
        (n,) = self.take("<Q")
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("truncated GGUF file")
        return data

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            self.string()
        elif vtype == _ARRAY:
            itype, n = self.take("<IQ")
            if itype in _SCALAR_SIZE:
                self.f.seek(n * _SCALAR_SIZE[itype], 1)
            else:
                for _ in range(n):
                    self.skip_value(itype)
        elif vtype in _SCALAR_SIZE:
            self.f.seek(_SCALAR_SIZE[vtype], 1)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")


def read_tensor_infos(path: str | Path) -> list[TensorInfo]:
    """The tensors of a GGUF (v2 or v3) file; ValueError if it is not one."""
    with open(path, "rb") as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = r.take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = r.take("<QQ")
        for _ in range(n_kv):
            r.string()
            (vtype,) = r.take("<I")
            r.skip_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = r.string().decode("utf-8", errors="replace")
            (n_dims,) = r.take("<I")
            shape = r.take(f"<{n_dims}Q")
            type_id, _offset = r.take("<IQ")
            infos.append(TensorInfo(name, tuple(shape), type_id))
        return infos


def type_summary(infos: list[TensorInfo]) -> dict[str, tuple[int, int]]:
    """type name -> (tensors, elements), most elements first."""
    out: dict[str, list[int]] = {}
    for t in infos:
        acc = out.setdefault(t.type_name, [0, 0])
        acc[0] += 1
        acc[1] += t.n_elements
    return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}
