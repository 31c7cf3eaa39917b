"""What the measurement scripts of runs/ share, imported as a module beside them (`from harness import ...`: a script
run as `python runs/X.py` has runs/ on its path): training a variant with the real CLI once, scores cached under the
settings that made them, the paired difference of two per-window scores, the choice of variants by `--only`, and
`dgemma serve` in a subprocess.

It lives here, not in the package, because it is harness, not functionality: how these scripts resume, cache and
start processes. What a script measures with (the held-out bounds, the samplers, the toy corpus of the smoke modes:
dgemma/data/tokenizer.py:write_toy_corpus) stays in dgemma, where the tests reach it too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from dgemma.io.fsio import write_text

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # a training run per core: runs go side by side


# --- training and scoring variants -------------------------------------------------------------------------------

def train_once(out: Path, name: str, steps: int, argv: Sequence[str]) -> str:
    """`dgemma train ARGV --max-steps STEPS --out OUT/NAME --resume` on one thread, its output in OUT/NAME.log, unless
    the run's last logged step is already STEPS (a finished variant is not retrained; an unfinished one resumes)."""
    run = out / name
    if (run / "checkpoints" / "latest").exists():
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]).get("step")
        if last == steps:
            return f"{name}: already trained"
    cmd = [sys.executable, "-m", "dgemma", "train", *argv, "--max-steps", str(steps), "--out", str(run), "--resume"]
    started = time.time()
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, env={**os.environ, **ONE_THREAD}, stdout=log, stderr=subprocess.STDOUT)
    return f"{name}: trained in {time.time() - started:.0f} s"


def saved_score(path: Path, settings: dict) -> dict | None:
    """The result saved at `path` when it was made with these settings, else None."""
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings:
            return saved["result"]
    return None


def score_once(path: Path, settings: dict, score: Callable[[], dict]) -> dict:
    """The result saved at `path` for these settings, or `score()`'s, saved there with them first."""
    result = saved_score(path, settings)
    if result is None:
        result = score()
        write_text(path, json.dumps({"settings": settings, "result": result}))
    return result


def paired_difference(a: Sequence[float], b: Sequence[float], estimator_a: str, estimator_b: str) -> str:
    """The mean of a - b over the same held-out windows, with its standard error (the windows' own difficulty
    cancels; each side's Monte Carlo draws are its own, so their noise is in the SE). Only like estimators pair: a
    continuous-time bound minus a T = 16 bound mixes the bounds' gap with the models' difference, so it is refused
    ("–")."""
    if estimator_a != estimator_b:
        return f"– ({estimator_a} vs {estimator_b}: unlike bounds do not pair)"
    d = np.asarray(a) - np.asarray(b)
    return f"{d.mean():+.3f} ± {d.std(ddof=1) / math.sqrt(len(d)):.3f}" if len(d) > 1 else f"{d.mean():+.3f}"


def chosen(parser: argparse.ArgumentParser, only: str | None, names: Sequence[str]) -> set[str]:
    """The variants `--only` names (comma-separated; None: all), refused through `parser` if one is unknown."""
    if only is None:
        return set(names)
    keep = set(only.split(","))
    unknown = sorted(keep - set(names))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such variant; choose from {', '.join(names)}")
    return keep


# --- the server ------------------------------------------------------------------------------------------------------

class Server:
    """`python -m dgemma serve --port 0` on localhost in a subprocess, serving `model` (a run or checkpoint) or the
    preset with random weights; its URL is read from what it prints. `threads`: its OMP_NUM_THREADS."""

    def __init__(self, *, model: str | None = None, preset: str = "tiny", max_batch: int = 32, impl: str | None = None,
                 threads: int | None = None, tokenizer: str | None = None, max_context: int | None = None) -> None:
        cmd = [sys.executable, "-m", "dgemma", "serve", "--host", "127.0.0.1", "--port", "0", "--max-batch",
               str(max_batch)]
        cmd += ["--model", model] if model else ["--preset", preset, "--random-init"]
        if tokenizer:  # its directory's chat template too
            cmd += ["--tokenizer", tokenizer]
        if impl:
            cmd += ["--impl", impl]
        if max_context:
            cmd += ["--max-context", str(max_context)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.command = cmd
        self.lines: deque[str] = deque(maxlen=200)
        self.url: str | None = None
        self._found = threading.Event()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=os.getcwd())
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            m = re.search(r"https?://(?:127\.0\.0\.1|localhost):(\d+)", line)
            if m and self.url is None:
                self.url = f"http://127.0.0.1:{m.group(1)}"
                self._found.set()
        self._found.set()

    def wait_ready(self, timeout: float = 120) -> str:
        """The server's URL once its /health answers 200; RuntimeError with its output if it does not come up."""
        import httpx

        deadline = time.monotonic() + timeout
        self._found.wait(timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not come up ({' '.join(self.command)}):\n" + "\n".join(self.lines))

    def stop(self) -> None:
        """Ctrl-C, as a user stops it; killed if it has not exited 15 s later."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
