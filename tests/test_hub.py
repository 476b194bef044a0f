"""GGUF files of Hugging Face repositories: `innerq pull hf.co/ORG/REPO[:QUANT]`, `innerq run`
of what was pulled, and Llama.from_pretrained, against a local server that speaks the Hub's
download API (http_fakes.FakeHub, reached through huggingface_hub's HF_ENDPOINT setting).

The commands run as a user runs them (subprocesses: huggingface_hub reads HF_ENDPOINT when it
is imported), each with its own cache (HF_HOME) and model folder (INNERQ_MODELS), and no
token but the one a test gives (HF_TOKEN)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiny_model
from http_fakes import FakeHub
from tiny_model import TinyConfig

pytest.importorskip("huggingface_hub")
innerq = pytest.importorskip("innerq")
from innerq import hub  # noqa: E402
from innerq.errors import InvalidArgumentError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REPO = "someone/Tiny-GGUF"


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> bytes:
    path = tiny_model.write_tiny_model(tmp_path_factory.mktemp("hub") / "tiny.gguf", TinyConfig(head_dim=32, n_ctx_train=128))
    return path.read_bytes()


@pytest.fixture
def server(model_bytes):
    with FakeHub() as s:
        s.add(REPO, {"tiny-Q8_0.gguf": model_bytes, "tiny-Q4_K_M.gguf": model_bytes, "README.md": b"# tiny\n"})
        yield s


def run(tmp_path: Path, server, *args, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "HUGGING_FACE_HUB_TOKEN"}
    base.update(PYTHONPATH=str(ROOT / "python"), HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf"),
                INNERQ_MODELS=str(tmp_path / "models"), HF_HUB_DISABLE_TELEMETRY="1", **env)
    return subprocess.run([sys.executable, *map(str, args)], env=base, capture_output=True, text=True, timeout=300)


def innerq_cmd(tmp_path, server, *args, **env):
    return run(tmp_path, server, "-m", "innerq", *args, **env)


def gets(server, name: str) -> list[dict]:
    return [h for method, path, h in server.log if method == "GET" and path.endswith("/" + name)]


def test_pull_picks_the_file_by_its_quant_tag_and_run_takes_its_name(tmp_path, server, model_bytes):
    r = innerq_cmd(tmp_path, server, "pull", f"hf.co/{REPO}:q8_0", "-q")
    assert r.returncode == 0, r.stderr
    linked = Path(r.stdout.strip())
    assert linked == tmp_path / "models" / "tiny-Q8_0.gguf"
    assert linked.read_bytes() == model_bytes
    assert tmp_path / "hf" in linked.resolve().parents  # the file itself is in huggingface_hub's cache
    listing = innerq_cmd(tmp_path, server, "list")
    assert "tiny-Q8_0.gguf" in listing.stdout
    by_name = innerq_cmd(tmp_path, server, "run", "tiny-Q8_0.gguf", "-p", "the", "-n", 6, "--temp", 0, "-q")
    by_path = innerq_cmd(tmp_path, server, "run", str(linked.resolve()), "-p", "the", "-n", 6, "--temp", 0, "-q")
    assert by_name.returncode == 0 and by_name.stdout == by_path.stdout, by_name.stderr
    # no tag: Q4_K_M, as llama.cpp's -hf; run pulls on first use
    r = innerq_cmd(tmp_path, server, "run", f"hf.co/{REPO}", "-p", "the", "-n", 2, "-q")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "models" / "tiny-Q4_K_M.gguf").is_file()
    r = innerq_cmd(tmp_path, server, "pull", f"hf.co/{REPO}:IQ2_XXS")
    assert r.returncode == 1 and "no .gguf file tagged IQ2_XXS" in r.stderr and "Q4_K_M, Q8_0" in r.stderr


def test_interrupted_download_resumes_and_is_never_used_half_written(tmp_path, server):
    # 12 MiB, cut after 11: huggingface_hub counts what arrived in whole chunks of 10 MiB
    big = os.urandom(12 << 20)
    server.add("someone/Big-GGUF", {"big-Q8_0.gguf": big})
    server.cut_bytes = 11 << 20
    # the connection drops and the resumed request fails too: no model appears
    server.plans["big-Q8_0.gguf"] = ["cut", "500"]
    r = innerq_cmd(tmp_path, server, "pull", "hf.co/someone/Big-GGUF", "-q")
    assert r.returncode == 1 and "cannot download big-Q8_0.gguf" in r.stderr
    assert not (tmp_path / "models" / "big-Q8_0.gguf").exists()
    assert all(b.stat().st_size < len(big) for b in (tmp_path / "hf").rglob("*") if b.is_file())
    assert "big-Q8_0" not in innerq_cmd(tmp_path, server, "list").stdout
    r = innerq_cmd(tmp_path, server, "run", "big-Q8_0.gguf", "-p", "x", "-n", 1)
    assert r.returncode == 1 and "no model file" in r.stderr
    # dropped, then resumed from where it stopped: the whole file. huggingface_hub resumes within
    # the call (2.x) or, where it gives up at the cut, at the next call from its partial file
    server.log.clear()
    server.plans["big-Q8_0.gguf"] = ["cut", "ok"]
    r = innerq_cmd(tmp_path, server, "pull", "hf.co/someone/Big-GGUF", "-q")
    if r.returncode != 0:
        assert not (tmp_path / "models" / "big-Q8_0.gguf").exists()
        r = innerq_cmd(tmp_path, server, "pull", "hf.co/someone/Big-GGUF", "-q")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == big
    ranges = [h.get("range") for h in gets(server, "big-Q8_0.gguf")]
    assert len(ranges) == 2 and ranges[0] is None, ranges
    start = int(ranges[1].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= server.cut_bytes, ranges


def test_token_comes_from_the_environment(tmp_path, server, model_bytes):
    server.add("someone/Private-GGUF", {"p-Q4_K_M.gguf": model_bytes}, token="hf_secret")
    r = innerq_cmd(tmp_path, server, "pull", "hf.co/someone/Private-GGUF", "-q")
    assert r.returncode == 1 and "someone/Private-GGUF" in r.stderr
    r = innerq_cmd(tmp_path, server, "pull", "hf.co/someone/Private-GGUF", "-q", HF_TOKEN="hf_secret")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == model_bytes
    assert all(h.get("authorization") == "Bearer hf_secret" for h in gets(server, "p-Q4_K_M.gguf"))


def test_a_split_model_is_pulled_whole_and_runs(tmp_path, tmp_path_factory):
    """A quant split into files by gguf-split (in a folder of the repository, as large models
    are published): pull fetches every file, links them side by side, and run loads the first;
    from_pretrained with a pattern matching the files does the same."""
    d = tmp_path_factory.mktemp("hubsplit")
    cfg = TinyConfig(head_dim=32, n_ctx_train=128, n_layer=2)
    first = tiny_model.write_tiny_model(d / "tiny-Q8_0.gguf", cfg, split_max_tensors=10)
    shards = sorted(d.glob("tiny-Q8_0-*-of-*.gguf"))
    assert first == shards[0] and len(shards) >= 2
    whole = tiny_model.write_tiny_model(d / "whole.gguf", cfg)
    with FakeHub() as s:
        s.add(REPO, {f"Q8_0/{f.name}": f.read_bytes() for f in shards})
        r = innerq_cmd(tmp_path, s, "pull", f"hf.co/{REPO}:Q8_0", "-q")
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()) == tmp_path / "models" / first.name
        assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f.name for f in shards]
        a = innerq_cmd(tmp_path, s, "run", first.name, "-p", "the", "-n", 6, "--temp", 0, "-q")
        b = innerq_cmd(tmp_path, s, "run", str(whole), "-p", "the", "-n", 6, "--temp", 0, "-q")
        assert a.returncode == 0 and a.stdout == b.stdout, a.stderr
        code = ("from innerq import Llama; llm = Llama.from_pretrained('%s', '*Q8_0-*.gguf', n_ctx=64); "
                "print(llm.model_path)" % REPO)
        r = run(tmp_path / "fp", s, "-c", code)
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()).name == first.name


def test_from_pretrained_takes_a_glob(tmp_path, server):
    code = ("from innerq import Llama; llm = Llama.from_pretrained('%s', '*Q8_0.gguf', n_ctx=64); "
            "print(llm.model_path); print(llm.generate('the', max_tokens=3, temperature=0) is not None)" % REPO)
    r = run(tmp_path, server, "-c", code)
    assert r.returncode == 0, r.stderr
    path, ok = r.stdout.split()
    assert Path(path).name == "tiny-Q8_0.gguf" and tmp_path / "hf" in Path(path).parents and ok == "True"


def test_choose_gguf_by_tag():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "m-Q4_K.gguf", "mmproj-m-F16.gguf",
             "m-F16.gguf"]
    assert hub.choose_gguf(files, "o/r", None) == "m-Q4_K_M.gguf"
    assert hub.choose_gguf(files, "o/r", "q4_k") == "m-Q4_K.gguf"
    assert hub.choose_gguf(files, "o/r", "IQ4_XS") == "m-IQ4_XS.gguf"
    assert hub.choose_gguf(files, "o/r", "F16") == "m-F16.gguf"  # not the projector
    assert hub.choose_gguf(["only.gguf"], "o/r", None) == "only.gguf"
    with pytest.raises(InvalidArgumentError, match="Q4_0"):
        hub.choose_gguf(["a-Q4_0.gguf", "a-Q8_0.gguf"], "o/r", None)
    split = ["x/a-Q4_K_M-00002-of-00002.gguf", "x/a-Q4_K_M-00001-of-00002.gguf"]
    assert hub.choose_gguf(split, "o/r", None) == "x/a-Q4_K_M-00001-of-00002.gguf"
    assert hub.split_files(split, "x/a-Q4_K_M-00001-of-00002.gguf", "o/r") == sorted(split)
    with pytest.raises(InvalidArgumentError, match="00002-of-00002.gguf is not in the repository"):
        hub.split_files(split[1:], "x/a-Q4_K_M-00001-of-00002.gguf", "o/r")
    with pytest.raises(InvalidArgumentError, match="several files"):
        hub.choose_gguf(split + ["y/b-Q4_K_M-00001-of-00002.gguf"], "o/r", None)
    with pytest.raises(InvalidArgumentError, match="no .gguf"):
        hub.choose_gguf(["README.md"], "o/r", None)
    assert hub.parse_ref("hf.co/Qwen/Qwen3-0.6B-GGUF:Q8_0") == ("Qwen/Qwen3-0.6B-GGUF", "Q8_0")
    assert hub.parse_ref("https://huggingface.co/org/repo") == ("org/repo", None)
    assert hub.parse_ref("smollm2-135m") is None and hub.parse_ref("hf.co/org") is None
