"""Llama.from_pretrained: a GGUF file of a Hugging Face repository, through huggingface_hub."""
from __future__ import annotations

import fnmatch
from pathlib import PurePosixPath

from .errors import InnerQIOError, InvalidArgumentError, UnsupportedError


def _match(files: list[str], pattern: str, repo_id: str) -> str:
    found = [f for f in files if fnmatch.fnmatch(f, pattern)]
    if len(found) != 1:
        what = "No file" if not found else "Several files"
        raise InvalidArgumentError(f"{what} in {repo_id} match {pattern!r}; files: {', '.join(files) or 'none'}")
    return found[0]


def download(repo_id: str, filename: str | None, additional_files=None, local_dir=None, cache_dir=None) -> str:
    """The local path of the file of repo_id that matches filename (a name or a glob pattern),
    with additional_files (e.g. the other shards) next to it. Files already in huggingface_hub's
    cache are used without a network (the repository's listing then comes from the cache too)."""
    try:
        import huggingface_hub
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise UnsupportedError("Llama.from_pretrained needs the huggingface-hub package "
                               "(pip install huggingface-hub)") from None
    if not filename:
        raise InvalidArgumentError("from_pretrained needs a filename (or a glob pattern such as '*Q4_K_M.gguf')")
    try:
        validate_repo_id(repo_id)
    except Exception as e:  # huggingface_hub's HFValidationError
        raise InvalidArgumentError(str(e)) from None
    try:
        files = huggingface_hub.list_repo_files(repo_id)
    except Exception as online_error:
        # offline (or the hub unreachable): what a previous download left in the cache
        files = _cached_files(huggingface_hub, repo_id, cache_dir)
        if not files:
            raise InnerQIOError(f"cannot list {repo_id} on the Hugging Face hub ({type(online_error).__name__}: "
                                f"{online_error}) and nothing of it is in the local cache") from None
    paths = [_match(files, filename, repo_id)] + [_match(files, extra, repo_id) for extra in additional_files or []]
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
