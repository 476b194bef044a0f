"""Where the native pieces are: the shared library, its header and the innerq-cli executable.

Looked up, in order: an environment variable (INNERQ_LIB, INNERQ_HEADER, INNERQ_CLI); beside
this package (a wheel puts them in innerq/lib, innerq/include and innerq/bin); the build/
directory (or src/ for the header) of a source checkout; an editable install's CMake install
tree, which it adds to the package's search path. Nothing here loads the library, so it is
safe to import before anything is built.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent  # the source checkout, when running from one

LIBRARY_NAMES = ("libinnerq.so", "libinnerq.dylib", "innerq.dll")
CLI_NAMES = ("innerq-cli", "innerq-cli.exe")


def _package_dirs() -> list[Path]:
    dirs = [_HERE]
    pkg = sys.modules.get(__package__ or "innerq")
    for p in getattr(pkg, "__path__", []) or []:
        d = Path(p).resolve()
        if d not in dirs:
            dirs.append(d)
    return dirs


def _first_file(candidates) -> str | None:
    for c in candidates:
        if c and Path(c).is_file():
            return str(c)
    return None


def _search(env: str, subdir: str, names, build_dir: Path) -> str | None:
    if os.environ.get(env):  # an explicit choice: that file or nothing
        return _first_file([os.environ[env]])
    # A wheel's own files, then a source checkout's current build, then an editable install's
    # tree (built at install time, so possibly older than build/).
    dirs = _package_dirs()
    cands = [dirs[0] / subdir / n for n in names] + [build_dir / n for n in names]
    cands += [d / subdir / n for d in dirs[1:] for n in names]
    return _first_file(cands)


def build_dir() -> Path:
    """The source checkout's build directory ($INNERQ_BUILD or build/)."""
    return Path(os.environ.get("INNERQ_BUILD") or _ROOT / "build")


def library_path() -> str:
    found = _search("INNERQ_LIB", "lib", LIBRARY_NAMES, build_dir())
    if found is None:
        if os.environ.get("INNERQ_LIB"):
            raise ImportError(f"INNERQ_LIB={os.environ['INNERQ_LIB']} does not exist")
        raise ImportError("libinnerq not found: pip install the package, build it "
                          "(cmake -B build && cmake --build build), or set INNERQ_LIB")
    return found


def header_path() -> str:
    dirs = _package_dirs()
    found = _first_file([os.environ.get("INNERQ_HEADER"), dirs[0] / "include" / "innerq.h", _ROOT / "src" / "innerq.h"]
                        + [d / "include" / "innerq.h" for d in dirs[1:]])
    if found is None:
        raise ImportError("innerq.h not found (set INNERQ_HEADER)")
    return found


def cli_path() -> str:
    """The native innerq-cli executable ($INNERQ_CLI, the wheel's innerq/bin, or build/)."""
    found = _search("INNERQ_CLI", "bin", CLI_NAMES, build_dir())
    if found is None:
        if os.environ.get("INNERQ_CLI"):
            raise FileNotFoundError(f"INNERQ_CLI={os.environ['INNERQ_CLI']} does not exist")
        raise FileNotFoundError("innerq-cli not found: pip install the package, build it, or set INNERQ_CLI")
    return found
