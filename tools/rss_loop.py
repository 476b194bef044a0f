"""Loads and frees a model N times in one process and reports the resident memory (RSS).

Each round opens innerq.Llama, evaluates a short prompt, generates a few tokens and closes
it. The figure that matters is the growth of the highest RSS of a window of rounds, from
just after the warm-up to the end: a leak of the model, the context or the compute buffers
shows up as steady growth.

    python tools/rss_loop.py [MODEL] [-n 50] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a .gguf path or a known model name (default: the default model)")
    ap.add_argument("-n", "--rounds", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3, help="rounds before the baseline window")
    ap.add_argument("--window", type=int, default=10, help="rounds whose highest RSS is compared")
    ap.add_argument("-c", "--ctx-size", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from innerq import Llama, models

    path = models.resolve(args.model)
    samples = []
    for i in range(args.rounds):
        with Llama(path, n_ctx=args.ctx_size, n_threads=2) as llm:
            llm.generate("The quick brown fox", max_tokens=2, temperature=0)
        samples.append(rss_bytes())
    # The allocator returns memory to the system in bursts, so single samples swing by several
    # MiB; the highest RSS of a window of rounds is steady unless something leaks.
    w = args.window
    base = max(samples[args.warmup:args.warmup + w])
    end = max(samples[-w:])
    result = {"model": str(path), "rounds": args.rounds, "rss_first_mib": samples[0] / 2**20,
              "rss_baseline_mib": base / 2**20, "rss_end_mib": end / 2**20, "growth_mib": (end - base) / 2**20,
              "min_mib": min(samples) / 2**20, "peak_mib": max(samples) / 2**20}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.rounds} load/generate/free rounds of {path.name}: highest RSS of rounds "
              f"{args.warmup + 1}-{args.warmup + w}: {result['rss_baseline_mib']:.1f} MiB, of the last {w}: "
              f"{result['rss_end_mib']:.1f} MiB (growth {result['growth_mib']:+.2f} MiB; all rounds "
              f"{result['min_mib']:.1f} .. {result['peak_mib']:.1f} MiB)")


if __name__ == "__main__":
    main()
