"""Plain-text progress bars on stderr (no dependency).

On a terminal the bar is redrawn in place; elsewhere (a log, a pipe) only the finished bar
is written, so logs get one line per task instead of a hundred.
"""
from __future__ import annotations

import sys
import time


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class ProgressBar:
    """`label [#########.........]  45%  12.0/27.0 MB`; update() with a fraction or a byte count."""

    def __init__(self, label: str, total_bytes: int | None = None, stream=None, width: int = 30):
        self.label = label
        self.total = total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._shown = -1
        self._last = 0.0
        self._text = ""
        self.closed = False

    def _render(self, fraction: float, done: int | None) -> str:
        fraction = min(max(fraction, 0.0), 1.0)
        fill = int(round(fraction * self.width))
        text = f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {fraction * 100:3.0f}%"
        if done is not None and self.total:
            text += f"  {_human_bytes(done)}/{_human_bytes(self.total)}"
        return text

    def update(self, fraction: float | None = None, done: int | None = None) -> None:
        if self.closed:
            return
        if fraction is None:
            fraction = done / self.total if self.total else 0.0
        self._text = self._render(fraction, done)
        percent = int(fraction * 100)
        now = time.monotonic()
        if self.live and percent != self._shown and (now - self._last > 0.05 or percent >= 100):
            self.stream.write("\r" + self._text)
            self.stream.flush()
            self._shown, self._last = percent, now

    def close(self, ok: bool = True) -> None:
        """Ends the line: the full bar when ok, else the bar as far as it got."""
        if self.closed:
            return
        if ok:
            self.update(1.0, self.total)
        self.closed = True
        if self.live:
            self.stream.write("\r" + self._text + "\n")
        elif self._text:
            self.stream.write(self._text + "\n")
        self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(ok=exc_type is None)
