"""GBNF grammars (llama.cpp's grammar format) and grammar-constrained sampling.

A grammar is parsed into rules of alternatives of elements, where an element is a character
class (a set of code-point ranges, possibly negated) or a reference to a rule; repetitions
(`*`, `+`, `?`, `{m,n}`) and groups become generated rules, as llama.cpp does, so rule
numbering matches llama.cpp's (symbols numbered at first appearance).

Matching is a set of parse stacks. A stack is a tuple of frames (rule, alternative, index),
the last one on top, each pointing at the next element to match of its sequence; a frame
that has matched its last element is dropped at once, so right-recursive repetitions keep
stacks short. After expansion every stack's top points at a character class, or the stack
is empty: the grammar may end there. The stacks of a position are expanded in one walk (a
stack several of them reach is expanded once) and grouped by the class on top, so a byte is
matched once per class, not once per stack. Text is fed as bytes: a code point split over tokens
(byte-level BPE) is carried as pending bytes, and a token that stops inside a code point is
accepted when some code point that starts with those bytes could match.

The tokens a grammar allows next are found by walking the vocabulary sorted by bytes, so a
prefix shared by many tokens is matched once and a rejected prefix prunes all of them.

Limits, so that a small input cannot stall a server (each a GrammarError naming it): the
grammar text (MAX_TEXT characters), its size once repetitions are written out (MAX_ELEMENTS
elements: `"a"{0,3000000}` is refused before anything is built), the nesting of groups
(MAX_DEPTH), the parse stacks one position may have at once (MAX_STACKS: nested optional
repetitions such as `(("a"{0,40}){0,40}){0,40}` multiply them) and the parse steps of one
expansion and of one vocabulary walk (MAX_STEPS, MAX_WALK_STEPS). The step limits count work
rather than time, so a grammar fails or passes alike on every machine; each stands for well
under a second.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .errors import InvalidArgumentError


class GrammarError(InvalidArgumentError):
    """A grammar that does not parse, names a rule it does not define, or passes a limit."""


MAX_CP = 0x10FFFF
MAX_TEXT = 1 << 20        # characters of grammar text
MAX_ELEMENTS = 200_000    # elements of all rules, repetitions written out
MAX_DEPTH = 100           # groups inside groups
MAX_STACKS = 10_000       # parse stacks at one position
MAX_STEPS = 400_000       # stacks visited by one expansion (advance, initial)
MAX_WALK_STEPS = 5_000_000  # stacks fed a byte in one walk over the vocabulary (allowed tokens)


@dataclass(frozen=True)
class CharClass:
    ranges: tuple  # ((lo, hi), ...) inclusive code-point ranges
    negated: bool = False

    def match(self, cp: int) -> bool:
        for lo, hi in self.ranges:
            if lo <= cp <= hi:
                return not self.negated
        return self.negated

    def match_any(self, lo: int, hi: int) -> bool:
        """Whether some code point in [lo, hi] matches (for a code point not complete yet)."""
        if not self.negated:
            return any(a <= hi and lo <= b for a, b in self.ranges)
        # negated: some point of [lo, hi] lies outside every range
        cur = lo
        for a, b in sorted(self.ranges):
            if b < cur:
                continue
            if a > cur:
                return True
            cur = b + 1
            if cur > hi:
                return False
        return cur <= hi


ANY = CharClass(((0, MAX_CP),))


# ---------------------------------------------------------------------------------- parser
class _Parser:
    def __init__(self, src: str):
        self.src = src
        self.pos = 0
        self.ids: dict[str, int] = {}
        self.rules: dict[int, list] = {}
        self.defined: set[int] = set()
        self.size = 0  # elements written so far (MAX_ELEMENTS)
        self.depth = 0

    def fail(self, msg: str):
        line = self.src.count("\n", 0, self.pos) + 1
        col = self.pos - (self.src.rfind("\n", 0, self.pos) + 1) + 1
        raise GrammarError(f"grammar: {msg} at line {line}, column {col}")

    def grow(self, n: int, what: str):
        """Counts n more elements against MAX_ELEMENTS, before they are made."""
        self.size += n
        if self.size > MAX_ELEMENTS:
            self.fail(f"{what} makes the grammar larger than {MAX_ELEMENTS} elements (the limit)")

    def symbol(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = len(self.ids)
        return self.ids[name]

    def new_symbol(self, base: str) -> int:
        n = len(self.ids)
        while f"{base}_{n}" in self.ids:
            n += 1
        return self.symbol(f"{base}_{n}")

    def space(self, newline_ok: bool):
        s = self.src
        while self.pos < len(s):
            c = s[self.pos]
            if c in " \t" or (newline_ok and c in "\r\n"):
                self.pos += 1
            elif c == "#":
                while self.pos < len(s) and s[self.pos] not in "\r\n":
                    self.pos += 1
            else:
                break

    def name(self) -> str:
        start = self.pos
        while self.pos < len(self.src) and (self.src[self.pos].isascii() and
                                            (self.src[self.pos].isalnum() or self.src[self.pos] in "-_")):
            self.pos += 1
        if self.pos == start:
            self.fail("expected a rule name")
        return self.src[start:self.pos]

    def char(self) -> int:
        """One character of a literal or class, with escapes."""
        s = self.src
        if self.pos >= len(s):
            self.fail("unexpected end of grammar")
        c = s[self.pos]
        if c != "\\":
            self.pos += 1
            return ord(c)
        if self.pos + 1 >= len(s):
            self.fail("unexpected end of grammar after '\\'")
        e = s[self.pos + 1]
        self.pos += 2
        simple = {"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45, "^": 94, "/": 47}
        if e in simple:
            return simple[e]
        digits = {"x": 2, "u": 4, "U": 8}.get(e)
        if digits is None:
            self.fail(f"unknown escape '\\{e}'")
        h = s[self.pos:self.pos + digits]
        if len(h) != digits or any(ch not in "0123456789abcdefABCDEF" for ch in h):
            self.fail(f"expected {digits} hex digits after '\\{e}'")
        self.pos += digits
        cp = int(h, 16)
        if cp > MAX_CP:
            self.fail(f"code point {h} is out of range")
        return cp

    def sequence(self, rule_name: str, nested: bool) -> list:
        seq: list = []
        last_start = None  # index in seq where the last element began (for repetitions)
        s = self.src
        while self.pos < len(s):
            c = s[self.pos]
            if c == '"':
                self.pos += 1
                last_start = len(seq)
                while self.pos < len(s) and s[self.pos] != '"':
                    cp = self.char()
                    seq.append(CharClass(((cp, cp),)))
                if self.pos >= len(s):
                    self.fail("unterminated string literal")
                self.pos += 1
                if last_start == len(seq):  # "" matches the empty string
                    last_start = None
            elif c == "[":
                self.pos += 1
                negated = self.pos < len(s) and s[self.pos] == "^"
                self.pos += negated
                ranges = []
                while self.pos < len(s) and s[self.pos] != "]":
                    lo = self.char()
                    hi = lo
                    if self.pos + 1 < len(s) and s[self.pos] == "-" and s[self.pos + 1] != "]":
                        self.pos += 1
                        hi = self.char()
                        if hi < lo:
                            self.fail("character range out of order")
                    ranges.append((lo, hi))
                if self.pos >= len(s):
                    self.fail("unterminated character class")
                self.pos += 1
                last_start = len(seq)
                seq.append(CharClass(tuple(ranges), negated))
            elif c == ".":
                self.pos += 1
                last_start = len(seq)
                seq.append(ANY)
            elif c == "(":
                self.depth += 1
                if self.depth > MAX_DEPTH:
                    self.fail(f"groups nested more than {MAX_DEPTH} deep")
                self.pos += 1
                self.space(True)
                sub = self.new_symbol(rule_name)
                self.rules[sub] = self.alternates(rule_name, True)
                self.defined.add(sub)
                if self.pos >= len(s) or s[self.pos] != ")":
                    self.fail("expected ')'")
                self.pos += 1
                self.depth -= 1
                last_start = len(seq)
                seq.append(sub)
            elif c.isascii() and (c.isalnum() or c in "-_"):
                ref = self.symbol(self.name())
                last_start = len(seq)
                seq.append(ref)
            elif c in "*+?{":
                if last_start is None:
                    self.fail(f"'{c}' follows nothing")
                lo, hi = self.repetition()
                seq[last_start:] = self.repeat(rule_name, seq[last_start:], lo, hi)
                last_start = None
            else:
                break
            self.space(nested)
        return seq

    def repetition(self):
        c = self.src[self.pos]
        self.pos += 1
        if c == "*":
            return 0, None
        if c == "+":
            return 1, None
        if c == "?":
            return 0, 1
        self.space(False)
        lo = self.number()
        self.space(False)
        hi = lo
        if self.src.startswith(",", self.pos):
            self.pos += 1
            self.space(False)
            hi = self.number() if self.pos < len(self.src) and self.src[self.pos].isdigit() else None
            self.space(False)
        if not self.src.startswith("}", self.pos):
            self.fail("expected '}'")
        self.pos += 1
        if hi is not None and hi < lo:
            self.fail("repetition {m,n} with n < m")
        return lo, hi

    def number(self) -> int:
        start = self.pos
        while self.pos < len(self.src) and self.src[self.pos].isdigit():
            self.pos += 1
        if start == self.pos:
            self.fail("expected a number")
        return int(self.src[start:self.pos])

    def repeat(self, rule_name: str, item: list, lo: int, hi) -> list:
        """item{lo,hi} as lo copies, then a generated rule for the rest (llama.cpp's rewrite)."""
        extra = 1 if hi is None else hi - lo
        self.grow(len(item) * (lo + extra) + 2 * extra,
                  f"the repetition {{{lo},{'' if hi is None else hi}}} of {len(item)} element(s)")
        out = list(item) * lo
        if hi is None:  # rest ::= item rest |
            rest = self.new_symbol(rule_name)
            self.rules[rest] = [list(item) + [rest], []]
            self.defined.add(rest)
            return out + [rest]
        tail = None  # opt_k ::= item opt_{k-1} |   (k = hi - lo optional copies)
        for _ in range(hi - lo):
            sym = self.new_symbol(rule_name)
            self.rules[sym] = [list(item) + ([tail] if tail is not None else []), []]
            self.defined.add(sym)
            tail = sym
        return out + ([tail] if tail is not None else [])

    def alternates(self, rule_name: str, nested: bool) -> list:
        alts = [self.sequence(rule_name, nested)]
        while self.pos < len(self.src) and self.src[self.pos] == "|":
            self.pos += 1
            self.space(True)
            alts.append(self.sequence(rule_name, nested))
        return alts

    def parse(self):
        self.space(True)
        while self.pos < len(self.src):
            name = self.name()
            sym = self.symbol(name)
            self.space(False)
            if not self.src.startswith("::=", self.pos):
                self.fail(f"expected '::=' after '{name}'")
            self.pos += 3
            self.space(True)
            self.rules[sym] = self.alternates(name, False)
            self.defined.add(sym)
            if self.pos < len(self.src) and self.src[self.pos] not in "\r\n":
                self.fail(f"unexpected '{self.src[self.pos]}'")
            self.space(True)
        names = {v: k for k, v in self.ids.items()}
        for sym in range(len(self.ids)):
            if sym not in self.defined:
                raise GrammarError(f"grammar: rule '{names[sym]}' is used but not defined")
        return [self.rules[i] for i in range(len(self.ids))], [names[i] for i in range(len(self.ids))]


class Grammar:
    """A parsed grammar: rules[i] = alternatives, each a tuple of CharClass or rule index."""

    def __init__(self, text: str, root: str = "root"):
        if not isinstance(text, str):
            raise GrammarError(f"grammar must be a str, got {type(text).__name__}")
        if len(text) > MAX_TEXT:
            raise GrammarError(f"grammar: {len(text)} characters, more than the limit of {MAX_TEXT}")
        rules, names = _Parser(text).parse()
        if not rules:
            raise GrammarError("grammar: no rules")
        if root not in names:
            raise GrammarError(f"grammar: no '{root}' rule")
        self.text = text
        self.names = names
        self.rules = [[tuple(alt) for alt in alts] for alts in rules]
        self.start = names.index(root)
        self._check_left_recursion()
        self._closure_cache: dict = {}
        self._closure_cached = 0  # stacks held by the cache (keys and values)
        self._by_top_cache: dict = {}

    @property
    def n_rules(self) -> int:
        return len(self.rules)

    def _nullable(self) -> set:
        """The rules that can match the empty string, by a worklist (a rule becomes nullable
        when one of its alternatives has no element left that is not), so that a long chain
        of optional rules costs its length, not its square."""
        left = {}   # (rule, alt) -> elements not yet known to be nullable
        users = {}  # rule -> the (rule, alt) whose elements include it, once per occurrence
        todo = []
        for r, alts in enumerate(self.rules):
            for a, alt in enumerate(alts):
                if any(isinstance(e, CharClass) for e in alt):
                    continue
                left[r, a] = len(alt)
                for e in alt:
                    users.setdefault(e, []).append((r, a))
                if not alt:
                    todo.append(r)
        nullable = set()
        while todo:
            r = todo.pop()
            if r in nullable:
                continue
            nullable.add(r)
            for ra in users.get(r, ()):
                left[ra] -= 1
                if left[ra] == 0:
                    todo.append(ra[0])
        return nullable

    def _check_left_recursion(self):
        nullable = self._nullable()
        first = []  # rules that can come first in rule r (left edges)
        for alts in self.rules:
            edges = set()
            for alt in alts:
                for e in alt:
                    if isinstance(e, CharClass):
                        break
                    edges.add(e)
                    if e not in nullable:
                        break
            first.append(sorted(edges))
        # depth-first, iteratively: a chain of rules may be as long as the grammar
        state = [0] * len(self.rules)  # 0 new, 1 on the path, 2 done
        for top in range(len(self.rules)):
            if state[top]:
                continue
            state[top] = 1
            path = [(top, iter(first[top]))]
            while path:
                r, edges = path[-1]
                n = next(edges, None)
                if n is None:
                    state[r] = 2
                    path.pop()
                elif state[n] == 1:
                    raise GrammarError(f"grammar: rule '{self.names[n]}' is left-recursive")
                elif state[n] == 0:
                    state[n] = 1
                    path.append((n, iter(first[n])))

    # ---- matching ----
    def _closure(self, stacks) -> frozenset:
        """The stacks reachable from `stacks` without reading a character whose top is a
        character class (or that are empty: the grammar may end there). One walk for all of
        them, so stacks shared by several are expanded once."""
        key = frozenset(stacks)
        hit = self._closure_cache.get(key)
        if hit is not None:
            return hit
        out: set = set()
        todo = list(key)
        seen = set()
        while todo:
            st = todo.pop()
            if st in seen:
                continue
            seen.add(st)
            if len(seen) > MAX_STEPS:
                raise GrammarError(f"grammar: one position takes more than {MAX_STEPS} parse steps (the limit): "
                                   "the grammar is too ambiguous here")
            if not st:
                out.add(st)
                continue
            r, a, i = st[-1]
            e = self.rules[r][a][i]
            if isinstance(e, CharClass):
                out.add(st)
                if len(out) > MAX_STACKS:
                    raise GrammarError(f"grammar: more than {MAX_STACKS} parse stacks at one position (the limit): "
                                       "the grammar is too ambiguous here (nested optional repetitions?)")
                continue
            base = st[:-1] if i + 1 == len(self.rules[r][a]) else st[:-1] + ((r, a, i + 1),)
            for b, alt in enumerate(self.rules[e]):
                todo.append(base + ((e, b, 0),) if alt else base)
        res = frozenset(out)
        self._closure_cached += len(key) + len(res)
        if self._closure_cached > 4 * MAX_STACKS * 25:  # a bounded memo: forget all, start again
            self._closure_cache.clear()
            self._closure_cached = len(key) + len(res)
        self._closure_cache[key] = res
        return res

    def initial(self) -> frozenset:
        return self._closure([((self.start, b, 0),) if alt else () for b, alt in enumerate(self.rules[self.start])])

    def _by_top(self, stacks: frozenset) -> list:
        """[(character class, [each stack with it on top, moved past it]), ...]: a walk over
        the vocabulary feeds one state many bytes, and stacks with the same class on top (most,
        when there are many) are then matched once per byte."""
        hit = self._by_top_cache.get(stacks)
        if hit is not None:
            return hit
        groups: dict = {}
        for st in stacks:
            if st:
                r, a, i = st[-1]
                groups.setdefault(self.rules[r][a][i], []).append(
                    st[:-1] if i + 1 == len(self.rules[r][a]) else st[:-1] + ((r, a, i + 1),))
        res = list(groups.items())
        if len(self._by_top_cache) >= 1024:
            self._by_top_cache.clear()
        self._by_top_cache[stacks] = res
        return res

    def advance(self, stacks: frozenset, cp: int) -> frozenset:
        nxt = []
        for cc, moved in self._by_top(stacks):
            if cc.match(cp):
                nxt += moved
        return self._closure(nxt) if nxt else frozenset()

    def viable(self, stacks: frozenset, lo: int, hi: int) -> bool:
        """Whether some code point in [lo, hi] is accepted next."""
        return any(cc.match_any(lo, hi) for cc, _ in self._by_top(stacks))


# ---------------------------------------------------------------------------------- UTF-8
def _utf8_len(lead: int) -> int:
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0  # a continuation byte or a byte UTF-8 never uses


def _pending_range(pending: bytes) -> tuple[int, int]:
    """Code points [lo, hi] that a sequence starting with `pending` can still become."""
    n = _utf8_len(pending[0])
    lead_bits = {2: 0x1F, 3: 0x0F, 4: 0x07}[n]
    v = pending[0] & lead_bits
    for b in pending[1:]:
        v = (v << 6) | (b & 0x3F)
    rest = n - len(pending)
    lo, hi = v << (6 * rest), (v << (6 * rest)) | ((1 << (6 * rest)) - 1)
    floor = {2: 0x80, 3: 0x800, 4: 0x10000}[n]
    return max(lo, floor), min(hi, MAX_CP)


@dataclass(frozen=True)
class MatchState:
    stacks: frozenset
    pending: bytes = b""  # bytes of a code point not complete yet

    @property
    def can_end(self) -> bool:
        return not self.pending and () in self.stacks

    @property
    def dead(self) -> bool:
        return not self.stacks


def feed_byte(g: Grammar, s: MatchState, b: int) -> MatchState | None:
    """The state after one more byte, or None where the grammar rejects it."""
    if not s.pending:
        n = _utf8_len(b)
        if n == 1:
            nxt = g.advance(s.stacks, b)
            return MatchState(nxt) if nxt else None
        if n == 0:
            return None
        pend = bytes([b])
    else:
        if b & 0xC0 != 0x80:
            return None
        pend = s.pending + bytes([b])
        n = _utf8_len(pend[0])
        if len(pend) == n:
            try:
                cp = ord(pend.decode("utf-8"))
            except UnicodeDecodeError:  # overlong forms, surrogates
                return None
            nxt = g.advance(s.stacks, cp)
            return MatchState(nxt) if nxt else None
    lo, hi = _pending_range(pend)
    if lo > hi or not g.viable(s.stacks, lo, hi):
        return None
    return MatchState(s.stacks, pend)


def feed_bytes(g: Grammar, s: MatchState, data: bytes) -> MatchState | None:
    for b in data:
        s = feed_byte(g, s, b)
        if s is None:
            return None
    return s


class TokenIndex:
    """A vocabulary's token texts sorted by bytes, for walking it as a trie."""

    def __init__(self, pieces: list[bytes], eog: set[int]):
        self.eog = set(eog)
        order = sorted((p, t) for t, p in enumerate(pieces) if p and t not in self.eog)
        self.keys = [p for p, _ in order]
        self.ids = [t for _, t in order]
        self.pieces = pieces
        self.n_vocab = len(pieces)
        self._allowed_cache: dict = {}

    def allowed(self, g: Grammar, state: MatchState) -> list[int]:
        """Every token the grammar accepts next (end-of-generation tokens where it may end).

        Remembered per (grammar, state): inside a string or a repetition the state comes back
        after every token, and a walk over a permissive state visits most of the vocabulary."""
        key = (id(g), state)
        hit = self._allowed_cache.get(key)
        if hit is None:
            hit = self._walk(g, state)
            if len(self._allowed_cache) >= 256:
                self._allowed_cache.pop(next(iter(self._allowed_cache)))
            self._allowed_cache[key] = hit
        return hit

    def _walk(self, g: Grammar, state: MatchState) -> list[int]:
        out = [t for t in self.eog if state.can_end]
        keys, ids = self.keys, self.ids
        steps = [0]  # stacks fed a byte (MAX_WALK_STEPS)

        def walk(lo: int, hi: int, depth: int, s: MatchState):
            while lo < hi and len(keys[lo]) == depth:  # tokens that end here
                out.append(ids[lo])
                lo += 1
            while lo < hi:
                b = keys[lo][depth]
                end = hi if b == 255 else bisect.bisect_left(keys, keys[lo][:depth] + bytes([b + 1]), lo, hi)
                steps[0] += len(s.stacks)
                if steps[0] > MAX_WALK_STEPS:
                    raise GrammarError(f"grammar: the tokens allowed here take more than {MAX_WALK_STEPS} parse "
                                       "steps (the limit): the grammar is too ambiguous here")
                nxt = feed_byte(g, s, b)
                if nxt is not None:
                    walk(lo, end, depth + 1, nxt)
                lo = end

        walk(0, len(keys), 0, state)
        return out


class GrammarMatcher:
    """One generation's progress through a grammar."""

    def __init__(self, grammar: Grammar, index: TokenIndex):
        self.grammar = grammar
        self.index = index
        self.state = MatchState(grammar.initial())

    def accepts(self, token: int) -> bool:
        if token in self.index.eog:
            return self.state.can_end
        piece = self.index.pieces[token] if 0 <= token < self.index.n_vocab else b""
        return bool(piece) and feed_bytes(self.grammar, self.state, piece) is not None

    def accept(self, token: int) -> None:
        """Moves past `token` (which must be accepted)."""
        if token in self.index.eog:
            return
        nxt = feed_bytes(self.grammar, self.state, self.index.pieces[token])
        if nxt is None:
            raise GrammarError(f"token {token} is not allowed by the grammar here")
        self.state = nxt

    def allowed(self) -> list[int]:
        return self.index.allowed(self.grammar, self.state)

    @property
    def finished(self) -> bool:
        """Nothing but the end is left: only an end-of-generation token is allowed."""
        return self.state.stacks == frozenset({()}) and not self.state.pending
