"""llama-cpp-python's `llama_grammar` module: LlamaGrammar and JSON Schema to GBNF.

A LlamaGrammar is parsed when it is made (innerq.grammar), so a grammar that does not parse
is a GrammarError (a ValueError) at once, not at the first sampled token.

json_schema_to_gbnf writes a grammar whose every sentence is a JSON text valid under the
schema. What it supports: type (one or a list), enum, const, anyOf / oneOf, $ref into $defs
or definitions (recursion included), allOf of objects, objects (properties, required,
additionalProperties when there are no properties), arrays (items, prefixItems, minItems,
maxItems), strings (minLength, maxLength), integers, numbers, booleans, null, and `{}` / true
for any JSON value. Keywords that would narrow the valid texts further and that it cannot
express (pattern, minimum, multipleOf, ...) are an error rather than silently ignored.
Properties are written in the schema's order (prop_order first): required ones always,
optional ones each at most once, with the commas a JSON object needs; the grammar grows
linearly with the number of properties (a chain of rules, one per optional property).
Limits: schemas nested more than MAX_SCHEMA_DEPTH deep, and counts (minItems, maxItems,
minLength, maxLength) above MAX_COUNT, are GrammarErrors: a grammar counts by writing the
item out once per count (llama.cpp refuses repetitions past 2000 as well), so maxItems 1e9
would be a grammar of a billion rules. The grammar's own limits (innerq.grammar) apply after.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .grammar import MAX_TEXT, Grammar, GrammarError

LLAMA_GRAMMAR_DEFAULT_ROOT = "root"
MAX_SCHEMA_DEPTH = 64
MAX_COUNT = 10_000

__all__ = ["LlamaGrammar", "GrammarError", "json_schema_to_gbnf", "JSON_GBNF", "LLAMA_GRAMMAR_DEFAULT_ROOT"]


class LlamaGrammar:
    """A GBNF grammar, parsed. `from_string`, `from_file` and `from_json_schema` make one."""

    def __init__(self, *args, _grammar: str, **kwargs):
        self._grammar = _grammar
        self._root = LLAMA_GRAMMAR_DEFAULT_ROOT
        self.parsed = Grammar(_grammar, self._root)

    @property
    def grammar(self) -> str:
        return self._grammar

    @property
    def _n_rules(self) -> int:
        return self.parsed.n_rules

    @property
    def _start_rule_index(self) -> int:
        return self.parsed.start

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file: str | Path, verbose: bool = True) -> "LlamaGrammar":
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read(MAX_TEXT + 1)  # no more: the file may be /dev/zero
        except (OSError, UnicodeDecodeError) as e:
            raise GrammarError(f"grammar file {file}: {e}") from None
        if not text.strip():
            raise GrammarError(f"grammar file {file} is empty")
        return cls.from_string(text, verbose=verbose)

    @classmethod
    def from_json_schema(cls, json_schema: str | dict, verbose: bool = True) -> "LlamaGrammar":
        return cls.from_string(json_schema_to_gbnf(json_schema), verbose=verbose)

    def __repr__(self) -> str:
        return f"LlamaGrammar({self._n_rules} rules)"


# ------------------------------------------------------------------- JSON as GBNF rules
# Whitespace between JSON tokens: at most one space, so a model can't spin in blank space.
_SPACE = '" "?'
_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
_INT = r'"-"? ([0-9] | [1-9] [0-9]{0,15})'
_PRIMITIVES = {
    "null": '"null" space',
    "boolean": '("true" | "false") space',
    "integer": f"({_INT}) space",
    "number": f'({_INT}) ("." [0-9]+)? ([eE] [-+]? [0-9]{{1,15}})? space',
    "string": '"\\"" char* "\\"" space',
}
_ANY = {
    "value": "object | array | string | number | boolean | null",
    "object": '"{" space (string ":" space value ("," space string ":" space value)*)? "}" space',
    "array": '"[" space (value ("," space value)*)? "]" space',
}
# Keywords that only annotate, or that a grammar of all valid texts may leave out.
_IGNORED = {"title", "description", "$schema", "$id", "$comment", "examples", "default", "deprecated",
            "readOnly", "writeOnly", "format", "$defs", "definitions", "additionalProperties",
            "unevaluatedProperties", "minProperties"}


def _literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly."""
    out = []
    for ch in text:
        cp = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif cp < 0x20 or cp == 0x7F:
            out.append(f"\\x{cp:02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_TYPE_NAMES = {str: "a string", list: "a list", dict: "an object"}


class _Converter:
    def __init__(self, root_schema: dict, prop_order: list[str]):
        self.root_schema = root_schema
        self.prop_order = {name: i for i, name in enumerate(prop_order)}
        self.rules: dict[str, str] = {"space": _SPACE}
        self.refs: dict[str, str] = {}
        self.depth = 0

    def fail(self, msg: str):
        raise GrammarError(f"JSON schema: {msg}")

    def get(self, schema: dict, key: str, types: tuple, name: str, default=None):
        """schema[key], which must be one of `types` (default where it is absent)."""
        if key not in schema:
            return default
        v = schema[key]
        if not isinstance(v, types):
            self.fail(f"{name}: {key} must be {' or '.join(_TYPE_NAMES[t] for t in types)}, got {v!r}"[:300])
        return v

    def count(self, schema: dict, key: str, name: str, default=None):
        """schema[key], a count in [0, MAX_COUNT] (default where absent)."""
        v = schema.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
            self.fail(f"{name}: {key} must be a non-negative integer, got {v!r}")
        if v > MAX_COUNT:
            self.fail(f"{name}: {key} {int(v)} is more than the {MAX_COUNT} a grammar can count (the limit)")
        return int(v)

    def add(self, name: str, body: str) -> str:
        name = re.sub(r"[^a-zA-Z0-9-]+", "-", name).strip("-") or "r"
        if self.rules.get(name, body) != body:
            n = 1
            while self.rules.get(f"{name}{n}", body) != body:
                n += 1
            name = f"{name}{n}"
        self.rules[name] = body
        return name

    def json_literal(self, value, name: str) -> str:
        """A GBNF literal of the JSON text of value (const, enum)."""
        try:
            return _literal(json.dumps(value, ensure_ascii=False, separators=(", ", ": ")))
        except (TypeError, ValueError, RecursionError) as e:
            self.fail(f"{name}: {value!r:.100} is not a JSON value ({e})")

    def primitive(self, t: str) -> str:
        if t == "string":
            self.rules.setdefault("char", _CHAR)
        return self.add(t, _PRIMITIVES[t])

    def any_value(self) -> str:
        for t in ("null", "boolean", "number", "string"):
            self.primitive(t)
        for name, body in _ANY.items():
            self.rules.setdefault(name, body)
        return "value"

    def target(self, ref, name: str):
        """The schema that $ref `ref` names (#/$defs/NAME or #/definitions/NAME)."""
        m = re.fullmatch(r"#/(\$defs|definitions)/(.+)", ref) if isinstance(ref, str) else None
        defs = self.root_schema.get(m.group(1)) if m else None
        if not isinstance(defs, dict) or m.group(2) not in defs:
            self.fail(f"{name}: cannot resolve $ref {ref!r} (only #/$defs/NAME and #/definitions/NAME)"[:300])
        return defs[m.group(2)]

    def resolve(self, ref, name: str) -> str:
        if isinstance(ref, str) and ref in self.refs:
            return self.refs[ref]
        schema = self.target(ref, name)
        rule = self.add(ref.rsplit("/", 1)[1], "")  # reserved now, so a recursive reference finds it
        self.refs[ref] = rule
        self.rules[rule] = self.body(schema, rule)
        return rule

    def visit(self, schema, name: str) -> str:
        """A rule reference (or a parenthesized expression) for `schema`."""
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            self.fail(f"{name}: a schema must be an object or true, got {schema!r}")
        if "$ref" in schema:
            return self.resolve(schema["$ref"], name)
        t = schema.get("type")
        if isinstance(t, str) and t in _PRIMITIVES and set(schema) - _IGNORED <= {"type"}:
            return self.primitive(t)
        return self.add(name, self.body(schema, name))

    def body(self, schema, name: str) -> str:
        if schema is not True and not isinstance(schema, dict):
            self.fail(f"{name}: a schema must be an object or true, got {schema!r}"[:300])
        self.depth += 1
        if self.depth > MAX_SCHEMA_DEPTH:
            self.fail(f"{name}: schemas nested more than {MAX_SCHEMA_DEPTH} deep (the limit)")
        try:
            return self._body(schema, name)
        finally:
            self.depth -= 1

    def _body(self, schema: dict, name: str) -> str:
        if schema is True or schema == {}:
            return self.any_value()
        keys = set(schema) - _IGNORED
        if "$ref" in keys:
            return self.resolve(schema["$ref"], name)
        if "const" in keys:
            return f"{self.json_literal(schema['const'], name)} space"
        if "enum" in keys:
            values = self.get(schema, "enum", (list,), name)
            if not values:
                self.fail(f"{name}: enum must be a non-empty list")
            return "(" + " | ".join(self.json_literal(v, name) for v in values) + ") space"
        for key in ("anyOf", "oneOf"):
            if key in keys:
                alts = self.get(schema, key, (list,), name)
                if not alts:
                    self.fail(f"{name}: {key} must be a non-empty list")
                return " | ".join(self.visit(s, f"{name}-{i}") for i, s in enumerate(alts))
        if "allOf" in keys:
            return self.body(self.merge_all_of(schema, name), name)
        t = self.get(schema, "type", (str, list), name)
        if isinstance(t, list):
            if not t or not all(isinstance(x, str) for x in t):
                self.fail(f"{name}: type must be a name or a non-empty list of names, got {t!r}"[:300])
            return " | ".join(self.visit({**schema, "type": x}, f"{name}-{x}") for x in t)
        if t is None:
            t = "object" if "properties" in schema else "array" if "items" in schema else None
            if t is None:
                if keys:
                    self.fail(f"{name}: unsupported keywords {sorted(keys)}")
                return self.any_value()
        handler = {"object": self.object, "array": self.array, "string": self.string}.get(t)
        if handler is not None:
            return handler(schema, name)
        if t not in _PRIMITIVES:
            self.fail(f"{name}: unknown type {t!r}")
        extra = keys - {"type"}
        if extra:
            self.fail(f"{name}: keywords {sorted(extra)} are not supported for {t}")
        return self.primitive(t)

    def merge_all_of(self, schema: dict, name: str) -> dict:
        merged = {"type": "object", "properties": {}, "required": []}
        for part in self.get(schema, "allOf", (list,), name):
            if isinstance(part, dict) and "$ref" in part:
                part = self.target(part["$ref"], name)
            if not isinstance(part, dict) or part.get("type", "object") != "object":
                self.fail(f"{name}: allOf is supported for objects only")
            merged["properties"].update(self.get(part, "properties", (dict,), name, {}))
            merged["required"] += self.get(part, "required", (list,), name, [])
        return merged

    def string(self, schema: dict, name: str) -> str:
        extra = set(schema) - _IGNORED - {"type", "minLength", "maxLength"}
        if extra:
            self.fail(f"{name}: keywords {sorted(extra)} are not supported for strings")
        lo, hi = self.count(schema, "minLength", name, 0), self.count(schema, "maxLength", name)
        if hi is not None and hi < lo:
            self.fail(f"{name}: maxLength < minLength")
        if lo == 0 and hi is None:
            return self.primitive("string")
        self.rules.setdefault("char", _CHAR)
        rep = f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"
        return f'"\\"" char{rep} "\\"" space'

    def array(self, schema: dict, name: str) -> str:
        extra = set(schema) - _IGNORED - {"type", "items", "prefixItems", "minItems", "maxItems"}
        if extra:
            self.fail(f"{name}: keywords {sorted(extra)} are not supported for arrays")
        prefix = self.get(schema, "prefixItems", (list,), name) or \
            (schema["items"] if isinstance(schema.get("items"), list) else None)
        if prefix is not None:
            items = [self.visit(s, f"{name}-{i}") for i, s in enumerate(prefix)]
            return '"[" space ' + ' "," space '.join(items) + ' "]" space' if items else '"[" space "]" space'
        item = self.visit(schema.get("items", True), f"{name}-item")
        lo, hi = self.count(schema, "minItems", name, 0), self.count(schema, "maxItems", name)
        if hi is not None and hi < lo:
            self.fail(f"{name}: maxItems < minItems")
        if hi == 0:
            return '"[" space "]" space'
        # n items, lo <= n <= hi: the first, then n - 1 more after commas
        more = f'("," space {item})' + ("*" if hi is None and lo <= 1 else
                                          f"{{{max(lo - 1, 0)},}}" if hi is None else f"{{{max(lo - 1, 0)},{hi - 1}}}")
        if lo >= 1:
            return f'"[" space {item} {more} "]" space'
        return f'"[" space ({item} {more})? "]" space'

    def object(self, schema: dict, name: str) -> str:
        extra = set(schema) - _IGNORED - {"type", "properties", "required"}
        if extra:
            self.fail(f"{name}: keywords {sorted(extra)} are not supported for objects")
        props = self.get(schema, "properties", (dict,), name, {})
        if not props:
            self.any_value()
            return _ANY["object"]
        order = sorted(props, key=lambda k: (self.prop_order.get(k, len(self.prop_order)), list(props).index(k)))
        required = self.get(schema, "required", (list,), name, [])
        if not all(isinstance(k, str) for k in required):
            self.fail(f"{name}: required must be a list of property names, got {required!r}"[:300])
        required = set(required)
        unknown = required - set(props)
        if unknown:
            self.fail(f"{name}: required properties {sorted(unknown)} have no schema")
        kv = {k: f'{_literal(json.dumps(k, ensure_ascii=False))} space ":" space {self.visit(props[k], f"{name}-{k}")}'
              for k in order}
        req = [kv[k] for k in order if k in required]
        opt = [kv[k] for k in order if k not in required]
        if req:
            inner = ' "," space '.join(req) + "".join(f' ("," space {o})?' for o in opt)
            return f'"{{" space {inner} "}}" space'
        # No required property: any in-order subset, the first one present without a comma.
        # rest[i] is the optional properties from i on, each after a comma: a chain of rules,
        # so the grammar grows with the count of properties, not with its square.
        rest = [""] * (len(opt) + 1)
        for i in range(len(opt) - 1, -1, -1):
            tail = f" {rest[i + 1]}" if rest[i + 1] else ""
            rest[i] = self.add(f"{name}-rest-{i}", f'("," space {opt[i]})?{tail}')
        alts = [opt[i] + (f" {rest[i + 1]}" if rest[i + 1] else "") for i in range(len(opt))]
        return '"{" space (' + " | ".join(alts) + ')? "}" space'


def json_schema_to_gbnf(schema: str | dict, prop_order: list[str] | None = None) -> str:
    """GBNF whose sentences are the JSON texts valid under `schema` (a dict or JSON text)."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"JSON schema is not valid JSON: {e}") from None
        except RecursionError:
            raise GrammarError("JSON schema: nested too deep to read") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"JSON schema must be an object, got {type(schema).__name__}")
    conv = _Converter(schema if isinstance(schema, dict) else {}, list(prop_order or []))
    root = conv.body(schema, "root")
    lines = [f"root ::= {root}"] + [f"{n} ::= {b}" for n, b in conv.rules.items()]
    return "\n".join(lines) + "\n"


# Any JSON object (response_format={"type": "json_object"}).
JSON_GBNF = json_schema_to_gbnf({"type": "object"})
