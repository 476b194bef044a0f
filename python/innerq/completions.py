"""Response dicts in the shapes of the OpenAI API (and llama-cpp-python): completions,
chat completions, and their streaming chunks."""
from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> tuple[str, int]:
    """A response id and its creation time (seconds)."""
    return f"{prefix}-{uuid.uuid4().hex}", int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, created: int, model: str, text: str, finish_reason: str | None, use: dict | None,
               logprobs: dict | None = None) -> dict:
    d = {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if use is not None:
        d["usage"] = use
    return d


def chat_completion(rid: str, created: int, model: str, content: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
