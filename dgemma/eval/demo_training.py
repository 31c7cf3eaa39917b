"""`dgemma demo`'s training step: runs trained at the same time (the demo trains one at a time), each in its own spawned
process on its share of the cores, watched from here with one status line for all of them (steps done of the budget,
ETA each).

Each child trains with `dgemma.train.loop.train` (resume=True: a rerun continues it), its console in a log file; the
parent reads the runs' metrics.jsonl as they grow, so what it shows is what the runs recorded. Each child is a
process group of its own, so a Ctrl-C at the terminal reaches the parent alone, which passes it on once to every
child: each finishes its step, saves and stops (a second Ctrl-C stops them at once). A child that fails sends its
exception back; the others are then stopped the same way and the error is raised here (a ValueError such as a busy
run directory stays one line at the CLI).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from dgemma.eval.curves import bound_of
from dgemma.io.console import Console, Eta, duration
from dgemma.train.config import TrainConfig
from dgemma.train.loop import train
from dgemma.train.run_dir import METRICS

INTERRUPTED = "interrupted"  # what a child sends when a Ctrl-C stopped it at once (no checkpoint of that step)
POLL_S = 0.25  # how often the runs' metrics are read
LOG_EVERY_S = 10.0  # off a terminal, one status line this often


@dataclass
class TrainingJob:
    """One run to train: its label on the status line, its config (max_steps: where it stops) and directory, the
    log file its console goes to, and the step it starts from (its earlier records are not this invocation's)."""

    label: str
    cfg: TrainConfig
    run: Path
    log: Path
    start: int = 0


@dataclass
class _Watched:
    job: TrainingJob
    process: Any
    conn: Any
    offset: int = 0  # bytes of metrics.jsonl read so far
    step: int = 0  # the last step recorded (job.start until this invocation records one)
    eta: Eta | None = None  # the run's ETA from the step rate measured in this invocation (Eta(job.cfg.max_steps))
    evaluated: int | None = None  # the step of the last held-out evaluation read
    stopping: bool = False  # a Ctrl-C was passed on: the next step is its last, evaluated and saved

    def evaluates_at(self, step: int) -> bool:
        """Whether `train` evaluates after `step`: at its eval_every, the end of its schedule, or a stop."""
        return step % self.job.cfg.eval_every == 0 or step >= self.job.cfg.max_steps or self.stopping

    def phase(self) -> str:
        """What the child is doing, from what it recorded and the schedule it follows (dgemma.train.loop.train)."""
        if self.outcome or not self.process.is_alive():
            return "done"
        if self.step == self.job.start:  # no step of this invocation yet: loading, and at step 0 an evaluation
            return "evaluating held-out, then training" if self.job.start == 0 and self.evaluated is None \
                else "loading"
        if self.stopping and self.evaluated != self.step:
            return "stopping: the step, a held-out evaluation, a checkpoint"
        if self.evaluates_at(self.step) and self.evaluated != self.step:
            return "evaluating held-out"
        if self.step >= self.job.cfg.max_steps or self.stopping:
            return "saving"
        return f"training, {self.eta.text()}" if self.eta is not None else "training"
    outcome: list[Any] = field(default_factory=list)  # what the child sent: None (done) or its exception


def _child(cfg_json: dict[str, Any], data: str, run: str, threads: int, log: str, conn: Any) -> None:
    """A spawned child: its own process group (Ctrl-C reaches the parent, which passes it on), `threads` torch
    threads, `train` with its console in `log`; sends None when done, INTERRUPTED when a Ctrl-C stopped it at once,
    else the exception (as text when it does not pickle)."""
    if hasattr(os, "setpgrp"):  # POSIX; elsewhere a Ctrl-C reaches every process, and the first one stops them
        os.setpgrp()
    torch.set_num_threads(threads)
    try:
        with open(log, "a", encoding="utf-8") as stream:
            try:
                train(TrainConfig.from_json(cfg_json), data, run, resume=True, stream=stream)
            except Exception:
                traceback.print_exc(file=stream)
                raise
    except KeyboardInterrupt:  # before train took over Ctrl-C, or a second one: stopped at once, not a failure
        conn.send(INTERRUPTED)
        sys.exit(1)
    except Exception as e:
        try:
            conn.send(e)
        except Exception:  # an exception that does not pickle: its text
            conn.send(RuntimeError(f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(None)


def _read(w: _Watched, say: Any) -> None:
    """The records `w`'s run appended since the last read: the step reached, and each held-out evaluation, said."""
    path = w.job.run / METRICS
    if not path.is_file():
        return
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size < w.offset:  # cut back to its checkpoint when the run resumed
            w.offset = 0
        f.seek(w.offset)
        chunk = f.read()
    complete = chunk[:chunk.rfind(b"\n") + 1]  # a line being written is read next time
    w.offset += len(complete)
    for line in complete.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or rec["step"] <= w.job.start:
            continue
        if "loss" in rec and "tokens" in rec:
            w.step = rec["step"]
            w.eta = w.eta or Eta(w.job.cfg.max_steps)
            w.eta.update(w.step)
            if w.evaluates_at(w.step):  # an evaluation follows: its time stays out of the ETA's rate
                w.eta.pause()
        elif "val_loss" in rec:
            w.evaluated = rec["step"]
            key, name = bound_of(rec) or ("val_loss", "CE")
            say(f"   {w.job.label} step {rec['step']}: held-out {name} {rec[key]:.3f} nats/token")


def _status(watched: list[_Watched]) -> str:
    parts = [f"{w.job.label} step {w.step}/{w.job.cfg.max_steps} ({w.phase()})" for w in watched]
    etas = [w.eta.seconds() if w.eta else None for w in watched if w.process.is_alive() and not w.outcome]
    known = [e for e in etas if e is not None]
    return " | ".join(parts) + (f" | all done in ~{duration(max(known))}"
                                if len(watched) > 1 and known and len(known) == len(etas) else "")


def _interrupt(watched: list[_Watched]) -> None:
    """Pass a Ctrl-C on to every child still running (each finishes its step and saves; a second stops it)."""
    for w in watched:
        w.stopping = True
        if w.process.is_alive() and w.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it ended in between
                os.kill(w.process.pid, signal.SIGINT)


def train_side_by_side(jobs: list[TrainingJob], data: Path, *, threads: int, stream: TextIO) -> bool:
    """Train every job at the same time, each in a spawned child on `threads` torch threads, with one status line
    on `stream`; returns whether a Ctrl-C stopped them early. Raises the first child's error (after stopping the
    others), or RuntimeError for a child that died without one."""
    console = Console(stream, max(1, round(LOG_EVERY_S / POLL_S)))
    say = console.print
    ctx = multiprocessing.get_context("spawn")
    watched = []
    for job in jobs:
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child, args=(job.cfg.to_json(), str(data), str(job.run), threads, str(job.log),
                                                   send), daemon=True)
        process.start()
        send.close()
        watched.append(_Watched(job, process, receive, step=job.start))
    interrupted, tick = 0, 0
    # A Ctrl-C is counted by a handler, never raised: raised, it could land between two statements of the loop and
    # leave it without passing the interrupt on, and the children would train their whole budget.
    signals: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda *_: signals.append(1)) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        while any(w.process.is_alive() for w in watched):
            time.sleep(POLL_S)
            while interrupted < len(signals):
                interrupted += 1
                if interrupted == 1:
                    say("interrupt: every run finishes its step, evaluates held-out and saves before exit (Ctrl-C "
                        "again to stop at once, without them)")
                _interrupt(watched)
            for w in watched:
                _read(w, say)
                if not w.outcome and w.conn.poll():
                    w.outcome.append(w.conn.recv())
                    if isinstance(w.outcome[0], BaseException):  # a failure stops the others, which save
                        _interrupt(watched)
            tick += 1
            console.status(tick, _status(watched))
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        for w in watched:
            w.process.join()
    for w in watched:
        _read(w, say)
        if not w.outcome and w.conn.poll():
            w.outcome.append(w.conn.recv())
    say(_status(watched))
    for w in watched:
        if w.outcome and isinstance(w.outcome[0], BaseException):
            raise w.outcome[0]
    for w in watched:
        if not w.outcome:
            raise RuntimeError(f"the {w.job.label} training stopped without finishing (exit {w.process.exitcode}); "
                               f"see {w.job.log}")
    return interrupted > 0 or any(w.outcome == [INTERRUPTED] for w in watched)


__all__ = ["TrainingJob", "train_side_by_side"]
