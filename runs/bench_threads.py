"""Tokens/s of training and generation on a quiet machine and beside busy processes, before and after dgemma's thread
choice (dgemma/io/threads.py): the table "Threads on a busy machine" in docs/benchmarks.md.

Each measurement is a fresh process, so OpenMP reads its wait setting when torch loads there, as in a `dgemma`
command:
- before: libgomp's default spin (GOMP_SPINCOUNT=300000, what torch had before dgemma bounded it) on every core
  (torch's default thread count);
- after:  dgemma's defaults (no setting given: the bounded spin, on every core this process may use).
"Load" starts that many busy processes (a pure-Python loop each) beside the measurement, waits for the load average
to see them (--settle seconds), and stops them after. Every cell runs the same work: `train` trains the preset's
model on random token windows (the step cost does not depend on the text; the first step is a warm-up), `generate`
runs `dgemma generate --random-init` on its default kernels.

    python runs/bench_threads.py --preset cpu-tiny --train-steps 40 --new-tokens 256 --loads 0,4
    python runs/bench_threads.py --preset tiny --train-steps 3 --new-tokens 16 --loads 0,1 --settle 0   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"before": {"GOMP_SPINCOUNT": "300000"}, "after": {},
            # the alternatives dgemma's choice was measured against (--settings)
            "no-spin": {"GOMP_SPINCOUNT": "0"}, "after-1-thread": {"OMP_NUM_THREADS": "1"}}
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")

TRAIN = """
import json, sys, time
import torch
import dgemma
from dgemma.io.threads import usable_cores
from dgemma.train.config import train_preset
from dgemma.train.diffusion import training_loss
from dgemma.train.loop import make_optimizer
preset, steps, batch, seq, before = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if before in ("after", "no-spin"):
    torch.set_num_threads(usable_cores())  # what `dgemma` commands do without --threads
cfg = train_preset(preset)
model = dgemma.init_weights(dgemma.DiffusionGemma(cfg.model_config), seed=0).train()
opt = make_optimizer(model, cfg, torch.device("cpu"))
g = torch.Generator().manual_seed(0)
data = torch.randint(0, cfg.model_config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
times = []
for _ in range(steps + 1):
    start = time.perf_counter()
    out = training_loss(model, data, objective=cfg.objective, num_steps=cfg.num_steps, chunk_rows=cfg.chunk_rows,
                        generator=g)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - start)
print(json.dumps({"tokens_per_s": batch * seq * steps / sum(times[1:]), "threads": torch.get_num_threads()}))
"""


def measure(work: str, setting: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS} | SETTINGS[setting]
    if work == "train":
        cmd = [sys.executable, "-c", TRAIN, args.preset, str(args.train_steps), str(args.batch_size),
               str(args.seq_len), setting]
    else:
        cmd = [sys.executable, "-m", "dgemma", "generate", "--preset", args.preset, "--random-init", "--prompt-ids",
               "2,45,300,17", "--max-new-tokens", str(args.new_tokens), "--seed", "0", "--json"]
        if setting == "before":
            cmd += ["--threads", str(os.cpu_count() or 1)]  # torch's default count
        elif setting == "after-1-thread":
            cmd += ["--threads", "1"]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{work} ({setting}) failed: {out.stderr.strip()[-2000:]}")
    if work == "train":
        return json.loads(out.stdout.strip().splitlines()[-1]) | {"wall_s": wall}
    m = re.search(r"([\d.]+) tokens/s", out.stderr)
    return {"tokens_per_s": float(m.group(1)) if m else float("nan"), "wall_s": wall}


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-tiny")
    p.add_argument("--train-steps", type=int, default=40, help="timed training steps (after one warm-up step)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256, help="tokens `dgemma generate` writes")
    p.add_argument("--loads", default="0,4", help="busy processes beside the measurement, comma-separated "
                   "(default 0 and 4: quiet, and twice the cores of a 2-core machine)")
    p.add_argument("--settle", type=float, default=30.0, help="seconds for the load average to see the busy ones")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per measurement")
    p.add_argument("--settings", default="before,after", help=f"which of {', '.join(SETTINGS)} (comma-separated; "
                   "the table compares the first two)")
    p.add_argument("--works", default="train,generate", help="train, generate or both")
    p.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = p.parse_args()
    rows = []
    for load in [int(x) for x in args.loads.split(",")]:
        procs = busy(load)
        try:
            time.sleep(args.settle if load else 0)
            for work in args.works.split(","):
                for setting in args.settings.split(","):
                    r = measure(work, setting, args)
                    rows.append({"work": work, "load": load, "setting": setting, **r,
                                 "load_average": os.getloadavg()[0]})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    print(f"{args.preset}, {os.cpu_count()} cores; train: batch {args.batch_size} x {args.seq_len}, "
          f"{args.train_steps} steps; generate: {args.new_tokens} tokens")
    settings = args.settings.split(",")
    print("| work | busy processes | " + " | ".join(f"{s} (tokens/s)" for s in settings) + " |")
    print("|---|---:|" + "---:|" * len(settings))
    for work in args.works.split(","):
        for load in sorted({r["load"] for r in rows}):
            cells = [next(r["tokens_per_s"] for r in rows if (r["work"], r["load"], r["setting"]) == (work, load, s))
                     for s in settings]
            print(f"| {work} | {load} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
