"""Parallel generation on the CPU (torchrun, gloo): token identity with one process and the communication share of
a denoising step, at world sizes 1, 2 and 4, for each layout: the table "Measured" in docs/parallel.md.

For each (layout, world) one `torchrun --standalone --nproc-per-node W` runs this script as a worker on every rank
(one thread a rank): the model (--preset, random weights, fp32, fast kernels) is split under the layout, then

    tokens     `generate` on a fixed prompt and seed, compared with one process without torchrun (this script's own
               process): "yes" when every token is the same, else the first generated token that differs
    step       one decoder pass over a canvas after a committed prompt (`model.denoise`), after --warmup passes;
               the median over --repeats of rank 0's wall time
    comm       rank 0's time inside the collectives of that pass (dgemma/parallel/comm.py times them: the
               rank-order sums of tensor parallelism, the gather of the experts' rows), median over the repeats;
               waiting for a slower rank counts, as it does in a step

The ranks share this machine's cores (a world of 4 on 2 cores is oversubscribed): what this measures is that the
parallel path is exact and what its collectives cost here, not a speed-up.

    python runs/bench_parallel.py                 # preset tiny, worlds 1,2,4, layouts ep,tp,ep+tp
    python runs/bench_parallel.py --smoke         # seconds: worlds 1,2, layout ep, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dgemma.sampling.generate import generate
from dgemma.weights.loading import build_model


def tokens_of(model, args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=g)
    return generate(model, prompt, seed=args.seed, max_new_tokens=args.new_tokens,
                    max_denoising_steps=args.steps).new_tokens()


def worker(args: argparse.Namespace) -> None:
    """One rank: split the model, generate, time the decoder pass; rank 0 writes what it measured to --out."""
    import torch.distributed as dist

    from dgemma.parallel import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model = build_model(args.preset, impl="fast")
        comm = parallelize(model, args.layout)
        tokens = tokens_of(model, args)
        cache = model.new_cache(1, args.prompt)
        g = torch.Generator().manual_seed(args.seed)
        model.commit(torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=g), cache)
        canvas = torch.randint(0, model.config.vocab_size, (1, model.config.canvas_length), generator=g)
        steps, comms, calls = [], [], 0
        for i in range(args.warmup + args.repeats):
            dist.barrier()
            comm.seconds, comm.calls = 0.0, 0
            started = time.perf_counter()
            model.denoise(canvas, cache)
            if i >= args.warmup:
                steps.append(time.perf_counter() - started)
                comms.append(comm.seconds)
                calls = comm.calls
        if comm.rank == 0:
            shares = [c / s for c, s in zip(comms, steps, strict=True)]
            Path(args.out).write_text(json.dumps({"tokens": tokens, "step_ms": 1e3 * statistics.median(steps),
                                                  "comm_ms": 1e3 * statistics.median(comms), "calls": calls,
                                                  "share": statistics.median(shares)}))
    finally:
        dist.destroy_process_group()


def first_difference(a: list[list[int]], b: list[list[int]]) -> int:
    """The index of the first generated token where two runs differ (one prompt)."""
    return next((i for i, (x, y) in enumerate(zip(a[0], b[0], strict=False)) if x != y), min(len(a[0]), len(b[0])))


def launch(layout: str, world: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(Path(__file__).resolve()), "--worker", "--layout", layout, "--out", str(out),
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("preset", "prompt", "new_tokens", "steps", "seed", "warmup", "repeats")]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}\n-> exit {done.returncode}: {done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--layouts", default="ep,tp,ep+tp")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens committed before the timed pass")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated for the identity check")
    p.add_argument("--steps", type=int, default=16, help="max denoising steps a canvas (identity check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="worlds 1,2, layout ep, 2 repeats: seconds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.worlds, args.layouts, args.warmup, args.repeats, args.new_tokens = "1,2", "ep", 1, 2, 32
    torch.set_num_threads(1)
    alone = tokens_of(build_model(args.preset, impl="fast"), args)
    load = os.getloadavg()[0]
    print(f"preset {args.preset}, fp32, fast kernels, gloo, 1 thread a rank, {os.cpu_count()} CPU cores, load "
          f"average {load:.2f} at the start; step = one decoder pass over a {args.prompt}-token prompt's canvas, "
          f"median of {args.repeats} after {args.warmup} warm-up\n")
    print("| layout | world | tokens = one process | step (ms) | in collectives (ms) | comm share "
          "| collectives a step |")
    print("|---|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            r = launch(layout, world, args)
            same = "yes" if r["tokens"] == alone else f"no: from token {first_difference(r['tokens'], alone)}"
            print(f"| {layout} | {world} | {same} | {r['step_ms']:.2f} | {r['comm_ms']:.2f} | {100 * r['share']:.0f}% "
                  f"| {r['calls']} |", flush=True)


if __name__ == "__main__":
    main()
