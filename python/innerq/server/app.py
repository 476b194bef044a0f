"""The HTTP face of `innerq serve`: a Starlette application over an Engine.

POST /v1/chat/completions, /v1/completions (streamed as server-sent events with stream: true,
the usage chunk with stream_options.include_usage, then [DONE]), /v1/embeddings; GET /v1/models;
GET /health (503 while the model loads); GET /metrics (Prometheus); POST /tokenize,
/detokenize (llama-server's shapes). With an API key the /v1 and token endpoints need
`Authorization: Bearer KEY` (/health and /metrics stay open for probes and scrapers). Errors
are OpenAI-shaped: {"error": {message, type, param, code}}. A client that disconnects ends its
request at once: the engine frees its sequence before the next step.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import socket
import time

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import completions
from ..errors import InvalidArgumentError, UnsupportedError
from ..chat import ChatTemplate
from ..llama_chat_format import ChatChunks, TemplateChatFormatter, chat_response
from .engine import Engine, Job, QueueFull
from .metrics import Metrics
from .protocol import APIError, Body, Defaults, chat_job, check_model, completion_job, embedding_inputs

log = logging.getLogger("innerq.server")


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


class EventStream(Response):
    """A text/event-stream response of an async iterator of events (str). The iterator is closed
    when the response ends, the client's disconnection included, so its cleanup runs at once."""

    media_type = "text/event-stream"

    def __init__(self, events):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while an event was written
            pass
        finally:
            await self.events.aclose()


def _error(request: Request, e: APIError) -> Response:
    log.info("%s %s %d %s", request.method, request.url.path, e.status, e.message)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(data) -> str:
    return "data: " + (data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)) + "\n\n"


class Server:
    """The routes over one engine. names: the model names requests may give (the first is the
    one /v1/models lists); api_key: None for an open server."""

    def __init__(self, engine: Engine, names: list[str], defaults: Defaults, api_key: str | None = None):
        self.engine = engine
        self.names = names
        self.defaults = defaults
        self.api_key = api_key
        self.metrics = Metrics(engine, names[0])
        self.created = int(time.time())
        self._formatter = None

    # ---- the common path of every endpoint ----

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Invalid API key: give it as 'Authorization: Bearer KEY'", type="authentication_error",
                           code="invalid_api_key")

    def _ready(self) -> None:
        if self.engine.state == "loading":
            raise APIError(503, "the model is loading", type="unavailable", headers={"Retry-After": "5"})
        if self.engine.state == "failed":
            raise APIError(503, f"the model failed to load: {self.engine.error}", type="unavailable")

    def endpoint(self, handler, open_access: bool = False, log_ok: bool = True):
        """handler(request) -> Response, behind the API key (unless open_access), the loading
        check, the error shape and a log line (log_ok: also for a success; generations log
        their own, at their end)."""
        async def run(request: Request) -> Response:
            t0 = time.perf_counter()
            try:
                if not open_access:
                    self._authorize(request)
                    self._ready()
                response = await handler(request)
            except APIError as e:
                return _error(request, e)
            except (InvalidArgumentError, UnsupportedError) as e:  # a request the library refused
                return _error(request, APIError(400, str(e)))
            except ClientGone:
                log.info("%s %s: the client disconnected", request.method, request.url.path)
                return Response(status_code=499)
            except Exception as e:  # a bug, not the request: the server answers and goes on
                log.exception("%s %s failed", request.method, request.url.path)
                e = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
                return JSONResponse(e.body(), status_code=500)
            if log_ok:
                log.info("%s %s %d %.3fs", request.method, request.url.path, response.status_code,
                         time.perf_counter() - t0)
            return response
        return run

    async def _prepare(self, fn, *args):
        """fn(*args) in a worker thread: tokenizing, chat templates and grammars take time the
        event loop should not wait for."""
        return await asyncio.to_thread(fn, *args)

    def _submit(self, job: Job) -> None:
        try:
            self.engine.submit(job)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; try again shortly", type="server_busy",
                           headers={"Retry-After": "1"}) from None

    async def _events(self, request: Request, job: Job, queue: asyncio.Queue):
        """The job's events until its end; ClientGone (and the job cancelled) if the client
        disconnects first."""
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    raise ClientGone()
                event = get.result()
                yield event
                if event[0] != "text":
                    return
        finally:
            watcher.cancel()
            self.engine.cancel(job)

    @staticmethod
    def _emitter() -> tuple[asyncio.Queue, object]:
        """A queue of a job's events and the function the scheduler thread puts them with."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop has closed: the server is stopping
                pass
        return queue, emit

    def _usage(self, job: Job) -> dict:
        use = completions.usage(len(job.prompt), len(job.text.tokens))
        use["prompt_tokens_details"] = {"cached_tokens": job.n_cached}
        return use

    def _log_job(self, request: Request, job: Job, finish: str) -> None:
        first = f"{job.t_first - job.t_queued:.3f}s" if job.t_first is not None else "-"
        log.info("%s %s 200 prompt %d (cached %d) completion %d first token %s total %.3fs finish %s",
                 request.method, request.url.path, len(job.prompt), job.n_cached, len(job.text.tokens), first,
                 time.perf_counter() - job.t_queued, finish)

    async def _generate(self, request: Request, job: Job, queue: asyncio.Queue, head: str, chat_tool, stream: bool,
                        include_usage: bool) -> Response:
        """The answer of a completion (chat_tool False) or chat completion (chat_tool: the tool
        its answer calls, or None) job."""
        rid, created = completions.new_id("cmpl")
        model = self.names[0]
        chat = chat_tool is not False
        converter = ChatChunks(chat_tool) if chat else None

        def chunks(text, finish, logprobs=None) -> list[dict]:
            chunk = completions.completion(rid, created, model, text, finish, None, logprobs)
            return converter.convert(chunk) if chat else [chunk]

        if not stream:
            finish = None
            async for event in self._events(request, job, queue):
                if event[0] == "error":
                    raise APIError(500, f"generation failed: {event[1]}", type="server_error")
                if event[0] == "end":
                    finish = event[1]
            self._log_job(request, job, finish)
            out = completions.completion(rid, created, model, head + job.text.text, finish, self._usage(job),
                                         job.text.logprobs)
            return JSONResponse(chat_response(out, chat_tool) if chat else out)

        async def events():
            finish = "cancelled"
            try:
                for chunk in (chunks(head, None) if head else []):
                    yield _sse(chunk)
                async for event in self._events(request, job, queue):
                    if event[0] == "text":
                        for chunk in chunks(event[1], None, event[2]):
                            yield _sse(chunk)
                    elif event[0] == "end":
                        finish = event[1]
                        for chunk in chunks("", finish):
                            yield _sse(chunk)
                    else:
                        finish = "error"
                        yield _sse(APIError(500, f"generation failed: {event[1]}", type="server_error").body())
                if include_usage:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield _sse({"id": ("chat" if chat else "") + rid, "object": obj, "created": created,
                                "model": model, "choices": [], "usage": self._usage(job)})
                yield _sse("[DONE]")
            except ClientGone:
                pass
            finally:
                self._log_job(request, job, finish)

        return EventStream(events())

    # ---- endpoints ----

    def formatter(self) -> TemplateChatFormatter:
        if self._formatter is None:
            self._formatter = TemplateChatFormatter(ChatTemplate.of_model(self.engine.model))
        return self._formatter

    async def chat_completions(self, request: Request) -> Response:
        body = Body(await request.body())
        check_model(self.names, body)
        stream, include_usage = _stream_options(body)
        queue, emit = self._emitter()
        job, chat = await self._prepare(chat_job, self.engine, self.formatter(), body, self.defaults, emit)
        self._submit(job)
        return await self._generate(request, job, queue, "", chat.tool, stream, include_usage)

    async def completions(self, request: Request) -> Response:
        body = Body(await request.body())
        check_model(self.names, body)
        stream, include_usage = _stream_options(body)
        queue, emit = self._emitter()
        job, head = await self._prepare(completion_job, self.engine, body, self.defaults, emit)
        self._submit(job)
        return await self._generate(request, job, queue, head, False, stream, include_usage)

    async def embeddings(self, request: Request) -> Response:
        body = Body(await request.body())
        check_model(self.names, body)
        fmt = body.get("encoding_format", "string", "float")
        if fmt not in ("float", "base64"):
            raise APIError(400, f"'encoding_format' must be float or base64, got {fmt!r}", param="encoding_format")
        dims = body.get("dimensions", "integer")
        if dims is not None and dims != self.engine.model.n_embd:
            raise APIError(400, f"'dimensions' must be the model's {self.engine.model.n_embd}", param="dimensions",
                           code="unsupported")
        inputs = await self._prepare(embedding_inputs, self.engine, body)
        vectors = await asyncio.to_thread(self.engine.embed, inputs)
        data = []
        for i, v in enumerate(vectors):
            norm = float(np.linalg.norm(v))
            v = (v / norm if norm > 0 else v).astype("<f4")  # unit length, as OpenAI's embeddings
            data.append({"object": "embedding", "index": i,
                         "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()})
        n = sum(len(ids) for ids in inputs)
        return JSONResponse({"object": "list", "data": data, "model": self.names[0],
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def models(self, request: Request) -> Response:
        m = self.engine.model
        meta = {"n_vocab": m.n_vocab, "n_ctx_train": m.n_ctx_train, "n_embd": m.n_embd, "n_params": m.n_params,
                "size": m.size, "n_ctx": self.engine.n_ctx, "parallel": len(self.engine.slots)}
        return JSONResponse({"object": "list", "data": [{"id": self.names[0], "object": "model",
                                                         "created": self.created, "owned_by": "innerq",
                                                         "meta": meta}]})

    async def tokenize(self, request: Request) -> Response:
        body = Body(await request.body())
        text = body.get("content", "string", required=True)
        add_special = body.get("add_special", "boolean", False)
        with_pieces = body.get("with_pieces", "boolean", False)
        model = self.engine.model
        try:
            ids = await self._prepare(model.tokenize, text, add_special, True)
        except ValueError as e:
            raise APIError(400, str(e), param="content") from None
        if with_pieces:
            return JSONResponse({"tokens": [{"id": t, "piece": model.token_to_piece(t, special=True).decode(
                "utf-8", "replace")} for t in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = Body(await request.body())
        ids = body.get("tokens", "array", required=True)
        n_vocab = self.engine.model.n_vocab
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in ids):
            raise APIError(400, f"'tokens' must be token ids (0 .. {n_vocab - 1})", param="tokens")
        text = self.engine.model.detokenize(ids).decode("utf-8", "replace")
        return JSONResponse({"content": text})

    async def health(self, request: Request) -> Response:
        if self.engine.state == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": self.engine.state}
        if self.engine.error:
            body["error"] = self.engine.error
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    async def prometheus(self, request: Request) -> Response:
        if self.engine.state != "ready":
            return await self.health(request)
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _stream_options(body: Body) -> tuple[bool, bool]:
    stream = body.get("stream", "boolean", False)
    options = body.get("stream_options", "object", {})
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError(400, "'stream_options.include_usage' must be boolean", param="stream_options")
    return stream, include


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _http_error(request: Request, exc: HTTPException) -> Response:
    e = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                 type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
    return JSONResponse(e.body(), status_code=exc.status_code)


class _ServerHeader:
    """Adds X-Innerq-Server: HOST:PID to every response, so that a client of several replicas
    behind one address can tell which one answered."""

    def __init__(self, app):
        self.app = app
        self.value = f"{socket.gethostname()}:{os.getpid()}".encode()

    async def __call__(self, scope, receive, send):
        async def send_marked(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-innerq-server", self.value)]
            await send(message)

        await self.app(scope, receive, send_marked if scope["type"] == "http" else send)


def create_app(engine: Engine, names: list[str], defaults: Defaults, api_key: str | None = None,
               cors: list[str] | None = None) -> Starlette:
    """The application; the engine starts loading when the application starts (ASGI lifespan)
    and closes when it stops. cors: origins allowed to call from a browser ("*": any)."""
    server = Server(engine, names, defaults, api_key)
    e = server.endpoint
    routes = [
        Route("/v1/chat/completions", e(server.chat_completions, log_ok=False), methods=["POST"]),
        Route("/v1/completions", e(server.completions, log_ok=False), methods=["POST"]),
        Route("/v1/embeddings", e(server.embeddings), methods=["POST"]),
        Route("/v1/models", e(server.models), methods=["GET"]),
        Route("/tokenize", e(server.tokenize), methods=["POST"]),
        Route("/detokenize", e(server.detokenize), methods=["POST"]),
        Route("/health", e(server.health, open_access=True, log_ok=False), methods=["GET"]),
        Route("/metrics", e(server.prometheus, open_access=True, log_ok=False), methods=["GET"]),
    ]
    middleware = [Middleware(_ServerHeader)]
    if cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=cors, allow_methods=["*"], allow_headers=["*"]))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()

    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.server = server
    return app
