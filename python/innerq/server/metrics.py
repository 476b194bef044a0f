"""/metrics of `innerq serve`, in Prometheus' text format: requests running and waiting, the KV
pool (innerq_kv_pool), tokens per second, token and request counters, and latency histograms.

Gateways that spread requests over replicas read a few gauges by the names vLLM gives them
(the model server protocol of the Gateway API inference extension, which llm-d's scheduler
implements): vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc and
vllm:cache_config_info; they are exported under those names as well, with the same values as
innerq's own. KV cache usage there is the share of the pool that running requests reserve
(what a new request cannot have), not the pages idle prefixes hold, which are given up on
demand."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from .engine import Engine, Job

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine's snapshot at each scrape."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        s = self.engine.stats()
        pool, total = s["pool"], s["n_pages"]

        def gauge(name: str, doc: str, value: float):
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("innerq_requests_running", "Requests decoding or reading their prompts", s["running"])
        yield gauge("innerq_requests_waiting", "Requests waiting for a sequence or room in the KV pool", s["waiting"])
        yield gauge("innerq_sequences_idle", "Idle sequences holding a finished request's tokens (a prefix for "
                    "later requests)", s["idle_sequences"])
        yield gauge("innerq_kv_pool_pages", "Pages of the KV pool", total)
        yield gauge("innerq_kv_pool_pages_used", "Pages of the KV pool in use (running and idle sequences)",
                    pool.get("n_pages_used", 0))
        yield gauge("innerq_kv_pool_pages_reserved", "Pages of the KV pool reserved by running requests",
                    s["reserved"])
        yield gauge("innerq_kv_pool_page_tokens", "Tokens per page of the KV pool", s["page_tokens"])
        yield gauge("innerq_kv_pool_tokens", "Tokens the sequences hold, together", pool.get("n_tokens", 0))
        yield gauge("innerq_kv_pool_bytes", "Bytes of the KV cache", pool.get("bytes", 0))
        yield gauge("innerq_prompt_tokens_per_second", "Prompt tokens evaluated per second (last 10 s)",
                    s["rates"]["prompt"])
        yield gauge("innerq_generation_tokens_per_second", "Tokens generated per second (last 10 s)",
                    s["rates"]["generation"])
        c = s["counters"]
        yield CounterMetricFamily("innerq_prompt_tokens", "Prompt tokens of the requests that started",
                                  value=c["prompt_tokens"])
        yield CounterMetricFamily("innerq_prompt_tokens_cached", "Prompt tokens taken from the prefix index "
                                  "rather than evaluated", value=c["prompt_tokens_cached"])
        yield CounterMetricFamily("innerq_generation_tokens", "Tokens generated", value=c["generation_tokens"])
        finished = CounterMetricFamily("innerq_requests_finished", "Requests ended, by reason", labels=["reason"])
        for reason in ("stop", "length", "cancelled", "error"):
            finished.add_metric([reason], c["requests_" + reason])
        yield finished
        # the gateway's names (module docstring)
        yield gauge("vllm:num_requests_running", "Requests running (innerq_requests_running)", s["running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting (innerq_requests_waiting)", s["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Share of the KV pool reserved by running requests, 0 to 1",
                    s["reserved"] / total if total else 0.0)
        info = InfoMetricFamily("vllm:cache_config", "The KV pool's pages (blocks) and tokens per page")
        info.add_metric([], {"block_size": str(s["page_tokens"]), "num_gpu_blocks": str(total),
                             "model_name": self.model_name})
        yield info


class Metrics:
    """The registry of one server: the engine's gauges and counters, and histograms of time to
    the first token, time per output token and request duration (observed as requests end)."""

    def __init__(self, engine: Engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model_name))
        self.ttft = Histogram("innerq_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY, registry=self.registry)
        self.tpot = Histogram("innerq_time_per_output_token_seconds", "Between tokens after the first",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5),
                              registry=self.registry)
        self.duration = Histogram("innerq_request_duration_seconds", "From arrival to the end",
                                  buckets=_LATENCY, registry=self.registry)
        self.step_sequences = Histogram("innerq_step_sequences", "Sequences evaluated together in a step",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry)
        self.step_tokens = Histogram("innerq_step_tokens", "Tokens evaluated in a step",
                                     buckets=(1, 4, 16, 64, 256, 1024, 4096), registry=self.registry)
        engine.observe = self.observe
        engine.on_step = self.step

    def observe(self, job: Job) -> None:
        if job.t_first is not None:
            self.ttft.observe(job.t_first - job.t_queued)
            n = len(job.text.tokens)
            if n > 1:
                self.tpot.observe((job.t_end - job.t_first) / (n - 1))
        self.duration.observe(job.t_end - job.t_queued)

    def step(self, sequences: int, tokens: int) -> None:
        self.step_sequences.observe(sequences)
        self.step_tokens.observe(tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)
