"""Exceptions: one class per C status, each carrying the C library's message.

Every class derives from InnerQError, and also from the built-in exception a Python caller
would expect (ValueError for bad arguments, OSError for files, MemoryError), so both
`except innerq.InnerQError` and `except ValueError` work.
"""
from __future__ import annotations


class InnerQError(Exception):
    """An error reported by innerq; str(e) is the C library's message."""

    status = None  # the innerq_status value, where the error came from the C library


class InvalidArgumentError(InnerQError, ValueError):
    status = 1


class InnerQIOError(InnerQError, OSError):
    status = 2


class FormatError(InnerQError, ValueError):
    """A malformed or inconsistent file: a GGUF model (or not a GGUF file at all), a state file."""

    status = 3


class UnsupportedError(InnerQError):
    status = 4


class InnerQMemoryError(InnerQError, MemoryError):
    status = 5


class ContextFullError(InnerQError, ValueError):
    """The tokens do not fit in the context (n_ctx)."""

    status = 6


class BackendError(InnerQError):
    status = 8


class StateMismatchError(InnerQError, ValueError):
    """A saved state of another model or cache configuration than the context's."""

    status = 9


class ClosedError(InnerQError, ValueError):
    """The object was closed."""


BY_STATUS = {cls.status: cls for cls in (InvalidArgumentError, InnerQIOError, FormatError, UnsupportedError,
                                          InnerQMemoryError, ContextFullError, BackendError,
                                          StateMismatchError)}


def from_status(status: int, message: str) -> InnerQError:
    cls = BY_STATUS.get(int(status), InnerQError)
    return cls(message)
