"""Training with the routed experts split over the ranks (`dgemma train --parallel ep|ddp+ep|fsdp+ep` under
torchrun). The W ranks form a (data, ep) mesh of D x K (model/plan.py `train_mesh`; ep: D = 1, K = W): each rank of
an expert-parallel group of K holds E / K of every layer's experts (dgemma/parallel/experts.py, trainable) and the rest
of the model (whole, or under fsdp+ep its FSDP2 shard over all W ranks); the K ranks of a group read the same rows,
each of the D groups its own (`Dist.data_world`, `Dist.data_rank`). dgemma/train/distributed.py calls these.

    shard_experts(model, d)        the split over d's ep groups, after model/plan.py's check (one line: a dense model,
                                   K not dividing E or W)
    clip_grad_norm(model, clip, d) the gradients reduced (the experts' averaged over the D replicas; the replicated
                                   parameters' over all W ranks, unless FSDP did), then the global norm (every
                                   parameter once: FSDP shards and each group's experts summed over the ranks) and
                                   clipping
    as_dtensors / locals_of        checkpoints: the experts (and their AdamW moments) as DTensor shards of the whole
                                   (E, ...) tensors, Shard(0) over ep and replicated over data, so DCP writes one
                                   tensor per name, read back resharded by any world size and layout (one process,
                                   ddp, fsdp, ep, ddp+ep, fsdp+ep)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dgemma.model.config import ConfigError, ModelConfig


def check(config: ModelConfig, parallel: str, world_size: int, ep_size: int | None) -> None:
    """ConfigError in one line unless `world_size` ranks make a (data, ep) mesh under `parallel` and `ep_size` whose
    ep splits this model's experts (model/plan.py's rules)."""
    from dgemma.model import plan

    try:
        plan.check_train_mesh(config, parallel, world_size, ep_size)
    except ValueError as e:
        raise ConfigError(f"--parallel {parallel} on {world_size} ranks: {e}") from None


def shard_experts(model: nn.Module, d: Any) -> None:
    """Each rank keeps E / K of every layer's routed experts (trainable), those of its place in the ep groups of
    `d` (a distributed.Dist), after `check`."""
    from dgemma.parallel.comm import Comm
    from dgemma.parallel.experts import shard_experts as shard

    check(model.config, d.parallel, d.world_size, d.ep_size)
    if d.splits_experts:
        shard(model, Comm(d.expert_mesh().get_group("ep")), trainable=True)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The split experts' parameters (none when the model holds them whole)."""
    from dgemma.parallel.experts import expert_names

    experts = expert_names(model)
    return [p for n, p in model.named_parameters() if n in experts]


def _average(grads: list[torch.Tensor], n: int, group: Any) -> None:
    """Each gradient replaced by its mean over the `n` ranks of `group` (one flat all-reduce)."""
    if not grads or n == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= n
    lo = 0
    for g in grads:
        g.copy_(flat[lo:lo + g.numel()].view_as(g))
        lo += g.numel()


def clip_grad_norm(model: nn.Module, clip: float, d: Any) -> float:
    """The experts' gradients averaged over the data replicas (each replica's expert-parallel group computed its
    rows' share), the replicated parameters' over every rank (under fsdp+ep FSDP's reduce-scatter did: those are
    DTensor shards); equal up to the order of floating-point sums, which nondeterministic GPU kernels may change:
    averaging keeps the replicas equal. Then the norm over every parameter counted once (the FSDP shards' and the
    experts' squares summed over the ranks, the experts' divided by the D replicas that hold them alike), clipped as
    clip_grad_norm_ clips."""
    from dgemma.parallel.experts import expert_names

    experts = expert_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    sharded = lambda g: hasattr(g, "to_local")  # an FSDP DTensor
    mesh, replicas = d.expert_mesh(), d.data_world
    _average([p.grad for n, p in params if n in experts], replicas, mesh.get_group("data"))
    _average([p.grad for n, p in params if n not in experts and not sharded(p.grad)], d.world_size, None)
    device = next(model.parameters()).device
    # (replicated: the same on every rank; FSDP shards; this rank's experts)
    squares = torch.zeros(3, dtype=torch.float64, device=device)
    for n, p in params:
        g = p.grad.to_local() if sharded(p.grad) else p.grad
        squares[2 if n in experts else 1 if sharded(p.grad) else 0] += g.double().square().sum()
    spread = squares[1:].clone()
    dist.all_reduce(spread)
    norm = float(squares[0] + spread[0] + spread[1] / replicas) ** 0.5
    if clip:
        coef = min(clip / (norm + 1e-6), 1.0)
        for _, p in params:
            p.grad.mul_(coef)
    return norm


def as_dtensors(d: Any, model: nn.Module, msd: dict[str, Any], osd: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dicts with each rank's experts (and their AdamW moments) as DTensor shards of the
    whole (E, ...) tensors, split on the expert dimension, so that DCP writes and reads them by name as a whole,
    resharded for any world size and layout; otherwise unchanged."""
    if not d.splits_experts:
        return msd, osd
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from dgemma.parallel.experts import expert_names

    mesh = d.expert_mesh()
    names = expert_names(model)
    whole = lambda t: DTensor.from_local(t, mesh, [Replicate(), Shard(0)], run_check=False)
    msd = {k: whole(v) if k in names else v for k, v in msd.items()}
    osd = {**osd, "state": {k: {m: whole(t) if k in names and torch.is_tensor(t) and t.dim() else t
                                for m, t in v.items()} for k, v in osd["state"].items()}}
    return msd, osd


def locals_of(d: Any, model: nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """`as_dtensors` undone on {"model": ..., "optimizer": ...}: each split expert's local shard (the tensor the model
    and AdamW hold); FSDP's DTensors are left as they are."""
    if not d.splits_experts:
        return sd
    from dgemma.parallel.experts import expert_names

    names = expert_names(model)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    osd = sd["optimizer"]
    return {"model": {k: local(v) if k in names else v for k, v in sd["model"].items()},
            "optimizer": {**osd, "state": {k: {m: local(t) if k in names else t for m, t in v.items()}
                                           for k, v in osd["state"].items()}}}


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

