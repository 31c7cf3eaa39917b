"""Traces: the per-step records of a generation (`StepInfo`, collected by dgemma/sampling/canvas.py:CanvasState with
`trace=True`), stacked into arrays and saved as FILE.npz and FILE.json (`dgemma generate --trace FILE`), where
`check_trace_path` allows, and read back and checked (`load_trace`, `TraceError` for a file that is not one);
dgemma/eval/viz.py draws them (docs/sampling.md, "Traces").
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dgemma.io import dirkind, fsio
from dgemma.sampling.canvas import StepInfo
from dgemma.sampling.generation_config import GenerationConfig, GenerationError

TRACE_FORMAT = "dgemma-trace-1"  # in every trace summary; bump when the arrays change meaning


@dataclass
class Trace:
    """Per-step records of a generation, without full-vocabulary tensors. `save(path)` writes path.npz (arrays
    stacked over all steps) and path.json (a summary)."""

    steps: list[StepInfo]
    summary: dict[str, Any]

    @classmethod
    def of(cls, steps: list[StepInfo], config: GenerationConfig, *, seed: int | None, batch_size: int,
           prompt_length: int, canvas_length: int, steps_per_canvas: list[list[int]], stop_reasons: list[list[str]],
           tokens_per_forward: list[float]) -> Trace:
        """The trace of a generation: its steps and the summary `generate` writes beside them."""
        return cls(steps, {
            "format": TRACE_FORMAT, "batch_size": batch_size, "prompt_length": prompt_length,
            "canvas_length": canvas_length, "num_canvases": len(steps_per_canvas),
            "steps_per_canvas": steps_per_canvas, "stop_reasons": stop_reasons,
            "tokens_per_forward": tokens_per_forward, "generation_config": config.summary() | {"seed": seed},
            "arrays": "per step: canvas, step, temperature, seconds (S,); input_canvas, argmax, accepted, entropy "
                      "(S, B, L); mean_entropy, done, active, level (S, B); with a constraint, grammar (S, B, L): "
                      "0 free, 1 pinned (the only token the grammar allows), 2 closed (the budget's closer chose it)",
        })

    def arrays(self) -> dict[str, np.ndarray]:
        s = self.steps
        stack = lambda name, dtype: np.stack([getattr(x, name).cpu().numpy().astype(dtype) for x in s])
        return {
            "canvas": np.array([x.canvas for x in s], dtype=np.int32),
            "step": np.array([x.step for x in s], dtype=np.int32),
            "temperature": np.array([x.temperature for x in s], dtype=np.float32),
            "seconds": np.array([x.seconds for x in s], dtype=np.float64),
            "input_canvas": stack("input_canvas", np.int32),
            "argmax": stack("argmax", np.int32),
            "accepted": stack("accepted", np.bool_),
            "entropy": stack("entropy", np.float16),
            "mean_entropy": stack("mean_entropy", np.float32),
            "done": stack("done", np.bool_),
            "active": stack("active", np.bool_),
            "level": stack("level", np.float32),
        } | ({"grammar": np.stack([x.grammar.cpu().numpy().astype(np.int8) for x in s])}
             if s and all(x.grammar is not None for x in s) else {})

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Write path.npz, then path.json, each atomically, where `check_trace_path` allows."""
        npz, js = check_trace_path(path)
        arrays = self.arrays()
        fsio.atomic_write(npz, lambda _tmp, f: np.savez_compressed(f, **arrays),
                          needed=sum(a.nbytes for a in arrays.values()))
        fsio.write_text(js, json.dumps(self.summary, indent=2) + "\n")
        return npz, js


def check_trace_path(path: str | Path) -> tuple[Path, Path]:
    """(path.npz, path.json), where a trace may be written: in an existing directory (none is created) that is not
    a checkpoint's, a run's, a data or an adapter directory (dgemma/io/dirkind.py), over nothing or over an earlier
    trace only. GenerationError otherwise, naming the path; `dgemma generate --trace` checks before generating."""
    path = Path(path)
    npz, js = path.with_suffix(".npz"), path.with_suffix(".json")
    if not npz.parent.is_dir():
        raise GenerationError(f"--trace {path}: its directory {npz.parent} does not exist; create it first (a trace "
                              "is written into an existing directory)")
    try:
        dirkind.require(npz.parent, {dirkind.EMPTY, dirkind.OTHER}, "--trace",
                        expected="in a directory of your own, not a checkpoint, run, data or adapter directory")
    except dirkind.DirectoryKindError as e:
        raise GenerationError(f"--trace {path}: {e}") from None
    existing = [f for f in (npz, js) if os.path.lexists(f)]
    if existing and not _is_trace(js):
        raise GenerationError(f"--trace {path}: {existing[0]} exists and is not a {TRACE_FORMAT} trace; choose "
                              "another path (only an earlier trace is replaced)")
    return npz, js


def _is_trace(js: Path) -> bool:
    """Whether `js` is a trace summary (a regular JSON file with "format": TRACE_FORMAT)."""
    try:
        summary = json.loads(fsio.read_text(js))
    except (OSError, ValueError):  # missing, unreadable, a FIFO, not JSON
        return False
    return isinstance(summary, dict) and summary.get("format") == TRACE_FORMAT


class TraceError(ValueError):
    """A file that is not a readable trace of this version; the message names it and what is wrong."""


REQUIRED_ARRAYS = {"canvas": 1, "step": 1, "temperature": 1, "input_canvas": 3, "argmax": 3, "accepted": 3,
                   "entropy": 3, "mean_entropy": 2, "active": 2}  # name -> ndim


@dataclass
class TraceData:
    """A trace read back: arrays (S steps, B rows, L positions) and the JSON summary."""

    path: Path
    arrays: dict[str, np.ndarray]
    summary: dict[str, Any]

    @property
    def canvas_length(self) -> int:
        return int(self.arrays["argmax"].shape[2])

    @property
    def batch_size(self) -> int:
        return int(self.arrays["argmax"].shape[1])

    def canvases(self) -> list[int]:
        return sorted(set(self.arrays["canvas"].tolist()))

    def steps(self, canvas: int, row: int) -> np.ndarray:
        """Indices of the steps row `row` spent on `canvas` (not the ones it rode along after stopping)."""
        a = self.arrays
        return np.flatnonzero((a["canvas"] == canvas) & a["active"][:, row])


def load_trace(path: str | Path) -> TraceData:
    """Read and validate PATH.json + PATH.npz (PATH may name either file, or their common stem)."""
    path = Path(path)
    stem = path.with_suffix("") if path.suffix in (".json", ".npz") else path
    js, npz = stem.with_suffix(".json"), stem.with_suffix(".npz")
    for f in (js, npz):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing (a trace is FILE.json + FILE.npz, from dgemma generate --trace)")
    try:
        summary = json.loads(js.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{js}: not a dgemma trace (not valid JSON: {e})") from None
    if not isinstance(summary, dict) or "format" not in summary:
        raise TraceError(f"{js}: not a dgemma trace (missing format field)")
    if summary["format"] != TRACE_FORMAT:
        raise TraceError(f"{js}: trace format {summary['format']!r} is from another version of dgemma; this one reads "
                        f"{TRACE_FORMAT!r} (regenerate the trace with this version)")
    try:
        with np.load(npz, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:  # truncated, CRC, not npz
        raise TraceError(f"{npz}: not a readable trace archive ({type(e).__name__}: {e})") from None
    missing = [k for k in REQUIRED_ARRAYS if k not in arrays]
    if missing:
        raise TraceError(f"{npz}: not a {TRACE_FORMAT} trace (missing arrays {', '.join(missing)})")
    S = len(arrays["canvas"])
    S_B_L = arrays["argmax"].shape
    for name, ndim in REQUIRED_ARRAYS.items():
        a = arrays[name]
        if a.ndim != ndim or a.shape != S_B_L[:ndim] or (ndim == 1 and len(a) != S):
            raise TraceError(f"{npz}: array {name!r} has shape {a.shape}, inconsistent with argmax {S_B_L}")
    if "grammar" in arrays and arrays["grammar"].shape != S_B_L:  # a constrained generation's (optional)
        raise TraceError(f"{npz}: array 'grammar' has shape {arrays['grammar'].shape}, inconsistent with argmax "
                         f"{S_B_L}")
    if S == 0:
        raise TraceError(f"{npz}: the trace has no steps")
    for name in ("input_canvas", "argmax"):
        a = arrays[name]
        if not np.issubdtype(a.dtype, np.integer):
            raise TraceError(f"{npz}: array {name!r} holds {a.dtype}, not token ids")
        if a.size and int(a.min()) < 0:
            raise TraceError(f"{npz}: array {name!r} holds negative token ids (min {int(a.min())}); the trace is "
                            "corrupt")
    if "canvas_length" in summary and summary["canvas_length"] != S_B_L[2]:
        raise TraceError(f"{js}: canvas_length {summary['canvas_length']} but the arrays hold {S_B_L[2]} positions")
    return TraceData(stem, arrays, summary)
