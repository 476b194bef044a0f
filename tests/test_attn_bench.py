"""innerq-attn-bench runs every cache type with tiny settings and reports what it says.

No timing is asserted. The bytes a cache type must read are checked against docs/DESIGN.md
section 3 worked out here: ggml row sizes (gguf's GGML_QUANT_SIZES) for plain types; for
quantized types the f16 sink and recent windows plus the quantized blocks, each block holding
G tokens at b bits per element and one fp16 (d, m) pair per G elements.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from conftest import tool_path
from cuda_lib import cuda_lib_path

N = 256
HEADS, KV_HEADS, D = 9, 3, 64
PLAIN = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
         "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
# --kv name -> (type_k, type_v, bits_k, bits_v, sink S, recent R), docs/DESIGN.md 3.2 and 3.5
QUANT = {
    "kivi2": ("kivi2", "kivi2", 2, 2, 0, 128),
    "kivi4": ("kivi4", "kivi4", 4, 4, 0, 128),
    "innerq2": ("innerq2", "innerq2", 2, 2, 32, 96),
    "innerq3": ("innerq3", "innerq3", 3, 3, 32, 96),
    "innerq4": ("innerq4", "innerq4", 4, 4, 32, 96),
    "innerq": ("innerq3", "innerq2", 3, 2, 32, 96),
}
ALL = list(PLAIN) + list(QUANT)


def run(*args, check=True):
    r = subprocess.run([tool_path("innerq-attn-bench"), *args], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def expected_bytes(kv: str, n: int, group: int = 64, vscale: bool = False) -> float:
    """What attention over n stored tokens reads; InnerQ with value row scales: a byte per token
    and KV head more (docs/INNERQ.md)."""
    if kv in PLAIN:
        blck, size = GGML_QUANT_SIZES[PLAIN[kv]]
        return 2 * n * KV_HEADS * D // blck * size
    _, _, bk, bv, sink, recent = QUANT[kv]
    n_sink = min(n, sink)
    # after every store the recent window keeps R .. R+G-1 tokens; the rest went to blocks
    n_quant = max(0, (n - n_sink - recent) // group) * group
    windows = (n - n_quant) * KV_HEADS * D * 2 * 2
    blocks = n_quant * KV_HEADS * D * (bk + bv) / 8 + (n_quant // group) * KV_HEADS * 2 * D * 4
    scales = n_quant * KV_HEADS if vscale and kv.startswith("innerq") else 0
    return windows + blocks + scales


@pytest.fixture(scope="module")
def rows():
    r = run("--heads", f"{HEADS}/{KV_HEADS}", "-D", str(D), "-N", str(N), "-r", "1", "-t", "1",
            "--kv", ",".join(ALL), "-o", "json")
    return {f"{x['type_k']}/{x['type_v']}": x for x in json.loads(r.stdout)}


def test_markdown_has_a_row_per_type():
    out = run("-N", str(N), "-r", "1", "-t", "1", "--kv", ",".join(ALL)).stdout.splitlines()
    body = [ln for ln in out if ln.startswith("|")][2:]
    assert len(body) == len(ALL)
    for kv, ln in zip(ALL, body):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        tk, tv = (kv, kv) if kv in PLAIN else QUANT[kv][:2]
        assert cells[5:7] == [tk, tv] and cells[4] == str(N)
        assert float(cells[7]) > 0 and float(cells[8]) > 0 and cells[9].endswith("x")


@pytest.mark.parametrize("kv", ALL)
def test_json_row(rows, kv):
    tk, tv = (kv, kv) if kv in PLAIN else QUANT[kv][:2]
    x = rows[f"{tk}/{tv}"]
    assert (x["n_head"], x["n_kv_head"], x["head_dim"], x["n_tokens"]) == (HEADS, KV_HEADS, D, N)
    assert x["us_median"] > 0 and len(x["samples_us"]) == 1
    assert x["bytes"] == pytest.approx(expected_bytes(kv, N))
    assert x["gb_per_s"] == pytest.approx(x["bytes"] / x["us_median"] / 1e3, rel=1e-3)
    if kv == "f16":
        assert x["speedup_vs_f16"] == pytest.approx(1.0)


def test_value_row_scales_read_a_byte_per_token_more():
    x = json.loads(run("--heads", f"{HEADS}/{KV_HEADS}", "-D", str(D), "-N", str(N), "-r", "1", "-t", "1",
                       "--kv", "innerq", "--kv-value-scales", "-o", "json").stdout)
    assert x[0]["bytes"] == pytest.approx(expected_bytes("innerq", N, vscale=True))
    assert x[0]["bytes"] > expected_bytes("innerq", N)


def test_group_and_long_context_bytes():
    n = 1000  # several flushes, a window that is not full
    x = json.loads(run("-N", str(n), "-r", "1", "-t", "2", "--kv-k", "innerq3", "--kv-v", "innerq2",
                       "--kv-group", "32", "-o", "json").stdout)
    assert len(x) == 1 and x[0]["kv_group"] == 32
    assert x[0]["bytes"] == pytest.approx(expected_bytes("innerq", n, group=32))
    assert x[0]["speedup_vs_f16"] > 0  # against an f16 run made for the ratio


def test_layers_cycle_through_copies_of_the_cache():
    """--layers N times one call on each of N copies in turn (a model's decode step reads its
    layers so): the same bytes per call, and a result per type."""
    x = json.loads(run("-N", str(N), "-r", "1", "-t", "1", "--kv", "f16,innerq", "--layers", "5", "-o", "json").stdout)
    assert [r["layers"] for r in x] == [5, 5]
    for r, kv in zip(x, ("f16", "innerq")):
        assert r["bytes"] == pytest.approx(expected_bytes(kv, N)) and r["us_median"] > 0
    md = run("-N", str(N), "-r", "1", "-t", "1", "--kv", "innerq", "--layers", "3").stdout
    assert md.startswith("3 copies of each layer's cache")


def test_presets():
    x = json.loads(run("--preset", "smollm,llama3-8b", "-N", "128", "-r", "1", "-t", "1", "--kv", "f16",
                       "-o", "json").stdout)
    assert [(r["config"], r["n_head"], r["n_kv_head"], r["head_dim"]) for r in x] == [
        ("smollm", 9, 3, 64), ("llama3-8b", 32, 8, 128)]


@pytest.mark.parametrize("args", [
    ["--bogus"],
    ["--heads", "9/4"],
    ["--heads", "nine"],
    ["-N", "0"],
    ["-o", "xml"],
    ["--kv", "f8"],
    ["--kv", "innerq3", "--kv-k", "f16"],
    ["--preset", "gpt5"],
    ["--preset", "smollm", "-D", "64"],
    ["--kv-group", "48"],
    ["-r"],
    ["--device", "gpu"],
    ["--device", "cpu", "-ngl", "1"],
    ["--device", "cuda", "-ngl", "0"],
    ["-ngl", "-2"],
    ["--layers", "0"],
    ["--layers", "2", "--device", "cuda"],
])
def test_bad_flags_exit_2(args):
    r = run(*args, check=False)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("innerq-attn-bench: error: ")


def test_unsupported_shape_is_a_runtime_error():
    r = run("-D", "48", "-N", "64", "--kv", "q8_0", check=False)  # q8_0 rows need D % 32 == 0
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("innerq-attn-bench: error: ")


def test_one_side_names_both_and_combinations():
    x = json.loads(run("-N", "64", "-r", "1", "-t", "1", "--kv-k", "q8_0,f16", "-o", "json").stdout)
    assert [(r["type_k"], r["type_v"]) for r in x] == [("q8_0", "q8_0"), ("f16", "f16")]
    x = json.loads(run("-N", "64", "-r", "1", "-t", "1", "--kv-k", "f16,q8_0", "--kv-v", "f32,q4_0",
                       "-o", "json").stdout)
    assert [(r["type_k"], r["type_v"]) for r in x] == [("f16", "f32"), ("f16", "q4_0"), ("q8_0", "f32"),
                                                        ("q8_0", "q4_0")]


def test_llama2_preset():
    x = json.loads(run("--preset", "llama2-7b", "-N", "64", "-r", "1", "-t", "1", "--kv", "f16", "-o", "json").stdout)
    assert [(r["config"], r["n_head"], r["n_kv_head"], r["head_dim"], r["device"]) for r in x] == [
        ("llama2-7b", 32, 32, 128, "cpu")]


@pytest.mark.parametrize("flag", [["--device", "cuda"], ["-ngl", "99"]])
def test_gpu_without_cuda_is_a_clear_error(flag):
    """A build without CUDA, or a machine without a device: one error line, status 1, no table."""
    r = run(*flag, "-N", "64", "-r", "1", "--kv", "f16", check=False)
    if r.returncode == 0:
        pytest.skip("this build sees a CUDA device")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("innerq-attn-bench: error: GPU: ")
    assert "no CUDA backend" in lines[0] or "no CUDA device" in lines[0]


GPU_KV = ["f16", "q8_0", "q4_0", "kivi2", "innerq2", "innerq4", "innerq"]


def test_gpu_table_columns():
    """The GPU mode on a tiny cache: a row per type with the floor columns filled in."""
    tool = Path(cuda_lib_path()).parent / "innerq-attn-bench"
    if not tool.is_file():
        pytest.skip(f"{tool} not built")
    n = 4096  # past the windows, and kernels long enough for the difference timing to be positive
    r = subprocess.run([str(tool), "-ngl", "99", "--preset", "llama3-8b", "-N", str(n), "-r", "3", "--copy-mib", "64",
                        "--kv", ",".join(GPU_KV)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("device: ") and "GB/s" in out[0]
    table = [ln for ln in out if ln.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[7:] == ["µs/call", "GB/s", "vs f16", "floor µs", "x floor", "kernel"]
    body = table[2:]
    assert len(body) == len(GPU_KV)
    kernels = {}
    for kv, ln in zip(GPU_KV, body):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        tk, tv = (kv, kv) if kv in PLAIN else QUANT[kv][:2]
        assert cells[3] == "gpu" and cells[4] == str(n) and cells[5:7] == [tk, tv]
        us, gbps, floor_us = float(cells[7]), float(cells[8]), float(cells[10])
        assert us > 0 and gbps > 0 and floor_us > 0
        # x floor is computed before rounding: allow the two-decimal rounding of both cells
        assert float(cells[11].rstrip("x")) == pytest.approx(us / floor_us, rel=0.02, abs=0.01 + 0.006 * us / floor_us ** 2)
        kernels[kv] = cells[12]
    assert kernels["f16"] == "plain" and kernels["innerq"] == "fused"

    x = json.loads(subprocess.run([str(tool), "--device", "cuda", "--heads", "8/2", "-D", "128", "-N", str(n), "-r",
                                   "1", "--copy-mib", "64", "--kv", "f16,innerq", "-o", "json"],
                                  capture_output=True, text=True, timeout=300, check=True).stdout)
    assert [r["device"] for r in x] == ["cuda", "cuda"]
    inq = x[1]
    assert inq["kv_group"] == 32  # the GPU's default group
    assert inq["floor_us"] == pytest.approx(inq["bytes"] / inq["copy_gb_per_s"] / 1e3, rel=1e-3)
    assert inq["x_floor"] == pytest.approx(inq["us_median"] / inq["floor_us"], rel=1e-3)
