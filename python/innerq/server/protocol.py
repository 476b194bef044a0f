"""The OpenAI API of `innerq serve`: request bodies read into jobs (with an HTTP 400 naming the
field for anything malformed), and the errors' shape. The responses' shapes are the Python
API's (innerq.completions, innerq.llama_chat_format): a request gets what Llama's
create_completion / create_chat_completion would answer, field for field."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..errors import InnerQError, InvalidArgumentError, UnsupportedError
from ..grammar import GrammarMatcher
from ..llama_chat_format import ChatPrompt, prepare_chat
from ..llama_grammar import LlamaGrammar
from ..sampling import Sampling, TokenSampler, logit_bias_processor, stop_list
from ..text_stream import TextStream
from .engine import Engine, Job


class APIError(Exception):
    """An answer other than 200, as the OpenAI API shapes it: {"error": {message, type, param,
    code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(e: InnerQError, param: str | None = None) -> APIError:
    return APIError(400, str(e), param=param, code="unsupported" if isinstance(e, UnsupportedError) else None)


_KINDS = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
          "object": (dict,)}


class Body:
    """A request's JSON object, read field by field: get() checks a field's JSON type (null is
    the default, as the OpenAI API reads it) and range."""

    def __init__(self, raw: bytes):
        try:
            self.data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(self.data, dict):
            raise APIError(400, "the request body must be a JSON object")

    def get(self, name: str, kinds: str | tuple, default=None, lo=None, hi=None, required: bool = False):
        value = self.data.get(name)
        if value is None:
            if required:
                raise APIError(400, f"'{name}' is required", param=name)
            return default
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        if not any(isinstance(value, _KINDS[k]) and (k == "boolean" or not isinstance(value, bool)) for k in kinds):
            raise APIError(400, f"'{name}' must be {' or '.join(kinds)}, got {json.dumps(value)[:80]}", param=name)
        if isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, f"'{name}' must be a finite number, got {value}", param=name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            limits = f"at least {lo}" if hi is None else f"at most {hi}" if lo is None else f"from {lo} to {hi}"
            raise APIError(400, f"'{name}' must be {limits}, got {value}", param=name)
        return value


@dataclass
class Defaults:
    """What a request that sets none of these gets: the sampling flags of `innerq serve`."""

    max_tokens: int  # <= 0: to the end of the context
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    seed: int


def check_model(names: list[str], body: Body) -> None:
    """A 404 for a model this server does not serve (names: the names it answers to)."""
    name = body.get("model", "string")
    if name is not None and name not in names:
        raise APIError(404, f"The model '{name}' does not exist (this server serves '{names[0]}')",
                       type="not_found_error", param="model", code="model_not_found")


def _fits(engine: Engine, n: int, param: str) -> None:
    if n >= engine.n_ctx:
        raise APIError(400, f"This model's maximum context length is {engine.n_ctx} tokens. However, your "
                       f"request has {n} prompt tokens (and at least one is generated).", param=param,
                       code="context_length_exceeded")


def make_job(engine: Engine, body: Body, defaults: Defaults, prompt: list[int], stops: list[str], grammar,
             n_logprobs: int | None, offset: int, emit, param: str = "prompt") -> Job:
    """A Job for prompt with the request's sampling fields (param: the field the prompt came
    from, for a prompt longer than the context)."""
    _fits(engine, len(prompt), param)
    room = engine.n_ctx - len(prompt)
    max_tokens = body.get("max_completion_tokens", "integer", lo=1)
    if max_tokens is None:
        max_tokens = body.get("max_tokens", "integer", defaults.max_tokens, lo=1)
    max_tokens = min(max_tokens, room) if max_tokens > 0 else room
    seed = body.get("seed", "integer", defaults.seed, lo=-1, hi=2**64 - 1)
    sampling = Sampling(body.get("temperature", "number", defaults.temperature, lo=0),
                        body.get("top_k", "integer", defaults.top_k, lo=0, hi=2**31 - 1),
                        body.get("top_p", "number", defaults.top_p, lo=0, hi=1),
                        body.get("min_p", "number", defaults.min_p, lo=0, hi=1),
                        body.get("repeat_penalty", "number", defaults.repeat_penalty, lo=0),
                        defaults.repeat_last_n, seed)
    bias = body.get("logit_bias", "object")
    try:
        processor = logit_bias_processor(bias, engine.model.n_vocab) if bias else None
    except InvalidArgumentError as e:
        raise bad_request(e, "logit_bias") from None
    matcher = GrammarMatcher(grammar.parsed, engine.model.token_index()) if grammar is not None else None
    sampler = TokenSampler(sampling, engine.n_ctx, last_n=defaults.repeat_last_n,
                           frequency_penalty=body.get("frequency_penalty", "number", 0.0, lo=-2, hi=2),
                           presence_penalty=body.get("presence_penalty", "number", 0.0, lo=-2, hi=2),
                           logits_processor=processor, matcher=matcher, history=prompt,
                           keep_rows=n_logprobs is not None)
    return Job(prompt, sampler, TextStream(engine.model, stops, n_logprobs, offset), max_tokens, emit)


def _stops(body: Body) -> list[str]:
    try:
        return stop_list(body.get("stop", ("string", "array"), []))
    except InvalidArgumentError as e:
        raise bad_request(e, "stop") from None


def _grammar(body: Body):
    """llama.cpp's extension: a GBNF grammar for the answer."""
    text = body.get("grammar", "string")
    try:
        return LlamaGrammar.from_string(text) if text else None
    except InvalidArgumentError as e:
        raise bad_request(e, "grammar") from None


def _single(body: Body) -> None:
    for name in ("n", "best_of"):
        if body.get(name, "integer", 1, lo=1) != 1:
            raise APIError(400, f"'{name}' must be 1: innerq serve answers with one choice (send several requests: "
                           "they are decoded together)", param=name, code="unsupported")


def chat_job(engine: Engine, formatter, body: Body, defaults: Defaults, emit) -> tuple[Job, ChatPrompt]:
    """The job of a /v1/chat/completions request, and its rendered prompt (whose tool, if
    any, the answer calls)."""
    messages = body.get("messages", "array", required=True)
    _single(body)
    logprobs = body.get("logprobs", "boolean", False)
    top = body.get("top_logprobs", "integer", None, lo=0, hi=20)
    try:
        chat = prepare_chat(formatter, messages, tools=body.get("tools", "array"),
                            tool_choice=body.get("tool_choice", ("string", "object")), stop=_stops(body),
                            response_format=body.get("response_format", "object"), grammar=_grammar(body))
        prompt = engine.model.tokenize(chat.prompt, add_bos=not chat.added_special, special=True)
    except InvalidArgumentError as e:
        raise bad_request(e, "messages") from None
    except UnsupportedError as e:
        raise bad_request(e) from None
    job = make_job(engine, body, defaults, prompt, chat.stop, chat.grammar, (top or 0) if logprobs else None, 0, emit,
                   "messages")
    return job, chat


def completion_prompt(engine: Engine, body: Body) -> tuple[list[int], str | None]:
    """The tokens of a /v1/completions prompt (a text, or token ids; a list of one of those)
    and its text (None for token ids)."""
    prompt = body.get("prompt", ("string", "array"), required=True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        model = engine.model
        bos = [model.token_bos()] if model.add_bos and model.token_bos() >= 0 else []
        try:
            return bos + (model.tokenize(prompt, add_bos=False, special=True) if prompt else []), prompt
        except InvalidArgumentError as e:
            raise bad_request(e, "prompt") from None
    if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise APIError(400, "'prompt' must be a text, a list of token ids, or a list of one of those (innerq serve "
                       "answers one prompt per request)", param="prompt")
    n_vocab = engine.model.n_vocab
    if not all(0 <= t < n_vocab for t in prompt):
        raise APIError(400, f"'prompt' has token ids outside the vocabulary (0 .. {n_vocab - 1})", param="prompt")
    return list(prompt), None


def completion_job(engine: Engine, body: Body, defaults: Defaults, emit) -> tuple[Job, str]:
    """The job of a /v1/completions request and the text it starts with (the prompt with
    echo)."""
    _single(body)
    if body.get("suffix", "string") is not None:
        raise APIError(400, "'suffix' (fill-in-the-middle) is not supported by innerq", param="suffix",
                       code="unsupported")
    prompt, text = completion_prompt(engine, body)
    if not prompt:
        raise APIError(400, "'prompt' is empty and the model has no BOS token to start from", param="prompt")
    echo = body.get("echo", "boolean", False)
    n_logprobs = body.get("logprobs", "integer", None, lo=0, hi=20)
    if echo and n_logprobs is not None:
        raise APIError(400, "logprobs with echo (the prompt's log-probabilities) are not supported by innerq serve",
                       param="echo", code="unsupported")
    head = (text if text is not None else engine.model.detokenize(prompt).decode("utf-8", "ignore")) if echo else ""
    offset = len(head) if echo else len(text or "")
    return make_job(engine, body, defaults, prompt, _stops(body), _grammar(body), n_logprobs, offset, emit), head


def embedding_inputs(engine: Engine, body: Body) -> list[list[int]]:
    """The token lists of an /v1/embeddings request's input (a text, a list of texts, token
    ids, or a list of token id lists)."""
    data = body.get("input", ("string", "array"), required=True)
    if isinstance(data, str) or (data and all(isinstance(t, int) and not isinstance(t, bool) for t in data)):
        data = [data]
    if not data:
        raise APIError(400, "'input' is empty", param="input")
    model, out = engine.model, []
    for item in data:
        if isinstance(item, str) and item:
            try:
                ids = model.tokenize(item, add_bos=True)
            except InvalidArgumentError as e:
                raise bad_request(e, "input") from None
        elif isinstance(item, list) and item and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model.n_vocab for t in item):
            ids = item
        else:
            raise APIError(400, "each 'input' must be a non-empty text or a non-empty list of token ids "
                           f"(0 .. {model.n_vocab - 1})", param="input")
        if len(ids) > engine.n_ctx:
            raise APIError(400, f"This model's maximum context length is {engine.n_ctx} tokens. However, an input "
                           f"has {len(ids)} tokens.", param="input", code="context_length_exceeded")
        out.append(ids)
    return out
