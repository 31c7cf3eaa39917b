"""The model's numeric kernels: plain functions of tensors (no model, no cache, nothing above torch). Each computes
what a readable twin computes, and tests/model/test_kernels.py pins the two together.

    kernel                            readable twin
    moe_experts                       model.Experts.forward (a torch.where per expert)
      = sort_slots, expert_rows, combine_slots (also run apart by dgemma/parallel/experts.py)
    logits_into                       DiffusionGemma.logits

The attention kernels and masks live in dgemma/model/attention.py; the sampling kernels (the head fused with
temperature, statistics and draw) in dgemma/sampling/kernels.py. The kernels agree with their twins to rounding (1e-4
on fp32 logits), not bit for bit.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# --- routed experts -------------------------------------------------------------------------------------------------

def _grouped_mm_available(x: Tensor, *weights: Tensor) -> bool:
    """Whether one grouped matmul can run every expert: `torch.nn.functional.grouped_mm` (torch >= 2.10, CPU and CUDA)
    or `torch._grouped_mm`, bf16 on CUDA (compute capability >= 8.0), not float64 on CPU, inference only (its CPU
    backward is incomplete), plain weight tensors (not quantized: dgemma/weights/quantize.py), and 16-byte aligned rows
    and pointers, which the kernel requires."""
    if any(type(w) not in (Tensor, torch.nn.Parameter) for w in weights):  # quantized or offloaded experts
        return False
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None or (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))):
        return False
    if x.device.type == "cuda":
        capability = torch.cuda.get_device_capability(x.device)
        if x.dtype != torch.bfloat16 or capability < (8, 0):
            return False
        version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        if version < (2, 9) and capability[0] != 9:
            return False  # before torch 2.9, torch._grouped_mm runs on Hopper only
    elif x.device.type != "cpu" or not hasattr(F, "grouped_mm"):
        return False
    elif x.dtype not in (torch.float32, torch.bfloat16, torch.float16):  # the CPU kernel refuses float64 (eval's
        return False                                                       # judge scores in float64)
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # inductor lowers grouped_mm for bf16 only
        return False
    size = x.element_size()
    dims = [x.shape[-1]] + [w.shape[-1] for w in weights] + [w.shape[-2] for w in weights]
    if torch.compiler.is_compiling():  # no pointers to check while tracing; inductor allocates aligned buffers
        return all(d * size % 16 == 0 for d in dims)
    return all(d * size % 16 == 0 for d in dims) and all(t.data_ptr() % 16 == 0 for t in (x, *weights))


def _grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w.transpose(1, 2), offs=offsets)  # rows [offsets[e-1], offsets[e]) @ w[e].T


def _fetch(counts: list[int], gate_up_proj: Tensor, down_proj: Tensor) -> None:
    """Offloaded experts (dgemma/weights/offload.py) start copying the experts with rows to the device, in loop
    order."""
    if hasattr(gate_up_proj, "fetch"):
        for e in (e for e, n in enumerate(counts) if n):
            gate_up_proj.fetch([e])
            down_proj.fetch([e])  # type: ignore[attr-defined]


def _expert_loop(xs: Tensor, counts: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """One gated-GELU matmul pair per expert on its contiguous block of rows xs (N*k, D); counts (E,)."""
    y = torch.empty_like(xs)
    lo = 0
    sizes = counts.tolist()  # the one host read per layer (free on CPU)
    _fetch(sizes, gate_up_proj, down_proj)
    for e, n in enumerate(sizes):
        if n:
            gate, up = F.linear(xs[lo:lo + n], gate_up_proj[e]).chunk(2, dim=-1)
            y[lo:lo + n] = F.linear(F.gelu(gate, approximate="tanh") * up, down_proj[e])
        lo += n
    return y


ROW_BLOCK = 16  # "padded" expert matmuls run on whole blocks of this many rows


def _padded_expert_loop(xs: Tensor, counts: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """`_expert_loop` with each expert's rows padded to whole blocks of ROW_BLOCK: a row's result then does not depend
    on how many other rows share its expert (CPU matmul kernels round a row differently for a handful of rows than
    for many, but the same for any number of whole blocks; tests/serving/test_engine.py checks this where it runs)."""
    y = torch.empty_like(xs)
    lo = 0
    sizes = counts.tolist()
    _fetch(sizes, gate_up_proj, down_proj)
    for e, n in enumerate(sizes):
        if n:
            rows = xs.new_zeros(-(-n // ROW_BLOCK) * ROW_BLOCK, xs.shape[1])
            rows[:n] = xs[lo:lo + n]
            gate, up = F.linear(rows, gate_up_proj[e]).chunk(2, dim=-1)
            y[lo:lo + n] = F.linear(F.gelu(gate, approximate="tanh") * up, down_proj[e])[:n]
        lo += n
    return y


@functools.cache
def register_expert_loop_op() -> None:
    """Register `_expert_loop` as the custom op `dgemma::expert_loop` (`torch.ops.dgemma.expert_loop`), at the
    compile call site rather than at import, so torch.compile(fullgraph=True) sees the loop as one call with a known
    output shape (inference). Idempotent: a second call is a no-op (torch refuses a second registration)."""
    op = torch.library.custom_op("dgemma::expert_loop", mutates_args=())(_expert_loop)
    op.register_fake(lambda xs, counts, gate_up_proj, down_proj: torch.empty_like(xs))


def moe_experts(x: Tensor, weights: Tensor, experts: Tensor, gate_up_proj: Tensor, down_proj: Tensor, *,
                backend: Literal["auto", "loop", "grouped", "padded"] = "auto") -> Tensor:
    """Twin of `model.Experts.forward`: x (N, D), weights, experts (N, k) -> (N, D).

    Sorts the N*k token slots by expert once (`sort_slots`: a stable argsort plus a bincount) so each expert's tokens
    are one contiguous block, then runs one matmul per expert on its block ("loop"), or all of them as one grouped
    matmul ("grouped", no host sync, capturable by CUDA graphs) (`expert_rows`). The weighted expert outputs are
    summed over the k slots in fp32 (`combine_slots`; the reference rounds each slot to the model dtype before
    adding); "auto" picks grouped where it runs (not for quantized or offloaded experts: dgemma/weights/quantize.py,
    dgemma/weights/offload.py). "padded" (`_padded_expert_loop`) makes each token's result independent of the other
    tokens in the batch, which continuous batching needs (a request's tokens must not depend on who else is served).
    The three parts are separate so that expert parallelism (dgemma/parallel/experts.py) runs the same ones, each rank
    the rows of its own experts, and combines them exactly as here."""
    k = experts.shape[1]
    order, counts = sort_slots(experts, gate_up_proj.shape[0])
    xs = x.index_select(0, order // k)  # (N*k, D) in expert order (faster than x[order // k], also backward)
    y = expert_rows(xs, counts, gate_up_proj, down_proj, backend=backend)
    return combine_slots(y, order, weights, x.dtype)


def sort_slots(experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """The N*k token slots (slot s = token * k + j) in expert order: `order` (N*k,), a stable argsort (token order
    kept inside an expert's block), and `counts` (E,), each expert's number of slots (a bincount of static length)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def expert_rows(xs: Tensor, counts: Tensor, gate_up_proj: Tensor, down_proj: Tensor, *,
                backend: Literal["auto", "loop", "grouped", "padded"] = "auto") -> Tensor:
    """Each expert's gated-GELU MLP on its contiguous block of rows: xs (R, D) sorted by expert, counts (E,) rows per
    expert (`sort_slots`), the experts' weights (E, 2*Ie, D) and (E, D, Ie) -> (R, D), the same order."""
    if backend == "grouped" or (backend == "auto" and _grouped_mm_available(xs, gate_up_proj, down_proj)):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = _grouped_mm(xs, gate_up_proj, offsets).chunk(2, dim=-1)
        return _grouped_mm((F.gelu(gate, approximate="tanh") * up).contiguous(), down_proj, offsets)
    if backend == "padded":
        return _padded_expert_loop(xs, counts, gate_up_proj, down_proj)
    # Traced without gradients (the compiled static step, a compiled block's self-conditioning pre-pass), the loop,
    # whose sizes are data, is one opaque op (register_expert_loop_op); traced for training, it breaks the graph.
    if torch.compiler.is_compiling() and not torch.is_grad_enabled():
        return torch.ops.dgemma.expert_loop(xs, counts, gate_up_proj, down_proj)
    return _expert_loop(xs, counts, gate_up_proj, down_proj)


def combine_slots(y: Tensor, order: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """The expert outputs y (N*k, D), in `order` (`sort_slots`), back in slot order (a gather: no scatter of rows),
    each times its routing weight (N, k) and the k slots summed in fp32, then cast to `dtype`: (N, D)."""
    N, k = weights.shape
    unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    slots = y.index_select(0, unsort).view(N, k, -1)
    return (slots.float() * weights[..., None]).sum(1).to(dtype)


# --- the head -------------------------------------------------------------------------------------------------------

@torch.no_grad()
def logits_into(rows: Tensor, weight: Tensor, softcap: float | None, out: Tensor | None = None) -> Tensor:
    """Twin of `DiffusionGemma.logits` for rows (R, D) and the tied head `weight` (V, D), written into `out` (R, V)
    fp32 when given (no allocation). The softcap is 2c * sigmoid(2x / c) - c, which is c * tanh(x / c) to ~1e-5 and
    runs ~3x faster on a CPU."""
    if out is None:
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=rows.device)
    if weight.dtype == torch.float32:
        torch.mm(rows, weight.t(), out=out)
    else:
        out.copy_(F.linear(rows, weight))
    if softcap is not None:
        out.mul_(2.0 / softcap).sigmoid_().mul_(2.0 * softcap).sub_(softcap)
    return out
