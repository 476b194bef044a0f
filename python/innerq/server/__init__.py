"""`innerq serve`: an OpenAI-compatible HTTP server whose requests are sequences of one context,
decoded together (engine.py: scheduling; protocol.py: the API's requests; app.py: the routes;
metrics.py: /metrics). It needs the extra `innerq[server]` (Starlette, uvicorn,
prometheus_client)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path


def make(args):
    """(engine, application, model names) of `innerq serve`'s parsed command line; the engine
    loads the model when the application starts."""
    from .. import cli, models
    from .app import create_app
    from .engine import Engine, EngineConfig
    from .protocol import Defaults

    if args.parallel < 1 or args.queue < 0:
        raise ValueError("--parallel must be at least 1 and --queue at least 0")
    path = models.resolve(args.model_opt or args.model)
    llama_args = cli._given(args, cli._LLAMA_ARGS)
    if args.gpu:
        llama_args["n_gpu_layers"] = -1
    seed = llama_args.pop("seed", -1)
    config = EngineConfig(str(path), parallel=args.parallel, queue_size=args.queue, n_ctx=llama_args.pop("n_ctx", None),
                          n_batch=llama_args.pop("n_batch", None), n_threads=llama_args.pop("n_threads", None),
                          n_gpu_layers=llama_args.pop("n_gpu_layers", 0), cache=llama_args)
    sampling = cli._sampling(args)
    defaults = Defaults(max_tokens=sampling["max_tokens"], temperature=sampling["temperature"],
                        top_k=sampling["top_k"], top_p=sampling["top_p"], min_p=sampling["min_p"],
                        repeat_penalty=sampling["repeat_penalty"], repeat_last_n=cli._c_defaults()["repeat_last_n"],
                        seed=seed)
    names = model_names(path, args.alias)
    engine = Engine(config)
    return engine, create_app(engine, names, defaults, api_key=args.api_key, cors=args.cors), names


def serve(args) -> int:
    """Runs the server of `innerq serve`'s parsed command line until it is interrupted; 1 when
    the model fails to load."""
    try:
        import uvicorn

        engine, app, names = make(args)
    except ImportError as e:
        print(f"innerq serve: {e.name} is missing: pip install 'innerq[server]'", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"innerq serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(format="%(asctime)s innerq: %(message)s", stream=sys.stderr)
    log = logging.getLogger("innerq.server")
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, access_log=False,
                                           log_level="warning" if args.quiet else "info"))

    def loaded(engine) -> None:
        if engine.state == "failed":
            server.should_exit = True
        else:
            log.info("serving %s as %r on http://%s:%d: %d sequences, n_ctx %d, KV pool %d pages of %d tokens",
                     Path(engine.config.model_path).name, names[0], args.host, args.port, args.parallel,
                     engine.n_ctx, engine.n_pages, engine.page_tokens)

    engine.on_ready = loaded
    server.run()
    return 1 if engine.state == "failed" else 0


def model_names(path: Path, alias: str | None = None) -> list[str]:
    """The names a request's "model" may give: the alias (or the file's name without .gguf),
    which /v1/models lists, then the path and the file's name."""
    return list(dict.fromkeys([alias or path.stem, str(path), path.name, path.stem]))
