"""Fuzz target (atheris, libFuzzer for Python) of the grammar compiler and matcher
(python/innerq/grammar.py) and of the JSON schema to GBNF converter (llama_grammar.py).

    python tests/fuzz/fuzz_grammar.py -max_total_time=30 CORPUS_DIR

An input is KIND, then a grammar (KIND 0: GBNF) or a JSON schema (KIND 1) as UTF-8, then a
NUL and a text to match. Anything may fail with a GrammarError; nothing else may escape,
and the limits must hold (a parse stays within MAX_STACKS, no input runs past libFuzzer's
-timeout). A schema's grammar accepts JSON only: a text it accepts must parse with json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "python"))  # innerq of this checkout
with atheris.instrument_imports(include=["innerq"]):
    from innerq.grammar import MAX_STACKS, Grammar, GrammarError, MatchState, feed_byte
    from innerq.llama_grammar import json_schema_to_gbnf


def test_one_input(data: bytes) -> None:
    if not data:
        return
    source, _, sample = data[1:].partition(b"\0")
    text = source.decode("utf-8", errors="replace")
    schema = data[0] & 1
    try:
        g = Grammar(json_schema_to_gbnf(text) if schema else text)
        state = MatchState(g.initial())
        for b in sample:
            state = feed_byte(g, state, b)
            if state is None:
                return
            assert len(state.stacks) <= MAX_STACKS
    except GrammarError:
        return
    if schema and state.can_end:
        json.loads(sample.decode("utf-8"))


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
