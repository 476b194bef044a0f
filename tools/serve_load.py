"""Concurrent streaming chat clients against an OpenAI-compatible server (`innerq serve`,
llama-server, ...), measured: aggregate completion tokens per second, time to the first token
(p50, p99) and time per output token (p50, p99), over rounds of N clients that start together.

Each client sends one greedy streamed chat completion (POST /v1/chat/completions, a shared
system prompt and a question of its own, numbered by round so that no round repeats a prompt;
max_tokens tokens) and reads the server-sent events; the tokens are the content chunks (one
token each, as both servers send them) unless the server reports usage. Aggregate tokens per
second: all clients' tokens over the round's wall time, from the first request to the last
answer. A first round, not timed, warms the server up (--warmup 0: none); with --check-alone its requests are
first sent one at a time, and the concurrent answers are checked against those texts.

    python tools/serve_load.py --url http://127.0.0.1:8080 --clients 16 --max-tokens 64 --rounds 3
    python tools/serve_load.py ... --document tests/data/sense-and-sensibility.txt --document-words 1000

--document puts that many words of a text into the system prompt (questions about a shared
document: a long prompt prefix that every request has); with --distinct each request gets its
own slice of the text instead (long prompts that share nothing: every request's prompt is read
in full). The decode rate: the tokens all clients received while every one of them was
decoding (from the last first token to the first answer's end) over that time. With --prefill
each round's requests are first sent with max_tokens 1 (timed apart: the prompt tokens per
second under load), so the servers hold the prompts in their prompt caches and the timed round
decodes all clients together from their cached prompts (a chat's next turn at depth).

    python tools/serve_load.py ... --clients 64 --max-tokens 128 --document T.txt --document-words 6000 --distinct --prefill
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

SYSTEM = "You are a helpful assistant. Answer in a few plain sentences."
QUESTIONS = [
    "What is the capital of France?", "How do plants make their food?", "Why is the sky blue?",
    "What is a prime number?", "How does a bicycle stay upright?", "What causes the seasons on Earth?",
    "Who wrote Pride and Prejudice?", "What is the boiling point of water?", "How do bees make honey?",
    "What is the speed of light?", "Why do cats purr?", "How many continents are there?",
    "What is photosynthesis?", "How does a rainbow form?", "What is the largest ocean?", "Why do leaves fall?",
]


def stream_chat(url: str, body: dict, headers: dict) -> dict:
    """One streamed chat completion: its text, token count and times (seconds since the send)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json", **headers})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    text, times, usage, prompt = [], [], None, 0
    while True:
        line = response.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage, prompt = chunk["usage"]["completion_tokens"], chunk["usage"].get("prompt_tokens", 0)
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
                times.append(time.perf_counter() - t0)
    conn.close()
    return {"text": "".join(text), "tokens": usage if usage is not None else len(times), "times": times,
            "end": time.perf_counter() - t0, "t0": t0, "prompt_tokens": prompt}


def system_prompt(i: int, rnd: int, args) -> str:
    if not args.distinct:
        return args.system
    words, n = args.words, args.document_words
    at = ((rnd * args.clients + i) * 997) % max(1, len(words) - n)  # a slice of its own each request
    return f"{SYSTEM} Use this text ({rnd}.{i}):\n" + " ".join(words[at:at + n])


def body(i: int, rnd: int, args, max_tokens: int | None = None) -> dict:
    question = f"Question {rnd}.{i}: {QUESTIONS[i % len(QUESTIONS)]}"
    b = {"messages": [{"role": "system", "content": system_prompt(i, rnd, args)},
                      {"role": "user", "content": question}],
         "max_tokens": max_tokens or args.max_tokens, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}}
    if args.model:
        b["model"] = args.model
    return b


def run_round(args, rnd: int, headers: dict, max_tokens: int | None = None) -> tuple[float, list[dict]]:
    """All clients at once: (wall seconds, each client's result)."""
    results: list = [None] * args.clients
    errors: list = []
    start = threading.Barrier(args.clients + 1)

    def client(i: int) -> None:
        start.wait()
        try:
            results[i] = stream_chat(args.url, body(i, rnd, args, max_tokens), headers)
        except Exception as e:  # reported after the round
            errors.append(f"client {i}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors))
    return wall, results


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summary(wall: float, results: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["times"][0] for r in results if r["times"]]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in results if len(r["times"]) > 1]
    # every client decoding: from the last first token to the first client's last token
    timed = [r for r in results if len(r["times"]) > 1]
    lo = max((r["t0"] + r["times"][0] for r in timed), default=0.0)
    hi = min((r["t0"] + r["times"][-1] for r in timed), default=0.0)
    in_window = sum(1 for r in timed for t in r["times"] if lo < r["t0"] + t <= hi)
    decode = in_window / (hi - lo) if hi > lo and len(timed) == len(results) else 0.0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": decode, "decode_window_s": max(0.0, hi - lo),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_ms": 1000 * percentile(tpot, 50), "tpot_p99_ms": 1000 * percentile(tpot, 99),
            "completed": sum(1 for r in results if r["tokens"] > 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="the request's model field (default: none)")
    ap.add_argument("--api-key")
    ap.add_argument("--check-alone", action="store_true", help="also check each answer against the request alone")
    ap.add_argument("--json", action="store_true", help="one JSON line per round")
    ap.add_argument("--document", help="a text whose first --document-words words go into the system prompt")
    ap.add_argument("--document-words", type=int, default=1000)
    ap.add_argument("--distinct", action="store_true", help="each request its own slice of --document")
    ap.add_argument("--warmup", type=int, default=1, choices=(0, 1), help="an untimed first round (default 1)")
    ap.add_argument("--prefill", action="store_true",
                    help="before each timed round, its requests with max_tokens 1 (the prompts read and cached), "
                         "so that the round decodes every client together")
    args = ap.parse_args()
    args.system = SYSTEM
    if args.distinct and not args.document:
        ap.error("--distinct needs --document")
    if args.document:
        words = open(args.document, encoding="utf-8").read().split()
        start = len(words) // 7  # past the front matter
        args.words = words[start:]
        args.system += " Use this text:\n" + " ".join(words[start:start + args.document_words])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.check_alone:
        alone = [stream_chat(args.url, body(i, 0, args), headers)["text"] for i in range(args.clients)]
        _wall, results = run_round(args, 0, headers)
        same = sum(1 for i, res in enumerate(results) if res["text"] == alone[i])
        print(f"same text as alone: {same}/{args.clients}", flush=True)
    elif args.warmup:
        run_round(args, 0, headers)
    for r in range(1, args.rounds + 1):
        if args.prefill:
            wall, results = run_round(args, r, headers, max_tokens=1)
            n = sum(res["prompt_tokens"] for res in results)
            print(json.dumps({"prefill_wall_s": wall, "prompt_tokens": n, "prompt_tokens_per_s": n / wall})
                  if args.json else f"round {r} prefill: {n} prompt tokens in {wall:.2f} s = {n / wall:.1f} tok/s",
                  flush=True)
        wall, results = run_round(args, r, headers)
        s = summary(wall, results)
        if args.json:
            print(json.dumps(s), flush=True)
        else:
            print(f"round {r}: {s['completed']}/{args.clients} completed, {s['tokens']} tokens in "
                  f"{s['wall_s']:.2f} s = {s['tokens_per_s']:.1f} tok/s; TTFT p50 {s['ttft_p50_s']:.3f} s p99 "
                  f"{s['ttft_p99_s']:.3f} s; TPOT p50 {s['tpot_p50_ms']:.1f} ms p99 {s['tpot_p99_ms']:.1f} ms; "
                  f"decode {s['decode_tokens_per_s']:.1f} tok/s over {s['decode_window_s']:.2f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
