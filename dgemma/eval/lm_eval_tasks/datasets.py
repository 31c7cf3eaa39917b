"""The data of dgemma's lm-evaluation-harness tasks, read from the JSON Lines beside this file (built by
runs/build_lm_eval_tasks.py): each task's YAML names its loader as `custom_dataset`, so the tasks run offline and
from wherever dgemma is installed (a `dataset_path: json` with `data_files` would be read relative to the working
directory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(name: str) -> Any:
    """{"test": the items of HERE/name.jsonl} as a datasets.DatasetDict."""
    import datasets

    rows = [json.loads(line) for line in (HERE / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def next_line(**kwargs: Any) -> Any:
    return load("next_line")


def speaker(**kwargs: Any) -> Any:
    return load("speaker")
