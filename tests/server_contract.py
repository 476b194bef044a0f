"""What any deployment of `innerq serve` answers, tested through the official `openai` package
against a live server: one process (test_server.py) or replicas behind Ray Serve
(test_serve_ray.py). A test module with a class that inherits ServerContract imports the fixtures
client, api_key and model_name, and defines `base`, the URL of a server started with --api-key
KEY and --alias MODEL over a model small enough that the tests stay
fast (tests/tiny_model.py's, a ChatML prompt and random weights: the text is noise, its
shape and its determinism are what is tested).

Also here: starting a server process on a free port, raw HTTP requests, and /metrics read by
prometheus_client.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tiny_model import TinyConfig

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 60):
    """(status, headers, body bytes) of one request; body: bytes, or a value sent as JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                           **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def metrics(base: str) -> dict:
    """/metrics as {sample name: {labels as a sorted tuple: value}}, parsed by prometheus_client."""
    status, _h, text = send("GET", base + "/metrics")
    assert status == 200, text
    out: dict = {}
    for family in parser.text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def metric(base: str, name: str, **labels) -> float:
    return metrics(base)[name][tuple(sorted(labels.items()))]


class ServerProcess:
    """`python -m innerq.server MODEL ARGS` on a free port of 127.0.0.1; start() waits for
    /health to answer 200."""

    def __init__(self, model: Path | str, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill and stop the server
        self.proc = subprocess.Popen([sys.executable, "-m", "innerq.server", str(model), "--port", str(self.port),
                                      *args], env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def start(self, timeout: float = 120) -> "ServerProcess":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.stop()}")
            try:
                if send("GET", self.url + "/health", timeout=5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the server did not become healthy")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> str:
        """Stops the server; returns what it printed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.seek(0)
        return self.log.read()


PROMPTS = [f"Question {i}: tell me about the number {i * 7} and the letter {chr(65 + i)}." for i in range(16)]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                            "score": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["answer", "score", "ok"]}


def check_schema(value) -> None:
    """value is valid under SCHEMA (the three required properties, their types, the enum)."""
    assert isinstance(value, dict) and set(value) == {"answer", "score", "ok"}, value
    assert value["answer"] in ("yes", "no", "maybe")
    assert isinstance(value["score"], int) and not isinstance(value["score"], bool)
    assert isinstance(value["ok"], bool)


def chat_text(client, model: str, content: str, **kw) -> str:
    """A greedy streamed chat answer's text."""
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            temperature=0, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


KEY = "test-key"  # the servers' API key
MODEL = "tiny"  # the servers' name for the model (--alias)
TINY = TinyConfig(head_dim=32, n_head=4, n_head_kv=2, n_layer=2, n_ctx_train=8192, seed=3)  # the model


@pytest.fixture(scope="module")
def api_key():
    return KEY


@pytest.fixture(scope="module")
def model_name():
    return MODEL


@pytest.fixture(scope="module")
def client(base):
    """An OpenAI client of the server (a test module that imports this fixture defines the
    fixture base)."""
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


class ServerContract:
    def test_health_and_models(self, base, client, model_name):
        assert send("GET", base + "/health")[:1] == (200,)
        models = client.models.list()
        assert [m.id for m in models.data] == [model_name]

    def test_chat(self, client, model_name):
        messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hello there"}]
        first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=12, temperature=0)
        choice = first.choices[0]
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")
        assert first.usage.completion_tokens <= 12 and first.usage.prompt_tokens > 5
        assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        # streamed, the same greedy answer; the usage chunk last, with choices empty
        chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=12,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == first.usage.completion_tokens
        assert chunks[-2].choices[0].finish_reason == first.choices[0].finish_reason
        assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == choice.message.content

    def test_completions(self, client, model_name):
        out = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=10, temperature=0)
        text = out.choices[0].text
        assert out.usage.completion_tokens <= 10
        streamed = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=10,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == text
        echo = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=10, temperature=0,
                                         echo=True)
        assert echo.choices[0].text == "Once upon a time" + text
        if len(text) > 3:  # a stop string cuts the text before it
            cut = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=10,
                                            temperature=0, stop=[text[2:4]])
            assert cut.choices[0].text == text[:text.index(text[2:4])]
            assert cut.choices[0].finish_reason == "stop"

    def test_seeded_sampling_repeats(self, client, model_name):
        def draw():
            return client.completions.create(model=model_name, prompt="The sea", max_tokens=12, temperature=1.0,
                                             top_p=0.9, seed=1234).choices[0].text

        assert draw() == draw()

    def test_json_schema(self, client, model_name):
        out = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Rate this."}], max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": SCHEMA}})
        check_schema(json.loads(out.choices[0].message.content))
        obj = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "JSON!"}],
                                             max_tokens=60, temperature=0.7, seed=5,
                                             response_format={"type": "json_object"})
        if obj.choices[0].finish_reason == "stop":  # random weights may not close the object in 60 tokens
            assert isinstance(json.loads(obj.choices[0].message.content), dict)

    def test_logprobs(self, client, model_name):
        out = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        content = out.choices[0].logprobs.content
        assert len(content) == out.usage.completion_tokens
        for entry in content:  # top_logprobs is keyed by text: tokens of one text (bytes of a character) count once
            assert entry.logprob <= 0 and 1 <= len(entry.top_logprobs) <= 4
            assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))  # greedy: the likeliest
        done = client.completions.create(model=model_name, prompt="Numbers:", max_tokens=5, temperature=0, logprobs=2)
        lp = done.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens
        assert "".join(lp.tokens) == done.choices[0].text
        assert lp.text_offset[0] == len("Numbers:")

    def test_embeddings(self, client, model_name):
        out = client.embeddings.create(model=model_name, input=["a cat", "a dog", "a cat"])  # base64, by the client
        vectors = [np.asarray(d.embedding) for d in out.data]
        assert [d.index for d in out.data] == [0, 1, 2]
        for v in vectors:
            assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5)
        assert np.allclose(vectors[0], vectors[2]) and not np.allclose(vectors[0], vectors[1])
        floats = client.embeddings.create(model=model_name, input="a cat", encoding_format="float")
        assert np.allclose(floats.data[0].embedding, vectors[0], atol=1e-6)
        assert out.usage.prompt_tokens > floats.usage.prompt_tokens > 0

    def test_errors(self, base, client, model_name, api_key):
        auth = {"Authorization": f"Bearer {api_key}"}
        status, _h, body = send("POST", base + "/v1/chat/completions", b"{not json", auth)
        assert status == 400 and "JSON" in json.loads(body)["error"]["message"]
        status, _h, body = send("POST", base + "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, auth)
        assert status == 400 and json.loads(body)["error"]["param"] == "temperature"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model_name, prompt="word " * 5000, max_tokens=4)
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        assert e.value.code == "model_not_found"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        status, _h, body = send("GET", base + "/v1/nothing-here", headers=auth)
        assert status == 404 and "error" in json.loads(body)

    def test_bad_input_never_breaks_the_server(self, base, api_key):
        """Malformed requests of every kind get a 400 naming the problem, and the server goes on."""
        auth = {"Authorization": f"Bearer {api_key}"}
        user = [{"role": "user", "content": "x"}]
        chat_bodies = [[], "text", {"messages": "hi"}, {"messages": [{"content": "no role"}]},
                       {"messages": [{"role": "user", "content": 5}]}, {"messages": []},
                       {"messages": user, "max_tokens": 0}, {"messages": user, "max_tokens": 1.5},
                       {"messages": user, "stream": "yes"}, {"messages": user, "stop": [1, 2]},
                       {"messages": user, "logit_bias": {"abc": 1}}, {"messages": user, "logit_bias": {"1": "x"}},
                       {"messages": user, "top_p": 7}, {"messages": user, "n": 3},
                       {"messages": user, "response_format": {"type": "xml"}},
                       {"messages": user, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                       {"messages": user, "response_format": {"type": "json_schema",
                                                              "json_schema": {"schema": {"type": "martian"}}}},
                       {"messages": user, "tools": [5], "tool_choice": {"type": "function", "function": {}}},
                       {"messages": user, "tool_choice": "required"},
                       {"messages": user, "stream_options": {"include_usage": 1}},
                       {"messages": user, "grammar": "root ::= ("},
                       {"messages": [{"role": "user", "content": "\ud800"}]},
                       {"messages": user, "top_k": 10**12}, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}']
        for body in chat_bodies:
            status, _h, data = send("POST", base + "/v1/chat/completions", body, auth)
            assert status == 400, (body, status, data)
            assert json.loads(data)["error"]["message"], body
        completion_bodies = [{"prompt": [1.5, 2]}, {"prompt": [10**9]}, {"prompt": ["a", "b"]}, {"prompt": None},
                             {"prompt": "x", "suffix": "y"}, {"prompt": "x", "echo": True, "logprobs": 1}]
        for body in completion_bodies:
            assert send("POST", base + "/v1/completions", body, auth)[0] == 400, body
        for body in ({"input": []}, {"input": [[]]}, {"input": "x", "encoding_format": "hex"}, {"input": [-1]}):
            assert send("POST", base + "/v1/embeddings", body, auth)[0] == 400, body
        assert send("POST", base + "/detokenize", {"tokens": ["a"]}, auth)[0] == 400
        assert send("GET", base + "/health")[0] == 200

    def test_tokenize(self, base, api_key):
        auth = {"Authorization": f"Bearer {api_key}"}
        status, _h, body = send("POST", base + "/tokenize", {"content": "the cat sat"}, auth)
        ids = json.loads(body)["tokens"]
        assert status == 200 and ids
        status, _h, body = send("POST", base + "/detokenize", {"tokens": ids}, auth)
        assert json.loads(body)["content"] == "the cat sat"

    def test_concurrent_greedy_streams_match_alone(self, client, model_name):
        """16 streams decoded together give each the text it gets alone."""
        alone = [chat_text(client, model_name, p, max_tokens=24) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: chat_text(client, model_name, p, max_tokens=24), PROMPTS))
        assert together == alone

    def test_metrics(self, base, client, model_name):
        client.completions.create(model=model_name, prompt="count", max_tokens=3, temperature=0)
        m = metrics(base)
        for name in ("innerq_requests_running", "innerq_requests_waiting", "innerq_kv_pool_pages",
                     "innerq_kv_pool_pages_used", "innerq_generation_tokens_per_second", "vllm:num_requests_waiting",
                     "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
            assert name in m, name
        assert m["innerq_kv_pool_pages"][()] > 0
        assert m["innerq_generation_tokens_total"][()] >= 3
        assert m["innerq_prompt_tokens_total"][()] > 0
        assert m["innerq_time_to_first_token_seconds_count"][()] >= 1
        assert 0 <= m["vllm:kv_cache_usage_perc"][()] <= 1

