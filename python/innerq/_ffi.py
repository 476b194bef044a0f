"""cffi (ABI mode) binding over the public C header.

The declarations are read from innerq.h itself, so they cannot drift from the C library.
The library is looked up in INNERQ_LIB, then beside this package (a wheel), then in the
build/ directory of a source checkout.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import cffi

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent


def _find(candidates):
    for c in candidates:
        if c and Path(c).is_file():
            return str(c)
    return None


def header_path() -> str:
    found = _find([os.environ.get("INNERQ_HEADER"), _HERE / "include" / "innerq.h", _ROOT / "src" / "innerq.h"])
    if found is None:
        raise ImportError("innerq.h not found (set INNERQ_HEADER)")
    return found


def library_path() -> str:
    names = ["libinnerq.so", "libinnerq.dylib", "innerq.dll"]
    cands = [os.environ.get("INNERQ_LIB")]
    cands += [_HERE / "lib" / n for n in names]
    cands += [_ROOT / "build" / n for n in names]
    found = _find(cands)
    if found is None:
        raise ImportError("libinnerq not found: build it (cmake -B build && cmake --build build) or set INNERQ_LIB")
    return found


def cdef_from_header(text: str) -> str:
    """The declarations of innerq.h in the form cffi's cdef accepts."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    keep = []
    for ln in text.splitlines():
        s = ln.strip()
        # preprocessor lines and the two halves of the extern "C" wrapper
        if s.startswith("#") or s == 'extern "C" {' or s == "}":
            continue
        keep.append(ln)
    text = "\n".join(keep)
    return text


ffi = cffi.FFI()
ffi.cdef(cdef_from_header(Path(header_path()).read_text()))
lib = ffi.dlopen(library_path())
