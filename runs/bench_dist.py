"""Training throughput of 1 against 2 processes on the CPU (torchrun, gloo): the table "Scaling out: measured on
this machine" in docs/training.md. What it measures is that the distributed path works and what it costs (the
gradient all-reduce, the per-step reductions, the duplicated optimizer), not how training scales: both ranks share
this machine's two cores.

Each configuration is one `torchrun --nproc-per-node N -m dgemma train` of `cpu-small` for --steps steps with the
same global micro-batch (1 process x batch 4, or 2 ranks x batch 2: the same windows and noise, to rounding); the
first two steps are warm-up, and tokens/s is over the rest, from metrics.jsonl's elapsed_s.

    python runs/bench_dist.py DATA    # DATA: a bpe:8192 directory from `dgemma data prepare`
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (label, processes, threads per process, extra flags)
CONFIGS = [
    ("1 process, 1 thread", 1, 1, []),
    ("1 process, 2 threads", 1, 2, []),
    ("2 processes (DDP), 1 thread each", 2, 1, ["--parallel", "ddp"]),
    ("2 processes (FSDP2), 1 thread each", 2, 1, ["--parallel", "fsdp"]),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(data: str, out: Path, nproc: int, threads: int, extra: list[str], args: argparse.Namespace) -> float:
    """Tokens/s of one configuration after the warm-up steps."""
    global_batch = args.batch_size
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "dgemma", "train", "--data", data, "--out", str(out),
           "--preset", args.preset, "--device", "cpu", "--batch-size", str(global_batch // nproc),
           "--seq-len", str(args.seq_len), "--max-steps", str(args.steps), "--warmup-steps", "1",
           "--eval-every", "1000000", "--eval-batches", "1", "--save-every", "1000000", "--log-every", "1000000",
           *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n-> exit {done.returncode}: {done.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    warm = min(2, len(steps) - 1)
    first, last = steps[warm - 1] if warm else {"elapsed_s": 0.0, "tokens": 0}, steps[-1]
    return (last["tokens"] - first["tokens"]) / max(last["elapsed_s"] - first["elapsed_s"], 1e-9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="a prepared data directory (the default corpus, bpe:8192)")
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--batch-size", type=int, default=4, help="global micro-batch (windows), split over the ranks")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=22)
    p.add_argument("--only", help="comma-separated indices of the configurations to run (default: all)")
    args = p.parse_args()
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(CONFIGS))
    load = os.getloadavg()[0]
    print(f"{args.preset}, global batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps "
          f"(load average {load:.1f})")
    print("| configuration | tokens/s |\n|---|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for i in chosen:
            label, nproc, threads, extra = CONFIGS[i]
            t0 = time.monotonic()
            rate = run(args.data, Path(tmp) / f"run-{i}", nproc, threads, extra, args)
            print(f"| {label} | {rate:,.0f} |  ({time.monotonic() - t0:.0f} s with start-up)", flush=True)


if __name__ == "__main__":
    main()
