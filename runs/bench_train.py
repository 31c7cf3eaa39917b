"""Step cost of the training objectives against the AR baseline: the table "Diffusion vs AR step cost" in
docs/training.md (cpu-small, batch 4 x 128, 2 threads: clean-context with self-conditioning 0.5 costs 1.84x an AR
step per data token).

Every variant trains its own copy of the same initial model in one process; the variants take turns step by step
(interleaved), so a change in machine load hits all of them alike. Random token windows: the cost of a step does
not depend on the text. The first step of each variant is a warm-up; the table gives the mean of the others (a
self-conditioning probability p runs the pre-pass on a fraction p of the steps, so the mean is its expected cost).

    python runs/bench_train.py --preset cpu-small --batch-size 4 --seq-len 128 --steps 12 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

import dgemma
from dgemma.train.config import train_preset
from dgemma.train.diffusion import training_loss
from dgemma.train.loop import make_optimizer

VARIANTS = [("ar", 0.0), ("noisy-context", 0.0), ("noisy-context", 0.5), ("clean-context", 0.0),
            ("clean-context", 0.5), ("clean-context", 1.0)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="steps per variant, the first one a warm-up")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = train_preset(args.preset)
    base = dgemma.init_weights(dgemma.DiffusionGemma(cfg.model_config), seed=0)
    data = torch.randint(0, cfg.model_config.vocab_size, (args.batch_size, args.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    runs = []
    for objective, sc in VARIANTS:
        model = copy.deepcopy(base).train()
        runs.append((objective, sc, model, make_optimizer(model, cfg, torch.device("cpu")),
                     torch.Generator().manual_seed(0), []))
    for _ in range(args.steps):
        for objective, sc, model, opt, g, times in runs:
            start = time.perf_counter()
            x0 = data if objective == "ar" else data[:, :-1]
            out = training_loss(model, x0, objective=objective, num_steps=cfg.num_steps, self_conditioning_prob=sc,
                                chunk_rows=cfg.chunk_rows, generator=g)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    tokens = args.batch_size * args.seq_len
    mean = [sum(t[1:]) / (len(t) - 1) if len(t) > 1 else t[0] for *_, t in runs]
    print(f"{args.preset}, batch {args.batch_size} x {args.seq_len}, {args.steps} steps, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| objective | step (s) | tokens/s | step / AR |\n|---|---:|---:|---:|")
    for (objective, sc, *_), s in zip(runs, mean, strict=True):
        name = objective if objective == "ar" else f"{objective}, SC {sc:g}"
        print(f"| {name} | {s:.3f} | {tokens / s:,.0f} | {s / mean[0]:.2f}x |")


if __name__ == "__main__":
    main()
