"""Tensor parallelism for generation: each of W ranks holds H / W query heads and K / W key-value heads of every
layer's attention (the KV cache is split with them) and I / W of the dense MLP's hidden units. Where a layer has
fewer kv heads than ranks (W a multiple of K: the 26B's 2 kv heads on full layers at W = 4 or 8), each rank holds
the one kv head its query heads read, W / K ranks alike (that layer's cache is then replicated W / K times).

    q_proj, k_proj, v_proj     column-parallel: rank r holds the rows of its heads (query head h reads kv head
                               h // (H/K), so rank r's query heads [r H/W, (r+1) H/W) read exactly its kv heads)
    q_norm, k_norm             replicated (one scale per head dim, shared by the heads)
    o_proj                     row-parallel: rank r holds the columns of its heads and computes a partial (B, S, D)
    gate_proj, up_proj         column-parallel: rank r holds hidden units [r I/W, (r+1) I/W)
    down_proj                  row-parallel: a partial (B, S, D)

Each partial is summed in rank order on every rank (`Comm.sum_in_rank_order`: an all_gather, then p0 + p1 + ...;
never an all_reduce), so every rank holds the same bits and the order of the sum is fixed: the logits are within
fp32 rounding of one process (one matmul over H*Dh sums in another order), and the same on every rank, so every
rank's sampler makes the same draws from them. A near-tie between two tokens is decided the same way on every rank
and in every run of the same world size; it may be decided differently from one process, which the tests check
does not happen on their seeds. The routed experts, the router, the embedding (the tied head), the norms and the
self-conditioning stay whole (replicated); dgemma/parallel/experts.py splits the experts.

After `shard_heads`, `model.config` is this rank's share of the geometry (heads and kv heads / W), which is what
`model.new_cache` sizes the cache by: each rank caches its own kv heads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dgemma.model import plan
from dgemma.model.config import ModelConfig
from dgemma.model.layers import MLP, Attention
from dgemma.model.plan import tp_shard_config
from dgemma.parallel.comm import Comm


def _rows(w: Tensor, rank: int, world: int) -> Tensor:
    n = w.shape[0] // world
    return w.detach()[rank * n:(rank + 1) * n].clone()


def _kv_rows(w: Tensor, num_kv_heads: int, rank: int, world: int) -> Tensor:
    """Rank r's kv heads' rows of k_proj / v_proj: heads [r K/W, (r+1) K/W), or, with fewer kv heads than ranks,
    the one kv head its query heads read (r K // W; W / K ranks hold each)."""
    head_rows = w.shape[0] // num_kv_heads
    first, n = rank * num_kv_heads // world, plan.local_kv_heads(num_kv_heads, world)
    return w.detach()[first * head_rows:(first + n) * head_rows].clone()


def _cols(w: Tensor, rank: int, world: int) -> Tensor:
    n = w.shape[1] // world
    return w.detach()[:, rank * n:(rank + 1) * n].clone()


class ShardedAttention(Attention):
    """`layers.Attention` over this rank's heads; its output is the whole layer's, summed over the ranks."""

    def __init__(self, whole: Attention, config: ModelConfig, layer_idx: int, comm: Comm):
        super().__init__(tp_shard_config(config, comm.world_size), layer_idx)
        self.comm = comm
        r, W = comm.rank, comm.world_size
        with torch.no_grad():
            self.q_proj.weight = nn.Parameter(_rows(whole.q_proj.weight, r, W), requires_grad=False)
            K = config.layer_num_kv_heads(layer_idx)
            for name in ("k_proj", "v_proj"):
                if getattr(self, name) is not None:
                    getattr(self, name).weight = nn.Parameter(_kv_rows(getattr(whole, name).weight, K, r, W),
                                                              requires_grad=False)
            self.o_proj.weight = nn.Parameter(_cols(whole.o_proj.weight, r, W), requires_grad=False)
            self.q_norm.load_state_dict(whole.q_norm.state_dict())
            self.k_norm.load_state_dict(whole.k_norm.state_dict())
        self.to(device=whole.o_proj.weight.device, dtype=whole.o_proj.weight.dtype)

    def forward(self, *args, **kw) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        out, k, v = super().forward(*args, **kw)  # k, v: this rank's kv heads, which its cache holds
        return self.comm.sum_in_rank_order(out), k, v


class ShardedMLP(MLP):
    """`layers.MLP` over this rank's hidden units; its output is the whole MLP's, summed over the ranks."""

    def __init__(self, whole: MLP, comm: Comm):
        D, hidden = whole.down_proj.weight.shape
        super().__init__(D, hidden // comm.world_size)
        self.comm = comm
        r, W = comm.rank, comm.world_size
        self.gate_proj.weight = nn.Parameter(_rows(whole.gate_proj.weight, r, W), requires_grad=False)
        self.up_proj.weight = nn.Parameter(_rows(whole.up_proj.weight, r, W), requires_grad=False)
        self.down_proj.weight = nn.Parameter(_cols(whole.down_proj.weight, r, W), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.comm.sum_in_rank_order(super().forward(x))


def shard_heads(model: nn.Module, comm: Comm) -> None:
    """Swap every layer's attention and dense MLP for this rank's shards, and `model.config` for this rank's share
    of the geometry (its KV cache holds its kv heads only)."""
    config = model.config
    for i, block in enumerate(model.layers):
        block.self_attn = ShardedAttention(block.self_attn, config, i, comm)
        block.mlp = ShardedMLP(block.mlp, comm)
    model.config = tp_shard_config(config, comm.world_size)
