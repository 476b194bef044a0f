"""`innerq serve` as one process (`python -m innerq.server`) on a real port: ServerContract's
tests through the openai package, and what one process shows: prefix reuse, a disconnected
client's sequence freed, the bounded queue's 503, /health while the model loads and when it
fails, CORS, memory over many requests, and SmolLM2 with its own chat template and a tool call.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import time

import pytest

import tiny_model
from conftest import lib_path
from server_contract import (KEY, MODEL, TINY, ServerContract, ServerProcess, api_key, client,  # noqa: F401
                             metric, metrics, model_name, openai, send)

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ORIGIN = "http://example.test"
NO_END = {str(t): -100 for t in range(len(tiny_model.SPECIAL_TOKENS))}  # a generation that does not end by itself


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny.gguf", TINY)


def start(model, *args: str) -> ServerProcess:
    os.environ["INNERQ_LIB"] = lib_path()  # the library under test, in the server process too
    return ServerProcess(model, "-t", "2", *args).start()


@pytest.fixture(scope="module")
def server(tiny):
    s = start(tiny, "-np", "16", "-c", "4096", "--alias", MODEL, "--api-key", KEY, "--cors", ORIGIN)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(server):
    return server.url


class TestServer(ServerContract):
    pass


def test_prefix_reuse(tiny):
    """A prompt sharing a prefix with an earlier one (a system prompt) evaluates only the rest."""
    server = start(tiny, "-np", "4", "-c", "4096", "--alias", MODEL)
    try:
        prefix_reuse(server, openai.OpenAI(base_url=server.url + "/v1", api_key="none"))
    finally:
        server.stop()


def prefix_reuse(server, client):
    system = {"role": "system", "content": "You are a terse assistant who answers in one line. " * 3}
    before = metric(server.url, "innerq_prompt_tokens_cached_total")
    first = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "One?"}],
                                           max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "Two?"}],
                                            max_tokens=4, temperature=0)
    shared = second.usage.prompt_tokens_details.cached_tokens
    assert shared >= 30 and shared < second.usage.prompt_tokens
    again = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "One?"}],
                                           max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    assert metric(server.url, "innerq_prompt_tokens_cached_total") - before == pytest.approx(
        first.usage.prompt_tokens_details.cached_tokens + shared + again.usage.prompt_tokens_details.cached_tokens)


def test_requests_that_arrive_together_read_their_shared_prefix_once(tiny):
    s = start(tiny, "-np", "8", "-c", "4096")
    try:
        system = {"role": "system", "content": "Read this first. " * 60}
        bodies = [{"messages": [system, {"role": "user", "content": f"Question {i}?"}], "max_tokens": 4}
                  for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = [json.loads(data) for _s, _h, data in pool.map(
                lambda b: send("POST", s.url + "/v1/chat/completions", b), bodies)]
        cached = sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
        assert cached[0] == 0 and all(c >= 200 for c in cached[1:]), cached  # one read the system prompt
    finally:
        s.stop()


def test_long_prompts_are_read_in_whole_chunks_beside_decoding(tiny):
    """A prompt longer than n_batch is read in chunks of n_batch tokens cut by the request alone,
    each in one step, while other requests decode and the quantized cache flushes under it (sink
    32, recent 96, groups of 32): each of four concurrent requests gets the text it gets alone."""
    s = start(tiny, "-np", "4", "-c", "4096", "-b", "64", "--kv-group", "32", "--kv-sink", "32", "--kv-recent", "96")
    try:
        words = "the cache keeps what it stores and reads the rest again in order".split()
        bodies = [{"prompt": " ".join(words[(i * 5 + j) % len(words)] + str(j % 7) for j in range(90 + 40 * i)),
                   "max_tokens": 24, "temperature": 0, "logit_bias": NO_END} for i in range(4)]

        def complete(body):
            status, _h, data = send("POST", s.url + "/v1/completions", body)
            assert status == 200, data
            return json.loads(data)

        steps, step_tokens = metric(s.url, "innerq_step_tokens_count"), metric(s.url, "innerq_step_tokens_sum")
        first = complete(bodies[3])
        n_prompt = first["usage"]["prompt_tokens"]
        assert n_prompt > 3 * 64
        # alone: ceil(n_prompt / 64) prompt steps, then one step per generated token but the last
        assert metric(s.url, "innerq_step_tokens_count") - steps == -(-n_prompt // 64) + 23
        assert metric(s.url, "innerq_step_tokens_sum") - step_tokens == n_prompt + 23
        alone = [complete(b)["choices"][0]["text"] for b in bodies[:3]] + [first["choices"][0]["text"]]
        s.stop()
        s = start(tiny, "-np", "4", "-c", "4096", "-b", "64", "--kv-group", "32", "--kv-sink", "32", "--kv-recent", "96")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = [a["choices"][0]["text"] for a in pool.map(complete, bodies)]
        assert together == alone
    finally:
        s.stop()


def test_logprobs_do_not_depend_on_the_prefix_a_request_copies(tiny):
    """On the CPU the context has decode semantics: requests that share a system prompt longer
    than n_batch get the same log-probabilities, bit for bit, whether each reads its prompt after
    the one before it (copying the prefix it left) or all arrive together (one reads the system
    prompt, the others copy it): the prompts are cut at other places. (Within the windows, S + R
    + G = 352 rows here, where a copied prefix is what a fresh evaluation holds; docs/SERVING.md.)"""
    # the innerq cache (plain ones agree within rounding), windows of S + R + G = 352 rows
    args = ("-np", "4", "-c", "4096", "-b", "32", "--kv-group", "32", "--kv-sink", "64", "--kv-recent", "256")
    system = " ".join(f"rule {i}: answer briefly." for i in range(6))
    bodies = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {q}?"}],
               "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2} for q in range(4)]

    def ask(s, body):
        status, _h, data = send("POST", s.url + "/v1/chat/completions", body)
        assert status == 200, data
        a = json.loads(data)
        return a["usage"]["prompt_tokens_details"]["cached_tokens"], a["choices"][0]["logprobs"]["content"]

    s = start(tiny, *args)
    try:
        alone = [ask(s, b) for b in bodies]
    finally:
        s.stop()
    s = start(tiny, *args)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda b: ask(s, b), bodies))
    finally:
        s.stop()
    assert alone[0][0] == 0 and all(c > 100 for c, _ in alone[1:])  # each copied the one before's prompt
    assert sorted(c for c, _ in together)[0] == 0
    for (_c, a), (_d, t) in zip(alone, together):
        assert a == t


def test_a_request_takes_the_sequence_whose_emptying_loses_least(tiny):
    """Every sequence holds a prompt: a request that goes on from what one of them holds (a chat's
    next turn, the same prompt again) takes that sequence, rather than the least recently used
    one, whose prompt a later request still finds."""
    s = start(tiny, "-np", "2", "-c", "2048")
    try:
        def cached(prompt):
            status, _h, data = send("POST", s.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                                        "temperature": 0})
            assert status == 200, data
            usage = json.loads(data)["usage"]
            return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

        a, b = "one long prompt about apples " * 8, "another long prompt about pears " * 8
        assert cached(a)[0] == 0 and cached(b)[0] == 0
        for prompt in (b, a, a + "and more"):
            n_cached, n_prompt = cached(prompt)
            assert n_cached >= (n_prompt - 1 if prompt in (a, b) else 40), (prompt, n_cached, n_prompt)
    finally:
        s.stop()


def test_disconnect_frees_the_sequence(server):
    cancelled = metric(server.url, "innerq_requests_finished_total", reason="cancelled")
    generated = metric(server.url, "innerq_generation_tokens_total")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": MODEL, "prompt": "Go on and on", "max_tokens": 3000, "temperature": 0, "stream": True,
            "logit_bias": NO_END}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}",
                                                              "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(3):
        assert response.readline().startswith(b"data: ")
        response.readline()
    assert metric(server.url, "innerq_requests_running") == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    end = time.monotonic() + 20
    while metric(server.url, "innerq_requests_running") != 0 and time.monotonic() < end:
        time.sleep(0.05)
    assert metric(server.url, "innerq_requests_running") == 0
    assert metric(server.url, "innerq_requests_finished_total", reason="cancelled") == cancelled + 1
    assert metric(server.url, "innerq_generation_tokens_total") - generated < 3000


def test_cors(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, headers, _b = send("OPTIONS", server.url + "/v1/chat/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _b = send("GET", server.url + "/v1/models", headers={"Origin": ORIGIN,
                                                                          "Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _b = send("GET", server.url + "/v1/models", headers={"Origin": "http://elsewhere.test",
                                                                          "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in headers


def test_many_requests_keep_memory(server, client):
    """Short requests one after another (INNERQ_SERVE_REQUESTS of them, 400 by default; the
    figure for 10,000 is in docs/BENCHMARKS.md): the server's resident memory grows by less
    than 5% after a warm-up."""
    n = int(os.environ.get("INNERQ_SERVE_REQUESTS", "400"))

    def one(i: int) -> None:
        client.completions.create(model=MODEL, prompt=f"request {i} says", max_tokens=2, temperature=0.5, seed=i)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(100)))
        before = server.rss_kib()
        list(pool.map(one, range(100, 100 + n)))
    after = server.rss_kib()
    assert after < before * 1.05, (before, after)


def test_full_queue_answers_503(tiny):
    s = start(tiny, "-np", "1", "--queue", "0", "-c", "8192")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "long", "max_tokens": 8000, "stream": True,
                                                            "logit_bias": NO_END}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.readline()  # the first token: the one sequence is busy
        status, headers, body = send("POST", s.url + "/v1/completions", {"prompt": "more", "max_tokens": 2})
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["type"] == "server_busy"
        conn.close()
    finally:
        s.stop()


def test_requests_wait_for_room_in_the_pool(tiny):
    """Admission counts pages: with a pool of 12 pages of 32 tokens (the tiny model's group) and
    requests that may take 5, at most two run at once though four sequences are free; the rest
    wait, and all complete. A request that may take the whole pool empties the idle sequences
    and runs."""
    s = start(tiny, "-np", "4", "-c", "512")
    try:
        body = {"prompt": "wait for room", "max_tokens": 100, "temperature": 0, "logit_bias": NO_END}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _i: send("POST", s.url + "/v1/completions", body), range(6)))
        assert all(status == 200 and json.loads(data)["usage"]["completion_tokens"] == 100
                   for status, _h, data in answers)
        prompt = json.loads(answers[0][2])["usage"]["prompt_tokens"]
        pages, page_tokens = metric(s.url, "innerq_kv_pool_pages"), metric(s.url, "innerq_kv_pool_page_tokens")
        assert pages // (-(-(prompt + 100) // page_tokens) + 1) == 2
        steps = metrics(s.url)["innerq_step_sequences_bucket"]
        assert steps[(("le", "2.0"),)] == steps[(("le", "+Inf"),)]  # no step had more than two sequences
        status, _h, data = send("POST", s.url + "/v1/completions", {**body, "max_tokens": 400})
        assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 400
    finally:
        s.stop()


def _asgi_get(app, path: str) -> tuple[int, dict, dict]:
    """GET path from an ASGI application, in this process, without its lifespan."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "server": ("test", 80), "client": ("test", 1)}
    asyncio.run(app(scope, receive, send))
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_health_while_loading(tmp_path):
    from innerq.server.app import create_app
    from innerq.server.engine import Engine, EngineConfig
    from innerq.server.protocol import Defaults

    defaults = Defaults(16, 0.8, 40, 0.95, 0.05, 1.0, 64, -1)
    app = create_app(Engine(EngineConfig(str(tmp_path / "m.gguf"))), ["m"], defaults)  # not started: loading
    status, headers, body = _asgi_get(app, "/health")
    assert (status, body) == (503, {"status": "loading"}) and headers["retry-after"] == "5"
    status, _h, body = _asgi_get(app, "/v1/models")
    assert status == 503 and body["error"]["message"] == "the model is loading"


def test_a_model_that_fails_to_load_ends_the_process(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    os.environ["INNERQ_LIB"] = lib_path()
    s = ServerProcess(bad, "-t", "1")
    assert s.proc.wait(timeout=60) == 1
    assert "loading" in s.stop()


def test_smollm2_template_and_tool_call(smollm2):
    from innerq import Llama

    s = start(smollm2, "-np", "2", "-c", "2048")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = client.chat.completions.create(model=smollm2.stem, messages=messages, max_tokens=8, temperature=0)
        with Llama(smollm2, n_ctx=256, n_threads=1) as llm:
            assert out.usage.prompt_tokens == len(llm.chat_tokens(messages))  # the GGUF's template
        assert out.choices[0].message.content
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
        call = client.chat.completions.create(
            model=smollm2.stem, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
    finally:
        s.stop()
    choice = call.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments)["city"], str)
