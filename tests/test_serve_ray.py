"""Two innerq replicas behind Ray Serve (innerq.serve_ray), started on Ray's local cluster,
answer ServerContract's tests as one server does, and requests spread over both. Skipped
where Ray Serve is not installed: it is not part of innerq[test] (`pip install "ray[serve]"`,
about 240 MB with its dependencies)."""
from __future__ import annotations

import concurrent.futures

import pytest

import tiny_model
from conftest import ROOT, lib_path
from server_contract import (KEY, MODEL, TINY, ServerContract, api_key, client, free_port,  # noqa: F401
                             model_name, send)

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("starlette")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from innerq import cli
    from innerq.serve_ray import build_app

    model = tiny_model.write_tiny_model(tmp_path_factory.mktemp("ray") / "tiny.gguf", TINY)
    env = {"PYTHONPATH": str(ROOT / "python"), "INNERQ_LIB": lib_path()}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, logging_level="warning")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = cli.build_parser().parse_args(["serve", str(model), "-np", "8", "-c", "4096", "-t", "1", "--alias", MODEL,
                                          "--api-key", KEY])
    serve.run(build_app(args, replicas=2, cpus=0.5), name="innerq", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


class TestRayReplicas(ServerContract):
    pass


def test_requests_spread_over_both_replicas(base):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}

    def answered_by(i: int) -> str:
        status, headers, _b = send("POST", base + "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"})
        assert status == 200
        return headers["x-innerq-server"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        servers = set(pool.map(answered_by, range(48)))
    assert len(servers) == 2, servers
