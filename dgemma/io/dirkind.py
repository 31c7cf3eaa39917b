"""What kind of directory a path is, and the one check every writing command makes before it writes into one.

A command that writes a directory (`data prepare --out`, `train`/`finetune --out`, `export --out`, `--trace PATH`'s
parent) declares the kinds it may write into; any other kind is refused up front, before anything is read or
trained, with one line naming the path, its kind (and the file that shows it) and what the command expects:

    dgemma data prepare: error: runs/x is a training run directory (run.json); --out must be a new or empty
    directory, or an existing data directory

So `data prepare` cannot replace a run's or a checkpoint's tokenizer.json, `export` cannot write over a checkpoint,
and nothing writes into `/` or another non-empty directory that is not dgemma's.
"""

from __future__ import annotations

import os
from pathlib import Path

# The files that mark dgemma's directories: the one home of their names (weights/checkpoint.py, weights/lora.py and
# train/ read and write them).
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"  # a checkpoint's weights: one file, or shards
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # a LoRA adapter (peft's layout)
CHECKPOINTS, STATE = "checkpoints", "trainer_state.pt"  # a training run's layout (dgemma/train/loop.py writes it)
SHARDED_STATE = "trainer_state.json"  # instead of STATE in a sharded checkpoint (dgemma/train/distributed.py)
LOCK, RECORD, META = ".lock", "run.json", "meta.json"  # a run's (or a data directory's) lock, a run's record, data's
MISSING, EMPTY, DATA, RUN, CHECKPOINT, ADAPTER, OTHER, FILE = (
    "missing", "empty", "data", "run", "checkpoint", "adapter", "other", "file")
_DESCRIBE = {DATA: "a prepared data directory", RUN: "a training run directory", CHECKPOINT: "a model checkpoint "
             "directory", ADAPTER: "a LoRA adapter directory", OTHER: "a non-empty directory that is not dgemma's",
             FILE: "not a directory"}
_EXPECT = {DATA: "an existing data directory", RUN: "an existing training run directory",
           CHECKPOINT: "an existing checkpoint directory", ADAPTER: "an existing adapter directory"}


class DirectoryKindError(ValueError):
    """A command was pointed at a directory it must not write into; the message names its kind and what would do."""


def classify(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(kind, the marker that shows it, e.g. ("run", "run.json")) of `path`: MISSING, EMPTY (nothing, or only a lock
    file), RUN (run.json or checkpoints/), DATA (meta.json), CHECKPOINT (config.json with weights or a trainer
    state), ADAPTER (adapter_config.json), OTHER (any other non-empty directory) or FILE (not a directory)."""
    path = Path(path)
    if not os.path.lexists(path):
        return MISSING, ""
    if not path.is_dir():
        return FILE, "a symbolic link to nothing" if path.is_symlink() and not path.exists() else ""
    names = {p.name for p in path.iterdir()} - {LOCK}
    if RECORD in names:
        return RUN, RECORD
    if CHECKPOINTS in names and (path / CHECKPOINTS).is_dir():
        return RUN, CHECKPOINTS + "/"
    if META in names:
        return DATA, META
    if "config.json" in names and names & {SINGLE, INDEX, STATE, SHARDED_STATE, ".metadata"}:
        return CHECKPOINT, "config.json"
    if ADAPTER_CONFIG in names:
        return ADAPTER, ADAPTER_CONFIG
    return (OTHER, "") if names else (EMPTY, "")


def require(path: str | os.PathLike[str], allowed: set[str], option: str, expected: str | None = None) -> str:
    """The kind of `path` when it is one of `allowed`, else DirectoryKindError: "PATH is KIND (MARKER); OPTION must
    be a new or empty directory, or ..." (`option` names the argument, e.g. "--out"; `expected` replaces the list
    of what it accepts)."""
    kind, marker = classify(path)
    if kind in allowed:
        return kind
    fresh = [w for k, w in ((MISSING, "new"), (EMPTY, "empty")) if k in allowed]
    phrases = [("an " if fresh[0] == "empty" else "a ") + " or ".join(fresh) + " directory"] if fresh else []
    phrases += [_EXPECT[k] for k in (DATA, RUN, CHECKPOINT, ADAPTER) if k in allowed]
    what = _DESCRIBE.get(kind, "an empty directory" if kind == EMPTY else "missing (does not exist)")
    raise DirectoryKindError(f"{path} is {what}{f' ({marker})' if marker else ''}; {option} must be "
                             f"{expected or ', or '.join(phrases)}")
