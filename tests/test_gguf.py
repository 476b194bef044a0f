"""The GGUF reader (src/gguf.c): valid files agree with the `gguf` package (GGUFWriter wrote
them, GGUFReader is the oracle); malformed files are refused with the right status and a
message that says what is wrong; damaged files never crash it.

gguf_open is reached through cffi over src/gguf.h. Malformed and fuzzed files are opened in a
worker subprocess (this file run as a script), so that a crash is reported as a failing test
naming the file, not as a dead pytest.
"""
from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
from pathlib import Path

import cffi
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from conftest import lib_path

ROOT = Path(__file__).resolve().parent.parent

IO, FORMAT, UNSUPPORTED = 2, 3, 4  # innerq_status


def make_ffi(lib_file: str):
    """(ffi, lib): cffi over innerq.h and gguf.h, declarations read from the headers."""
    os.environ.setdefault("INNERQ_LIB", lib_file)  # importing innerq._ffi opens a library
    from innerq._ffi import cdef_from_header

    enum = re.search(r"enum iq_type \{.*?\};", (ROOT / "ggml_innerq" / "iq-types.h").read_text(), re.S).group(0)
    ffi = cffi.FFI()
    ffi.cdef("\n".join(cdef_from_header(text) for text in
                       [(ROOT / "src" / "innerq.h").read_text(), enum, (ROOT / "src" / "gguf.h").read_text()]))
    return ffi, ffi.dlopen(lib_file)


def check_open_file(ffi, lib, f) -> list[str]:
    """Inconsistencies in an opened file; reads every tensor byte and prints every value."""
    bad = []
    data = int(ffi.cast("uintptr_t", f.data))
    for i in range(f.n_tensors):
        t = f.tensors[i]
        p = int(ffi.cast("uintptr_t", t.data))
        if not (data <= p and p + t.size <= data + f.data_size) or p - data != t.offset:
            bad.append(f"tensor {i} outside the data section")
        bytes(ffi.buffer(t.data, t.size))
        if lib.gguf_find_tensor(f, t.name) != ffi.addressof(f.tensors, i):
            bad.append(f"tensor {i} not found by name")
    buf = ffi.new("char[16]")
    for i in range(f.n_kv):
        kv = ffi.addressof(f.kv, i)
        n = lib.gguf_kv_to_text(kv, buf, 16)
        if n < 0 or len(ffi.string(buf)) > min(n, 15):
            bad.append(f"kv {i}: text length {n}")
        if lib.gguf_find_kv(f, kv.key) != kv:
            bad.append(f"kv {i} not found by key")
    return bad


def worker_main(lib_file: str) -> None:
    """Opens each path read from stdin (JSON list) with and without mmap; one JSON line each."""
    ffi, lib = make_ffi(lib_file)
    for path in json.load(sys.stdin):
        for mmap in (False, True):
            out = ffi.new("struct gguf_file **")
            st = lib.gguf_open(path.encode(), mmap, out)
            msg = ffi.string(lib.innerq_last_error()).decode("utf-8", "replace") if st else ""
            rec = {"path": path, "mmap": mmap, "status": st, "msg": msg}
            if st == 0:
                rec["bad"] = check_open_file(ffi, lib, out[0])
                lib.gguf_close(out[0])
            print(json.dumps(rec), flush=True)


@pytest.fixture(scope="module")
def ffi_lib():
    return make_ffi(lib_path())


def open_batch(paths: list[str]) -> dict[tuple[str, bool], dict]:
    """Results of the worker over paths, keyed by (path, mmap); fails naming the file it died on."""
    proc = subprocess.run([sys.executable, __file__, "--worker", lib_path()], input=json.dumps(paths),
                          capture_output=True, text=True, timeout=120)
    recs = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0:
        done = {(r["path"], r["mmap"]) for r in recs}
        died = next(((p, m) for p in paths for m in (False, True) if (p, m) not in done), None)
        pytest.fail(f"worker died (rc {proc.returncode}) opening {died}:\n{proc.stderr[-2000:]}")
    return {(r["path"], r["mmap"]): r for r in recs}


# ---- hand-made files ----

def s(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def kv_u32(key, v: int) -> bytes:
    return kv(key, VT.UINT32, struct.pack("<I", v))


def tinfo(name, ne, ttype: int = QT.F32, offset: int = 0) -> bytes:
    return s(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", ttype, offset)


def gguf_bytes(kvs=(), tensors=(), data: bytes = b"", *, magic=b"GGUF", version=3, n_tensors=None, n_kv=None,
               alignment=32) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % alignment) + data


F32_4 = tinfo("a", [4])  # 16 bytes at offset 0
DATA = bytes(range(64))

# name -> (file bytes, status, words the message must hold)
BAD = {
    "bad_magic": (b"GGML" + bytes(60), FORMAT, ["bad magic 'GGML'", "not a GGUF file"]),
    "binary_magic": (b"\x7fELF" + bytes(60), FORMAT, ["bad magic '\\x7fELF'"]),
    "version_1": (gguf_bytes(version=1), UNSUPPORTED, ["version 1"]),
    "version_99": (gguf_bytes(version=99), UNSUPPORTED, ["version 99"]),
    "version_0": (gguf_bytes(version=0), FORMAT, ["version 0"]),
    "big_endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), UNSUPPORTED, ["big-endian"]),
    "tensor_count_2^40": (gguf_bytes(n_tensors=1 << 40), FORMAT, ["tensor count 1099511627776", "absurd"]),
    "tensor_count_max": (gguf_bytes(n_tensors=2**64 - 1), FORMAT, ["tensor count", "absurd"]),
    "kv_count_2^62": (gguf_bytes([kv_u32("x", 1)], n_kv=1 << 62), FORMAT, ["key/value count", "absurd"]),
    "kv_count_short_by_one": (gguf_bytes([kv_u32(f"k{i}", i) for i in range(10)], n_kv=11, alignment=1), FORMAT,
                              ["key #10", "truncated"]),
    "key_length_huge": (gguf_bytes([struct.pack("<Q", 9 * 10**18) + b"abcdefgh" * 2]), FORMAT,
                        ["key #0", "key length 9000000000000000000", "exceeds the file"]),
    "string_length_huge": (gguf_bytes([kv("x", VT.STRING, struct.pack("<Q", 9 * 10**18) + b"abc")]), FORMAT,
                           ["key 'x'", "string length 9000000000000000000", "exceeds the file"]),
    "string_length_one_over": (gguf_bytes([kv("x", VT.STRING, struct.pack("<Q", 4) + b"abc")], alignment=1),
                               FORMAT, ["key 'x'", "string length 4", "exceeds the file"]),
    "int_array_length_huge": (gguf_bytes([kv("x", VT.ARRAY, struct.pack("<IQ", VT.INT32, 1 << 61) + bytes(8))]),
                              FORMAT, ["key 'x'", "array of 2305843009213693952 int32 values", "exceeds the file"]),
    "string_array_length_huge": (gguf_bytes([kv("x", VT.ARRAY, struct.pack("<IQ", VT.STRING, 1 << 60))]), FORMAT,
                                 ["key 'x'", "array of 1152921504606846976 string values", "exceeds the file"]),
    "string_array_element_huge": (gguf_bytes([kv("x", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2) + s("ok")
                                                 + struct.pack("<Q", 1 << 50))]), FORMAT,
                                  ["key 'x'", "string length 1125899906842624", "exceeds"]),
    "array_of_arrays": (gguf_bytes([kv("x", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) + bytes(16))]), FORMAT,
                        ["key 'x'", "arrays of arrays"]),
    "array_element_type_77": (gguf_bytes([kv("x", VT.ARRAY, struct.pack("<IQ", 77, 1) + bytes(16))]), FORMAT,
                              ["key 'x'", "unknown array element type 77"]),
    "value_type_13": (gguf_bytes([kv("x", 13, bytes(8))]), FORMAT, ["key 'x'", "unknown value type 13"]),
    "key_with_nul": (gguf_bytes([kv(b"a\0b", VT.UINT8, b"\1")]), FORMAT, ["key", "NUL"]),
    "duplicate_key": (gguf_bytes([kv_u32("general.x", 1), kv_u32("general.x", 2)]), FORMAT,
                      ["key 'general.x'", "duplicate key"]),
    "n_dims_5": (gguf_bytes(tensors=[tinfo("a", [1, 1, 1, 1, 1])], data=DATA), FORMAT, ["tensor 'a'", "n_dims 5"]),
    "n_dims_0": (gguf_bytes(tensors=[tinfo("a", [])], data=DATA), FORMAT, ["tensor 'a'", "n_dims 0"]),
    "dim_zero": (gguf_bytes(tensors=[tinfo("a", [576, 0])], data=DATA), FORMAT, ["tensor 'a'", "dims 576 x 0", "zero"]),
    "dim_huge": (gguf_bytes(tensors=[tinfo("a", [2**64 - 1])], data=DATA), FORMAT, ["tensor 'a'", "overflows"]),
    "element_count_overflow": (gguf_bytes(tensors=[tinfo("a", [1 << 32, 1 << 32])], data=DATA), FORMAT,
                               ["tensor 'a'", "dims 4294967296 x 4294967296", "element count overflows"]),
    "byte_size_overflow": (gguf_bytes(tensors=[tinfo("a", [1 << 62])], data=DATA), FORMAT,
                           ["tensor 'a'", "size in bytes overflows"]),
    "unknown_type_77": (gguf_bytes(tensors=[tinfo("a", [32], 77)], data=DATA), FORMAT,
                        ["tensor 'a'", "unknown type 77"]),
    "cache_only_type": (gguf_bytes(tensors=[tinfo("a", [32], 64)], data=DATA), FORMAT,
                        ["tensor 'a'", "unknown type 64"]),
    "foreign_ggml_type": (gguf_bytes(tensors=[tinfo("a", [256], QT.IQ2_XXS)], data=DATA), UNSUPPORTED,
                          ["tensor 'a'", "iq2_xxs", "not supported"]),
    "row_not_whole_blocks": (gguf_bytes(tensors=[tinfo("a", [33, 2], QT.Q4_0)], data=DATA), FORMAT,
                             ["tensor 'a'", "row of 33 elements is not a multiple of the q4_0 block size 32"]),
    "offset_beyond_file": (gguf_bytes(tensors=[tinfo("blk.0.attn_q.weight", [4], offset=1 << 40)], data=DATA),
                           FORMAT,
                           ["tensor 'blk.0.attn_q.weight'", "data [1099511627776, 1099511627792)", "outside the file"]),
    "data_one_byte_short": (gguf_bytes(tensors=[tinfo("a", [16])], data=bytes(63)), FORMAT,
                            ["tensor 'a'", "data [0, 64)", "outside the file (size 127"]),
    "offset_max": (gguf_bytes(tensors=[tinfo("a", [16], offset=2**64 - 32)], data=DATA), FORMAT,
                   ["tensor 'a'", "data [18446744073709551584, 18446744073709551584 + 64)", "outside the file"]),
    "misaligned_offset": (gguf_bytes(tensors=[tinfo("a", [4], offset=4)], data=DATA), FORMAT,
                          ["tensor 'a'", "offset 4", "not a multiple of the alignment 32"]),
    "overlapping": (gguf_bytes(tensors=[tinfo("a", [16]), tinfo("b", [8], offset=32)], data=DATA + DATA), FORMAT,
                    ["'a' [0, 64)", "'b' [32, 64)", "overlap"]),
    "duplicate_tensor": (gguf_bytes(tensors=[F32_4, tinfo("a", [4], offset=32)], data=DATA), FORMAT,
                         ["tensor 'a'", "duplicate tensor name"]),
    "tensor_name_too_long": (gguf_bytes(tensors=[tinfo("n" * 64, [4])], data=DATA), FORMAT, ["too long"]),
    "alignment_48": (gguf_bytes([kv_u32("general.alignment", 48)], [F32_4], DATA, alignment=48), FORMAT,
                     ["general.alignment 48", "not a power of 2"]),
    # alignment 1 lets f32 data start anywhere: one of offsets 0 and 17 is not a multiple of 4
    # after any header length (the weights are read in place, as float)
    "alignment_1_misaligned_f32": (gguf_bytes([kv_u32("general.alignment", 1)],
                                              [tinfo("a", [4]), tinfo("b", [4], offset=17)], DATA + bytes(1) + DATA,
                                              alignment=1), FORMAT,
                                   ["is not a multiple of 4, the alignment its type needs", "general.alignment 1"]),
    "alignment_0": (gguf_bytes([kv_u32("general.alignment", 0)], [F32_4], DATA), FORMAT,
                    ["general.alignment 0", "not a power of 2"]),
    "alignment_string": (gguf_bytes([kv("general.alignment", VT.STRING, s("32"))], [F32_4], DATA), FORMAT,
                         ["general.alignment", "string", "can't be read"]),
    "truncated_in_counts": (b"GGUF" + struct.pack("<IQ", 3, 0) + b"\0\0", FORMAT, ["truncated", "key/value count"]),
    "truncated_in_tensor_dims": (gguf_bytes(tensors=[tinfo("t" * 40, [4, 4])])[:80], FORMAT,
                                 ["tensor 'tttt", "truncated", "dimension"]),
    "empty": (b"", FORMAT, ["empty file"]),
}

# Files the reader must accept; the tests below check their details.
GOOD = {
    "no_tensors_no_padding": gguf_bytes([kv_u32("x", 7)], alignment=1),
    "alignment_64": gguf_bytes([kv_u32("general.alignment", 64)], [tinfo("a", [4]), tinfo("b", [4], offset=64)],
                               DATA + DATA, alignment=64),
    "version_2": gguf_bytes([kv_u32("x", 7)], [F32_4], DATA, version=2),
    "adjacent_tensors": gguf_bytes(tensors=[tinfo("b", [8], offset=32), tinfo("a", [8])], data=DATA),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The worker's results over every BAD and GOOD file, a missing file and a directory."""
    d = tmp_path_factory.mktemp("gguf")
    paths = {}
    for name, content in [*((n, c[0]) for n, c in BAD.items()), *GOOD.items()]:
        paths[name] = str(d / f"{name}.gguf")
        Path(paths[name]).write_bytes(content)
    paths["missing"] = str(d / "no-such-model.gguf")
    paths["directory"] = str(d)
    res = open_batch(list(paths.values()))
    return {name: (res[(p, False)], res[(p, True)]) for name, p in paths.items()}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_file(batch, name):
    _, status, words = BAD[name]
    for r in batch[name]:
        assert r["status"] == status, r
        assert r["path"] in r["msg"], r
        for w in words:
            assert w in r["msg"], (w, r)


@pytest.mark.parametrize("name", list(GOOD))
def test_good_file(batch, name):
    for r in batch[name]:
        assert r["status"] == 0, r
        assert r["bad"] == [], r


def test_missing_file_and_directory(batch):
    for r in batch["missing"]:
        assert r["status"] == IO and r["path"] in r["msg"] and "No such file" in r["msg"], r
    for r in batch["directory"]:
        assert r["status"] == IO and r["path"] in r["msg"] and "directory" in r["msg"], r


# ---- files written by gguf.GGUFWriter ----

def write_sample(path: Path, endian=gguf.GGUFEndian.LITTLE) -> dict[str, np.ndarray]:
    """A file with every value type and F32 / F16 / Q8_0 / Q4_1 tensors; returns the tensors' data."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld")
    w.add_uint64("t.u64", 2**64 - 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_float32("t.rope_base", 100000.0)
    w.add_key_value("t.tokens", ["<s>", "</s>", "a", "ü"], VT.ARRAY, VT.STRING)
    w.add_key_value("t.ids", list(range(-3, 20)), VT.ARRAY, VT.INT32)
    w.add_key_value("t.few", [1.5, -2.0], VT.ARRAY, VT.FLOAT32)
    data = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal((2, 8)).astype(np.float16),
        "q8_0": gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), QT.Q8_0),
        "q4_1": gguf.quants.quantize(rng.standard_normal((3, 32)).astype(np.float32), QT.Q4_1),
    }
    for name, a in data.items():
        w.add_tensor(name, a, raw_dtype={"q8_0": QT.Q8_0, "q4_1": QT.Q4_1}.get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return data


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "sample.gguf"
    return path, write_sample(path)


def gguf_open(ffi_lib, path, mmap=True):
    ffi, lib = ffi_lib
    out = ffi.new("struct gguf_file **")
    st = lib.gguf_open(str(path).encode(), mmap, out)
    assert st == 0, ffi.string(lib.innerq_last_error())
    return out[0]


@pytest.mark.parametrize("mmap", [True, False])
def test_sample_matches_gguf_reader(ffi_lib, sample, mmap):
    ffi, lib = ffi_lib
    path, data = sample
    ref = gguf.GGUFReader(str(path))
    f = gguf_open(ffi_lib, path, mmap)
    try:
        assert f.version == 3 and f.alignment == ref.alignment and f.data_offset == ref.data_offset
        fields = [fl for fl in ref.fields.values() if not fl.name.startswith("GGUF.")]
        assert [ffi.string(f.kv[i].key).decode() for i in range(f.n_kv)] == [fl.name for fl in fields]
        for fl in fields:
            k = lib.gguf_find_kv(f, fl.name.encode())
            assert k.type == fl.types[0], fl.name
            want = fl.contents()
            if fl.types[0] == VT.STRING:
                assert ffi.buffer(k.str.data, k.str.n)[:].decode() == want
            elif fl.types[0] == VT.ARRAY:
                assert k.arr_type == fl.types[1] and k.arr_n == len(want)
                if fl.types[1] == VT.STRING:
                    got = [ffi.buffer(k.arr_str[i].data, k.arr_str[i].n)[:].decode() for i in range(k.arr_n)]
                else:
                    dt = fl.parts[-1].dtype if k.arr_n else np.uint8
                    got = np.frombuffer(ffi.buffer(k.arr_data, k.arr_n * np.dtype(dt).itemsize), dt).tolist()
                assert got == want, fl.name
            elif fl.types[0] in (VT.FLOAT32, VT.FLOAT64):
                assert k.num.f64 == float(np.asarray(fl.parts[-1])[0]), fl.name
            elif fl.types[0] in (VT.INT8, VT.INT16, VT.INT32, VT.INT64):
                assert k.num.i64 == want, fl.name
            else:
                assert k.num.u64 == int(want), fl.name
        assert f.n_tensors == len(ref.tensors) == len(data)
        for rt in ref.tensors:
            t = lib.gguf_find_tensor(f, rt.name.encode())
            assert t != ffi.NULL and ffi.string(t.name).decode() == rt.name
            assert [t.ne[i] for i in range(t.n_dims)] == [int(x) for x in rt.shape]
            assert t.n_dims == len(rt.shape) and t.type == rt.tensor_type and t.size == rt.n_bytes
            assert f.data_offset + t.offset == rt.data_offset
            got = ffi.buffer(t.data, t.size)[:]
            assert got == data[rt.name].tobytes() == rt.data.tobytes()
        assert lib.gguf_find_tensor(f, b"nope") == ffi.NULL and lib.gguf_find_kv(f, b"nope") == ffi.NULL
    finally:
        lib.gguf_close(f)


def test_big_endian_file_refused(ffi_lib, tmp_path):
    ffi, lib = ffi_lib
    write_sample(tmp_path / "be.gguf", gguf.GGUFEndian.BIG)
    out = ffi.new("struct gguf_file **")
    assert lib.gguf_open(str(tmp_path / "be.gguf").encode(), True, out) == UNSUPPORTED
    assert b"big-endian" in ffi.string(lib.innerq_last_error())
    assert out[0] == ffi.NULL


def test_typed_getters(ffi_lib, sample):
    ffi, lib = ffi_lib
    f = gguf_open(ffi_lib, sample[0])
    try:
        u32, f32, b = ffi.new("uint32_t *"), ffi.new("float *"), ffi.new("bool *")
        st = ffi.new("innerq_status *", 0)
        for key, want in [(b"t.u8", 200), (b"t.u16", 60000), (b"t.u32", 4000000000)]:
            assert lib.gguf_get_u32(f, key, u32, st) and u32[0] == want and st[0] == 0
        for key in (b"t.i8", b"t.i32", b"t.u64", b"t.i64", b"t.str", b"t.f32", b"t.ids"):
            st[0] = 0
            assert not lib.gguf_get_u32(f, key, u32, st) and st[0] == FORMAT, key
            assert key.decode() in ffi.string(lib.innerq_last_error()).decode()
        # absent: false, and an earlier failure is left for the caller to see
        assert not lib.gguf_get_u32(f, b"t.absent", u32, st) and st[0] == FORMAT
        st[0] = 0
        assert not lib.gguf_get_u32(f, b"t.absent", u32, st) and st[0] == 0
        assert lib.gguf_get_f32(f, b"t.f32", f32, st) and f32[0] == np.float32(0.1)
        assert lib.gguf_get_f32(f, b"t.f64", f32, st) and f32[0] == np.float32(1e-300)
        assert lib.gguf_get_f32(f, b"t.i16", f32, st) and f32[0] == -30000.0 and st[0] == 0
        assert lib.gguf_get_bool(f, b"t.bool", b, st) and b[0] is True
        assert not lib.gguf_get_bool(f, b"t.u8", b, st) and st[0] == FORMAT
        st[0] = 0
        gs = ffi.new("struct gguf_str *")
        assert lib.gguf_get_str(f, b"t.str", gs, st) and ffi.buffer(gs.data, gs.n)[:] == "héllo wörld".encode()
        arr = lib.gguf_get_arr(f, b"t.tokens", lib.GGUF_TYPE_STRING, st)
        assert arr != ffi.NULL and arr.arr_n == 4
        assert ffi.buffer(arr.arr_str[3].data, arr.arr_str[3].n)[:] == "ü".encode()
        assert lib.gguf_get_arr(f, b"t.ids", lib.GGUF_TYPE_UINT32, st) == ffi.NULL and st[0] == FORMAT
    finally:
        lib.gguf_close(f)


def kv_text(ffi_lib, f, key: str, size: int = 256) -> tuple[int, str]:
    ffi, lib = ffi_lib
    buf = ffi.new("char[]", max(size, 1))
    n = lib.gguf_kv_to_text(lib.gguf_find_kv(f, key.encode()), buf if size else ffi.NULL, size)
    return n, ffi.string(buf).decode()


def test_values_as_text(ffi_lib, sample):
    f = gguf_open(ffi_lib, sample[0])
    try:
        want = {
            "t.u8": "200", "t.i8": "-100", "t.u32": "4000000000", "t.u64": str(2**64 - 5), "t.i64": str(-(2**62)),
            "t.bool": "true", "t.str": "héllo wörld", "t.f32": "0.1", "t.f64": "1e-300", "t.rope_base": "100000",
            "t.tokens": "[4 strings]", "t.few": "[1.5, -2]",
        }
        for key, text in want.items():
            assert kv_text(ffi_lib, f, key) == (len(text.encode()), text), key
        n, text = kv_text(ffi_lib, f, "t.ids")
        assert text.startswith("[-3, -2, -1, 0, 1, 2, 3, 4") and "23" in text and n == len(text)
        # cut to the buffer like snprintf, and the full length returned
        full = "héllo wörld".encode()
        n, text = kv_text(ffi_lib, f, "t.str", 5)
        assert n == len(full) and text.encode() == full[:4]
        assert kv_text(ffi_lib, f, "t.str", 0)[0] == len(full)
    finally:
        ffi_lib[1].gguf_close(f)


def test_empty_arrays(ffi_lib, tmp_path):
    ffi, lib = ffi_lib
    path = tmp_path / "empty-arrays.gguf"
    path.write_bytes(gguf_bytes([kv("e.u8", VT.ARRAY, struct.pack("<IQ", VT.UINT8, 0)),
                                 kv("e.str", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0))]))
    f = gguf_open(ffi_lib, path)
    try:
        assert kv_text(ffi_lib, f, "e.u8") == (2, "[]")
        assert kv_text(ffi_lib, f, "e.str") == (11, "[0 strings]")
        assert lib.gguf_find_kv(f, b"e.str").arr_n == 0
    finally:
        lib.gguf_close(f)


def test_many_tensors_found_by_name(ffi_lib, tmp_path):
    ffi, lib = ffi_lib
    names = [f"blk.{i // 9}.w{i % 9}.weight" for i in range(400)]
    w = gguf.GGUFWriter(str(tmp_path / "many.gguf"), "llama")
    for i, name in enumerate(names):
        w.add_tensor(name, np.full(8, i, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = gguf_open(ffi_lib, tmp_path / "many.gguf", mmap=False)
    try:
        for i in reversed(range(len(names))):
            t = lib.gguf_find_tensor(f, names[i].encode())
            assert t == ffi.addressof(f.tensors, i)
            assert np.frombuffer(ffi.buffer(t.data, t.size), np.float32).tolist() == [i] * 8
        assert lib.gguf_find_tensor(f, b"blk.0.w0.weightx") == ffi.NULL
    finally:
        lib.gguf_close(f)


@pytest.fixture(scope="module")
def smollm2_ref(smollm2):
    return gguf.GGUFReader(str(smollm2))


def test_real_model_matches_gguf_reader(ffi_lib, smollm2, smollm2_ref):
    ffi, lib = ffi_lib
    ref = smollm2_ref
    f = gguf_open(ffi_lib, smollm2)
    try:
        assert f.n_tensors == len(ref.tensors) and f.data_offset == ref.data_offset
        for rt in ref.tensors:
            t = lib.gguf_find_tensor(f, rt.name.encode())
            assert t.type == rt.tensor_type and t.size == rt.n_bytes and f.data_offset + t.offset == rt.data_offset
        tok = ref.fields["tokenizer.ggml.tokens"]
        k = lib.gguf_find_kv(f, b"tokenizer.ggml.tokens")
        assert k.arr_n == len(tok.data)
        for i in (0, 1, 1000, len(tok.data) - 1):
            assert ffi.buffer(k.arr_str[i].data, k.arr_str[i].n)[:] == bytes(tok.parts[tok.data[i]])
    finally:
        lib.gguf_close(f)


# ---- damaged copies of a valid file ----

@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> tuple[bytes, int, int]:
    """A small valid file, where its data section starts, and where its last tensor ends."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_string("general.name", "tiny")
    w.add_key_value("tokenizer.ggml.tokens", ["a", "bc", "def"], VT.ARRAY, VT.STRING)
    w.add_key_value("tokenizer.ggml.scores", [0.5, 0.25, 0.125], VT.ARRAY, VT.FLOAT32)
    w.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(3, 8))
    w.add_tensor("blk.0.q", gguf.quants.quantize(np.ones((2, 32), np.float32), QT.Q8_0), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = gguf.GGUFReader(str(path))
    end = max(int(t.data_offset) + int(t.n_bytes) for t in ref.tensors)
    return path.read_bytes(), int(ref.data_offset), end


def test_truncated_files(small_file, tmp_path):
    content, data_start, end = small_file
    cuts = [*range(0, data_start, 7), data_start - 1, data_start, data_start + 1, (data_start + end) // 2, end - 1]
    paths = []
    for n in cuts:
        paths.append(str(tmp_path / f"cut{n}.gguf"))
        Path(paths[-1]).write_bytes(content[:n])
    res = open_batch(paths)
    for p in paths:
        for mmap in (False, True):
            r = res[(p, mmap)]
            assert r["status"] == FORMAT, r
            assert any(w in r["msg"] for w in ("truncated", "exceeds", "absurd", "outside the file", "empty file")), r


def test_fuzzed_files_never_crash(small_file, tmp_path):
    content, data_start, _ = small_file
    rng = random.Random(1234)
    extremes = [0, 1, 31, 1 << 31, 2**32 - 1, 1 << 40, 2**63 - 1, 2**64 - 1]
    paths = []
    for i in range(300):
        b = bytearray(content)
        kind = i % 3
        if kind == 0:  # a few bytes of the header changed
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(data_start)] = rng.randrange(256)
        elif kind == 1:  # an extreme 64-bit value written over the header
            pos = rng.randrange(data_start - 8)
            b[pos:pos + 8] = struct.pack("<Q", rng.choice(extremes))
        else:  # changed and cut short
            b[rng.randrange(len(b))] = rng.randrange(256)
            del b[rng.randrange(1, len(b)):]
        paths.append(str(tmp_path / f"fuzz{i}.gguf"))
        Path(paths[-1]).write_bytes(bytes(b))
    res = open_batch(paths)
    assert len(res) == 2 * len(paths)
    n_ok = 0
    for r in res.values():
        assert r["status"] in (0, FORMAT, UNSUPPORTED), r
        if r["status"]:
            assert r["path"] in r["msg"] and len(r["msg"]) > len(r["path"]) + 10, r
        else:
            n_ok += 1
            assert r["bad"] == [], r
    assert 0 < n_ok < len(res)  # the mutations reach both outcomes


# ---- through innerq_model_load (runs once the model loader is in the library) ----

def model_load(ffi_lib, path: str):
    ffi, lib = ffi_lib
    try:
        load = lib.innerq_model_load
    except AttributeError:
        pytest.skip("innerq_model_load is not in the library yet")
    out = ffi.new("innerq_model **")
    if load(b"/nonexistent/model.gguf", ffi.NULL, out) == UNSUPPORTED:
        pytest.skip("innerq_model_load is a stub")
    st = load(path.encode(), ffi.NULL, out)
    return st, ffi.string(lib.innerq_last_error()).decode("utf-8", "replace"), out[0]


@pytest.mark.parametrize("name", ["bad_magic", "version_1", "tensor_count_2^40", "dim_zero", "offset_beyond_file",
                                  "overlapping", "empty"])
def test_model_load_reports_reader_errors(ffi_lib, tmp_path, name):
    content, status, words = BAD[name]
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(content)
    st, msg, model = model_load(ffi_lib, str(path))
    assert model == ffi_lib[0].NULL
    assert st == status and str(path) in msg and all(w in msg for w in words), msg


def test_model_load_missing_file(ffi_lib, tmp_path):
    st, msg, _ = model_load(ffi_lib, str(tmp_path / "absent.gguf"))
    assert st == IO and "absent.gguf" in msg and "No such file" in msg


def test_model_load_metadata_text(ffi_lib, smollm2, smollm2_ref):
    ffi, lib = ffi_lib
    st, msg, model = model_load(ffi_lib, str(smollm2))
    if st == UNSUPPORTED:
        pytest.skip(msg)
    assert st == 0, msg
    try:
        fields = [fl for fl in smollm2_ref.fields.values() if not fl.name.startswith("GGUF.")]
        assert lib.innerq_model_meta_count(model) == len(fields)
        buf = ffi.new("char[4096]")
        for fl in fields:
            n = lib.innerq_model_meta_value(model, fl.name.encode(), buf, 4096)
            text = ffi.string(buf).decode("utf-8", "replace")
            if fl.types[0] == VT.STRING:
                assert text == fl.contents() and n == len(fl.contents().encode()), fl.name
            elif fl.types[0] == VT.ARRAY and fl.types[1] == VT.STRING:
                count = len(fl.data)
                assert text == f"[{count} string{'' if count == 1 else 's'}]", fl.name
            elif fl.types[0] in (VT.UINT32, VT.INT32, VT.UINT64, VT.INT64, VT.UINT8):
                assert text == str(fl.contents()), fl.name
            elif fl.types[0] == VT.BOOL:
                assert text == str(fl.contents()).lower(), fl.name
        assert lib.innerq_model_meta_value(model, b"no.such.key", buf, 4096) == -1
    finally:
        lib.innerq_model_free(model)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker_main(sys.argv[2])
