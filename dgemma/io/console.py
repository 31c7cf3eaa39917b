"""What dgemma prints while it works, in one style for data, train, eval and bench: a one-line progress bar
(`Progress`), a live training status line (`Console`), info / warning messages (`Log`), and the text of a generation
as its canvases commit, with the canvas being refined drawn live below it (`Streamer`). Everything goes to stderr
unless a stream is given; on a terminal lines redraw in place, elsewhere they print once, so logs stay short."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO


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

    def phase(self, text: str) -> None:
        """A phase that starts now and holds the line a while (an evaluation): the status line on a terminal, drawn at
        once; one line elsewhere."""
        if self.tty:
            self.drawn = time.monotonic()
            self.out.write("\r\x1b[K" + text)
            self.out.flush()
        else:
            self.print(text)


class Eta:
    """The time left in a phase of `total` units (training steps), from the rate measured in it: the seconds spent in
    units over the units done, where the first unit seen starts the clock (its time holds one-time costs: loading,
    warm-up, compilation) and the time between `pause()` and the next `update` (an evaluation, a checkpoint: not
    units) is left out. On a steady machine it only falls; `clock` is time.monotonic (a test passes its own)."""

    def __init__(self, total: int, clock: Any = time.monotonic):
        self.total, self.clock = total, clock
        self.done: int | None = None  # units done at the last update (None: the clock has not started)
        self.counted, self.spent, self.last, self.paused = 0, 0.0, 0.0, False

    def update(self, done: int) -> None:
        """`done` units are done now."""
        now = self.clock()
        if self.done is not None and not self.paused:
            self.counted += done - self.done
            self.spent += now - self.last
        self.done, self.last, self.paused = done, now, False

    def pause(self) -> None:
        """What runs until the next `update` is not a unit: that interval (and the units it ends) is left out of the
        rate."""
        self.paused = True

    def seconds(self) -> float | None:
        """The time left, or None until a unit after the first has been timed."""
        if self.done is None or self.counted <= 0:
            return None
        return self.spent / self.counted * max(self.total - self.done, 0)

    def text(self) -> str:
        left = self.seconds()
        return "ETA measuring" if left is None else f"ETA {duration(left)}"


def duration(seconds: float) -> str:
    """12m05s, or 3h06m from an hour on."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


__all__ = ["Console", "Eta", "Log", "Progress", "duration", "si"]


LIVE_INTERVAL_S = 0.1  # redraw the refining canvas at most 10 times a second: terminals are slow, steps are not


class Streamer:
    """on_canvas: prints each committed canvas's new text (one row: as a running stream; a batch: one line per row
    and canvas). on_step, when `stream` is a terminal: redraws the canvas being refined below the text, with ANSI
    escapes, and erases it before the next committed text."""

    def __init__(self, tok: Any, eos: tuple[int, ...], pad: int | None, batch_size: int, *,
                 quiet: bool = False, stream: Any = None, live: bool | None = None):
        self.tok, self.eos, self.pad, self.quiet = tok, set(eos), pad, quiet
        self.out = stream or sys.stdout
        self.live = (not quiet and self.out.isatty()) if live is None else live
        self.ids: list[list[int]] = [[] for _ in range(batch_size)]
        self.shown, self.done = [""] * batch_size, [False] * batch_size
        self.last_canvas: list[list[int]] = [[] for _ in range(batch_size)]  # cut before EOS; chat re-feeds it
        self.col, self.drawn, self.last_draw = 0, 0, 0.0

    def text(self, ids: list[int]) -> str:
        if self.tok is None:
            return "".join(f" {i}" for i in ids)
        # Control bytes (an untrained model emits any) would act on the terminal; show them as U+FFFD.
        return self.tok.decode(ids, skip_special_tokens=True).translate(_CONTROL)

    def on_canvas(self, index: int, tokens: Any) -> None:
        self._erase()
        for r, row in enumerate(tokens.tolist()):
            if self.done[r]:
                continue
            cut = next((j for j, t in enumerate(row) if t in self.eos), None)
            self.done[r] = cut is not None
            self.last_canvas[r] = row[:cut]
            kept = [t for t in row[:None if cut is None else cut + 1] if t != self.pad]
            self.ids[r] += kept
            full = self.text(self.ids[r])
            new, self.shown[r] = full[len(self.shown[r]):], full
            if self.quiet:
                continue
            if len(self.ids) == 1:
                self.out.write(new)
                self.col = (len(full) - full.rfind("\n") - 1) % shutil.get_terminal_size().columns
            else:
                self.out.write(f"[{r}] canvas {index}: {_oneline(self.text(kept))}\n")
        self.out.flush()

    def on_step(self, info: Any) -> None:
        now = time.monotonic()
        if not self.live or now - self.last_draw < LIVE_INTERVAL_S:
            return
        self.last_draw = now
        width = shutil.get_terminal_size().columns - 1
        lines = []
        for r in [r for r in range(len(self.ids)) if not self.done[r]][:4]:
            acc = int(info.accepted[r].sum())
            head = (f"{'' if len(self.ids) == 1 else f'[{r}] '}canvas {info.canvas} step {info.step}/{info.num_steps} "
                    f"H={float(info.mean_entropy[r]):.3f} acc {acc}/{info.accepted.shape[-1]} | ")
            lines.append((head + _oneline(self.text(info.argmax[r].tolist())))[:width])
        self._erase()
        if not lines:
            return
        # Below the committed text, then back up to where it ends: relative moves survive the terminal scrolling.
        self.out.write("".join("\n\x1b[2m" + s + "\x1b[0m" for s in lines) + f"\x1b[{len(lines)}A\x1b[{self.col + 1}G")
        self.out.flush()
        self.drawn = len(lines)

    def _erase(self) -> None:
        if self.drawn:
            self.out.write("\x1b[J")  # clear from the cursor (end of committed text) to the end of the screen
            self.drawn = 0

    def close(self) -> None:
        self._erase()
        if len(self.ids) == 1 and not self.quiet and self.shown[0]:
            self.out.write("\n")
        self.out.flush()


_CONTROL = {c: "\ufffd" for c in (*range(9), *range(11, 32), 127)}  # all but tab and newline


def _oneline(s: str) -> str:
    return s.translate({c: "⏎" if c == 10 else " " for c in range(32)})
