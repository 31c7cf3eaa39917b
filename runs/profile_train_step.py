"""Where a training step spends its time, and what the optimizer and loss settings change: the profile behind
docs/benchmarks.md, "Training step".

    python runs/profile_train_step.py --preset cpu-small --threads 1          # the cpu-small training shape
    python runs/profile_train_step.py --preset lite-380m --batch-size 1 --seq-len 1024 --steps 3 --no-variants
    python runs/profile_train_step.py --preset cpu-small --threads 1 --compile-blocks          # + compiled blocks

1. A profile (torch.profiler, self CPU time) of `--steps` clean-context steps with self-conditioning 0.5 (the
   training default) after a warm-up step, by op and by kind: matmuls, attention, the chunked cross-entropy, the
   optimizer, elementwise and the rest. MFU = model FLOPs (`dgemma bench`'s count) / time / this machine's measured
   fp32 matmul peak.
2. Variants timed against each other, interleaved step by step on copies of one model with the same data and draws:
   the fused head loss (dgemma/train/head_loss.py, the default with the fast kernels) against the readable chunk
   loss it replaced (`train.diffusion.fusable` switched off for that variant), AdamW `foreach` (the default off
   CUDA) against `fused=True`, the cross-entropy's row chunk (`chunk_rows`), for a MoE model the experts' gather
   before 31e24f1 (advanced indexing) and, with --compile-blocks, each block under torch.compile as `dgemma train`
   runs it on CUDA. Medians of the timed steps.

Random token windows (a step's cost does not depend on the text); one process; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

import dgemma
from dgemma.eval.bench import measure_matmul_peak, training_flops
from dgemma.model import attention, kernels
from dgemma.train import diffusion
from dgemma.train.config import TrainConfig, train_preset
from dgemma.train.diffusion import training_loss

FUSABLE = diffusion.fusable
KINDS = (("matmul", ("mm", "bmm", "addmm", "linear", "grouped_mm", "matmul", "baddbmm")),
         ("cross-entropy and softcap", ("cross_entropy", "log_softmax", "nll_loss", "logsumexp", "tanh")),
         ("attention", ("scaled_dot_product", "flash_attention", "_softmax", "softmax")),
         ("optimizer", ("adam", "_foreach", "fused_adamw", "lerp", "addcdiv", "addcmul")),
         ("gather / scatter / copy", ("index", "gather", "scatter", "copy_", "cat", "clone", "to", "contiguous")),
         ("elementwise", ("mul", "add", "sub", "div", "gelu", "tanh", "sigmoid", "exp", "rsqrt", "pow", "mean",
                          "sum", "where", "neg", "sqrt", "clamp", "fill", "zero")))


MOE_EXPERTS = kernels.moe_experts
INDEXED = "fused head loss, experts gathered by indexing (before 31e24f1)"


def indexed_moe_experts(x, weights, experts, gate_up_proj, down_proj, *, backend="auto"):
    """`kernels.moe_experts` before 31e24f1: the sorted rows gathered by advanced indexing (in training its backward
    is an indexed scatter-add) and slot order restored by `index_copy_`."""
    N, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = flat.new_zeros(gate_up_proj.shape[0]).scatter_add_(0, flat, torch.ones_like(flat))
    xs = x[order // k]
    if kernels._grouped_mm_available(x, gate_up_proj, down_proj):  # the pre-pass, without gradients
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = kernels._grouped_mm(xs, gate_up_proj, offsets).chunk(2, dim=-1)
        y = kernels._grouped_mm((F.gelu(gate, approximate="tanh") * up).contiguous(), down_proj, offsets)
    else:
        y = kernels._expert_loop(xs, counts, gate_up_proj, down_proj)
    weighted = y.float() * weights.reshape(-1)[order, None]
    slots = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return slots.view(N, k, -1).sum(1).to(x.dtype)


def kind_of(op: str) -> str:
    name = op.removeprefix("aten::")
    for kind, words in KINDS:
        if any(w in name for w in words):
            return kind
    return "other"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu-small", help="training preset (its model, batch and window)")
    p.add_argument("--batch-size", type=int, help="windows per step (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="window length (default: the preset's)")
    p.add_argument("--steps", type=int, default=6, help="profiled steps, and timed steps per variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--no-variants", action="store_true",
                   help="the profile only (each variant holds its own model and AdamW state: lite-380m's five copies "
                        "need ~25 GB)")
    p.add_argument("--compile-blocks", action="store_true",
                   help="also time each block under torch.compile (inductor; CUDA's training default) on this device")
    return p.parse_args(argv)


def step(model, opt, data, cfg, g, chunk_rows, fused_loss: bool = True) -> float:
    diffusion.fusable = FUSABLE if fused_loss else (lambda model, final: False)
    start = time.perf_counter()
    out = training_loss(model, data, objective="clean-context", num_steps=cfg.num_steps,
                        self_conditioning_prob=cfg.self_conditioning_prob, chunk_rows=chunk_rows, generator=g)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def optimizer(model, cfg, fused: bool) -> torch.optim.AdamW:
    """`train.loop.make_optimizer`'s groups, with foreach (the default off CUDA) or the fused kernel."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused, foreach=not fused)


def time_variants(args: argparse.Namespace, cfg: TrainConfig, base: dgemma.DiffusionGemma, data: torch.Tensor, B: int,
                  S: int) -> dict[str, float]:
    """Each variant's median step (seconds) on its own copy of `base`, interleaved step by step."""
    chunks = sorted({cfg.chunk_rows, 256, 4096})
    before = "readable head loss, AdamW foreach (before)"
    default = "fused head loss, AdamW foreach (the default)"
    variants = {before: (False, cfg.chunk_rows, False, False), default: (False, cfg.chunk_rows, True, False),
                "fused head loss, AdamW fused": (True, cfg.chunk_rows, True, False),
                **{f"fused head loss, CE chunk {c}": (False, c, True, False) for c in chunks if c != cfg.chunk_rows}}
    moe = cfg.model_config.is_moe
    if moe:
        variants[INDEXED] = (False, cfg.chunk_rows, True, False)
    if args.compile_blocks:
        variants["fused head loss, each block torch.compile'd (inductor)"] = (False, cfg.chunk_rows, True, True)
    runs = {}
    for name, (fused, chunk, fused_loss, compiled) in variants.items():
        m = copy.deepcopy(base)
        if compiled:  # what `dgemma train` does on CUDA (train/distributed.py: wrap), here on the CPU
            kernels.register_expert_loop_op()
            for block in m.layers:
                block.compile()
            start = time.perf_counter()
            for sc in (0.0, 1.0):  # both graphs: the self-conditioning pre-pass runs without gradients
                step(m, optimizer(copy.deepcopy(m), cfg, False), data, dataclasses.replace(
                    cfg, self_conditioning_prob=sc), torch.Generator().manual_seed(0), chunk)
            m.zero_grad(set_to_none=True)  # the warm-up's optimizer held a copy: only the gradients stayed behind
            print(f"compiling the blocks: {time.perf_counter() - start:.0f} s", flush=True)
        runs[name] = (m, optimizer(m, cfg, fused), torch.Generator().manual_seed(0), chunk, fused_loss, [])
    for i in range(args.steps + 1):
        for name in (list(runs) if i % 2 == 0 else list(reversed(runs))):
            m, o, gen, chunk, fused_loss, times = runs[name]
            kernels.moe_experts = indexed_moe_experts if name == INDEXED and moe else MOE_EXPERTS
            t = step(m, o, data, cfg, gen, chunk, fused_loss)
            kernels.moe_experts = MOE_EXPERTS
            if i:
                times.append(t)
    diffusion.fusable = FUSABLE
    print("\n| variant | ms / step (median) | tokens/s | vs before |\n|---|---:|---:|---:|")
    med = {name: statistics.median(r[5]) for name, r in runs.items()}
    for name, s in med.items():
        print(f"| {name} | {1000 * s:.0f} | {B * S / s:,.0f} | {med[before] / s:.2f}x |")
    return med


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = train_preset(args.preset)
    B, S = args.batch_size or cfg.batch_size, args.seq_len or cfg.seq_len
    mc = cfg.model_config
    base = dgemma.init_weights(dgemma.DiffusionGemma(mc, impl=cfg.impl), seed=0).train()
    data = torch.randint(0, mc.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    peak = measure_matmul_peak("cpu", torch.float32)
    masks = attention.clean_context_masks(S, mc.canvas_length, mc.sliding_window)

    # 1. the profile
    model, g = copy.deepcopy(base), torch.Generator().manual_seed(0)
    opt = optimizer(model, cfg, fused=False)
    step(model, opt, data, cfg, g, cfg.chunk_rows)  # warm-up: allocations, AdamW state
    seconds, flops = [], 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            seconds.append(step(model, opt, data, cfg, g, cfg.chunk_rows))
    for sc in (False, True):  # the expected FLOPs of a step: the self-conditioning pre-pass on a share p of them
        share = cfg.self_conditioning_prob if sc else 1 - cfg.self_conditioning_prob
        flops += share * training_flops(mc, B, S, "clean-context", sc, masks)
    by_op: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        by_op[e.key] += e.self_cpu_time_total / 1e6 / args.steps
    by_kind: dict[str, float] = defaultdict(float)
    for op, s in by_op.items():
        by_kind[kind_of(op)] += s
    total = sum(by_op.values())
    mean = statistics.mean(seconds)
    print(f"{args.preset}: batch {B} x {S}, clean-context, self-conditioning {cfg.self_conditioning_prob:g}, "
          f"{args.threads} thread(s), load {os.getloadavg()[0]:.2f}")
    print(f"under the profiler: step {1000 * mean:.0f} ms; model FLOPs {flops / 1e9:.1f} G per step, this machine's "
          f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s")
    print("\n| kind | ms / step | share |\n|---|---:|---:|")
    for kind, s in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {1000 * s:.1f} | {100 * s / total:.0f}% |")
    print("\n| op (self CPU) | ms / step | share |\n|---|---:|---:|")
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:15]
    for op, s in top:
        print(f"| `{op}` | {1000 * s:.1f} | {100 * s / total:.0f}% |")

    # 2. the variants, interleaved
    med = {} if args.no_variants else time_variants(args, cfg, base, data, B, S)
    default = "fused head loss, AdamW foreach (the default)"
    mfu = flops / med.get(default, mean) / peak
    timed = "timed without the profiler" if med else "under the profiler"
    print(f"\nMFU (the default, {timed}): {100 * mfu:.1f}% of the measured peak")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "batch": B, "seq_len": S, "threads": args.threads,
                                         "profiled_step_s": mean, "mfu": mfu, "peak_flops": peak,
                                         "by_kind_s": by_kind, "top_ops_s": dict(top), "variants_s": med},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
