"""Files replaced whole or not at all.

The content goes to a temporary file in the target's folder, is flushed to the disk (fsync),
renamed over the target, and the folder is flushed too: a crash or kill -9 before the rename
leaves the previous file as it was (and a "NAME.tmp-XXXXXXXX" beside it, which a later writer
to the folder may remove); no reader ever sees half of the new one. The files are created
readable by their owner only: states hold prompts.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

TMP = ".tmp-"  # in the name of a temporary file
STALE_SECONDS = 3600  # a temporary file this old is a killed writer's


def write_whole(path: str | os.PathLike, chunks) -> None:
    """Writes the byte strings (or buffers) of `chunks` to path; OSError if it fails, with path
    as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + TMP)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def is_stale_temporary(entry: os.DirEntry) -> bool:
    """Whether entry is a temporary file of write_whole left by a writer that was killed."""
    with contextlib.suppress(OSError):
        return TMP in entry.name and time.time() - entry.stat().st_mtime > STALE_SECONDS
    return False
