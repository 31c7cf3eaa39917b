"""A training run directory's state: who writes it (the lock), what it was started with (run.json), its checkpoints
(atomic publishing, the newest intact one) and its metrics log (repaired after a kill).

    RUN/.lock                  an fcntl.flock lock held by the one process writing the run, for as long as it trains;
                               the kernel releases it when that process dies, however it dies. The file holds the
                               holder's pid, host and start time, for the error a second writer gets
    RUN/run.json               the run's record, written when a writer starts: its TrainConfig and the fingerprint
                               of its data (shard checksums from the data's meta.json, the tokenizer's sha256);
                               for a run started from another run's checkpoint (init_from), what that one had done
                               (`inherited`: its step, tokens and CPU seconds), so that curves count them
    RUN/metrics.jsonl          one JSON object per line
    RUN/checkpoints/step-*/    published by renaming a complete temporary directory; `latest` is written last

Readers (`load_model`, `dgemma generate`, `dgemma eval`) never take the lock: a `step-*` directory is complete from
the moment it has its name, and a reader only looks at those.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from dgemma.io import dirkind, fsio
from dgemma.io.dirkind import RECORD
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.weights.checkpoint import (
    CHECKPOINTS,
    MODEL_FILES,
    SHARDED_STATE,
    STATE,
    NonFiniteError,
    list_checkpoints,
    nonfinite_tensor,
    resolve_model_dir,
    save_pretrained,
)

METRICS, LATEST = "metrics.jsonl", "latest"
T = TypeVar("T")


class RunStateError(ValueError):
    """A run directory whose state cannot be continued as asked (foreign content, another data directory, no intact
    checkpoint, a damaged metrics log); the message says what to do."""


# --- the run's record ----------------------------------------------------------------------------------------------

def read_record(run: Path) -> dict[str, Any] | None:
    path = Path(run) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunStateError(f"{path}: unreadable ({e}); it is replaced atomically, so something else wrote it") \
            from None
    if not isinstance(record, dict) or not isinstance(record.get("train_config"), dict):
        raise RunStateError(f"{path}: not a dgemma run record (no train_config object)")
    return record


def write_record(run: Path, record: dict[str, Any]) -> None:
    fsio.write_text(Path(run) / RECORD, json.dumps(record, indent=2) + "\n")


def inherited(init_from: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """What the checkpoint a run starts from had done, read from its trainer state: {"checkpoint", "step", "tokens",
    "cpu_s"}; None without init_from, or for a checkpoint that no training run wrote (a Hugging Face model)."""
    if init_from is None:
        return None
    ckpt = resolve_model_dir(init_from)
    try:
        if (ckpt / STATE).is_file():  # mmap: the optimizer's tensors are not read
            state = torch.load(ckpt / STATE, map_location="cpu", weights_only=True, mmap=True)
        elif (ckpt / SHARDED_STATE).is_file():
            state = json.loads((ckpt / SHARDED_STATE).read_text())
        else:
            return None
    except (OSError, RuntimeError, ValueError, json.JSONDecodeError):
        return None  # an unreadable state is named when that checkpoint is loaded, not here
    out = {"checkpoint": str(ckpt)}
    for key in ("step", "tokens", "cpu_s"):
        v = state.get(key) if isinstance(state, dict) else None
        out[key] = v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return out


def data_fingerprint(meta: dict[str, Any]) -> dict[str, Any]:
    """What makes two data directories the same data: the tokenizer's sha256 and every shard's name and sha256, from
    meta.json (`dgemma data prepare` checksums each shard as it writes it)."""
    return {"tokenizer_sha256": meta["tokenizer"]["sha256"],
            "shards": {s["file"]: s["sha256"] for split in meta["splits"].values() for s in split["shards"]}}


def describe_data_change(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """None when the fingerprints match, else what differs, in a few words."""
    parts = []
    if old.get("tokenizer_sha256") != new["tokenizer_sha256"]:
        parts.append("another tokenizer")
    a, b = old.get("shards", {}), new["shards"]
    changed = sorted(f for f in a.keys() & b.keys() if a[f] != b[f])
    gone, added = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    for what, files in (("changed", changed), ("missing", gone), ("new", added)):
        if files:
            parts.append(f"{len(files)} {what} shard(s), e.g. {files[0]}")
    return "; ".join(parts) or None


def is_fresh(run: Path) -> bool:
    """True when `run` does not exist or holds nothing but its lock file."""
    return dirkind.classify(run)[0] in (dirkind.MISSING, dirkind.EMPTY)


def check_writable(run: Path, resume: bool, fingerprint: dict[str, Any], allow_new_data: bool, data_dir: Path,
                   check_config: Callable[[dict[str, Any], Path], None]) -> dict[str, Any] | None:
    """Whether a writer may train in `run` (read-only): a new or empty directory; with `resume` (or for a run killed
    before its first checkpoint) a run whose recorded config passes `check_config(saved, source)` and whose data is
    the same (unless `allow_new_data`). Returns the run's record (None for a new run). Any other kind of directory
    (a data directory, a checkpoint, an adapter: dgemma/io/dirkind.py) is refused as such."""
    run = Path(run)
    dirkind.require(run, {dirkind.MISSING, dirkind.EMPTY, dirkind.RUN, dirkind.OTHER}, "--out")
    record = read_record(run)
    if is_fresh(run):
        return None
    if not resume and (record is None or list_checkpoints(run)):
        raise ValueError(f"{run} exists and is not an empty directory: pass --resume to continue it, or choose "
                         "another --out")
    if record is None:
        ckpts = list_checkpoints(run)
        if not ckpts:
            raise RunStateError(f"--resume: {run} has no checkpoint to resume from and is not a dgemma run (no "
                                f"{RECORD}); choose another --out")
        source = ckpts[-1] / "train_config.json"  # a run from before run.json: its newest checkpoint's config
        record = {"train_config": json.loads(source.read_text())}
    else:
        source = run / RECORD
    check_config(record["train_config"], source)
    change = "data" in record and describe_data_change(record["data"], fingerprint)
    if change and not allow_new_data:
        raise RunStateError(f"cannot resume {run} on {data_dir}: it was trained on other data ({change}); pass "
                            "--allow-new-data to continue on this data anyway (no longer a bit-exact resume)")
    return record


# --- checkpoints ---------------------------------------------------------------------------------------------------

def save_checkpoint(run: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_config: dict[str, Any],
                    keep_last: int, state: dict[str, Any], generation_config: GenerationConfig | None = None,
                    write_weights: Callable[[Path], None] | None = None) -> Path:
    """Write checkpoints/step-XXXXXXX atomically (`publish_checkpoint`). Refuses (NonFiniteError) weights or
    optimizer state with a non-finite value. `write_weights(dir)` writes the weights (default:
    `save_pretrained(model, dir, generation_config=generation_config)`; a LoRA run: its adapter)."""
    opt_state = optimizer.state_dict()
    bad = nonfinite_tensor(iter(model.state_dict().items())) or nonfinite_tensor(iter([("optimizer", opt_state)]))
    if bad:
        raise NonFiniteError(f"step {state['step']}: {bad} has non-finite values; no checkpoint written")
    final, tmp = checkpoint_paths(run, state["step"], str(os.getpid()))
    fresh_dir(tmp)
    state = {**state, "optimizer": opt_state, "rng_cpu": torch.get_rng_state(),
             "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}

    def fill() -> None:
        (write_weights or (lambda path: save_pretrained(model, path, generation_config=generation_config)))(tmp)
        with open(tmp / STATE, "xb") as f:  # a Python file, so that a failed write keeps its errno (ENOSPC)
            torch.save(state, f)

    publish_checkpoint(run, tmp, final, train_config, keep_last, fill,
                       needed=tensor_bytes(model.state_dict()) + tensor_bytes(state))
    return final


def checkpoint_paths(run: Path, step: int, tag: str) -> tuple[Path, Path]:
    """(checkpoints/step-XXXXXXX, the temporary directory it is written in: `.tmp-step-XXXXXXX-TAG`)."""
    root = Path(run) / CHECKPOINTS
    final = root / f"step-{step:07d}"
    return final, root / f".tmp-{final.name}-{tag}"


def fresh_dir(tmp: Path) -> None:
    """An empty `tmp` (what a killed save left there is removed first)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)


def publish_checkpoint(run: Path, tmp: Path, final: Path, train_config: dict[str, Any], keep_last: int,
                       fill: Callable[[], None], needed: int) -> None:
    """Complete the temporary checkpoint directory `tmp` and publish it as `final`: `fill()` writes the weights and
    the trainer state; the run's tokenizer and chat template files are copied in and train_config.json written;
    everything is fsynced and `tmp` renamed to `final` (complete from the moment it has its name), then `latest` is
    written and the run pruned to its last `keep_last` checkpoints. On any failure `tmp` is removed, so nothing
    half-written is left filling the disk, and a full disk is one NoSpaceError naming `final` and the `needed`
    bytes (resuming once there is space continues from the previous checkpoint, bit-exact)."""
    root = final.parent
    try:
        fill()
        for name in MODEL_FILES:
            if (run / name).is_file():
                fsio.copy_file(run / name, tmp / name)
        fsio.write_text(tmp / "train_config.json", json.dumps(train_config, indent=2) + "\n")
        for f in tmp.iterdir():
            fsio.fsync_file(f)
        if final.exists():  # only after resuming from an older checkpoint: same step, same content
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = fsio.no_space(e, final, needed)
        if full is not None:
            raise full from None
        raise
    fsio.fsync_dir(root)
    fsio.write_text(root / LATEST, final.name + "\n")
    for old in list_checkpoints(run)[:-keep_last]:
        shutil.rmtree(old)


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in `value` (nested in dicts, lists and tuples): what saving it takes on disk."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def newest_intact(run: Path, load: Callable[[Path], T], warn: Callable[[str], None]) -> tuple[Path, T] | None:
    """The newest checkpoint that `load` reads without an error, with what it returned; each newer one that fails
    (a truncated or corrupt trainer_state.pt or weights file) is named in a warning and left in place. None when
    the run has no checkpoint; RunStateError when it has some and none is intact."""
    ckpts, skipped = list_checkpoints(run), []
    for ckpt in reversed(ckpts):
        try:
            loaded = load(ckpt)
        except Exception as e:  # any failure to read a checkpoint means it is not intact
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            skipped.append(f"{ckpt.name} ({why})")
            warn(f"warning: skipping checkpoint {ckpt}: it does not load ({why})")
            continue
        return ckpt, loaded
    if skipped:
        raise RunStateError(f"{run}: no intact checkpoint to resume from (skipped {'; '.join(skipped)}); delete the "
                            f"damaged ones to start the run over")
    return None


def clean_temporaries(run: Path) -> None:
    """Remove what a save killed half-way left (only a lock holder may: another writer's save could be in flight)."""
    for tmp in (Path(run) / CHECKPOINTS).glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


# --- the metrics log -----------------------------------------------------------------------------------------------

def repair_metrics(run: Path, step: int | None, warn: Callable[[str], None]) -> None:
    """Keep the records up to `step` (None: none; they are redone), dropping a torn last line (a writer killed
    mid-write) with a warning; rewritten atomically. A damaged line elsewhere is a RunStateError naming it."""
    path = Path(run) / METRICS
    if not path.is_file():
        return
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and isinstance(rec.get("step"), int)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            if n == len(lines):
                warn(f"warning: {path}: dropping its last line, torn by a killed writer: {line[:60]!r}")
                break
            raise RunStateError(f"{path}:{n}: not a metrics record ({line[:60]!r}); fix or delete that line")
        if step is not None and rec["step"] <= step:
            kept.append(line)
    fsio.write_text(path, "".join(line + "\n" for line in kept))
