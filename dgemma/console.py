"""What dgemma prints while it works, in one style for data, train, eval and bench: a one-line progress bar
(`Progress`), a live training status line (`Console`), and info / warning messages (`Log`). Everything goes to
stderr unless a stream is given; on a terminal lines redraw in place, elsewhere they print once, so logs stay short."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


def si(n: float) -> str:
    """1234567 -> 1.2M: counts in progress lines."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


class Progress:
    """A one-line progress bar on stderr. On a terminal it redraws in place (at most 10 times a second); elsewhere
    it prints one line when done, so logs stay short. `enabled=False` prints nothing."""

    def __init__(self, desc: str, total: int, unit: str = "", enabled: bool = True):
        self.desc, self.total, self.unit, self.done = desc, max(int(total), 0), unit, 0
        self.enabled, self.is_tty = enabled, sys.stderr.isatty()
        self.start = self.last_draw = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and self.is_tty and now - self.last_draw >= 0.1:
            self.last_draw = now
            self._draw(end="\r")

    def close(self) -> None:
        if self.enabled:
            self._draw(end="\n")

    def _draw(self, end: str) -> None:
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(24 * frac)
        elapsed = time.perf_counter() - self.start
        print(f"{self.desc} [{bar:<24}] {100 * frac:3.0f}% {si(self.done)}/{si(self.total)} {self.unit} "
              f"{elapsed:.1f}s\033[K" if self.is_tty else
              f"{self.desc}: {si(self.done)} {self.unit} in {elapsed:.1f}s", end=end, file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Log:
    """Info lines (silenced by `quiet`) and warnings (always printed, and kept for the caller's result)."""

    quiet: bool = False
    warnings: list[str] = field(default_factory=list)

    def info(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)
        print(f"warning: {msg}", file=sys.stderr, flush=True)


class Console:
    """A live status line: redrawn in place on a terminal, printed every `log_every` steps otherwise."""

    def __init__(self, stream: TextIO, log_every: int):
        self.out, self.every, self.drawn = stream, log_every, 0.0
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def status(self, step: int, text: str) -> None:
        if self.tty:
            if time.monotonic() - self.drawn < 0.1:  # terminals are slower than tiny steps
                return
            self.drawn = time.monotonic()
            self.out.write("\r\x1b[K" + text)
        elif step % self.every == 0:
            self.out.write(text + "\n")
        self.out.flush()

    def print(self, text: str) -> None:
        self.out.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.out.flush()


__all__ = ["Console", "Log", "Progress", "si"]
