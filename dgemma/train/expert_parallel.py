"""Training with the routed experts split over the ranks (`dgemma train --parallel ep` under torchrun): each of W
ranks holds E / W of every layer's experts (dgemma/parallel/experts.py, trainable) and the whole rest of the model,
and every rank reads the same batch (one data replica: `Dist.data_world`). dgemma/train/distributed.py calls these.

    shard_experts(model, W)        the split, after model/plan.py's check (one line: a dense model, W not dividing E)
    clip_grad_norm(model, clip, W) the replicated parameters' gradients averaged over the ranks, then the global norm
                                   (each rank's experts' squares summed over the ranks) and clipping
    as_dtensors / locals_of        checkpoints: the experts (and their AdamW moments) as DTensor shards of the whole
                                   (E, ...) tensors, Shard(0), so DCP writes one tensor per name, read back resharded by
                                   any world size and layout (one process, ddp, fsdp, ep)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dgemma.model.config import ConfigError, ModelConfig


def check(config: ModelConfig, world_size: int) -> None:
    """ConfigError in one line unless `world_size` ranks split this model's experts (model/plan.py's rules)."""
    from dgemma.model import plan

    try:
        plan.check_layout(config, plan.ParallelLayout(ep=world_size))
    except ValueError as e:
        raise ConfigError(f"--parallel ep on {world_size} ranks: {e}") from None


def shard_experts(model: nn.Module, world_size: int) -> None:
    """--parallel ep: each rank keeps E / W of every layer's routed experts (trainable), after `check`."""
    from dgemma.parallel.comm import Comm
    from dgemma.parallel.experts import shard_experts as shard

    check(model.config, world_size)
    shard(model, Comm(), trainable=True)


def clip_grad_norm(model: nn.Module, clip: float, world: int) -> float:
    """--parallel ep: the replicated parameters' gradients averaged over the ranks (equal up to the order of
    floating-point sums, which nondeterministic GPU kernels may change: averaging keeps the replicas equal), then the
    norm over every parameter (the experts' squares summed over the ranks), clipped as clip_grad_norm_ clips."""
    from dgemma.parallel.experts import expert_names

    experts = expert_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    replicated = [p.grad for n, p in params if n not in experts]
    device = next(model.parameters()).device
    if replicated:
        flat = torch.cat([g.reshape(-1) for g in replicated])
        dist.all_reduce(flat)
        flat /= world
        lo = 0
        for g in replicated:
            g.copy_(flat[lo:lo + g.numel()].view_as(g))
            lo += g.numel()
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # (replicated, this rank's experts)
    for n, p in params:
        squares[int(n in experts)] += p.grad.double().square().sum()
    own = squares[1:].clone()
    dist.all_reduce(own)
    norm = float(squares[0] + own[0]) ** 0.5
    if clip:
        coef = min(clip / (norm + 1e-6), 1.0)
        for _, p in params:
            p.grad.mul_(coef)
    return norm


def as_dtensors(d: Any, model: nn.Module, msd: dict[str, Any], osd: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """--parallel ep: the state dicts with each rank's experts (and their AdamW moments) as DTensor shards of the
    whole (E, ...) tensors, split on the expert dimension, so that DCP writes and reads them by name as a whole,
    resharded for any world size and layout; otherwise unchanged."""
    if d.parallel != "ep" or d.world_size == 1:
        return msd, osd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dgemma.parallel.experts import expert_names

    mesh = init_device_mesh(d.device.type, (d.world_size,))
    names = expert_names(model)
    whole = lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
    msd = {k: whole(v) if k in names else v for k, v in msd.items()}
    osd = {**osd, "state": {k: {m: whole(t) if k in names and torch.is_tensor(t) and t.dim() else t
                                for m, t in v.items()} for k, v in osd["state"].items()}}
    return msd, osd


def locals_of(sd: Any) -> Any:
    """`as_dtensors` undone: each DTensor's local shard (the tensor the model and AdamW hold)."""
    if isinstance(sd, dict):
        return {k: locals_of(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [locals_of(v) for v in sd]
    return sd.to_local() if hasattr(sd, "to_local") and hasattr(sd, "placements") else sd


def own_share(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, Any], saved: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A single process's checkpoint (whole weights by name, a torch optimizer state dict by index) cut to this
    rank's experts, for `load_state_dict`."""
    from dgemma.parallel.experts import expert_names

    experts = expert_names(model)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    cut = lambda name, t: t[experts[name].first:experts[name].last] if name in experts and t.dim() else t
    weights = {k: cut(k, v) for k, v in weights.items()}
    state = {i: {m: cut(order[i], t) if torch.is_tensor(t) else t for m, t in s.items()}
             for i, s in saved["state"].items()}
    return weights, {**saved, "state": state}

