"""Expert parallelism for generation: each of W ranks holds E / W of a layer's routed experts (rank r the
contiguous ids [r E/W, (r+1) E/W)) and computes them for every token routed to them; everything else is replicated.

    router               replicated: every rank routes every token (the same bits: its input is the same)
    sort_slots           replicated: the N*k slots in expert order (dgemma/model/kernels.py)
    expert_rows          rank r: the rows of its own experts, a contiguous run of the sorted slots
    gather_rows          the rows of every rank, concatenated in rank order = expert order (comm.py)
    combine_slots        replicated: back to slot order, weighted, summed over k in fp32, as one process does

Each expert's rows are the rows one process computes for that expert (the same inputs, the same kernel), and the
combine is the single-process kernel's, so the output is bit-identical to one process in any dtype
(tests/parallel/test_parallel.py). The readable path (impl="reference") is split the same way: each rank computes
its experts' weighted outputs in the model dtype, and every rank adds all of them in ascending expert id, as
`layers.Experts.forward` does. Dispatch is a gather, not an all-to-all: every rank already holds every token (the
attention before it is replicated or tensor-parallel), so only the experts' outputs travel.

Training (`dgemma train --parallel ep`, `ShardedExperts(..., trainable=True)`): every rank of the group computes the
same loss from the same batch, so the gradient of the gathered rows is the same on every rank and the backward of
the gather is this rank's slice of it (`GatherRows`: no communication); each rank's expert gradients are then
exactly its experts' share of one process's. The experts' input gets from each rank only its own experts' share of
its gradient: `SumGradients` (identity forward) sums those shares over the ranks in backward, so everything before
the experts gets one process's gradient on every rank (to the order of that sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dgemma.model import kernels
from dgemma.model.attention import Impl
from dgemma.model.layers import Experts
from dgemma.parallel.comm import Comm


class GatherRows(torch.autograd.Function):
    """`Comm.gather_rows` with a backward: this rank's slice of the gathered rows' gradient (every rank of the group
    runs the same computation downstream, so that gradient is the same on every rank; nothing is summed)."""

    @staticmethod
    def forward(ctx, rows: Tensor, comm: Comm, sizes: list[int]) -> Tensor:  # type: ignore[override]
        ctx.lo, ctx.n = sum(sizes[:comm.rank]), sizes[comm.rank]
        return comm.gather_rows(rows, sizes)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return grad[ctx.lo:ctx.lo + ctx.n], None, None


class SumGradients(torch.autograd.Function):
    """The identity, whose backward sums the gradient over the ranks (each holds its own experts' share of it)."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:  # type: ignore[override]
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        if ctx.comm.world_size > 1:
            dist.all_reduce(grad, group=ctx.comm.group)
        return grad, None


class ShardedExperts(nn.Module):
    """`layers.Experts` holding experts [first, last) of `num_experts`, with the same forward and per_row."""

    def __init__(self, experts: Experts, comm: Comm, trainable: bool = False):
        super().__init__()
        E, W = experts.gate_up_proj.shape[0], comm.world_size
        self.comm, self.num_experts = comm, E
        self.bounds = [r * E // W for r in range(W + 1)]  # rank r holds experts [bounds[r], bounds[r + 1])
        self.first, self.last = self.bounds[comm.rank], self.bounds[comm.rank + 1]
        # fresh storage (aligned: CPU matmuls can round differently on unaligned slices, dgemma/testing/hf.py)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[self.first:self.last].clone(),
                                         requires_grad=trainable)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[self.first:self.last].clone(),
                                      requires_grad=trainable)

    def extra_repr(self) -> str:
        return f"experts [{self.first}, {self.last}) of {self.num_experts}"

    def _rows_per_rank(self, counts: list[int]) -> list[int]:
        return [sum(counts[lo:hi]) for lo, hi in zip(self.bounds[:-1], self.bounds[1:], strict=True)]

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor, impl: Impl = "reference") -> Tensor:
        """As `layers.Experts.forward`: x (N, D); weights, experts (N, k) -> (N, D), bit-identical to one process."""
        if torch.is_grad_enabled() and x.requires_grad:  # training: the input's gradient summed over the ranks
            x = SumGradients.apply(x, self.comm)
        if impl == "fast":
            return self._sorted(x, weights, experts, "auto")
        return self._reference(x, weights, experts)

    def per_row(self, x: Tensor, weights: Tensor, experts: Tensor, row_length: int, impl: Impl = "reference"
                ) -> Tensor:
        """As `layers.Experts.per_row` (continuous batching): a row computes what it would in a batch of its own."""
        if impl == "fast":
            return self._sorted(x, weights, experts, "padded")
        return torch.cat([self.forward(x[r:r + row_length], weights[r:r + row_length], experts[r:r + row_length])
                          for r in range(0, x.shape[0], row_length)])

    def _sorted(self, x: Tensor, weights: Tensor, experts: Tensor, backend: str) -> Tensor:
        """`kernels.moe_experts` with its middle part (`expert_rows`) split across the ranks."""
        k = experts.shape[1]
        order, counts = kernels.sort_slots(experts, self.num_experts)
        sizes = counts.tolist()
        rows = self._rows_per_rank(sizes)
        lo = sum(rows[:self.comm.rank])
        xs = x.index_select(0, order[lo:lo + rows[self.comm.rank]] // k)  # this rank's experts' rows
        y = kernels.expert_rows(xs, counts[self.first:self.last], self.gate_up_proj, self.down_proj,
                                backend=backend)  # type: ignore[arg-type]
        return kernels.combine_slots(GatherRows.apply(y, self.comm, rows), order, weights, x.dtype)

    def _reference(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """`layers.Experts.forward` split: this rank's experts' weighted outputs, then all of them added in ascending
        expert id on every rank."""
        picked = [torch.where(experts.T == e) for e in range(self.num_experts)]  # (slot, token) per expert
        mine = []
        for e in range(self.first, self.last):
            slot, token = picked[e]
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up_proj[e - self.first]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e - self.first])
            mine.append((y * weights[token, slot, None]).to(x.dtype))
        local = torch.cat(mine) if mine else x.new_zeros(0, x.shape[1])
        rows = GatherRows.apply(local, self.comm, self._rows_per_rank([t.numel() for _, t in picked]))
        out, lo = torch.zeros_like(x), 0
        for _, token in picked:
            if token.numel():
                out = out.index_add(0, token, rows[lo:lo + token.numel()])
                lo += token.numel()
        return out


def shard_experts(model: nn.Module, comm: Comm, trainable: bool = False) -> None:
    """Swap every layer's `experts` for this rank's `ShardedExperts` (the router stays whole on every rank)."""
    for block in model.layers:
        if getattr(block, "is_moe", False):
            block.experts = ShardedExperts(block.experts, comm, trainable)


def expert_names(model: nn.Module) -> dict[str, ShardedExperts]:
    """The parameter names (as `model.named_parameters` gives them) of its sharded experts -> their module."""
    return {f"{name}.{p}": m for name, m in model.named_modules() if isinstance(m, ShardedExperts)
            for p in ("gate_up_proj", "down_proj")}
