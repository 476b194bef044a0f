"""cffi (ABI mode) binding over the public C header.

The declarations are read from innerq.h itself, so they cannot drift from the C library.
The library is looked up in INNERQ_LIB, then beside this package (a wheel), then in the
build/ directory of a source checkout (see _paths.py).
"""
from __future__ import annotations

import re
from pathlib import Path

import cffi

from ._paths import header_path, library_path


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
    return "\n".join(keep)


def function_names(text: str) -> list[str]:
    """Names of the functions innerq.h declares (the binding's whole surface)."""
    decl = cdef_from_header(text)
    return re.findall(r"\b(innerq_\w+)\s*\(", re.sub(r"\(\s*\*\s*\w+\s*\)", "", decl))


ffi = cffi.FFI()
ffi.cdef(cdef_from_header(Path(header_path()).read_text()))
lib = ffi.dlopen(library_path())
