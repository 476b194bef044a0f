"""llama-cpp-python's `llama_chat_format`: chat formats (a prompt from messages) and chat
completion handlers (a chat completion from a Llama and messages).

A chat format renders messages to a ChatFormatterResponse (the prompt, stop strings);
chat_formatter_to_chat_completion_handler turns one into a handler, which completes the prompt
with Llama.create_completion and returns the chat response (or its chunks). Registered names:
chatml, llama-2, llama-3, mistral-instruct, zephyr (the templates Llama-family GGUFs ship);
Llama uses the GGUF's own template (Jinja2) when no chat_format or chat_handler is given."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional, Protocol, Union

from . import completions
from .chat import ChatTemplate
from .errors import InvalidArgumentError, UnsupportedError

# Templates of the formats llama-cpp-python recognizes in a GGUF's metadata.
CHATML_CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                        "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                        "{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_BOS_TOKEN = "<s>"
CHATML_EOS_TOKEN = "<|im_end|>"
MISTRAL_INSTRUCT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
MISTRAL_INSTRUCT_BOS_TOKEN = "<s>"
MISTRAL_INSTRUCT_EOS_TOKEN = "</s>"
LLAMA3_INSTRUCT_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_INSTRUCT_BOS_TOKEN = "<|begin_of_text|>"
LLAMA3_INSTRUCT_EOS_TOKEN = "<|eot_id|>"


@dataclasses.dataclass
class ChatFormatterResponse:
    """A rendered chat prompt; stop: strings that end the answer; added_special: the prompt
    already holds the special tokens (BOS), so none is added when it is tokenized."""

    prompt: str
    stop: Optional[Union[str, List[str]]] = None
    stopping_criteria: Any = None
    added_special: bool = False


class ChatFormatter(Protocol):
    def __call__(self, *, messages: List[dict], **kwargs: Any) -> ChatFormatterResponse: ...


class LlamaChatCompletionHandler(Protocol):
    def __call__(self, *, llama, messages: List[dict], **kwargs: Any): ...


class LlamaChatCompletionHandlerNotFoundException(InvalidArgumentError):
    pass


_HANDLERS: Dict[str, Callable] = {}


def register_chat_completion_handler(name: str):
    def decorator(handler):
        _HANDLERS[name] = handler
        return handler

    return decorator


def get_chat_completion_handler(name: str):
    try:
        return _HANDLERS[name]
    except KeyError:
        raise LlamaChatCompletionHandlerNotFoundException(
            f"Invalid chat handler: {name} (known: {', '.join(sorted(_HANDLERS))})") from None


def register_chat_format(name: str):
    def decorator(formatter):
        # the handler is made at the call: the formats are registered above its definition
        register_chat_completion_handler(name)(
            lambda **kwargs: chat_formatter_to_chat_completion_handler(formatter)(**kwargs))
        return formatter

    return decorator


def _text(message: dict) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _system(messages: List[dict]) -> str:
    return next((_text(m) for m in messages if m.get("role") == "system"), "")


def _mapped(messages: List[dict], roles: Dict[str, str]) -> List[tuple]:
    """(the role's prefix, the text or None) of the messages whose role the format writes."""
    return [(roles[m["role"]], m.get("content") if isinstance(m.get("content"), str) else None)
            for m in messages if m.get("role") in roles]


def _turns(system: str, turns: List[tuple], sep: str) -> str:
    """ChatML-like layout: the system block, then each turn as prefix, newline, text, sep."""
    out = "" if system == "" else system + sep + "\n"
    for prefix, text in turns:
        out += f"{prefix}\n{text}{sep}\n" if text else f"{prefix}\n"
    return out


@register_chat_format("chatml")
def format_chatml(messages: List[dict], **kwargs: Any) -> ChatFormatterResponse:
    turns = _mapped(messages, {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"})
    prompt = _turns(f"<|im_start|>system\n{_system(messages)}", turns + [("<|im_start|>assistant", None)],
                    "<|im_end|>")
    return ChatFormatterResponse(prompt=prompt, stop="<|im_end|>")


@register_chat_format("llama-2")
def format_llama2(messages: List[dict], **kwargs: Any) -> ChatFormatterResponse:
    """Llama 2 chat: the system prompt inside the first [INST] block."""
    system = _system(messages)
    if system:
        system = f"[INST] <<SYS>>\n{system}\n<</SYS>>"
    seps = [" ", "</s>"]
    prompt = system + " "
    for i, (prefix, text) in enumerate(_mapped(messages, {"user": "<s>[INST]", "assistant": "[/INST]"})):
        if system and i == 0:
            prompt += (text or "") + seps[i % 2]
        elif text:
            prompt += prefix + text + " " + seps[i % 2]
        else:
            prompt += prefix + " "
    return ChatFormatterResponse(prompt=prompt + "[/INST]")


@register_chat_format("llama-3")
def format_llama3(messages: List[dict], **kwargs: Any) -> ChatFormatterResponse:
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    turns = _mapped(messages, {r: header.format(r) for r in ("system", "user", "assistant")})
    turns.append((header.format("assistant"), None))
    prompt = "".join(prefix + text + "<|eot_id|>" if text else prefix for prefix, text in turns)
    return ChatFormatterResponse(prompt=prompt, stop="<|eot_id|>")


@register_chat_format("mistral-instruct")
def format_mistral_instruct(messages: List[dict], **kwargs: Any) -> ChatFormatterResponse:
    prompt = ""
    for m in messages:
        if m["role"] == "user" and isinstance(m.get("content"), str):
            prompt += "[INST] " + m["content"]
        elif m["role"] == "assistant" and m.get("content") is not None:
            prompt += " [/INST]" + _text(m) + "</s>"
    return ChatFormatterResponse(prompt=prompt + " [/INST]", stop="</s>")


@register_chat_format("zephyr")
def format_zephyr(messages: List[dict], **kwargs: Any) -> ChatFormatterResponse:
    turns = _mapped(messages, {"user": "<|user|>\n", "assistant": "<|assistant|>\n"})
    prompt = _turns(f"<|system|>\n{_system(messages)}", turns + [("<|assistant|>\n", None)], "</s>")
    return ChatFormatterResponse(prompt=prompt, stop="</s>")


class Jinja2ChatFormatter:
    """A chat format from a Jinja2 chat template (as Hugging Face tokenizers and GGUF files
    carry them), rendered in a sandbox."""

    def __init__(self, template: str, eos_token: str, bos_token: str, add_generation_prompt: bool = True,
                 stop_token_ids: Optional[List[int]] = None):
        self.template = template
        self.eos_token, self.bos_token = eos_token, bos_token
        self.add_generation_prompt = add_generation_prompt
        self.stop_token_ids = set(stop_token_ids) if stop_token_ids is not None else None
        self._template = ChatTemplate(template, bos_token, eos_token)

    def __call__(self, *, messages: List[dict], functions=None, function_call=None, tools=None, tool_choice=None,
                 **kwargs: Any) -> ChatFormatterResponse:
        prompt = self._template.render(messages, add_generation_prompt=self.add_generation_prompt,
                                       functions=functions, function_call=function_call, tools=tools,
                                       tool_choice=tool_choice, **kwargs)
        criteria = None
        if self.stop_token_ids is not None:
            from .llama import StoppingCriteriaList

            ids = self.stop_token_ids
            criteria = StoppingCriteriaList([lambda tokens, logits: tokens[-1] in ids])
        return ChatFormatterResponse(prompt=prompt, stop=[self.eos_token], stopping_criteria=criteria,
                                     added_special=True)

    def to_chat_handler(self):
        return chat_formatter_to_chat_completion_handler(self)


class TemplateChatFormatter(Jinja2ChatFormatter):
    """The chat format of a Llama's own template (Llama.chat_prompt): BOS is added when the
    model asks for it unless the template wrote it, as Llama.chat_tokens does."""

    def __init__(self, template: ChatTemplate):
        self.template = template.source
        self.eos_token, self.bos_token = template.eos_token, template.bos_token
        self.add_generation_prompt, self.stop_token_ids = True, None
        self._template = template

    def __call__(self, *, messages: List[dict], **kwargs: Any) -> ChatFormatterResponse:
        out = super().__call__(messages=messages, **kwargs)
        out.added_special = bool(self.bos_token) and out.prompt.startswith(self.bos_token)
        return out


def hf_tokenizer_config_to_chat_formatter(tokenizer_config: Dict[str, Any], add_generation_prompt: bool = True):
    """A chat format from a Hugging Face tokenizer_config.json (as a dict). As
    llama-cpp-python's, it renders the messages followed by an empty assistant message."""
    for key in ("chat_template", "bos_token", "eos_token"):
        if not isinstance(tokenizer_config.get(key), str):
            raise InvalidArgumentError(f"tokenizer config: {key!r} must be a string")
    template = ChatTemplate(tokenizer_config["chat_template"], tokenizer_config["bos_token"],
                            tokenizer_config["eos_token"])

    def format_tokenizer_config(messages: List[dict], **kwargs: Any) -> ChatFormatterResponse:
        if add_generation_prompt:
            messages = [*messages, {"role": "assistant", "content": ""}]
        prompt = template.render(messages, add_generation_prompt=False, **kwargs)
        return ChatFormatterResponse(prompt=prompt, stop=[template.eos_token, template.bos_token], added_special=True)

    return format_tokenizer_config


def hf_tokenizer_config_to_chat_completion_handler(tokenizer_config: Dict[str, Any],
                                                   add_generation_prompt: bool = True):
    return chat_formatter_to_chat_completion_handler(
        hf_tokenizer_config_to_chat_formatter(tokenizer_config, add_generation_prompt))


def guess_chat_format_from_gguf_metadata(metadata: Dict[str, str]) -> Optional[str]:
    template = metadata.get("tokenizer.chat_template")
    if template == CHATML_CHAT_TEMPLATE:
        return "chatml"
    if template == MISTRAL_INSTRUCT_CHAT_TEMPLATE:
        return "mistral-instruct"
    if template == LLAMA3_INSTRUCT_CHAT_TEMPLATE:
        return "llama-3"
    return None


# ---- response_format and tools as grammars ----

def _grammar_for_response_format(response_format, verbose: bool = False):
    """The LlamaGrammar of a response_format: json_object (with an optional "schema") or
    json_schema ({"json_schema": {"schema": ...}}); None for text."""
    from .llama_grammar import JSON_GBNF, LlamaGrammar

    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise InvalidArgumentError(f"response_format must be a dict with a 'type', got {response_format!r}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise InvalidArgumentError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
    else:
        raise InvalidArgumentError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
    if schema is None:
        return LlamaGrammar.from_string(JSON_GBNF, verbose=verbose)
    return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=verbose)


def _function(tool) -> dict:
    """The "function" of a tool or a tool_choice ({} where there is none)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    return function if isinstance(function, dict) else {}


def _tool_grammar(tools, tool_choice):
    """(the tool, its grammar) where tool_choice names a function: the answer is then that
    call's JSON arguments; (None, None) where the model answers in text."""
    from .llama_grammar import LlamaGrammar

    if tool_choice is None or tool_choice in ("none", "auto"):
        return None, None
    if tool_choice == "required" or not isinstance(tool_choice, dict):
        raise UnsupportedError(f"tool_choice={tool_choice!r}: innerq constrains a call to a named function only "
                               "({'type': 'function', 'function': {'name': ...}})")
    name = _function(tool_choice).get("name")
    if not isinstance(name, str):
        raise InvalidArgumentError(f"tool_choice={tool_choice!r} names no function")
    tool = next((t for t in tools or [] if _function(t).get("name") == name), None)
    if tool is None:
        raise InvalidArgumentError(f"tool_choice names {name!r}, which is not among the tools")
    return tool, LlamaGrammar.from_json_schema(json.dumps(_function(tool).get("parameters") or {}))


def _chat_logprobs(logprobs: Optional[dict]) -> Optional[dict]:
    """A completion's logprobs in the chat shape."""
    if logprobs is None:
        return None
    content = []
    for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        content.append({"token": token, "bytes": None, "logprob": lp,
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": None} for t, v in (top or {}).items()]})
    return {"content": content, "refusal": None}


@dataclasses.dataclass
class ChatPrompt:
    """A chat request made ready for a completion: the prompt text (added_special: it holds its
    special tokens, so none is added when it is tokenized), the stop strings, the grammar that
    constrains the answer (response_format's, a named tool's or the caller's), the tool whose
    call the answer is (None: a text answer), and the formatter's stopping criteria."""

    prompt: str
    added_special: bool
    stop: List[str]
    grammar: Any
    tool: Optional[dict]
    stopping_criteria: Any


def prepare_chat(chat_formatter, messages, *, tools=None, tool_choice=None, stop=(), response_format=None,
                 grammar=None, functions=None, function_call=None) -> ChatPrompt:
    """Renders messages with chat_formatter and turns response_format or a tool_choice naming a
    function into the grammar of the answer."""
    if functions or function_call:
        raise UnsupportedError("functions / function_call (the legacy OpenAI function calling) are not "
                               "supported; use tools with tool_choice naming the function")
    result = chat_formatter(messages=messages, tools=tools, tool_choice=tool_choice)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if result.stop is not None:
        stops += [result.stop] if isinstance(result.stop, str) else list(result.stop)
    fmt_grammar = _grammar_for_response_format(response_format)
    tool, tool_grammar = _tool_grammar(tools, tool_choice)
    if sum(g is not None for g in (grammar, fmt_grammar, tool_grammar)) > 1:
        raise InvalidArgumentError("give one of grammar, response_format and a named tool_choice")
    return ChatPrompt(result.prompt, result.added_special, stops, grammar or fmt_grammar or tool_grammar, tool,
                      result.stopping_criteria)


def chat_formatter_to_chat_completion_handler(chat_formatter):
    def chat_completion_handler(*, llama, messages, functions=None, function_call=None, tools=None,
                                tool_choice=None, temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                                min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False, stop=(),
                                seed=None, response_format=None, max_tokens=None, presence_penalty: float = 0.0,
                                frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, tfs_z: float = 1.0,
                                mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                                model=None, logits_processor=None, grammar=None, logit_bias=None, logprobs=None,
                                top_logprobs=None, **kwargs):
        chat = prepare_chat(chat_formatter, messages, tools=tools, tool_choice=tool_choice, stop=stop,
                            response_format=response_format, grammar=grammar, functions=functions,
                            function_call=function_call)
        prompt = llama.tokenize(chat.prompt.encode("utf-8"), add_bos=not chat.added_special, special=True)
        out = llama.create_completion(
            prompt=prompt, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, typical_p=typical_p,
            logprobs=(top_logprobs or 0) if logprobs else None, stream=stream, stop=chat.stop, seed=seed,
            max_tokens=max_tokens, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta, model=model, logits_processor=logits_processor,
            stopping_criteria=chat.stopping_criteria, grammar=chat.grammar, logit_bias=logit_bias)
        if stream:
            return _chat_chunks(out, chat.tool)
        return chat_response(out, chat.tool)

    return chat_completion_handler


def _tool_call(tool, arguments: str, rid: str) -> dict:
    return {"id": "call_" + rid, "type": "function",
            "function": {"name": tool["function"]["name"], "arguments": arguments}}


def chat_response(completion: dict, tool) -> dict:
    """A completion as the chat completion of the same answer (a call of tool, if given)."""
    choice = completion["choices"][0]
    rid = completion["id"]
    message = {"role": "assistant", "content": choice["text"]}
    finish = choice["finish_reason"]
    if tool is not None:
        message = {"role": "assistant", "content": None, "tool_calls": [_tool_call(tool, choice["text"], rid)]}
        finish = "tool_calls"
    return {"id": "chat" + rid, "object": "chat.completion", "created": completion["created"],
            "model": completion["model"],
            "choices": [{"index": 0, "message": message, "logprobs": _chat_logprobs(choice["logprobs"]),
                         "finish_reason": finish}],
            "usage": completion["usage"]}


class ChatChunks:
    """A completion's chunks as chat completion chunks: the first says the role, the text
    becomes content (or a call of tool, if given), the last says why the answer ended."""

    def __init__(self, tool):
        self.tool = tool
        self.first = True

    def convert(self, chunk: dict) -> List[dict]:
        choice = chunk["choices"][0]
        rid, created, model = "chat" + chunk["id"], chunk["created"], chunk["model"]
        out = []
        if self.first:
            out.append(completions.chat_chunk(rid, created, model, {"role": "assistant"}, None))
            self.first = False
        if choice["finish_reason"] is not None:
            reason = "tool_calls" if self.tool is not None else choice["finish_reason"]
            out.append(completions.chat_chunk(rid, created, model, {}, reason))
        elif choice["text"] or choice["logprobs"]:
            delta = ({"tool_calls": [{"index": 0, **_tool_call(self.tool, choice["text"], chunk["id"])}]}
                     if self.tool is not None else {"content": choice["text"]})
            out.append(completions.chat_chunk(rid, created, model, delta, None))
            out[-1]["choices"][0]["logprobs"] = _chat_logprobs(choice["logprobs"])
        return out


def _chat_chunks(chunks, tool):
    converter = ChatChunks(tool)
    for chunk in chunks:
        yield from converter.convert(chunk)
