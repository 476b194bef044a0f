"""StopMatcher against a brute-force oracle: for random texts cut into random pieces, what it
emits is the text up to the first occurrence of any stop string, and at no moment has it
emitted anything beyond that (so a stop string split across pieces never leaks)."""
from __future__ import annotations

import random

import pytest

try:
    from innerq.sampling import StopMatcher, stop_list
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)


def expected(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s in text]
    return text[:min(hits)] if hits else text


@pytest.mark.parametrize("seed", range(300))
def test_random_pieces(seed):
    rng = random.Random(seed)
    alphabet = "ab c\né"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    want = expected(text, stops)
    m = StopMatcher(stops)
    emitted = ""
    i = 0
    while i < len(text) and not m.stopped:
        j = i + rng.randint(1, 5)
        emitted += m.feed(text[i:j])
        assert want.startswith(emitted)
        i = j
    emitted += m.finish()
    assert emitted == want
    assert m.stopped == any(s in text for s in stops)


def test_stop_list():
    assert stop_list(None) == [] and stop_list("x") == ["x"] and stop_list(["a", "", "b"]) == ["a", "b"]
    assert stop_list(("a",)) == ["a"]
