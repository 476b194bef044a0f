"""innerq next to llama.cpp (through llama-cpp-python, an optional dependency of this tool only).

    python tools/compare_llamacpp.py greedy -m MODEL -p "The capital of France is" -n 16
    python tools/compare_llamacpp.py kld -m MODEL -f tests/data/sense-and-sensibility.txt --tokens 512
    python tools/compare_llamacpp.py bench -m MODEL -t 2 -r 5 --innerq build/innerq-bench
    python tools/compare_llamacpp.py ppl-kld -m MODEL --base BASE --kv q8_0 -t 2
    python tools/compare_llamacpp.py ppl-kld -m MODEL --base BASE --kv f16 -t 2 --save-base LLAMA_BASE

Both engines get the same token ids (llama.cpp's tokenization; whether innerq's agrees is
printed). `bench` times llama.cpp with the definitions of innerq-bench (depth prefilled
untimed, prompt processing in batches of 512, generation one token per decode), prints JSON
with llama-bench's field names and, with --innerq, runs innerq-bench on the same tests and
prints a markdown table of medians and ratios. `ppl-kld` is innerq-perplexity --kl-divergence
run by llama.cpp: the chunks and base log-probabilities of a file written by innerq-perplexity
--kl-divergence-base, the same decode semantics (docs/DESIGN.md section 4), the same statistics and
output lines; with --save-base it also writes llama.cpp's own log-probabilities of those chunks
as a base file, so that llama.cpp's quantized caches can be compared with its own f16 cache
(--base LLAMA_BASE), as innerq's are with innerq's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from innerq_session import Session  # noqa: E402
from logit_stats import KldStats, kl_divergence, kld_from_codes, log_softmax, top1_agreement  # noqa: E402

# ggml type ids of the cache types llama.cpp is asked for
LLAMA_KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8}


_LOG_SINK = None


def _llama_cpp():
    """llama_cpp, with its C-level logging silenced (the low-level API logs every load)."""
    global _LOG_SINK
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install llama-cpp-python")
    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_LOG_SINK, None)
    return llama_cpp


def llama_open(model: str, n_ctx: int, n_threads: int, kv: str = "f16"):
    llama_cpp = _llama_cpp()
    return llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, logits_all=True, n_threads=n_threads,
                           n_threads_batch=n_threads, verbose=False, flash_attn=True,
                           type_k=LLAMA_KV_TYPES[kv], type_v=LLAMA_KV_TYPES[kv])


class LlamaContext:
    """One model and one single-sequence context through llama.cpp's C API, flash attention
    on, keys and values of cache type kv."""

    def __init__(self, model: str, *, n_ctx: int, n_batch: int, n_threads: int, kv: str):
        self.lib = lib = _llama_cpp()
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(model.encode(), lib.llama_model_default_params())
        if not self.model:
            sys.exit(f"llama.cpp could not load {model}")
        cp = lib.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = self.n_batch = n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k = cp.type_v = LLAMA_KV_TYPES[kv]
        cp.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            sys.exit("llama.cpp could not create a context")
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)

    def decode(self, tokens: list[int]) -> None:
        """tokens in batches of n_batch, each asking for its last token's logits only."""
        for i in range(0, len(tokens), self.n_batch):
            part = tokens[i:i + self.n_batch]
            arr = (self.lib.llama_token * len(part))(*part)
            if self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(arr, len(part))) != 0:
                sys.exit("llama_decode failed")
        self.lib.llama_synchronize(self.ctx)

    def eval_all(self, tokens: list[int], pos0: int) -> np.ndarray:
        """tokens (at most n_batch) at positions pos0.. in one batch; a copy of every token's
        logits. llama.cpp writes a batch into its cache before attending, so token i reads the
        earlier ones (and itself) as stored, exactly as decoding them one at a time does."""
        lib, n = self.lib, len(tokens)
        b = lib.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, 1
                b.seq_id[i][0] = 0
            b.n_tokens = n
            if lib.llama_decode(self.ctx, b) != 0:
                sys.exit("llama_decode failed")
            lib.llama_synchronize(self.ctx)
            return np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                             for i in range(n)]).copy()
        finally:
            lib.llama_batch_free(b)

    def last_logits(self) -> np.ndarray:
        """The logits of the last token decoded (a view into llama.cpp's buffer)."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def llama_tokens(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=llm.metadata.get("tokenizer.ggml.add_bos_token") == "true",
                        special=False)


def greedy_llama(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def greedy_innerq(s: Session, prompt: list[int], n: int) -> list[int]:
    s.clear()
    s.decode(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(s.logits(-1))))
        s.decode([out[-1]])
    return out


def cmd_greedy(a) -> None:
    llm = llama_open(a.model, a.ctx, a.threads, a.kv)
    prompt = llama_tokens(llm, a.prompt)
    with Session(a.model, n_ctx=a.ctx, n_threads=a.threads, kv_k=a.kv, kv_v=a.kv) as s:
        same = s.tokenize(a.prompt, add_special=True) == prompt
        ours = greedy_innerq(s, prompt, a.n)
        ours_text = s.detokenize(ours)
    theirs = greedy_llama(llm, prompt, a.n)
    lead = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
    print(f"prompt tokens: {prompt} (innerq's tokenization {'agrees' if same else 'DIFFERS'})")
    print(f"llama.cpp: {theirs}\n  {llm.detokenize(theirs).decode(errors='replace')!r}")
    print(f"innerq:    {ours}\n  {ours_text!r}")
    print(f"matching leading tokens: {lead}/{a.n}")


def passage(llm, path: str, n_tokens: int, offset: int) -> list[int]:
    """n_tokens tokens of the file, starting offset tokens in."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    chars = 8 * (offset + n_tokens)
    while True:
        toks = llm.tokenize(text[:chars].encode(), add_bos=False, special=False)
        if len(toks) >= offset + n_tokens + 1 or chars >= len(text):
            break
        chars *= 2
    toks = toks[offset:offset + n_tokens]
    if len(toks) < n_tokens:
        sys.exit(f"{path} has only {len(toks)} tokens after offset {offset}")
    return toks


def cmd_kld(a) -> None:
    llm = llama_open(a.model, a.tokens, a.threads, a.kv)
    toks = passage(llm, a.file, a.tokens, a.offset)
    llm.eval(toks)
    base = np.array(llm.scores[:len(toks)], dtype=np.float64)
    with Session(a.model, n_ctx=a.tokens, n_threads=a.threads, kv_k=a.innerq_kv or a.kv,
                 kv_v=a.innerq_kv or a.kv) as s:
        ours = s.eval(toks)
    kld = kl_divergence(base, ours)
    print(f"{len(toks)} tokens of {a.file} from token {a.offset}; llama.cpp cache {a.kv}, "
          f"innerq cache {a.innerq_kv or a.kv}")
    print(f"KLD(llama.cpp || innerq): mean {kld.mean():.6f}  median {np.median(kld):.6f}  "
          f"p99 {np.percentile(kld, 99):.6f}  max {kld.max():.6f}")
    print(f"top-1 agreement: {100 * top1_agreement(base, ours):.2f}%")


# ---- ppl-kld ----

class KldBase:
    """A file of base log-probabilities (innerq-perplexity --kl-divergence-base; its format is
    described in tools/perplexity.c), mapped rather than read: 8 chunks of 4096 tokens of a
    49152-token vocabulary are 1.6 GB."""

    MAGIC, VERSION, NATS, HEADER = b"IQKLBASE", 1, 32.0, 32

    def __init__(self, path: str):
        with open(path, "rb") as f:
            head = f.read(self.HEADER)
        if len(head) < 12 or head[:8] != self.MAGIC:
            sys.exit(f"'{path}' is not a file of base log-probabilities (written by --kl-divergence-base)")
        version = int(np.frombuffer(head, "<u4", 1, 8)[0])
        if version != self.VERSION:
            sys.exit(f"'{path}' has format version {version}; this tool reads version {self.VERSION}")
        if len(head) < self.HEADER:
            sys.exit(f"'{path}' has a damaged header")
        self.n_ctx, self.n_vocab, self.n_chunks = (int(v) for v in np.frombuffer(head, "<i4", 3, 12))
        nats = float(np.frombuffer(head, "<f8", 1, 24)[0])
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunks < 1 or nats != self.NATS:
            sys.exit(f"'{path}' has a damaged header")
        self.first = self.n_ctx // 2
        self.n_scored = self.n_ctx - 1 - self.first
        rec = np.dtype([("nll", "<f8"), ("lo", "<f8"), ("top", "<i4"), ("code", "<u2", (self.n_vocab,))])
        n_tokens = self.n_chunks * self.n_ctx
        expected = self.HEADER + 4 * n_tokens + self.n_chunks * self.n_scored * rec.itemsize
        actual = Path(path).stat().st_size
        if actual != expected:
            sys.exit(f"'{path}' is truncated or damaged ({actual} bytes, its header says {expected})")
        self.tokens = np.memmap(path, "<i4", "r", self.HEADER, (self.n_chunks, self.n_ctx))
        self.records = np.memmap(path, rec, "r", self.HEADER + 4 * n_tokens, (self.n_chunks, self.n_scored))
        if self.tokens.min() < 0 or self.tokens.max() >= self.n_vocab:
            sys.exit(f"'{path}' has a token id out of its vocabulary")


PPL_SCORE_BATCH = 128  # as innerq-perplexity


def cmd_ppl_kld(a) -> None:
    base = KldBase(a.base)
    n_chunks = base.n_chunks if a.chunks < 0 else a.chunks
    if n_chunks < 1 or n_chunks > base.n_chunks:
        sys.exit(f"'{a.base}' holds {base.n_chunks} chunks, --chunks asks for {a.chunks}")
    n_ctx, first = base.n_ctx, base.first
    # n_batch: innerq-perplexity's default -b
    llama = LlamaContext(a.model, n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=a.threads, kv=a.kv)
    if llama.n_vocab != base.n_vocab:
        sys.exit(f"'{a.base}' was computed with a vocabulary of {base.n_vocab} tokens, the model has {llama.n_vocab}")
    print(f"llama.cpp: {n_chunks} chunks of {n_ctx} tokens ({base.n_scored} scored each), n_batch = {llama.n_batch}, "
          f"cache {a.kv}/{a.kv}", file=sys.stderr)
    save = None
    if a.save_base:
        # llama.cpp's own base: the same header and tokens, llama.cpp's log-probabilities
        save = open(a.save_base, "wb")
        with open(a.base, "rb") as f:
            head = bytearray(f.read(KldBase.HEADER))
        head[20:24] = np.array([n_chunks], "<i4").tobytes()
        save.write(bytes(head))
        save.write(np.ascontiguousarray(base.tokens[:n_chunks]).tobytes())
    print(KldStats.CHUNK_HEADER)
    stats = KldStats()
    t_start = time.perf_counter()
    for c in range(n_chunks):
        t = [int(x) for x in base.tokens[c]]
        llama.clear()
        llama.decode(t[:first])
        logits = {}
        for k, j in enumerate(range(first, n_ctx - 1)):
            if j not in logits:  # the scored tokens in batches (eval_all: decode semantics)
                part = range(j, min(j + PPL_SCORE_BATCH, n_ctx - 1))
                logits = dict(zip(part, llama.eval_all([t[i] for i in part], j)))
            lp = log_softmax(logits[j])
            if save is not None:
                save.write(base_record(lp, t[j + 1], base))
            rec = base.records[c, k]
            kld = float(kld_from_codes(rec["lo"], rec["code"], lp, base.NATS))
            stats.add(-lp[t[j + 1]], float(rec["nll"]), kld, int(np.argmax(lp)) == int(rec["top"]))
        if c == 0:
            seconds = time.perf_counter() - t_start
            print(f"llama.cpp: {seconds:.2f} seconds per pass - ETA {seconds * n_chunks / 60:.2f} minutes",
                  file=sys.stderr)
        print(stats.chunk_line(c), flush=True)
    print()
    print(stats.summary(), flush=True)
    llama.close()
    if save is not None:
        save.close()


def base_record(lp: np.ndarray, nxt: int, base: KldBase) -> bytes:
    """One record of a base file, coded as tools/common/kld-base.c's kld_write_record."""
    rec = np.zeros(1, base.records.dtype)
    top = int(np.argmax(lp))
    lo = float(lp[top]) - base.NATS
    code = np.floor((np.asarray(lp, np.float64) - lo) * (65535.0 / base.NATS) + 0.5)
    rec["nll"], rec["lo"], rec["top"] = -float(lp[nxt]), lo, top
    rec["code"][0] = np.clip(code, 0, 65535).astype("<u2")
    return rec.tobytes()


# ---- bench ----

def _bench_llama(a, kv: str) -> list[dict]:
    """pp and tg tests for one cache type through llama.cpp's C API."""
    depths = [int(d) for d in a.depths.split(",")]
    llama = LlamaContext(a.model, n_ctx=max(depths) + max(a.n_prompt, a.n_gen) + 16, n_batch=a.n_batch,
                         n_threads=a.threads, kv=kv)
    lib, mem, decode = llama.lib, llama.mem, llama.decode
    rng = np.random.default_rng(0)

    def run(n_prompt: int, n_gen: int, depth: int) -> dict:
        llama.clear()
        decode([int(t) for t in rng.integers(0, llama.n_vocab, depth)])   # untimed
        samples = []
        for rep in range(a.reps + 1):            # the first run warms up and is not counted
            lib.llama_memory_seq_rm(mem, 0, depth, -1)
            toks = [int(t) for t in rng.integers(0, llama.n_vocab, max(n_prompt, n_gen))]
            t0 = time.perf_counter()
            if n_prompt:
                decode(toks[:n_prompt])
            for t in toks[:n_gen]:
                decode([t])
            if rep:
                samples.append((n_prompt + n_gen) / (time.perf_counter() - t0))
        return {
            "model_filename": a.model, "n_batch": a.n_batch, "n_ubatch": a.n_batch, "n_threads": a.threads,
            "type_k": kv, "type_v": kv, "flash_attn": True, "n_prompt": n_prompt, "n_gen": n_gen,
            "n_depth": depth, "avg_ts": statistics.mean(samples),
            "stddev_ts": statistics.stdev(samples) if len(samples) > 1 else 0.0, "samples_ts": samples,
        }

    results = [run(a.n_prompt, 0, 0)] + [run(0, a.n_gen, d) for d in depths]
    llama.close()
    return results


def _bench_innerq(a, kv: str) -> list[dict]:
    """The same tests through innerq-bench -o json (one invocation per test)."""
    tests = [(a.n_prompt, 0, 0)] + [(0, a.n_gen, int(d)) for d in a.depths.split(",")]
    out = []
    for n_prompt, n_gen, depth in tests:
        cmd = [a.innerq, "-m", a.model, "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth),
               "-t", str(a.threads), "-r", str(a.reps), "--kv", kv, "-o", "json"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr}")
        out += [r for r in _json_records(res.stdout) if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen]
    return out


def _json_records(text: str) -> list[dict]:
    """A JSON array, one object, or one object per line (llama-bench's json and jsonl)."""
    text = text.strip()
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        return [json.loads(ln) for ln in text.splitlines() if ln.strip().startswith("{")]


def _median_ts(r: dict) -> float:
    return statistics.median(r["samples_ts"]) if r.get("samples_ts") else r["avg_ts"]


def _test_name(r: dict) -> str:
    name = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    return name + (f" @ d{r['n_depth']}" if r.get("n_depth") else "")


def _kv_label(r: dict) -> str:
    return r["type_k"] if r["type_k"] == r["type_v"] else f"{r['type_k']}/{r['type_v']}"


def markdown_table(llama: list[dict], innerq: list[dict]) -> str:
    """Median t/s per test and engine/cache type; ratios against the first llama.cpp column."""
    cols = [("llama.cpp", _kv_label(r)) for r in llama] + [("innerq", _kv_label(r)) for r in innerq]
    cols = list(dict.fromkeys(cols))
    by = {}
    for engine, rs in (("llama.cpp", llama), ("innerq", innerq)):
        for r in rs:
            by[(_test_name(r), engine, _kv_label(r))] = _median_ts(r)
    tests = list(dict.fromkeys(_test_name(r) for r in llama + innerq))
    base = cols[0]
    head = ["test"] + [f"{e} {k} t/s" for e, k in cols] + [f"{e} {k} / {base[0]} {base[1]}" for e, k in cols[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in tests:
        vals = [by.get((t, e, k)) for e, k in cols]
        cells = [t] + [f"{v:.2f}" if v else "-" for v in vals]
        cells += [f"{v / vals[0]:.2f}" if v and vals[0] else "-" for v in vals[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cmd_bench(a) -> None:
    llama = [r for kv in a.kv.split(",") for r in _bench_llama(a, kv)]
    print(json.dumps(llama, indent=2))
    if a.innerq:
        innerq = [r for kv in (a.innerq_kv or a.kv).split(",") for r in _bench_innerq(a, kv)]
        print(json.dumps(innerq, indent=2))
        print(markdown_table(llama, innerq))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("-m", "--model", required=True)
        p.add_argument("-t", "--threads", type=int, default=2)
        p.add_argument("--kv", default="f16", help="cache type(s) of llama.cpp (bench: comma list)")

    g = sub.add_parser("greedy", help="greedy tokens from both")
    common(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", type=int, default=16)
    g.add_argument("-c", "--ctx", type=int, default=512)
    k = sub.add_parser("kld", help="KL divergence of innerq's next-token distributions from llama.cpp's")
    common(k)
    k.add_argument("-f", "--file", required=True)
    k.add_argument("--tokens", type=int, default=512)
    k.add_argument("--offset", type=int, default=0, help="tokens of the file to skip")
    k.add_argument("--innerq-kv", help="innerq's cache type (default: --kv)")
    b = sub.add_parser("bench", help="llama.cpp timings with innerq-bench's definitions")
    common(b)
    b.add_argument("-r", "--reps", type=int, default=5)
    b.add_argument("-p", "--n-prompt", type=int, default=512)
    b.add_argument("-n", "--n-gen", type=int, default=64)
    b.add_argument("-b", "--n-batch", type=int, default=512)
    b.add_argument("--depths", default="0,4096", help="depths of the tg tests")
    b.add_argument("--innerq", help="path of innerq-bench: also time innerq and print a table")
    b.add_argument("--innerq-kv", help="innerq's cache type(s) or presets, as innerq-bench --kv (default: --kv)")
    q = sub.add_parser("ppl-kld", help="innerq-perplexity --kl-divergence run by llama.cpp (same chunks and base)")
    common(q)
    q.add_argument("--base", required=True, help="base file written by innerq-perplexity --kl-divergence-base")
    q.add_argument("--chunks", type=int, default=-1, help="evaluate at most N chunks (default -1: all)")
    q.add_argument("--save-base", help="also write llama.cpp's log-probabilities as a base file (the same chunks), "
                   "to compare llama.cpp's quantized caches with its own f16 cache")
    a = ap.parse_args()
    if a.cmd == "ppl-kld" and a.kv not in LLAMA_KV_TYPES:
        ap.error(f"--kv: one of {', '.join(LLAMA_KV_TYPES)}")
    {"greedy": cmd_greedy, "kld": cmd_kld, "bench": cmd_bench, "ppl-kld": cmd_ppl_kld}[a.cmd](a)


if __name__ == "__main__":
    main()
