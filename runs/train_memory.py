"""The training memory pre-flight against the measured peak: the table "Memory pre-flight vs measured peak" in
docs/training.md (cpu-small recipe: 1,016 MiB measured, 1,236 MiB estimated, 1.22).

Each configuration trains for 3 steps (one thread, eager fp32 on the CPU) with `dgemma.train.loop.train` in its own
process; the measured figure is that whole process's peak resident set (ru_maxrss), the estimate the sum of
`dgemma.train.config.estimate_memory`, the number the pre-flight compares with the free memory.

    python runs/train_memory.py DATA    # DATA: a bpe:8192 directory from `dgemma data prepare`
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dgemma.train.config import estimate_memory, train_preset
from dgemma.train.loop import train

# (label, TrainConfig overrides of the cpu-small recipe)
CONFIGS = [
    ("recipe (4 × 128, clean-context)", {}),
    ("batch 16 × 256", {"batch_size": 16, "seq_len": 256}),
    ("batch 16 × 256, ar", {"batch_size": 16, "seq_len": 256, "objective": "ar"}),
    ("batch 8 × 512, noisy-context", {"batch_size": 8, "seq_len": 512, "objective": "noisy-context"}),
    ("batch 4 × 256, impl reference", {"seq_len": 256, "impl": "reference"}),
]


def measure(data: str, overrides: dict, steps: int) -> None:
    """One configuration in this process: prints `measured_bytes estimated_bytes`."""
    torch.set_num_threads(1)
    cfg = train_preset("cpu-small").replace(max_steps=steps, warmup_steps=1, eval_every=10**6, eval_batches=1,
                                            save_every=10**6, log_every=10**6, **overrides)
    with tempfile.TemporaryDirectory() as out:
        train(cfg, data, Path(out) / "run", stream=io.StringIO())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(peak, sum(estimate_memory(cfg, "cpu").values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="a prepared data directory (bpe:8192)")
    p.add_argument("--steps", type=int, default=3, help="training steps per configuration")
    p.add_argument("--only", type=int, metavar="N", help="measure only the first N configurations")
    p.add_argument("--config", help=argparse.SUPPRESS)  # internal: one configuration's overrides, as JSON
    args = p.parse_args()
    if args.config is not None:
        return measure(args.data, json.loads(args.config), args.steps)
    print("| cpu-small, overrides | measured peak | estimate | estimate / peak |\n|---|---:|---:|---:|")
    for label, overrides in CONFIGS[:args.only]:
        out = subprocess.run([sys.executable, __file__, args.data, "--steps", str(args.steps),
                              "--config", json.dumps(overrides)], check=True, capture_output=True, text=True).stdout
        peak, estimate = map(int, out.split()[-2:])
        print(f"| {label} | {peak / 2**20:,.0f} MiB | {estimate / 2**20:,.0f} MiB | {estimate / peak:.2f} |")


if __name__ == "__main__":
    main()
