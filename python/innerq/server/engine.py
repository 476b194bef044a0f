"""The engine of `innerq serve`: requests are sequences of one context (innerq.Sequences),
decoded together by one scheduler thread.

Each step is one decode call: the next token of every decoding request, then prompt chunks of
requests still reading their prompts (a long prompt is read over several steps, so the
decoders go on meanwhile). A request that arrives joins at the next step. A request's prompt is
cut by the request alone: chunks of n_batch tokens from the first token it reads, each read
whole in one call (the context's n_batch is n_batch + parallel, so a chunk always fits beside
every decoding token).

Where the model runs on the CPU the context has decode semantics (docs/DESIGN.md 3.4): what a
sequence holds does not depend on how its prompt was cut, nor on where a copied prefix ends, and
a step gives a sequence the same bits whatever shares it (docs/DESIGN.md 3.6), so with its own
seeded sampler a request gets the text it gets alone, bit for bit. Decode semantics end a batch
at each flush of the cache (every G tokens past the windows), which costs the CPU little; on the
GPU it made prompts ~7.6x slower (steps of 32 tokens), and there a mixed step's products depend
on its width anyway (GEMMs above 64 tokens), so the GPU reads prompt chunks whole, without it:
a request's text then equals its text alone within float rounding, not bit for bit.

The prefix index is the tokens each sequence holds (a finished request's tokens stay in its
sequence until the sequence is needed). A new request takes an empty sequence, else the least
recently used idle one, copies into it the longest prefix of its prompt that a sequence holds
(Sequences.copy shares the stored blocks; where the source is the sequence it takes, the tokens
past the prefix are removed), and reads only the rest of its prompt. A request whose prompt
shares a longer prefix with one that a running request is still reading waits until that
prefix is read, so requests that arrive together with one system prompt read it once. The prefix is kept as stored (docs/DESIGN.md
3.6): where it lies in the source's f16 rows (sink and recent window) it is what the request
would compute alone, bit for bit; where the source has since quantized rows that a fresh
evaluation would still hold in f16, it differs by less than the cache differs from f16.

Admission never overcommits the KV pool: a running request reserves the pages its prompt and
max_tokens can ever take (ceil(tokens / page_tokens) + 1, the most a sequence of that length
holds in any cache format, counted as if nothing were shared), and an idle sequence the pages
of what it holds. A request is admitted when its reservation fits beside the others, idle
sequences being emptied (least recently used first) to make room; otherwise it waits in a
bounded queue (full: QueueFull, an HTTP 503). A running request is never evicted: it ends at
an end-of-generation token, a stop string, max_tokens, or when its client goes (cancel).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .._ffi import ffi, lib
from ..errors import InnerQError
from ..gguf_model import Model
from ..llama_cache import common_prefix
from ..sampling import TokenSampler
from ..sequences import Sequences
from ..text_stream import TextStream

log = logging.getLogger("innerq.server")

DEFAULT_BATCH = 512  # prompt tokens a request reads per step (the library's default n_batch)
MAX_BATCH = 8192  # the library's largest n_batch


class QueueFull(Exception):
    """Every sequence is busy and the queue of waiting requests is full."""


@dataclass
class Job:
    """One generation request as the scheduler runs it. emit(event) is called on the scheduler
    thread with ("text", piece, logprobs entry), then one ("end", finish_reason) or
    ("error", InnerQError)."""

    prompt: list[int]
    sampler: TokenSampler
    text: TextStream
    max_tokens: int
    emit: object
    cancelled: bool = False
    slot: "Slot | None" = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to read
    next_token: int | None = None  # sampled, to be evaluated in the next step
    n_cached: int = 0  # prompt tokens taken from the prefix index, not evaluated
    t_queued: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # when the first token was sampled
    t_end: float | None = None
    history: np.ndarray = None  # prompt and generated tokens, for penalties and logits processors
    n_history: int = 0

    def __post_init__(self):
        self.history = np.zeros(len(self.prompt) + self.max_tokens, dtype=np.intc)
        self.history[:len(self.prompt)] = self.prompt
        self.n_history = len(self.prompt)


@dataclass
class Slot:
    """A sequence of the context: the tokens it holds (the prefix index), the request decoding
    in it (None: idle, its tokens a prefix for later requests), and the pages it reserves."""

    seq: int
    tokens: list[int] = field(default_factory=list)
    job: Job | None = None
    reserved: int = 0
    used: float = 0.0  # when a request last ended here (least recently used idle slots go first)


@dataclass
class EngineConfig:
    model_path: str
    parallel: int = 4  # sequences decoded together
    queue_size: int = 64  # requests that may wait for a sequence
    n_ctx: int | None = None
    n_batch: int | None = None
    n_threads: int | None = None
    n_gpu_layers: int = 0
    cache: dict = field(default_factory=dict)  # the cache keywords of Sequences (kv_type, kv_k, ...)


class Rate:
    """Tokens per second over the last `window` seconds."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self.events: collections.deque = collections.deque()

    def add(self, n: int, now: float) -> None:
        self.events.append((now, n))
        while self.events and self.events[0][0] < now - self.window:
            self.events.popleft()

    def per_second(self, now: float) -> float:
        n = sum(k for t, k in self.events if t >= now - self.window)
        return n / self.window


class Engine:
    """Loads the model in the background (state: "loading", "ready" or "failed"), then
    schedules submitted jobs until close()."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.state = "loading"
        self.error: str | None = None
        self.model: Model | None = None
        self.seqs: Sequences | None = None
        self.slots: list[Slot] = []
        self.n_pages = self.page_tokens = 0
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._stopping = False
        self._embed = None  # the embeddings context, made on first use
        self._embed_lock = threading.Lock()
        self.pool: dict = {}  # the KV pool after the last step (innerq_kv_pool)
        self.counters = {"prompt_tokens": 0, "prompt_tokens_cached": 0, "generation_tokens": 0,
                         "requests_stop": 0, "requests_length": 0, "requests_cancelled": 0, "requests_error": 0}
        self.rates = {"prompt": Rate(), "generation": Rate()}
        self.observe = None  # observe(job) when a job ends (the metrics' histograms)
        self.on_ready = None  # on_ready(engine) once loading has succeeded or failed
        self.on_step = None  # on_step(sequences, tokens) after each step (the metrics' histograms)
        self._loaded = threading.Event()
        self._loader = threading.Thread(target=self._load, name="innerq-load", daemon=True)
        self._scheduler = threading.Thread(target=self._run, name="innerq-scheduler", daemon=True)

    # ---- lifetime ----

    def start(self) -> None:
        """Loads the model in a thread, then starts the scheduler (once; later calls do nothing)."""
        if self._loader.ident is None:
            self._loader.start()

    def _load(self) -> None:
        c = self.config
        try:
            self.model = Model(c.model_path, n_gpu_layers=c.n_gpu_layers)
            self.chunk = c.n_batch or DEFAULT_BATCH
            # decode semantics where the model runs on the CPU (see the module's docstring)
            self.exact = ffi.string(lib.innerq_model_backend(self.model.handle.ptr)).decode() == "CPU"
            self.seqs = Sequences(self.model, n_seq_max=c.parallel, n_ctx=c.n_ctx,
                                  n_batch=min(self.chunk + c.parallel, MAX_BATCH), n_threads=c.n_threads,
                                  decode_semantics=self.exact, **c.cache)
            self.chunk = max(1, min(self.chunk, self.seqs.n_batch - c.parallel))  # where n_ctx caps n_batch
            self.pool = self.seqs.pool()
            self.n_pages, self.page_tokens = self.pool["n_pages"], self.pool["page_tokens"]
            self.slots = [Slot(i) for i in range(c.parallel)]
            self.state = "ready"
        except (InnerQError, OSError, ValueError) as e:
            self.state, self.error = "failed", str(e)
            log.error("innerq serve: loading %s failed: %s", c.model_path, e)
        else:
            self._scheduler.start()
        self._loaded.set()
        if self.on_ready is not None:
            self.on_ready(self)

    def wait_loaded(self, timeout: float | None = None) -> str:
        """Waits until loading has succeeded or failed; returns the state."""
        self._loaded.wait(timeout)
        return self.state

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._scheduler.is_alive():
            self._scheduler.join()

    @property
    def n_ctx(self) -> int:
        return self.seqs.n_ctx

    @property
    def n_batch(self) -> int:
        return self.seqs.n_batch

    # ---- requests ----

    def submit(self, job: Job) -> None:
        """Queues a job (QueueFull when the queue is full); it starts at the next step where a
        sequence and room in the pool are free."""
        with self._cond:
            free = sum(1 for s in self.slots if s.job is None)
            if len(self._waiting) >= free + self.config.queue_size:
                raise QueueFull(f"all {len(self.slots)} sequences are busy and {len(self._waiting)} requests wait")
            self._waiting.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Ends a job whose client went away: it is dropped from the queue, or its sequence is
        freed before the next step. Nothing happens to a job that has ended."""
        with self._cond:
            if job.t_end is None:
                job.cancelled = True
                self._cond.notify_all()

    def stats(self) -> dict:
        """A snapshot for /metrics."""
        now = time.perf_counter()
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "reserved": sum(s.reserved for s in self.slots if s.job is not None),
                    "idle_sequences": sum(1 for s in self.slots if s.job is None and s.tokens),
                    "pool": dict(self.pool), "n_pages": self.n_pages, "page_tokens": self.page_tokens,
                    "counters": dict(self.counters),
                    "rates": {k: r.per_second(now) for k, r in self.rates.items()}}

    # ---- the scheduler ----

    def _run(self) -> None:
        while True:
            try:
                with self._cond:
                    self._drop_cancelled()
                    self._admit()
                    while not self._stopping and not self._running:
                        self._cond.wait()
                        self._drop_cancelled()
                        self._admit()
                    if self._stopping:
                        return
                self._step()
            except Exception as e:  # a fault of the engine, not of a request: start over, and go on serving
                log.exception("innerq serve: the scheduler failed; its running requests end with the error")
                self._reset(e)

    def _reset(self, error: Exception) -> None:
        """Ends every running job with error and empties every sequence."""
        with self._cond:
            for job in list(self._running):
                self._end(job, "error", error)
            for slot in self.slots:
                slot.tokens, slot.reserved = [], 0
            self.seqs.clear()

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            self._finish(job, "cancelled")
        for job in [j for j in self._running if j.cancelled]:
            self._end(job, "cancelled")

    def _pages(self, n_tokens: int) -> int:
        """The most pages a sequence of n_tokens holds (a lone sequence fits in the pool)."""
        return min(-(-n_tokens // self.page_tokens) + 1, self.n_pages)

    def _admit(self) -> None:
        """Starts waiting jobs in order while a sequence and room in the pool are free."""
        while self._waiting:
            job = self._waiting[0]
            try:
                if not self._place(job):
                    return
            except InnerQError as e:  # copying or removing tokens failed (memory)
                self._waiting.popleft()
                self._finish(job, "error", e)
                continue
            self._running.append(self._waiting.popleft())

    def _place(self, job: Job) -> bool:
        """Gives job a sequence holding as much of its prompt as the prefix index has; False
        when no sequence or not enough of the pool is free."""
        idle = [s for s in self.slots if s.job is None]
        if not idle:
            return False
        source, shared = None, 0
        for s in self.slots:
            n = common_prefix(s.tokens, job.prompt)
            if n > shared:
                source, shared = s, n
        # a longer prefix that a running request is still reading: wait for it (a step or a few)
        # rather than read it twice
        if any(common_prefix(j.prompt, job.prompt) >= shared + self.page_tokens for j in self._running if j.pending):
            return False
        # an empty sequence, else the idle one whose emptying throws the fewest stored tokens away
        # (the source only those past the prefix: a chat's next turn goes on in its own sequence),
        # the least recently used among equals, so that idle prefixes stay as long as they can;
        # where the pool has no room then, the idle source itself (its tokens past the prefix go)
        need = self._pages(len(job.prompt) + job.max_tokens)
        keep = min(shared, len(job.prompt) - 1)  # the last prompt token is read for its logits
        target = min(idle, key=lambda s: (len(s.tokens) > 0, len(s.tokens) - (keep if s is source else 0), s.used))
        evict = self._room(need, target, source)
        if evict is None and source is not None and source.job is None:
            target = source
            evict = self._room(need, target, source)
        if evict is None:
            return False
        for s in evict:
            self._clear(s)
        target.tokens, target.reserved = [], 0  # until the calls below succeed
        if target is source:
            kept = self.seqs.remove(target.seq, keep)
        elif source is not None and keep > 0:
            kept = self.seqs.copy(source.seq, target.seq, keep)
        else:
            kept = self.seqs.remove(target.seq, 0)
        target.tokens, target.job, target.reserved = job.prompt[:kept], job, need
        job.slot, job.pending, job.n_cached = target, job.prompt[kept:], kept
        return True

    def _room(self, need: int, target: Slot, keep: Slot | None) -> list[Slot] | None:
        """The idle sequences to empty (least recently used first; not target, whose pages the
        request takes over, nor keep) so that need pages fit beside every reservation; None
        when they cannot."""
        others = sum(s.reserved for s in self.slots if s is not target)
        evict = []
        for s in sorted((s for s in self.slots if s.job is None and s.tokens and s is not target and s is not keep),
                        key=lambda s: s.used):
            if others + need <= self.n_pages:
                break
            others -= s.reserved
            evict.append(s)
        return evict if others + need <= self.n_pages else None

    def _clear(self, slot: Slot) -> None:
        """Empties an idle sequence."""
        if slot.tokens:
            self.seqs.remove(slot.seq, 0)
        slot.tokens, slot.reserved = [], 0

    def _step(self) -> None:
        """One decode call: each decoding job's next token, then prompt chunks; then each job
        whose logits came back samples its next token."""
        with self._cond:
            jobs = list(self._running)
        tokens, seq_ids, want = [], [], []
        parts = []  # (job, tokens of its sequence in this step)
        sample = []  # (batch index, job)
        for job in jobs:
            if not job.pending:
                sample.append((len(tokens), job))
                tokens.append(job.next_token)
                seq_ids.append(job.slot.seq)
                want.append(True)
                parts.append((job, [job.next_token]))
        budget = self.seqs.n_batch - len(tokens)  # at least one whole chunk
        for job in jobs:
            chunk = job.pending[:self.chunk]
            if not chunk or len(chunk) > budget:
                continue
            budget -= len(chunk)
            tokens += chunk
            seq_ids += [job.slot.seq] * len(chunk)
            last = len(chunk) == len(job.pending)
            want += [False] * (len(chunk) - 1) + [last]
            if last:
                sample.append((len(tokens) - 1, job))
            parts.append((job, chunk))
        try:
            self.seqs.decode(tokens, seq_ids, want)
        except InnerQError as e:  # nothing was evaluated: the step's jobs end with the error
            log.error("innerq serve: a step of %d tokens failed: %s", len(tokens), e)
            with self._cond:
                for job, _chunk in parts:
                    self._end(job, "error", e)
            return
        now = time.perf_counter()
        n_prompt = 0
        for job, chunk in parts:
            job.slot.tokens += chunk
            if job.pending:
                job.pending = job.pending[len(chunk):]
                n_prompt += len(chunk)
        self.rates["prompt"].add(n_prompt, now)
        self.rates["generation"].add(len(sample), now)
        self.counters["generation_tokens"] += len(sample)
        if self.on_step is not None:
            self.on_step(len(parts), len(tokens))
        ended = []
        for i, job in sample:
            finish = self._sample(job, self.seqs.logits(i))
            if finish is not None:
                ended.append((job, finish))
        with self._cond:
            for job, finish in ended:
                self._end(job, *finish)
            self.pool = self.seqs.pool()

    def _sample(self, job: Job, row: np.ndarray):
        """Samples job's next token and emits its text; returns (reason,) or (reason, error)
        when the job ends."""
        if job.cancelled:
            return ("cancelled",)
        try:
            token = job.sampler.sample(row, job.history[:job.n_history])
            job.sampler.accept(token)
            piece, step = job.text.push(token, job.sampler.last_row)
        except InnerQError as e:
            return ("error", e)
        if job.t_first is None:
            job.t_first = time.perf_counter()
        finish = job.text.finish_reason
        if finish is None and len(job.text.tokens) >= job.max_tokens:
            finish = "length"
        if finish is not None:
            piece += job.text.finish()
        if piece or step:
            job.emit(("text", piece, step))
        if finish is not None:
            return (finish,)
        job.next_token = token
        job.history[job.n_history] = token
        job.n_history += 1
        return None

    def _end(self, job: Job, reason: str, error: Exception | None = None) -> None:
        """A running job ends (call with the lock held): its sequence goes idle, keeping its
        tokens as a prefix for later requests."""
        self._running.remove(job)
        slot = job.slot
        slot.job, slot.used = None, time.perf_counter()
        slot.reserved = self._pages(len(slot.tokens))
        self._finish(job, reason, error)

    def _finish(self, job: Job, reason: str, error: Exception | None = None) -> None:
        job.t_end = time.perf_counter()
        self.counters["requests_" + (reason if reason in ("stop", "length", "cancelled") else "error")] += 1
        if job.slot is not None:
            self.counters["prompt_tokens"] += len(job.prompt)
            self.counters["prompt_tokens_cached"] += job.n_cached
        if self.observe is not None:
            self.observe(job)
        job.emit(("error", error) if error is not None else ("end", reason))

    # ---- embeddings ----

    def embed(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        """The pooled embedding of each token list (the model's pooling, the mean where it has
        none), from a context of its own made on first use: embeddings come from whole decode
        calls, which the steps of the generation context are not."""
        from .._native import ContextHandle

        with self._embed_lock:
            if self._embed is None:
                arch = self.model.meta("general.architecture")
                pooling = self.model.meta(f"{arch}.pooling_type")
                pooling = int(pooling) if pooling not in (None, "0") else 1
                self._embed = ContextHandle.init(self.model.handle, n_ctx=self.n_ctx, n_batch=self.n_batch,
                                                 n_threads=self.config.n_threads, embeddings=True, pooling=pooling)
            out = []
            for ids in token_lists:
                self._embed.seq_rm(-1)
                self._embed.decode(ids)
                out.append(self._embed.embeddings())
            self._embed.seq_rm(-1)
            return out
