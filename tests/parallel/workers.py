"""What each rank of a parallel test runs (spawned with torch.multiprocessing, a gloo process group on the CPU):
the tiny MoE built from one seed, parallelized under a layout, its logits on a fixed prompt and canvas and the tokens
`generate` draws on a few seeds, saved by rank 0 for the test to compare with one process."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dgemma.model.config import preset
from dgemma.model.kv_cache import RowCaches
from dgemma.sampling.generate import generate
from dgemma.weights.loading import build_model

SEEDS = (0, 1)
PROMPT = [[5, 17, 301, 42, 7, 99, 250, 3, 11]]


def tiny_config(heads: int | None = 2):
    """The tiny preset (8 experts top-2; 4 query heads, 2 kv heads on sliding layers, 1 on full ones), or with
    `heads` kv heads on every layer."""
    if heads is None:
        return preset("tiny")
    return dataclasses.replace(preset("tiny"), num_key_value_heads=heads, num_global_key_value_heads=heads)


def run_model(model, impl: str) -> dict:
    """The logits of one commit + denoise and the tokens of generate on SEEDS, on `model` (parallel or not)."""
    torch.manual_seed(1234)
    ids = torch.tensor(PROMPT)
    canvas = torch.randint(0, model.config.vocab_size, (1, model.config.canvas_length))
    cache = model.new_cache(1, 64)
    model.commit(ids, cache, impl=impl)
    logits = model.denoise(canvas, cache, impl=impl)
    # continuous batching's pass (the server's): two one-row caches at different lengths in one batch, each row
    # computing what it would alone (RowCaches: attention row by row, the experts' `per_row`)
    pool = model.new_cache(2, 64)
    rows = [pool.rows(0, 1, 0), pool.rows(1, 2, 0)]
    model.commit(ids, rows[0], impl=impl)
    model.commit(ids[:, :4], rows[1], impl=impl)
    row_logits = model.denoise(canvas.expand(2, -1), RowCaches(rows), impl=impl)
    tokens = [generate(model, ids, seed=s, impl=impl, max_new_tokens=32, max_denoising_steps=8).sequences.tolist()
              for s in SEEDS]  # two canvases: the first is committed
    return {"logits": logits, "row_logits": row_logits, "tokens": tokens}


def single(config, impl: str, dtype: str = "float32") -> dict:
    """One process: what the parallel ranks must reproduce."""
    return run_model(build_model(config, impl=impl, dtype=getattr(torch, dtype)), impl)


def rank_main(rank: int, world: int, port: int, jobs: list[tuple[str, str, int | None, str]], out: str) -> None:
    """Rank `rank` of `world`: for each (layout, impl, kv heads, dtype) in `jobs`, a fresh model (`tiny_config`)
    parallelized under it and run; rank 0 saves {job: result} to `out`, each result saying whether every rank had the
    same logits and tokens."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from dgemma.parallel import parallelize

        results = {}
        for layout, impl, heads, dtype in jobs:
            model = build_model(tiny_config(heads), impl=impl, dtype=getattr(torch, dtype))
            parallelize(model, layout)
            result = run_model(model, impl)
            gathered = [None] * world
            dist.all_gather_object(gathered, result["tokens"])
            same = all(g == result["tokens"] for g in gathered)
            for key in ("logits", "row_logits"):
                every = [torch.empty_like(result[key]) for _ in range(world)]
                dist.all_gather(every, result[key])
                same &= all(torch.equal(x, result[key]) for x in every)
            result["same_on_every_rank"] = same
            results[(layout, impl, heads, dtype)] = result
        if rank == 0:
            torch.save(results, Path(out))
    finally:
        dist.destroy_process_group()


def train_grads(rank: int = 0, world: int = 1, parallel: str = "ep", ep_size: int | None = None) -> dict:
    """One training loss and its gradients on the tiny MoE (fp32, fast kernels) from a fixed seed and a global batch
    of 4 rows; on `world` > 1 ranks under `Dist.wrap(parallel)` as `dgemma train` wraps it, each data replica on its
    rows (the loss: the mean over the replicas; the gradients after `clip_grad_norm`'s reduction, FSDP shards and the
    experts gathered whole). What test_parallel_train.py compares."""
    from dgemma.parallel.experts import expert_names
    from dgemma.train.diffusion import training_loss
    from dgemma.train.distributed import Dist

    model = build_model(preset("tiny"), impl="fast", dtype=torch.float32).train()
    x0 = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(3))
    d = Dist(rank, world, parallel=parallel, ep_size=ep_size) if world > 1 else Dist()
    net = d.wrap(model, training_loss, parallel=d.parallel)
    rows = 4 // d.data_world
    lo = d.data_rank * rows
    loss, _ = net(x0[lo:lo + rows], self_conditioning_prob=1.0, generator=torch.Generator().manual_seed(4),
                  batch_rows=d.rows(rows))
    loss.backward()
    norm = d.clip_grad_norm(model, 0.0)
    experts = expert_names(model)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if hasattr(g, "full_tensor"):  # an FSDP shard
            g = g.full_tensor()
        if name in experts:  # this rank's experts: the whole from its expert-parallel group
            parts = [torch.empty_like(g) for _ in range(d.layout.ep)]
            dist.all_gather(parts, g.contiguous(), group=d.expert_mesh().get_group("ep"))
            g = torch.cat(parts)
        grads[name] = g.clone()
    return {"loss": d.sum([float(loss.detach())])[0] / world, "norm": norm, "grads": grads}


def train_rank_main(rank: int, world: int, port: int, out: str, parallel: str = "ep",
                    ep_size: int | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = train_grads(rank, world, parallel, ep_size)
        if rank == 0:
            torch.save(result, Path(out))
    finally:
        dist.destroy_process_group()
