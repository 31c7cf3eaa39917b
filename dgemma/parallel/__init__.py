"""Parallel generation on torch.distributed: expert parallelism (experts.py), tensor parallelism (tensor.py) and
the collectives they run (comm.py). `parallelize(model, layout)` swaps a loaded model's modules for this rank's
shards; the model itself knows nothing of ranks (dgemma/model/ stays a pure module). docs/parallel.md has the
layouts, the commands and the guarantees.

    layout   what is split over the W ranks                              what stays whole on every rank
    ep       the routed experts (E / W each)                              attention, dense MLP, router, head
    tp       attention heads and kv heads (and the KV cache), dense MLP   experts, router, embedding/head
             (fewer kv heads than ranks: each replicated on W / K ranks)
    ep+tp    both, over the same W ranks                                  router, embedding/head, norms
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from dgemma.model import plan
from dgemma.model.config import ConfigError, ModelConfig
from dgemma.parallel.comm import Comm

LAYOUTS = ("ep", "tp", "ep+tp")


class ParallelError(ConfigError):
    """A layout this model's shapes or this job cannot run: one line, naming the value."""


def check_layout(config: ModelConfig, layout: str, world_size: int) -> None:
    """Refuse a layout that does not split this model over `world_size` ranks (one line naming the value). The rules
    have one home, `dgemma.model.plan.check_layout` (ep divides the experts; tp divides the query heads and the dense
    MLP's width, and each layer type's kv heads divide by tp or divide it); this adds the flag."""
    if layout not in LAYOUTS:
        raise ParallelError(f"--parallel must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    try:
        plan.check_layout(config, plan.ParallelLayout.over_ranks(layout, world_size))
    except ValueError as e:
        raise ParallelError(f"--parallel {layout}: {e}") from None


def parallelize(model: nn.Module, layout: str, group: dist.ProcessGroup | None = None) -> Comm:
    """Swap `model`'s modules for this rank's shards under `layout` over `group` (default: the whole job), after
    `check_layout`. Returns the `Comm` its collectives run on (which times them)."""
    comm = Comm(group)
    check_layout(model.config, layout, comm.world_size)
    parts = layout.split("+")
    if "ep" in parts:
        from dgemma.parallel.experts import shard_experts

        shard_experts(model, comm)
    if "tp" in parts:
        from dgemma.parallel.tensor import shard_heads

        shard_heads(model, comm)
    return comm
