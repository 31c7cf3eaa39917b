"""Progress a person can trust: the ETA comes from the measured rate and does not jump (a fake clock drives it), the
training status line names its phase, and the demo's status line says when a run evaluates or saves."""

from __future__ import annotations

import io
import itertools
import json
import types

from dgemma.eval.demo_training import TrainingJob, _read, _Watched
from dgemma.io.console import Eta
from dgemma.train.config import train_preset
from dgemma.train.loop import train
from dgemma.train.run_dir import METRICS


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_eta_never_jumps_on_a_steady_machine():
    """A first step of 40 s (loading, warm-up), then 1 s steps, with a 90 s evaluation every 10 steps: the ETA is
    "measuring" until a step after the first is timed, then never grows by more than 2x (here: never grows)."""
    clock = Clock()
    eta = Eta(100, clock)
    shown = []
    clock.now += 40.0
    eta.update(1)
    assert eta.seconds() is None and eta.text() == "ETA measuring"
    for step in range(2, 101):
        clock.now += 1.0
        eta.update(step)
        shown.append(eta.seconds())
        if step % 10 == 0:
            eta.pause()
            clock.now += 90.0  # the evaluation
    assert shown[0] == 98.0 and shown[-1] == 0.0
    assert all(later <= earlier for earlier, later in itertools.pairwise(shown)), shown


def test_training_status_names_its_phases(tiny_data, tmp_path):
    cfg = train_preset("tiny").replace(batch_size=2, max_steps=3, warmup_steps=1, eval_every=2, eval_batches=1,
                                       save_every=100, log_every=1)
    out = io.StringIO()
    train(cfg, tiny_data, tmp_path / "run", stream=out)
    lines = out.getvalue().splitlines()
    evaluating = [i for i, line in enumerate(lines) if line.startswith("evaluating | held-out loss at step ")]
    training = [i for i, line in enumerate(lines) if line.startswith("training | step ")]
    assert len(evaluating) == 3 and len(training) == 3, lines  # at steps 0, 2 and 3 (the end)
    assert "ETA measuring" in lines[training[0]] and "ETA 0m00s" in lines[training[-1]], lines
    assert evaluating[0] < training[0] and lines[evaluating[1]].endswith("at step 2 (1 batches)"), lines


def test_demo_status_says_when_a_run_evaluates_and_saves(tmp_path):
    """The demo's status line is read from what the child records (its metrics.jsonl) and the schedule `train`
    follows: an evaluation or the final save shows as such, not as a frozen step with an ETA."""
    cfg = train_preset("tiny").replace(max_steps=20, eval_every=10)
    run = tmp_path / "run"
    run.mkdir()
    alive = types.SimpleNamespace(is_alive=lambda: True)  # the child process, running
    w = _Watched(TrainingJob("AR", cfg, run, tmp_path / "log"), alive, None)
    said: list[str] = []

    def record(**rec) -> str:
        with (run / METRICS).open("a") as f:
            f.write(json.dumps(rec) + "\n")
        _read(w, said.append)
        return w.phase()

    assert w.phase() == "evaluating held-out, then training"
    assert record(step=0, val_loss=6.0) == "evaluating held-out, then training"  # step 0's: before this invocation
    assert record(step=1, loss=5.0, tokens=10) == "training, ETA measuring"
    assert record(step=2, loss=5.0, tokens=20).startswith("training, ETA ")
    assert record(step=10, loss=4.0, tokens=100) == "evaluating held-out"
    assert record(step=10, val_loss=4.1).startswith("training, ETA ")
    assert record(step=20, loss=3.0, tokens=200) == "evaluating held-out"
    assert record(step=20, val_loss=3.1) == "saving"
    assert said == ["   AR step 10: held-out CE 4.100 nats/token", "   AR step 20: held-out CE 3.100 nats/token"]


def test_generate_shows_canvases_done_on_a_terminal_when_the_text_is_not_live(tmp_path):
    """`dgemma generate --json` (or with stdout redirected) and stderr a terminal: a progress bar of the canvases; with
    stderr not a terminal, only the final line."""
    import os
    import pty
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "dgemma", "generate", "--preset", "tiny", "--random-init", "--prompt-ids", "2,45",
            "--max-new-tokens", "48", "--max-denoising-steps", "2", "--seed", "0", "--json", "--threads", "1"]
    env = os.environ | {"PYTHONPATH": str(root)}
    leader, follower = pty.openpty()
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=follower, timeout=300)
    os.close(follower)
    err = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end is closed and drained
            break
        if not chunk:
            break
        err += chunk
    os.close(leader)
    assert done.returncode == 0, err
    assert b"generating [" in err and b"canvases" in err, err
    plain = subprocess.run(argv, env=env, capture_output=True, timeout=300)
    assert plain.returncode == 0 and b"generating" not in plain.stderr, plain.stderr
    assert b"tokens generated for 1 prompt(s)" in plain.stderr
