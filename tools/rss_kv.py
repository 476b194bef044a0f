"""Resident memory of a full KV cache, measured: for each cache type a fresh process loads the
model, makes its weights resident, reads VmRSS, creates a context of n_ctx tokens, decodes
n_ctx tokens of text in batches, and reads VmRSS again. The growth is set against the
cache's buffer (innerq_cache_size) and against the docs/DESIGN.md formula (n_ctx x
innerq_kv_bytes_per_token; quantized types add their fixed windows on top). What the growth
holds beyond the cache is the compute buffers and scratch of the batches.

    nice -n 10 python tools/rss_kv.py [MODEL] [-c 8192] [-b 512] [--kv f16,innerq] [-f TEXT] [--json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

DEFAULT_TEXT = ROOT / "tests" / "data" / "sense-and-sensibility.txt"
MIB = 1024 * 1024


def vm_rss() -> int:
    """Bytes resident now (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(model: str, kv: str, n_ctx: int, n_batch: int, text: Path, threads: int) -> dict:
    """In this process: the RSS growth of one context of cache type kv, decoded full."""
    from innerq._ffi import ffi, lib

    def check(status, what):
        if status != lib.INNERQ_OK:
            raise SystemExit(f"rss_kv: {what}: {ffi.string(lib.innerq_last_error()).decode()}")

    out = ffi.new("innerq_model **")
    check(lib.innerq_model_load(model.encode(), ffi.new("innerq_model_params *", lib.innerq_model_default_params()),
                                out), "loading the model")
    m = out[0]
    # tokens first (their arrays are not the cache's), from enough of the text
    data = text.read_bytes()[: 16 * n_ctx]
    toks = ffi.new("innerq_token[]", len(data) + 8)
    n = ffi.new("int32_t *")
    check(lib.innerq_tokenize(m, data, len(data), True, False, toks, len(data) + 8, n), "tokenizing")
    if n[0] < n_ctx:
        raise SystemExit(f"rss_kv: {text} gives {n[0]} tokens, fewer than n_ctx = {n_ctx}")

    p = ffi.new("innerq_context_params *", lib.innerq_context_default_params())
    names = ffi.new("char[]", kv.encode())
    p.kv_k = p.kv_v = names
    p.n_ctx, p.n_batch, p.n_threads = n_ctx, n_batch, threads
    per_token = ffi.new("double *")
    check(lib.innerq_kv_bytes_per_token(m, p, per_token), "bytes per token")

    # A throwaway context evaluates one batch first, so the mapped weights are resident before
    # the baseline and the growth is the context's own memory.
    octx = ffi.new("innerq_context **")
    warm = ffi.new("innerq_context_params *", p[0])
    warm.n_ctx = n_batch
    check(lib.innerq_context_init(m, warm, octx), "creating the warm-up context")
    check(lib.innerq_decode(octx[0], toks, n_batch), "warm-up decode")
    lib.innerq_context_free(octx[0])

    before = vm_rss()
    check(lib.innerq_context_init(m, p, octx), "creating the context")
    ctx = octx[0]
    t0 = time.monotonic()
    for i in range(0, n_ctx, n_batch):
        check(lib.innerq_decode(ctx, toks + i, min(n_batch, n_ctx - i)), f"decoding tokens {i}..")
    seconds = time.monotonic() - t0
    after = vm_rss()
    result = {"kv": kv, "n_ctx": n_ctx, "n_batch": n_batch, "rss_before_mib": before / MIB,
              "rss_after_mib": after / MIB, "growth_mib": (after - before) / MIB,
              "cache_mib": lib.innerq_cache_size(ctx) / MIB, "formula_mib": n_ctx * per_token[0] / MIB,
              "decode_s": seconds}
    lib.innerq_context_free(ctx)
    lib.innerq_model_free(m)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a .gguf path or a known model name (default: the default model)")
    ap.add_argument("-c", "--ctx-size", type=int, default=8192)
    ap.add_argument("-b", "--batch-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--kv", default="f16,innerq", help="comma-separated cache types (each used for K and V)")
    ap.add_argument("-f", "--file", type=Path, default=DEFAULT_TEXT, help="text to decode")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one measurement in this process
    args = ap.parse_args()

    from innerq import models

    path = str(models.resolve(args.model))
    if args.child:
        print(json.dumps(measure(path, args.child, args.ctx_size, args.batch_size, args.file, args.threads)))
        return
    rows = []
    for kv in args.kv.split(","):
        r = subprocess.run([sys.executable, __file__, path, "--child", kv, "-c", str(args.ctx_size),
                            "-b", str(args.batch_size), "-t", str(args.threads), "-f", str(args.file)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(r.stderr.strip() or f"rss_kv: the measurement of {kv} failed")
        rows.append(json.loads(r.stdout))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{Path(path).name}, n_ctx {args.ctx_size}, decoded in batches of {args.batch_size}")
    print("| kv     | RSS growth MiB | cache buffer MiB | n_ctx x bytes/token MiB | growth - cache MiB | decode s |")
    print("| ------ | -------------: | ---------------: | ----------------------: | -----------------: | -------: |")
    for r in rows:
        print(f"| {r['kv']:<6} | {r['growth_mib']:14.1f} | {r['cache_mib']:16.1f} | {r['formula_mib']:23.1f} | "
              f"{r['growth_mib'] - r['cache_mib']:18.1f} | {r['decode_s']:8.1f} |")


if __name__ == "__main__":
    main()
