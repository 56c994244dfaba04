"""A progress bar on stderr for `make bench` and the load tool: no dependency, one line.

On a terminal the line is redrawn in place (`\\r`); otherwise (CI logs, a pipe) each step is
printed once on its own line, so a log shows what ran and how long it took.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24


class Progress:
    """`total` steps; `step(label)` starts the next one, `done()` ends the bar."""

    def __init__(self, total: int, title: str, stream: TextIO | None = None) -> None:
        self.total, self.title = max(1, total), title
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.count = 0
        self.t0 = self._last = time.monotonic()
        self.label = ""

    def step(self, label: str) -> None:
        """Mark the previous step done and show `label` as the one now running."""
        if self.label:
            self.count += 1
        self.label = label
        self._draw()

    def note(self, text: str) -> None:
        """Extra detail for the step now running (a sub-step, a live figure)."""
        self._draw(text)

    def done(self) -> None:
        self.count, self.label = self.total, "done"
        self._draw()
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()

    def _draw(self, detail: str = "") -> None:
        now = time.monotonic()
        if self.tty and detail and now - self._last < 0.2:
            return  # redraws of a live figure: a few per second are enough
        self._last = now
        filled = BAR_WIDTH * self.count // self.total
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        line = (
            f"{self.title} [{bar}] {self.count}/{self.total} {now - self.t0:5.0f} s  {self.label}"
            + (f": {detail}" if detail else "")
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + line[:200])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
