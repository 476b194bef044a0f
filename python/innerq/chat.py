"""Chat prompts rendered from a GGUF's tokenizer.chat_template (a Jinja2 template, as in
Hugging Face tokenizers), in a sandbox."""
from __future__ import annotations

import json
from datetime import datetime

from .errors import InvalidArgumentError

# Used when the model carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise(message):
    raise InvalidArgumentError(f"chat template: {message}")


def _tojson(value, indent=None, ensure_ascii=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _content_text(content) -> str:
    """OpenAI message content: a string, or a list of parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
            else:
                raise InvalidArgumentError(f"unsupported message content part {part!r} (only text)")
        return "".join(texts)
    raise InvalidArgumentError(f"message content must be a string or a list of parts, got {content!r}")


def normalize_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not hasattr(messages, "__iter__"):
        raise InvalidArgumentError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidArgumentError(f"each message must be a dict with a 'role', got {m!r}")
        if not isinstance(m["role"], str):
            raise InvalidArgumentError(f"a message's role must be a string, got {m['role']!r}")
        # OpenAI allows a null content only beside tool calls, which templates render themselves
        if m.get("content") is None and not m.get("tool_calls"):
            raise InvalidArgumentError(f"message {m!r} has no 'content'")
        out.append({**m, "content": _content_text(m.get("content"))})
    if not out:
        raise InvalidArgumentError("messages is empty")
    return out


class ChatTemplate:
    """A compiled chat template; render(messages) gives the prompt text."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source or CHATML_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise InvalidArgumentError(f"chat template does not compile: {e}") from None

    @classmethod
    def of_model(cls, model, source: str | None = None) -> "ChatTemplate":
        """A Model's template: source, else the GGUF's tokenizer.chat_template (ChatML where it
        has none), with the model's BOS and EOS texts."""
        def text(token: int) -> str:
            return model.token_to_piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

        return cls(source or model.chat_template, text(model.token_bos()), text(model.token_eos()))

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        import jinja2

        try:
            return self._template.render(messages=normalize_messages(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except jinja2.TemplateError as e:
            raise InvalidArgumentError(f"chat template failed: {e}") from None
