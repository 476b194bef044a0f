"""GBNF grammars (python/innerq/grammar.py) and JSON Schema to GBNF (llama_grammar.py).

Oracles: Python's own json module and hand-checked validity under each schema for the JSON
side; for the token mask, feeding each allowed token's bytes through the matcher one by one
(the walk over the sorted vocabulary must agree with token-by-token checks).
llama.cpp's grammars in tests/peer/grammars come from llama-cpp-python 0.3.36's sdist
(vendor/llama.cpp/grammars, MIT licence) and must parse as they do there.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from innerq.grammar import Grammar, GrammarError, GrammarMatcher, MatchState, TokenIndex, feed_bytes  # noqa: E402
from innerq.llama_grammar import JSON_GBNF, LlamaGrammar, json_schema_to_gbnf  # noqa: E402

GRAMMARS = ROOT / "tests" / "peer" / "grammars"


def accepts(g: Grammar, text: str) -> bool:
    s = feed_bytes(g, MatchState(g.initial()), text.encode("utf-8"))
    return s is not None and s.can_end


def test_rule_numbering_as_llama_cpp():
    g = LlamaGrammar.from_string('\nleaf ::= "."\nnode ::= leaf | "(" node node ")"\nroot ::= node\n')
    assert (g._n_rules, g._start_rule_index) == (3, 2)
    assert accepts(g.parsed, "((..).)") and not accepts(g.parsed, "((..)") and not accepts(g.parsed, "(.)")


@pytest.mark.parametrize("name", sorted(p.name for p in GRAMMARS.glob("*.gbnf")))
def test_llama_cpp_grammars_parse(name):
    g = LlamaGrammar.from_file(GRAMMARS / name)
    assert g.parsed.names[g._start_rule_index] == "root"


@pytest.mark.parametrize("text, ok", [
    ('{"a": 1}', True), ('{"a": [1, 2.5e3, "x\\n", true, null, {}]}', True), ('{"é": "ü ☃"}', True),
    ('{"a": 1', False), ('[1]', False), ('{"a": tru}', False), ('{"a": "\x01"}', False), ('{"a": 01}', False),
])
def test_json_gbnf(text, ok):
    g = LlamaGrammar.from_file(GRAMMARS / "json.gbnf").parsed
    assert accepts(g, text) == ok


def test_arithmetic_and_list():
    a = LlamaGrammar.from_file(GRAMMARS / "arithmetic.gbnf").parsed
    assert accepts(a, "1+x = 3\n") and accepts(a, "(a*b) = c\ny=3\n") and not accepts(a, "x = 1+2\n")
    lst = LlamaGrammar.from_file(GRAMMARS / "list.gbnf").parsed
    assert accepts(lst, "- eggs\n- milk\n") and not accepts(lst, "- eggs") and not accepts(lst, "* eggs\n")


@pytest.mark.parametrize("src, why", [
    ("root ::= foo", "not defined"), ('root ::= "a', "unterminated string"), ("root ::= [a", "unterminated character"),
    ('x ::= "a"', "no 'root' rule"), ('root ::= root "a"', "left-recursive"), ('root ::= "a"{2,1}', "n < m"),
    ('root ::= "\\q"', "unknown escape"), ("root ::= ( \"a\"", "expected ')'"), ("root := \"a\"", "'::='"),
    ("", "no rules"), ('root ::= "a" *', None), ("root ::= * \"a\"", "follows nothing"),
])
def test_invalid_grammars_are_clear_errors(src, why):
    if why is None:  # a repetition may be separated from its element by a space
        assert accepts(Grammar(src), "aaa")
        return
    with pytest.raises(GrammarError, match=re.escape(why)):
        LlamaGrammar.from_string(src)
    with pytest.raises(ValueError):  # GrammarError is a ValueError, as llama-cpp-python raises
        LlamaGrammar.from_string(src)


def test_bad_grammar_file(tmp_path):
    with pytest.raises(GrammarError, match="missing"):
        LlamaGrammar.from_file(tmp_path / "missing.gbnf")
    (tmp_path / "empty.gbnf").write_text("  \n")
    with pytest.raises(GrammarError, match="empty"):
        LlamaGrammar.from_file(tmp_path / "empty.gbnf")


def test_utf8_split_over_bytes():
    g = Grammar('root ::= [ä-ö]+ "!"')
    s = feed_bytes(g, MatchState(g.initial()), "ä".encode()[:1])  # half of a code point
    assert s is not None and s.pending and not s.can_end
    assert feed_bytes(g, s, "ä!".encode()[1:]).can_end
    assert feed_bytes(g, MatchState(g.initial()), "a".encode()) is None
    assert feed_bytes(g, MatchState(g.initial()), b"\xc3") is not None    # U+00C0..U+00FF may follow
    assert feed_bytes(g, MatchState(g.initial()), b"\xe2") is None        # U+2000..: none in [ä-ö]
    assert feed_bytes(g, MatchState(g.initial()), b"\xc0\x80") is None    # an overlong form is never text


SCHEMAS = {
    "nested-ref": ({"$defs": {"A": {"properties": {"a": {"type": "integer"}}, "required": ["a"], "type": "object"}},
                    "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"type": "integer"}}, "required": ["a"],
                    "type": "object"},
                   [('{"a": {"a": 1}, "b": 2}', True), ('{"a": {"a": -3}}', True), ('{"b": 2}', False),
                    ('{"a": {"a": 1.5}}', False), ('{"a": {"a": 1}, "b": 2, "b": 3}', False)]),
    "any-of-enum": ({"properties": {"temperature": {"type": "number"},
                                    "unit": {"anyOf": [{"enum": ["celsius", "fahrenheit"], "type": "string"},
                                                       {"type": "null"}]}}, "type": "object"},
                    [('{"temperature": 1.5, "unit": "celsius"}', True), ('{"unit": null}', True), ("{}", True),
                     ('{"unit": "kelvin"}', False), ('{"temperature": 1, "temperature": 2}', False)]),
    "array-bounds": ({"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
                     [('["a"]', True), ('["a", "bcd"]', True), ('["abcd"]', False), ("[]", False),
                      ('["a", "b", "c"]', True), ('["a", "b", "c", "d"]', False)]),
    "recursive": ({"$defs": {"node": {"type": "object", "required": ["v"],
                                      "properties": {"v": {"type": "integer"},
                                                     "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
                   "$ref": "#/$defs/node"},
                  [('{"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}', True), ('{"kids": []}', False)]),
    "types": ({"type": "object", "required": ["s", "b", "n", "t"],
               "properties": {"s": {"type": "string"}, "b": {"type": "boolean"}, "n": {"type": ["integer", "null"]},
                              "t": {"const": "x\"y"}}},
              [('{"s": "\\u00e9\\n", "b": false, "n": null, "t": "x\\"y"}', True),
               ('{"s": "", "b": true, "n": 7, "t": "x\\"y"}', True), ('{"s": 1, "b": true, "n": 7, "t": "x\\"y"}', False)]),
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_grammars(name):
    schema, cases = SCHEMAS[name]
    g = LlamaGrammar.from_json_schema(json.dumps(schema)).parsed
    for text, ok in cases:
        json.loads(text)  # every case is JSON; validity under the schema is the question
        assert accepts(g, text) == ok, (name, text)


@pytest.mark.parametrize("schema, why", [
    ({"type": "string", "pattern": "a+"}, "pattern"), ({"type": "integer", "minimum": 3}, "minimum"),
    ({"$ref": "#/x"}, "cannot resolve"), ({"type": "thing"}, "unknown type"), ({"enum": []}, "non-empty"),
    ("{not json", "not valid JSON"),
])
def test_unsupported_schemas_are_errors(schema, why):
    with pytest.raises(GrammarError, match=why):
        json_schema_to_gbnf(schema if isinstance(schema, str) else json.dumps(schema))


def test_json_object_grammar():
    g = Grammar(JSON_GBNF)
    assert accepts(g, '{"a": [1, {"b": null}]}') and not accepts(g, "[1]") and not accepts(g, '"x"')


def test_token_mask_equals_token_by_token_checks():
    """The vocabulary walk allows exactly the tokens whose bytes the matcher accepts."""
    pieces = [b"", b"{", b"{\"", b"\"", b"a", b"ab", b"\"a", b"}", b" ", b"\xc3", b"\xa4", b"\xc3\xa4", b"1", b"12",
              b"\": ", b"\":", b"\"}", b"}\n", b"x\"", b",", b", \""]
    eog = {0}
    index = TokenIndex(pieces, eog)
    g = Grammar(json_schema_to_gbnf({"type": "object", "properties": {"a": {"type": "string"}}}))
    m = GrammarMatcher(g, index)
    for prefix in ["", "{", '{"', '{"a', '{"a": "', '{"a": "\xe4', '{"a": "x"', '{"a": "x"}']:
        m.state = feed_bytes(g, MatchState(g.initial()), prefix.encode())
        assert m.state is not None, prefix
        walked = sorted(m.allowed())
        checked = sorted(t for t in range(len(pieces)) if m.accepts(t))
        assert walked == checked, prefix
    m.state = feed_bytes(g, MatchState(g.initial()), b'{"a": "x"} ')  # the optional space after the object
    assert m.allowed() == [0] and m.finished


# ---- limits (issue 33): small inputs that blew up; tests/test_limits.py times them under a memory cap ----

def test_a_huge_repetition_is_refused_before_it_is_built():
    with pytest.raises(GrammarError, match=r"repetition \{0,3000000\}.*larger than 200000 elements"):
        Grammar('root ::= "a"{0,3000000}')
    assert accepts(Grammar('root ::= "a"{0,3000}'), "a" * 3000)  # below the limit: as before


def test_json_schema_counts_past_the_limit_are_refused():
    with pytest.raises(GrammarError, match="maxItems 1000000000 is more than the 10000"):
        json_schema_to_gbnf({"type": "array", "items": {"type": "integer"}, "maxItems": 10**9})
    with pytest.raises(GrammarError, match="minLength must be a non-negative integer"):
        json_schema_to_gbnf({"type": "string", "minLength": -1})


def test_optional_properties_grow_the_grammar_linearly():
    """9f85726 wrote every in-order subset's first property with all that may follow it: 2,000
    optional properties took 72 s and a MemoryError."""
    def schema(n):
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}

    sizes = {n: len(json_schema_to_gbnf(schema(n))) for n in (500, 1000, 2000)}
    assert sizes[2000] < 2.2 * sizes[1000] < 4.84 * sizes[500]
    g = LlamaGrammar.from_json_schema(schema(2000)).parsed
    for text, ok in [("{}", True), ('{"p5": 1, "p1999": 2}', True), ('{"p1999": 2}', True), ('{"p0": 0}', True),
                     ('{"p1999": 2, "p5": 1}', False), ('{"p5": 1, "p5": 1}', False), ('{"p2000": 1}', False),
                     ('{, "p5": 1}', False), ('{"p5": 1,}', False)]:
        assert accepts(g, text) == ok, text


def test_an_ambiguous_grammar_stops_at_the_stack_limit():
    """Nested optional repetitions multiply the parse stacks; 9f85726 took 80 s to match a few
    characters. Whatever it matched before the limit, it matched right."""
    g = Grammar('root ::= (("a"{0,40}){0,40}){0,40}')
    s = MatchState(g.initial())
    with pytest.raises(GrammarError, match="more than 10000 parse stacks"):
        for _ in range(100):
            s = feed_bytes(g, s, b"a")
            assert s is not None and s.can_end


@pytest.mark.parametrize("src, why", [
    ("root ::= " + "(" * 150 + '"a"' + ")" * 150, "nested more than 100 deep"),
    ('root ::= "' + "a" * (1 << 20) + '"', "more than the limit"),
])
def test_grammar_size_limits(src, why):
    with pytest.raises(GrammarError, match=why):
        Grammar(src)


def test_a_long_chain_of_rules_is_checked_without_recursion():
    """The left-recursion check walks a chain of 5,000 rules (Python's recursion stops at 1,000)."""
    n = 5_000
    chain = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} | "x"\n' for i in range(n))
    g = Grammar(chain + f'r{n} ::= "y"\n')
    assert accepts(g, "x") and accepts(g, "y") and not accepts(g, "xy")
    with pytest.raises(GrammarError, match="rule 'r0' is left-recursive"):
        Grammar(chain + f'r{n} ::= r0 "y"\n')


def test_schemas_nested_too_deep_are_an_error():
    deep = {"type": "array", "items": True}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError, match="nested more than 64 deep"):
        json_schema_to_gbnf(deep)
    with pytest.raises(GrammarError, match="nested too deep"):
        json_schema_to_gbnf("[" * 100_000)
