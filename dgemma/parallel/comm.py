"""The collectives that parallel generation runs, over one torch.distributed process group, each timed (the time a
rank spends in them is what runs/bench_parallel.py reports as the communication share of a step).

    sum_in_rank_order(partial)    every rank's partial result (row-parallel projections), summed in rank order on
                                  every rank: an all_gather, then ((p0 + p1) + p2) + ..., never an all_reduce, whose
                                  reduction order is the backend's and may differ between ranks and runs
    gather_rows(rows, sizes)      every rank's rows (its experts' outputs), concatenated in rank order (an
                                  all_gather of the rows padded to the longest; gloo takes equal shapes only)

Both leave identical bits on every rank, so every rank's sampler draws the same tokens.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor


class Comm:
    """One process group as parallel generation sees it: this rank, the world size, the two collectives, and the
    seconds spent in them since `seconds` was last reset."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.seconds = 0.0
        self.calls = 0

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size})"

    def _all_gather(self, t: Tensor) -> list[Tensor]:
        if self.world_size == 1:  # a group of one: nothing to exchange
            return [t]
        started = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return parts

    def sum_in_rank_order(self, partial: Tensor) -> Tensor:
        """The sum over ranks of `partial` (the same shape on every rank), added in rank order on every rank."""
        parts = self._all_gather(partial)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def gather_rows(self, rows: Tensor, sizes: list[int]) -> Tensor:
        """(sum(sizes), D): rank r's `rows` (sizes[r], D) after those of ranks < r. Every rank passes the same
        `sizes` (computed from values every rank holds)."""
        assert rows.shape[0] == sizes[self.rank], (rows.shape, sizes, self.rank)
        longest = max(sizes)
        if longest == 0:
            return rows
        padded = rows.new_zeros(longest, *rows.shape[1:])
        padded[:rows.shape[0]] = rows
        return torch.cat([p[:n] for p, n in zip(self._all_gather(padded), sizes, strict=True)])
