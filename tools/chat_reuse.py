"""A multi-turn chat with prefix reuse, measured: how many prompt tokens each cache evaluates,
how long a follow-up takes to its first token, and how far the reused logits are from a fresh
evaluation's (docs/ACCURACY.md, docs/BENCHMARKS.md).

Each turn sends the whole conversation so far with the next user message (a passage of the
text), as a chat client using llama-cpp-python's API does (create_chat_completion with the
history), streams the greedy reply (innerq chat's call) and keeps it in the history. Per cache:
the prompt tokens and those evaluated (the rest were kept), the time to the first token of each
follow-up, and, against a fresh context given the same prompt, the KL divergence of the logits
at the prompt's end: KL(fresh || reused), next to the cache's own KL(f16 fresh || fresh).

    python tools/chat_reuse.py -m MODEL -f TEXT [-f TEXT ...] [--turns 5] [--kv innerq,f16]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from innerq import Llama  # noqa: E402


def kld(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of the softmaxes of two rows of logits."""
    lp = p_logits - np.logaddexp.reduce(p_logits.astype(np.float64))
    lq = q_logits - np.logaddexp.reduce(q_logits.astype(np.float64))
    return float(np.sum(np.exp(lp) * (lp - lq)))


def passages(path: Path, n: int, words: int) -> list[str]:
    """n user messages: consecutive passages of about `words` words of the text."""
    text = path.read_text(encoding="utf-8").split()
    start = len(text) // 7  # past front matter
    return ["Read this and say what happens next:\n" + " ".join(text[start + i * words:start + (i + 1) * words])
            for i in range(n)]


def prompt_logits(llm: Llama, history: list[dict]) -> np.ndarray:
    """The logits at the end of the chat prompt of history, evaluated in a fresh context."""
    ids = llm.tokenize(llm.chat_prompt(history).encode(), add_bos=False, special=True)
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[-1], dtype=np.float32)


def run(model: str, text: Path, kv: str, args) -> dict:
    common = dict(n_ctx=args.ctx, n_threads=args.threads, verbose=False)
    llm = Llama(model, kv_type=kv, logits_all=True, **common)  # scores[i]: the logits after token i
    fresh = Llama(model, kv_type=kv, **common)
    exact = Llama(model, kv_type="f16", **common)
    evaluated = []
    decode = llm._decode
    llm._decode = lambda ids, progress=None: (evaluated.append(len(ids)), decode(ids, progress))
    history = [{"role": "system", "content": "You are a careful reader."}]
    out = {"prompt": [], "evaluated": [], "ttft": [], "kld_reuse": [], "kld_cache": []}
    for i, user in enumerate(passages(text, args.turns, args.words)):
        history.append({"role": "user", "content": user})
        n_prompt = len(llm.tokenize(llm.chat_prompt(history).encode(), add_bos=False, special=True))
        evaluated.clear()
        t0 = time.perf_counter()
        stream = llm.create_chat_completion(history, max_tokens=args.max_tokens, temperature=0, stream=True)
        reply, first = [], None
        for chunk in stream:
            piece = chunk["choices"][0]["delta"].get("content")
            if piece and first is None:
                first = time.perf_counter() - t0
            reply.append(piece or "")
        logits = np.array(llm.scores[n_prompt - 1], dtype=np.float32)
        out["prompt"].append(n_prompt)
        out["evaluated"].append(evaluated[0] if evaluated else 0)
        out["ttft"].append(first if first is not None else float("nan"))
        if i > 0 and first is not None:  # a follow-up: reused against fresh, and the cache against f16
            want = prompt_logits(fresh, history)
            out["kld_reuse"].append(kld(want, logits))
            out["kld_cache"].append(kld(prompt_logits(exact, history), want))
        history.append({"role": "assistant", "content": "".join(reply)})
    for m in (llm, fresh, exact):
        m.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-f", "--file", action="append", required=True, help="a text to take the user messages from")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--words", type=int, default=180, help="words per user message")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv", default="innerq,f16", help="caches to compare (comma-separated)")
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    print("| text | cache | prompt tokens | evaluated | evaluated / prompt | follow-up TTFT s (median) | "
          "KL(fresh‖reused) | KL(f16‖fresh) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for f in args.file:
        for kv in args.kv.split(","):
            r = run(args.model, Path(f), kv, args)
            prompt, ev = sum(r["prompt"]), sum(r["evaluated"])
            print(f"| {Path(f).name} | {kv} | {prompt} | {ev} | {ev / prompt:.3f} | "
                  f"{np.median(r['ttft'][1:]):.3f} | {np.mean(r['kld_reuse']):.6f} | {np.mean(r['kld_cache']):.6f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
