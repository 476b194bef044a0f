"""The `innerq` command: run, chat, serve, pull, list, info.

MODEL is a path to a .gguf file, the name of a known model or of a file in the model folder (what
`innerq list` shows), or hf.co/ORG/REPO[:QUANT] (known and hub models are pulled on first use);
without one the default model is used. Generated text goes to stdout, everything else to stderr.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from . import __version__, models
from .progress import ProgressBar


def _c_defaults() -> dict:
    """The C library's defaults (docs/DEFAULTS.md); loaded on first use, so that `innerq pull`
    and `innerq list` work before anything is built."""
    from ._native import defaults

    return defaults()


def _default_help(key: str, text: str) -> str:
    """A help text naming the C default; without a built library the help still prints."""
    try:
        value = _c_defaults()[key]
    except (ImportError, OSError):
        value = "the library's"
    return text.format(value)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help=f"a .gguf path, a name `innerq list` shows, or hf.co/ORG/REPO[:QUANT] (default: "
                   f"{models.DEFAULT_MODEL})")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="same as MODEL")
    p.add_argument("-c", "--ctx-size", type=int, help=_default_help("n_ctx", "context size in tokens (default {}; 0: the model's)"))
    p.add_argument("-b", "--batch-size", type=int, help=_default_help("n_batch", "most tokens per evaluation (default {})"))
    p.add_argument("-t", "--threads", type=int, help=_default_help("n_threads", "threads (default {}: the CPUs this process may use, at most 8)"))
    p.add_argument("--kv", metavar="TYPE", help="KV cache type of keys and values (default innerq: innerq3 keys and "
                   "innerq2 values at least, more bits on the CPU where its windows' bytes allow; `innerq info` "
                   "lists the types)")
    p.add_argument("--kv-k", metavar="TYPE", help="KV cache type of keys")
    p.add_argument("--kv-v", metavar="TYPE", help="KV cache type of values")
    p.add_argument("--kv-group", type=int, help=_default_help("kv_group", "InnerQ group size: 32, 64, 128 (default {}: the backend's)"))
    p.add_argument("--kv-sink", type=int, help=_default_help("kv_sink", "InnerQ sink window (default {}: n_ctx/64 within 32 .. 128; 64 with value row scales; the preset's: 32)"))
    p.add_argument("--kv-recent", type=int, help=_default_help("kv_recent", "InnerQ recent window (default {}: n_ctx/16 within 96 .. 512 (448 with value row scales; the preset's: 96), at least a sliding window + G)"))
    p.add_argument("--no-kv-hybrid", dest="kv_hybrid", action="store_false", default=None,
                   help="asymmetric groups only (no symmetric/asymmetric choice)")
    p.add_argument("--no-kv-norm", dest="kv_norm", action="store_false", default=None,
                   help="no per-channel key normalization")
    p.add_argument("--no-kv-debias", dest="kv_debias", action="store_false", default=None,
                   help="no score correction of quantized keys")
    p.add_argument("--no-kv-norm-pairs", dest="kv_norm_pairs", action="store_false", default=None,
                   help="key normalization per channel, not per RoPE channel pair")
    p.add_argument("--kv-rot", type=int,
                   help="InnerQ Hadamard rotation along head_dim: 0 none, 1 keys, 2 values, 3 both (default -1: both)")
    p.add_argument("--no-kv-search", dest="kv_search", action="store_false", default=None,
                   help="min-max group scales instead of the least-squares search")
    p.add_argument("--kv-value-scales", dest="kv_value_scales", action="store_const", const=1, default=None,
                   help="InnerQ value row scales on (the CPU; default -1: off)")
    p.add_argument("--no-kv-value-scales", dest="kv_value_scales", action="store_const", const=0,
                   help="InnerQ value row scales off")
    p.add_argument("--kv-params8", dest="kv_params8", action="store_const", const=1, default=None,
                   help="InnerQ group parameters in 8 bits (the CPU; default -1: off)")
    p.add_argument("--no-kv-params8", dest="kv_params8", action="store_const", const=0,
                   help="InnerQ group parameters in fp16")
    p.add_argument("--kv-key-levels", dest="kv_key_levels", action="store_const", const=1, default=None,
                   help="InnerQ 3-bit keys on non-uniform (Lloyd-Max) levels (the CPU; default -1: off)")
    p.add_argument("--no-kv-key-levels", dest="kv_key_levels", action="store_const", const=0,
                   help="InnerQ keys on the uniform grid")
    p.add_argument("--kv-bits", type=float, metavar="B",
                   help="InnerQ automatic layout: B effective bits per element of the whole cache at n_ctx (f16 "
                   "windows, (d, m) and norms included); what the windows leave is spent per layer on keys and "
                   "values where the prompt shows they help most (default: off)")
    p.add_argument("--kv-layer-bits", metavar="LIST",
                   help="InnerQ bits of single layers over the types', LAYER:K:V,... (e.g. 0:4:3,29:4:2)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int,
                   help="layers on the GPU: 0 (CPU, the default), N (the last N layers; the rest on the CPU) or "
                        "-1 (the whole model)")
    p.add_argument("--gpu", action="store_true", help="the whole model on the GPU (same as -ngl -1)")
    p.add_argument("-q", "--quiet", action="store_true", help="no loading bar, progress or statistics on stderr")


def _add_sampling_args(p: argparse.ArgumentParser, stop: bool = True) -> None:
    p.add_argument("-n", "--max-tokens", type=int,
                   help=_default_help("n_predict", "most tokens to generate (default {}; -1: to the end of the context)"))
    p.add_argument("--temp", type=float, help=_default_help("temperature", "temperature, <= 0 is greedy (default {})"))
    p.add_argument("--top-k", type=int, help=_default_help("top_k", "keep the N most likely tokens (default {}; 0: off)"))
    p.add_argument("--top-p", type=float, help=_default_help("top_p", "nucleus sampling (default {}; 1: off)"))
    p.add_argument("--min-p", type=float, help=_default_help("min_p", "drop tokens below P times the best (default {}; 0: off)"))
    p.add_argument("--repeat-penalty", type=float, help=_default_help("repeat_penalty", "repetition penalty (default {}: off)"))
    p.add_argument("--seed", type=int, help="sampling seed (default -1: from the clock)")
    if stop:
        p.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")


# argparse dest -> Llama / generate keyword; None (not given) leaves the C default
_LLAMA_ARGS = {"ctx_size": "n_ctx", "batch_size": "n_batch", "threads": "n_threads", "seed": "seed", "kv": "kv_type",
               "kv_k": "kv_k", "kv_v": "kv_v", "kv_group": "kv_group", "kv_sink": "kv_sink", "kv_recent": "kv_recent",
               "kv_hybrid": "kv_hybrid", "kv_norm": "kv_norm", "kv_debias": "kv_debias",
               "kv_norm_pairs": "kv_norm_pairs", "kv_rot": "kv_rot", "kv_search": "kv_search", "kv_bits": "kv_bits",
               "kv_value_scales": "kv_value_scales", "kv_params8": "kv_params8", "kv_key_levels": "kv_key_levels",
               "kv_layer_bits": "kv_layer_bits", "n_gpu_layers": "n_gpu_layers"}
_SAMPLING_ARGS = {"max_tokens": "max_tokens", "temp": "temperature", "top_k": "top_k", "top_p": "top_p",
                  "min_p": "min_p", "repeat_penalty": "repeat_penalty", "seed": "seed"}


def _given(args, names: dict) -> dict:
    return {kw: getattr(args, dest) for dest, kw in names.items() if getattr(args, dest) is not None}


def _sampling(args) -> dict:
    """The sampling keywords with the shared defaults (docs/DEFAULTS.md) filled in: Llama's chat
    completions default to llama-cpp-python's values, and innerq run/chat/serve keep the
    project's."""
    d = _c_defaults()
    shared = {"max_tokens": d["n_predict"], "temperature": d["temperature"], "top_k": d["top_k"], "top_p": d["top_p"],
              "min_p": d["min_p"], "repeat_penalty": d["repeat_penalty"]}
    return {**shared, **_given(args, _SAMPLING_ARGS), "stop": getattr(args, "stop", [])}


def _max_tokens(args) -> int:
    return args.max_tokens if args.max_tokens is not None else _c_defaults()["n_predict"]


def _model_path(args) -> Path:
    return models.resolve(args.model_opt or args.model)


def _prompt_bar(quiet: bool):
    """Progress of a long prompt on a terminal; nothing in a log or a pipe, or with -q."""
    if quiet or not sys.stderr.isatty():
        return None
    bars = {}

    def update(done: int, total: int) -> None:
        bar = bars.setdefault(total, ProgressBar(f"innerq: prompt of {total} tokens"))
        bar.update(done / total)
        if done >= total:
            bar.close()
            bars.clear()
    return update


def _open_llama(args):
    from .llama import Llama
    from .sampling import Sampling

    s = _sampling(args)  # checked here, by the library, before the model is loaded
    Sampling(s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["repeat_penalty"], None, args.seed).check()
    kwargs = _given(args, _LLAMA_ARGS)  # checked by Llama before it loads the model
    if args.gpu:
        kwargs["n_gpu_layers"] = -1
    path = _model_path(args)
    bar = None if args.quiet else ProgressBar(f"innerq: loading {path.name}")
    try:
        llm = Llama(path, progress=bar.update if bar else None, prompt_progress=_prompt_bar(args.quiet), **kwargs)
    except BaseException:
        if bar:
            bar.close(ok=False)
        raise
    if bar:
        bar.close()
    return llm


def _stopped_note(llm, args) -> None:
    """Says so when the reply ended at the token limit rather than where the model ended it."""
    r = llm.last_run
    if r is not None and r.finish_reason == "length" and r.completion_tokens == _max_tokens(args):
        print(f"(stopped after {r.completion_tokens} tokens; -n to change)", file=sys.stderr)


def _stats(llm, args) -> None:
    _stopped_note(llm, args)
    r = llm.last_run
    if r is None or args.quiet:
        return
    gen = r.completion_tokens / r.generate_seconds if r.generate_seconds > 0 else 0.0
    pp = r.prompt_tokens / r.prompt_seconds if r.prompt_seconds > 0 else 0.0
    print(f"innerq: prompt {r.prompt_tokens} tokens ({pp:.1f} tok/s), generated {r.completion_tokens} tokens "
          f"({gen:.1f} tok/s), finish: {r.finish_reason or 'interrupted'}", file=sys.stderr)


def cmd_run(args) -> int:
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            print("innerq run: give a prompt with -p PROMPT (or on stdin)", file=sys.stderr)
            return 2
        from ._native import read_text

        prompt = read_text(sys.stdin.buffer, "the prompt on stdin")
    with _open_llama(args) as llm:
        if args.chat:
            pieces = (c["choices"][0]["delta"].get("content", "")
                      for c in llm.create_chat_completion([{"role": "user", "content": prompt}], stream=True, **_sampling(args)))
        else:
            pieces = llm.generate(prompt, stream=True, **_sampling(args))
        try:
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pieces.close()
            print(file=sys.stderr)
            _stats(llm, args)
            return 130
        print(flush=True)  # as innerq-cli: the text, then a newline
        _stats(llm, args)
    return 0


def _fit_history(llm, history: list[dict], reserve: int) -> None:
    """Drops the oldest turns (keeping a system message) until the prompt leaves `reserve`
    tokens of the context for the reply."""
    first = 1 if history and history[0]["role"] == "system" else 0
    while len(history) - first > 1 and len(llm.chat_tokens(history)) > llm.n_ctx() - reserve:
        del history[first]


def _read_line(prompt: str) -> str:
    """input(prompt), but from a pipe or a file a line of at most innerq_max_text_bytes()."""
    if sys.stdin.isatty():
        return input(prompt)
    from ._native import read_text

    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = read_text(sys.stdin.buffer, "a line on stdin", line=True)
    if not line:
        raise EOFError
    return line.rstrip("\r\n")


def cmd_chat(args) -> int:
    # Ctrl-C must reach the chat even when the shell that started it ignores SIGINT
    # (a background job), so the default handler is put back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    from .errors import InnerQError

    with _open_llama(args) as llm:
        history = [{"role": "system", "content": args.system}] if args.system else []
        reserve = min(256, llm.n_ctx() // 4)
        if sys.stdin.isatty():
            print(f"innerq chat: {llm.model.description}. Enter sends, Ctrl-C stops a reply, Ctrl-D (or Ctrl-C "
                  "at the prompt) quits.", file=sys.stderr)
        while True:
            try:
                line = _read_line("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            _fit_history(llm, history, reserve)
            reply = []
            try:
                stream = llm.create_chat_completion(history, stream=True, **_sampling(args))
                for chunk in stream:
                    piece = chunk["choices"][0]["delta"].get("content", "")
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                sys.stdout.write(" [stopped]")
            except InnerQError as e:
                print(f"innerq: {e}", file=sys.stderr)
                history.pop()
                continue
            print()
            _stopped_note(llm, args)
            history.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args) -> int:
    from .server import serve

    return serve(args)


def cmd_pull(args) -> int:
    from . import hub

    if hub.parse_ref(args.name):
        print(hub.pull(args.name, quiet=args.quiet))
        return 0
    if args.name not in models.KNOWN:
        print(f"innerq pull: unknown model {args.name!r}: one of {', '.join(sorted(models.KNOWN))}, or "
              "hf.co/ORG/REPO[:QUANT]", file=sys.stderr)
        return 2
    print(models.pull(args.name, quiet=args.quiet))
    return 0


def cmd_list(args) -> int:
    print(f"models directory: {models.models_dir()}")
    known = set()
    for name, m in sorted(models.KNOWN.items()):
        path = models.local_path(name)
        known.add(path)
        state = f"{path.stat().st_size / 2**20:.0f} MiB" if path.is_file() else "not pulled"
        default = " (default)" if name == models.DEFAULT_MODEL else ""
        print(f"  {name:<16} {state:<12} {m.description}{default}")
    for path in models.local_models():
        if path not in known:
            size = f"{path.stat().st_size / 2**20:.0f} MiB" if path.exists() else "a link to a missing file"
            print(f"  {path.name:<16} {size}")
    return 0


def _kv_table(model) -> list[str]:
    from ._native import kv_types
    from .errors import InnerQError

    sizes = {}
    for t in kv_types():
        try:
            sizes[t] = model.kv_bytes_per_token(t, t)
        except InnerQError as e:
            sizes[t] = e
    base = sizes.get("f16")
    lines = []
    for t, b in sizes.items():
        if isinstance(b, Exception):
            lines.append(f"  {t:<8} not available: {b}")
            continue
        rel = f"  {b / base:5.2f} x f16" if isinstance(base, float) and base > 0 else ""
        lines.append(f"  {t:<8} {b:>12,.1f} bytes/token  {b * 1024 / 2**20:8.2f} MiB per 1K tokens{rel}")
    return lines


# the contexts `innerq info` sizes: the default, 32K and 128K (and the model's own, if other)
INFO_N_CTX = (4096, 32768, 131072)


def _kv_memory_table(model) -> list[str]:
    from .errors import InnerQError

    n_ctxs = sorted(set(INFO_N_CTX) | {model.n_ctx_train})
    lines = ["  " + f"{'cache':<22}" + "".join(f"{'n_ctx ' + str(n):>22}" for n in n_ctxs)]
    for label, kv, gpu in (("innerq (CPU, G 64)", None, False), ("innerq (GPU, G 32)", "innerq", True),
                           ("f16", "f16", False), ("q8_0", "q8_0", False), ("q4_0", "q4_0", False)):
        cells = []
        for n in n_ctxs:
            try:
                mem = model.kv_memory(kv, kv, gpu=gpu, n_ctx=n)
                cells.append(f"{mem['bytes'] / 2**20:9.1f} MiB {mem['bits']:5.2f} b")
            except InnerQError:
                cells.append("n/a")
        lines.append(f"  {label:<22}" + "".join(f"{c:>22}" for c in cells))
    return lines


def cmd_info(args) -> int:
    from .gguf_model import Model
    from .gguf_tensors import read_tensor_infos, type_summary

    path = _model_path(args)
    with Model(path) as m:
        print(f"{path}  ({path.stat().st_size / 2**20:.1f} MiB)")
        print(f"  {m.description}: {m.n_params / 1e6:.1f} M parameters, {m.size / 2**20:.1f} MiB of weights")
        print(f"  layers {m.n_layer}, embedding {m.n_embd}, heads {m.n_head} (KV {m.n_head_kv}), head dim "
              f"{m.head_dim}, vocabulary {m.n_vocab}, training context {m.n_ctx_train}")
        meta = m.metadata
        print(f"metadata ({len(meta)} keys):")
        for k, v in meta.items():
            v = v.replace("\n", "\\n")
            print(f"  {k} = {v if len(v) <= 100 else v[:97] + '...'}")
        infos = read_tensor_infos(path)
        print(f"tensors ({len(infos)}):")
        for name, (count, elems) in type_summary(infos).items():
            print(f"  {name:<8} {count:5d} tensors  {elems / 1e6:10.2f} M elements")
        print("KV cache bytes per token, all layers (keys and values of one type; innerq: innerq3 keys, innerq2 "
              "values, before a context's size gives its layers more bits):")
        for line in _kv_table(m):
            print(line)
        print("KV cache at n_ctx tokens, everything included (f16 windows, scales, norms): MiB and effective bits "
              "per element")
        for line in _kv_memory_table(m):
            print(line)
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `innerq serve` (also those of each replica of innerq.serve_ray)."""
    _add_model_args(p)
    _add_sampling_args(p, stop=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-np", "--parallel", type=int, default=4,
                   help="sequences decoded together, at most one request each (default 4); -c is their KV pool")
    p.add_argument("--queue", type=int, default=64,
                   help="requests that may wait for a sequence; more get 503 with Retry-After (default 64)")
    p.add_argument("--api-key", default=os.environ.get("INNERQ_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $INNERQ_API_KEY; none: an open server)")
    p.add_argument("--cors", action="append", metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; * for any)")
    p.add_argument("--alias", help="the model's name in the API (default: the file's name without .gguf)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="innerq", description="LLM inference with an InnerQ-quantized KV cache")
    ap.add_argument("--version", action="version", version=f"innerq {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="generate text from a prompt (streamed to stdout)")
    _add_model_args(p)
    p.add_argument("-p", "--prompt", help="the prompt (default: read stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _add_model_args(p)
    p.add_argument("--system", help="a system message")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server whose requests are decoded together",
                       description="Serves the OpenAI API (chat completions, completions, embeddings) with requests "
                       "decoded together as sequences of one context. Needs `pip install 'innerq[server]'`. The "
                       "sampling flags are the defaults of requests that don't set them.")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("pull", help="download a known model, or a GGUF of a Hugging Face repository, into the model cache")
    p.add_argument("name", nargs="?", default=models.DEFAULT_MODEL, metavar="MODEL",
                   help=f"a known model ({', '.join(sorted(models.KNOWN))}; default {models.DEFAULT_MODEL}) or "
                   "hf.co/ORG/REPO[:QUANT] (QUANT picks the file by its tag, default Q4_K_M)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="known and downloaded models")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("info", help="a model's metadata, tensor types and KV cache sizes")
    p.add_argument("model", nargs="?", metavar="MODEL")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL")
    p.set_defaults(func=cmd_info)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import InnerQError

    try:
        return args.func(args)
    except (InnerQError, ImportError) as e:
        print(f"innerq: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `innerq run ... | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
