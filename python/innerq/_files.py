"""Files replaced whole or not at all.

The content goes to a temporary file in the target's folder, is flushed to the disk (fsync),
renamed over the target, and the folder is flushed too: a crash or kill -9 before the rename
leaves the previous file as it was (and a "NAME.tmp-XXXXXXXX" beside it, which a later writer
to the folder removes once it is an hour old); no reader ever sees half of the new one. The files are created
readable by their owner only: states hold prompts.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

TMP = ".tmp-"  # in the name of a temporary file
STALE_SECONDS = 3600  # a temporary file this old is a killed writer's


def write_whole(path: str | os.PathLike, chunks) -> None:
    """Writes the byte strings (or buffers) of `chunks` to path; OSError if it fails, with path
    as it was. A link is followed (the file it names is replaced, the link stays); a path that
    exists and is not a regular file (/dev/null, a pipe) is written as it is."""
    path = Path(path)
    if path.exists() and not path.is_file():
        with open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        return
    path = path.resolve()
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


def remove_stale_temporaries(folder: str | os.PathLike) -> None:
    """Removes what killed writers left in folder: files and folders with TMP in their name
    (write_whole's, `innerq pull`'s download folder) older than an hour."""
    with contextlib.suppress(OSError):
        for e in os.scandir(folder):
            with contextlib.suppress(OSError):
                if TMP in e.name and time.time() - e.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
                    if e.is_dir(follow_symlinks=False):
                        shutil.rmtree(e.path, ignore_errors=True)
                    else:
                        os.unlink(e.path)
