"""Per-row LoRA deltas: one forward pass in which each batch row runs the base model plus its own LoRA adapter, or
the base alone. dgemma/weights/adapters.py loads the adapters and stacks their factors (`Factors`); the model threads
one
`AdapterRows` through its layer loop (`DiffusionGemma.commit` / `denoise`, argument `adapters`), and each layer's
`LayerRows` adds the deltas where the base computes:

    projection (q/k/v/o_proj)   y = W x, then for the adapted rows only  y[r] += B[a] (A[a] x[r])
    routed experts              the adapted rows' tokens rerun the expert loop with W_e + B[a, e] A[a, e]

where a is row r's adapter and the scale (alpha / r, peft's `scaling`) is folded into B. A row without an adapter
(index -1), or whose adapter leaves a weight alone, gets no delta at all. Over one-row caches (continuous batching),
where every row is computed on its own, such a row is bit-identical to the base model on that row alone, whatever
the other rows run; over one batched cache the routed experts share their matmuls across rows (as they do without
adapters), so it matches to rounding. An adapted row agrees with its adapter merged into the weights (`lora.merge`)
to rounding (1e-4 on fp32 logits in tests/weights/test_adapters.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"  # the routed experts' adapted 3-D parameters


@dataclass(frozen=True)
class Factors:
    """One adapted weight's LoRA factors for the n adapters of a set, zero-padded to the largest rank r, the scale
    folded into B, so that adapter a's delta weight is B[a] @ A[a]. A projection: A (n, r, in), B (n, out, r); a
    routed experts' parameter (E, out, in): A (n, E, r, in), B (n, E, out, r). `has[a]`: whether adapter a adapts
    this weight at all (its factors are zeros otherwise, and its rows get no delta)."""

    A: Tensor
    B: Tensor
    has: tuple[bool, ...]


Stacks = Mapping[tuple[int, str], Factors]  # (layer, "q_proj" / ... / "experts.down_proj") -> the stacked factors


class AdapterRows:
    """Which adapter each row of a batch runs: `index[r]` is the adapter's position in `stacks` (the
    `AdapterSet.names` order), -1 the base model alone. Built for one pass (`AdapterSet.rows`); it keeps the stacks
    it was built with, so adding or removing an adapter from the set afterwards does not change it."""

    def __init__(self, stacks: Stacks, index: Sequence[int]):
        self.stacks, self.index = stacks, [int(i) for i in index]
        n = len(next(iter(stacks.values())).has) if stacks else 0
        bad = [i for i in self.index if not -1 <= i < n]
        if bad:
            raise ValueError(f"adapter index {bad[0]} is out of range: -1 (the base) or 0..{n - 1}")
        self._selected: dict[tuple[int, str], tuple[list[int], list[int]]] = {}

    def layer(self, i: int) -> LayerRows:
        """Layer i's view, which `Attention` and `Block` call."""
        return LayerRows(self, i)

    def selected(self, key: tuple[int, str], batch: int) -> tuple[list[int], list[int]]:
        """The rows whose adapter adapts weight `key`, and their adapters (host lists: no device sync)."""
        if batch != len(self.index):
            raise ValueError(f"adapters: {len(self.index)} rows given for a batch of {batch}")
        if key not in self._selected:
            factors = self.stacks.get(key)
            rows = [] if factors is None else [r for r, a in enumerate(self.index) if a >= 0 and factors.has[a]]
            self._selected[key] = rows, [self.index[r] for r in rows]
        return self._selected[key]


class LayerRows:
    """One layer's per-row deltas (`AdapterRows.layer`)."""

    def __init__(self, rows: AdapterRows, layer: int):
        self.rows, self.layer = rows, layer

    def linear(self, name: str, linear: nn.Module, x: Tensor) -> Tensor:
        """`linear(x)` for x (B, S, in), plus B[a] A[a] x on the rows whose adapter a adapts projection `name`; the
        other rows are left exactly as `linear` computed them."""
        y = linear(x)
        rows, ids = self.rows.selected((self.layer, name), x.shape[0])
        if not rows:
            return y
        f = self.rows.stacks[(self.layer, name)]
        at, which = torch.tensor(rows, device=x.device), torch.tensor(ids, device=x.device)
        low = torch.bmm(x.index_select(0, at), f.A[which].transpose(1, 2))  # (R, S, r)
        return y.index_add(0, at, torch.bmm(low, f.B[which].transpose(1, 2)))

    def experts(self, module: nn.Module, x: Tensor, weights: Tensor, experts: Tensor, out: Tensor,
                row_length: int) -> Tensor:
        """The routed experts' output `out` (N, D) for tokens x (N, D) in rows of `row_length` tokens, with the
        tokens of each row whose adapter adapts the experts recomputed by `adapted_experts`, one row at a time (a
        row's result does not depend on the other rows); the other rows are left as they are."""
        gate_up, down = (self.rows.stacks.get((self.layer, k)) for k in (GATE_UP, DOWN))
        batch = x.shape[0] // row_length
        rows = sorted({*self.rows.selected((self.layer, GATE_UP), batch)[0],
                       *self.rows.selected((self.layer, DOWN), batch)[0]})
        if not rows:
            return out
        out = out.clone()
        for r in rows:
            a, span = self.rows.index[r], slice(r * row_length, (r + 1) * row_length)
            out[span] = adapted_experts(module, x[span], weights[span], experts[span], _factors(gate_up, a),
                                        _factors(down, a))
        return out


def _factors(f: Factors | None, a: int) -> tuple[Tensor, Tensor] | None:
    return (f.A[a], f.B[a]) if f is not None and f.has[a] else None


def project(name: str, linear: nn.Module, x: Tensor, lora: LayerRows | None) -> Tensor:
    """Projection `name` of x: exactly `linear(x)` without adapters, else with the adapted rows' deltas."""
    return linear(x) if lora is None else lora.linear(name, linear, x)


def adapted_experts(module: nn.Module, x: Tensor, weights: Tensor, experts: Tensor,
                    gate_up: tuple[Tensor, Tensor] | None, down: tuple[Tensor, Tensor] | None) -> Tensor:
    """`model.Experts.forward`'s reference loop with expert e's weights W_e + B[e] A[e]: `gate_up` and `down` are
    one adapter's factors (A (E, r, in), B (E, out, r), the scale folded into B) of the two expert parameters, or
    None for one it leaves alone. x (N, D); weights, experts (N, k) -> (N, D)."""
    out = torch.zeros_like(x)
    for e in range(module.gate_up_proj.shape[0]):
        slot, token = torch.where(experts.T == e)
        if token.numel() == 0:
            continue
        h = x[token]
        gate, up = _plus_delta(F.linear(h, module.gate_up_proj[e]), h, gate_up, e).chunk(2, dim=-1)
        h = F.gelu(gate, approximate="tanh") * up
        y = _plus_delta(F.linear(h, module.down_proj[e]), h, down, e)
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


def _plus_delta(y: Tensor, x: Tensor, factors: tuple[Tensor, Tensor] | None, e: int) -> Tensor:
    """y + B[e] A[e] x, or y itself without factors."""
    if factors is None:
        return y
    A, B = factors
    return y + F.linear(F.linear(x, A[e]), B[e])
