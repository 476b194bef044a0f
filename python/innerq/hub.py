"""GGUF files of Hugging Face repositories, through huggingface_hub (the optional extra
`innerq[hub]`): Llama.from_pretrained(repo_id, filename) and `innerq pull hf.co/ORG/REPO[:QUANT]`.

Files are kept in huggingface_hub's cache (HF_HOME), which resumes interrupted transfers and
moves a file into place only once it is complete; HF_TOKEN authorizes private or gated
repositories and HF_ENDPOINT names another hub. A pulled file is linked into the model folder
(innerq.models.models_dir) under its own name, so that `innerq list` shows it and `innerq run`
takes that name.
"""
from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path, PurePosixPath

from .errors import InnerQIOError, InvalidArgumentError, UnsupportedError

DEFAULT_QUANT = "Q4_K_M"  # as llama.cpp's -hf and ollama pick without a tag
_REF = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/([^/:\s]+/[^/:\s]+)(?::([^/\s]+))?/?$")
_SHARD = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def split_files(files: list[str], first: str, repo_id: str) -> list[str]:
    """The files of the model whose first file is `first`: itself, or every file of a model split
    by gguf-split (PREFIX-00001-of-0000N.gguf ... -0000N-of-0000N.gguf), all in the repository."""
    m = _SHARD.match(first)
    if m is None:
        return [first]
    prefix, n = m.group(1), int(m.group(3))
    want = [f"{prefix}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    missing = [f for f in want if f not in files]
    if missing:
        raise InvalidArgumentError(f"{repo_id}: {first} is file 1 of a model split in {n}, but "
                                   f"{', '.join(missing)} is not in the repository")
    return want


def _first_of(found: list[str], what: str) -> str:
    """The one model that `found` holds: a file, or the files of one split model (its first)."""
    groups = {(m.group(1), m.group(3)) if (m := _SHARD.match(f)) else (f, "") for f in found}
    if len(groups) != 1:
        raise InvalidArgumentError(f"several files {what}: {', '.join(found)}")
    prefix, n = groups.pop()
    return f"{prefix}-00001-of-{n}.gguf" if n else prefix


def _match(files: list[str], pattern: str, repo_id: str) -> str:
    found = [f for f in files if fnmatch.fnmatch(f, pattern)]
    if len(found) != 1:
        what = "No file" if not found else "Several files"
        raise InvalidArgumentError(f"{what} in {repo_id} match {pattern!r}; files: {', '.join(files) or 'none'}")
    return found[0]


def _hub(what: str):
    try:
        import huggingface_hub
    except ImportError:
        raise UnsupportedError(f"{what} needs the huggingface-hub package (pip install 'innerq[hub]')") from None
    return huggingface_hub


def _repo_files(huggingface_hub, repo_id: str, cache_dir) -> list[str]:
    """The repository's files, from the hub, or where it can't be reached from what earlier
    downloads left in the cache."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except Exception as e:  # huggingface_hub's HFValidationError
        raise InvalidArgumentError(str(e)) from None
    try:
        return huggingface_hub.list_repo_files(repo_id)
    except Exception as online_error:
        files = _cached_files(huggingface_hub, repo_id, cache_dir)
        if not files:
            raise InnerQIOError(f"cannot list {repo_id} on the Hugging Face hub ({type(online_error).__name__}: "
                                f"{online_error}) and nothing of it is in the local cache") from None
        return files


def download(repo_id: str, filename: str | None, additional_files=None, local_dir=None, cache_dir=None) -> str:
    """The local path of the file of repo_id that matches filename (a name or a glob pattern),
    with additional_files (e.g. the other shards) next to it. Files already in huggingface_hub's
    cache are used without a network (the repository's listing then comes from the cache too)."""
    huggingface_hub = _hub("Llama.from_pretrained")
    if not filename:
        raise InvalidArgumentError("from_pretrained needs a filename (or a glob pattern such as '*Q4_K_M.gguf')")
    files = _repo_files(huggingface_hub, repo_id, cache_dir)
    found = [f for f in files if fnmatch.fnmatch(f, filename)]
    # a pattern that matches the files of one split model names it: every file is fetched
    first = _first_of(found, f"of {repo_id} match {filename!r}") if found else _match(files, filename, repo_id)
    paths = split_files(files, first, repo_id) + [_match(files, extra, repo_id) for extra in additional_files or []]
    local = []
    for path in paths:
        try:
            local.append(huggingface_hub.hf_hub_download(repo_id=repo_id, filename=path, local_dir=local_dir,
                                                         cache_dir=cache_dir))
        except Exception as e:
            raise InnerQIOError(f"cannot download {path} of {repo_id}: {type(e).__name__}: {e}") from None
    return local[0]


def _cached_files(huggingface_hub, repo_id: str, cache_dir) -> list[str]:
    try:
        info = huggingface_hub.scan_cache_dir(cache_dir)
    except Exception:  # no cache directory at all
        return []
    files = set()
    for repo in info.repos:
        if repo.repo_id == repo_id and repo.repo_type == "model":
            for rev in repo.revisions:
                for f in rev.files:
                    files.add(str(PurePosixPath(*f.file_path.relative_to(rev.snapshot_path).parts)))
    return sorted(files)


# ---- innerq pull hf.co/ORG/REPO[:QUANT] ----

def parse_ref(ref: str) -> tuple[str, str | None] | None:
    """(repo_id, quant tag or None) of `hf.co/ORG/REPO[:QUANT]` (also huggingface.co/...), or
    None for anything else."""
    m = _REF.match(ref.strip())
    return (m.group(1), m.group(2)) if m else None


def _has_tag(path: str, tag: str) -> bool:
    """Whether the file name carries the quant tag as a whole word: Q4_K matches
    model-Q4_K.gguf but neither model-Q4_K_M.gguf nor model-IQ4_K.gguf."""
    name = PurePosixPath(path).name
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", name, re.IGNORECASE) is not None


def _tags(ggufs: list[str]) -> list[str]:
    """The quant tags the file names show, for messages."""
    found = set()
    for f in ggufs:
        found.update(re.findall(r"(?<![A-Za-z0-9])(I?Q\d_[A-Z0-9_]*[A-Z0-9]|I?Q\d_\d|BF16|F16|F32)(?![A-Za-z0-9])",
                                PurePosixPath(f).name, re.IGNORECASE))
    return sorted(found, key=str.upper)


def choose_gguf(files: list[str], repo_id: str, quant: str | None) -> str:
    """The .gguf of a repository that a quant tag names: without one Q4_K_M, or the only
    .gguf; of a model split over several files, the first. Projector files (mmproj) are not
    models."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower()]
    if not ggufs:
        raise InvalidArgumentError(f"{repo_id} has no .gguf file")
    tag = quant or DEFAULT_QUANT
    found = [f for f in ggufs if _has_tag(f, tag)]
    if not found and quant is None and len(ggufs) == 1:
        found = ggufs
    if not found:
        what = f"no .gguf file tagged {tag}" if quant else f"no {DEFAULT_QUANT} file and several .gguf files"
        raise InvalidArgumentError(f"{repo_id} has {what}; pick one with hf.co/{repo_id}:QUANT, QUANT one of: "
                                   f"{', '.join(_tags(ggufs)) or ', '.join(ggufs)}")
    # the files of one split model are one model: its first file
    return _first_of(found, f"of {repo_id} are tagged {tag}")


def pull(ref: str, quiet: bool = False) -> Path:
    """Downloads the file `hf.co/ORG/REPO[:QUANT]` names into huggingface_hub's cache (or finds it
    there) and links it into the model folder; returns the path in the model folder."""
    from .models import models_dir

    parsed = parse_ref(ref)
    if parsed is None:
        raise InvalidArgumentError(f"{ref!r} is not hf.co/ORG/REPO[:QUANT]")
    repo_id, quant = parsed
    huggingface_hub = _hub(f"innerq pull {ref}")
    files = _repo_files(huggingface_hub, repo_id, None)
    names = split_files(files, choose_gguf(files, repo_id, quant), repo_id)
    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    links = []
    for filename in names:  # a split model's files side by side in the model folder, where the loader finds them
        try:
            cached = Path(huggingface_hub.hf_hub_download(repo_id=repo_id, filename=filename))
        except Exception as e:
            raise InnerQIOError(f"cannot download {filename} of {repo_id}: {type(e).__name__}: {e}") from None
        links.append(_link(cached, models_dir() / PurePosixPath(filename).name))
    return links[0]


def _link(cached: Path, dest: Path) -> Path:
    """dest, a symbolic link to the cache's complete file (a copy where links can't be made).
    An earlier link of that name is replaced; a file of the user's is not."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_file() and not dest.is_symlink():
        if dest.stat().st_size == cached.stat().st_size:  # the copy of an earlier pull
            return dest
        raise InnerQIOError(f"{dest} exists and is not this download; move it to pull this model")
    tmp = dest.with_name(f".{dest.name}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(cached.resolve(), tmp)
    except OSError:
        import shutil

        shutil.copyfile(cached, tmp)
    os.replace(tmp, dest)
    return dest
