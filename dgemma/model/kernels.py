"""Numeric kernels: plain functions of tensors (no model, no cache, nothing above torch). Each computes what a
readable twin computes, and tests/model/test_kernels.py pins the two together.

    kernel                            readable twin
    moe_experts                       model.Experts.forward (a torch.where per expert)
    logits_into                       DiffusionGemma.logits
    tempered_stats, draw_cdf,         sampling.token_entropy, torch.argmax, sampling.draw_tokens (multinomial) and
      draw_race, head_and_sample      DiffusionGemma.soft_embedding, fused and row-chunked
    one_pass_head_and_sample          the same, in one pass over the vocabulary (online softmax, block by block)

The attention kernels and masks live in dgemma/model/attention.py; the fast sampler loop that uses the sampling kernels
in dgemma/sampling/fast_sampler.py. The kernels agree with their twins to rounding (1e-4 on fp32 logits), not bit for
bit, and the draws differ: inverse-CDF or exponential-race sampling instead of torch.multinomial, which is slow on CPU
and synchronises on CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Draw = Literal["cdf", "race"]


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

    Sorts the N*k token slots by expert once (a stable argsort plus a bincount) so each expert's tokens are one
    contiguous block, then runs one matmul per expert on its block ("loop"), or all of them as one grouped matmul
    ("grouped", no host sync, capturable by CUDA graphs). The weighted expert outputs are summed over the k slots in
    fp32 (the reference rounds each slot to the model dtype before adding); "auto" picks grouped where it runs
    (not for quantized or offloaded experts: dgemma/weights/quantize.py, dgemma/weights/offload.py).
    "padded" (`_padded_expert_loop`) makes each token's result independent of the other tokens in the batch, which
    continuous batching needs (a request's tokens must not depend on who else is served)."""
    N, k = experts.shape
    E = gate_up_proj.shape[0]
    flat = experts.reshape(-1)  # slot s = token * k + j
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order kept inside a group
    counts = flat.new_zeros(E).scatter_add_(0, flat, torch.ones_like(flat))  # a bincount of static length E
    xs = x.index_select(0, order // k)  # (N*k, D) in expert order (faster than x[order // k], also backward)
    if backend == "grouped" or (backend == "auto" and _grouped_mm_available(x, gate_up_proj, down_proj)):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = _grouped_mm(xs, gate_up_proj, offsets).chunk(2, dim=-1)
        y = _grouped_mm((F.gelu(gate, approximate="tanh") * up).contiguous(), down_proj, offsets)
    elif backend == "padded":
        y = _padded_expert_loop(xs, counts, gate_up_proj, down_proj)
    # Traced without gradients (the compiled static step, a compiled block's self-conditioning pre-pass), the loop,
    # whose sizes are data, is one opaque op (register_expert_loop_op); traced for training, it breaks the graph.
    elif torch.compiler.is_compiling() and not torch.is_grad_enabled():
        y = torch.ops.dgemma.expert_loop(xs, counts, gate_up_proj, down_proj)
    else:
        y = _expert_loop(xs, counts, gate_up_proj, down_proj)
    unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    slots = y.index_select(0, unsort).view(N, k, -1)  # back to slot order (a gather: no scatter of rows)
    return (slots.float() * weights[..., None]).sum(1).to(x.dtype)  # (N, D): the k weighted slots summed in fp32


# --- sampling --------------------------------------------------------------------------------------------------------

CPU_CHUNK_BYTES = 256 * 2**20  # rows of (rows, V) fp32 logits per chunk; the head matmul wants many rows at once
CUDA_CHUNK_BYTES = 2**30  # on both, chunks only bound memory (a batch of 262k-vocabulary canvases is GBs)
SHIFTED_LOGIT_FLOOR = -70.0  # z - max(z) is clamped here: exp(-70) ~ 4e-31 keeps every probability a normal float
# (subnormals are ~100x slower on x86); the mass this gives the unlikely tokens is below 1e-24 in all


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


def tempered_stats(z: Tensor, work: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Probabilities, argmax and entropy (nats) of softmax(z) for tempered logits z (R, V) fp32: fast twin of
    softmax + torch.argmax + sampling.token_entropy. H = log s - sum(e * d) / s with d = z - max, e = exp(d), which
    has no cancellation when H is tiny (the stop rule compares a mean entropy with 0.005). Overwrites z (it ends up
    holding e * d); the probabilities go to `work` (R, V) if given, so a step allocates nothing of size V.
    On a CPU, `max` gives the maximum and its first index in one pass, ~4x faster than `argmax` alone, and the
    in-place product then a sum ~4x faster than a batched dot product (docs/benchmarks.md, "The CPU step")."""
    top, argmax = z.max(-1, keepdim=True)  # the first maximal index, as torch.argmax
    d = z.sub_(top).clamp_(min=SHIFTED_LOGIT_FLOOR)
    e = torch.exp(d, out=work) if work is not None else d.exp()
    s = e.sum(-1, keepdim=True)
    ed = d.mul_(e).sum(-1)  # sum(e * d) per row, in z's own storage (d is not needed after this)
    entropy = s.log().squeeze(-1) - ed / s.squeeze(-1)
    return e.div_(s), argmax.squeeze(-1), entropy


def draw_cdf(probs: Tensor, uniforms: Tensor, block: int = 1024) -> Tensor:
    """Inverse-CDF sampling, one draw per row: probs (R, V), uniforms (R,) in [0, 1) -> ids (R,), in two levels: the
    running sum over blocks of `block` tokens picks a block, the running sum inside it picks the token. The running
    sums are fp64 (a single fp32 cumsum over 262k tokens would blur the tail), block masses fp32 sums of at most
    `block` terms, and a zero-probability token is never drawn. One uniform per row (no (R, V) noise), about one read
    of `probs`, no host sync."""
    R, V = probs.shape
    whole = V - V % block
    masses = [probs[:, :whole].view(R, -1, block).sum(-1)] if whole else []
    if whole < V:
        masses.append(probs[:, whole:].sum(-1, keepdim=True))
    return _inverse_cdf(torch.cat(masses, 1).to(torch.float64).cumsum(-1), uniforms, probs, block)


def _inverse_cdf(cum: Tensor, uniforms: Tensor, values: Tensor, block: int, scale: Tensor | None = None) -> Tensor:
    """The two levels of `draw_cdf` given `cum` (R, blocks) fp64, the running sums of the block masses: a block by
    `uniforms` (R,), then a token by the running sum of `values` (R, V) inside it, which hold the block's masses
    divided by `scale` (R, blocks) where given (`one_pass_head_and_sample`'s exponentials)."""
    V = values.shape[1]
    target = uniforms.to(torch.float64)[:, None] * cum[:, -1:]
    b = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)  # (R, 1)
    rest = target - torch.where(b > 0, cum.gather(1, (b - 1).clamp_(min=0)), 0.0)
    if scale is not None:
        rest = rest / scale.gather(1, b).to(torch.float64)
    ids = b * block + torch.arange(block, device=values.device)  # (R, block)
    inner = torch.where(ids < V, values.gather(1, ids.clamp(max=V - 1)), 0.0).to(torch.float64).cumsum(-1)
    rest = torch.minimum(rest, inner[:, -1:] * (1 - 2**-40))  # rounding never steps past the block's last token
    j = torch.searchsorted(inner, rest, right=True).clamp_(max=block - 1)
    return (b * block + j).squeeze(-1).clamp_(max=V - 1)


def draw_race(probs: Tensor, exponentials: Tensor) -> Tensor:
    """Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) is distributed as p. (R, V) -> (R,)."""
    return (probs / exponentials).argmax(-1)


@dataclass
class StepDraws:
    draw: Tensor  # (B, L) one sample per position from the tempered distribution
    argmax: Tensor  # (B, L)
    entropy: Tensor  # (B, L) fp32 nats
    soft: Tensor | None  # (B, L, D) the next step's self-conditioning input, in the embedding dtype


class Workspace:
    """Two (rows, V) fp32 buffers reused by every step of a canvas: a fresh tensor of tens of MB costs a CPU more
    in page faults than the arithmetic done on it."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device):
        self.logits = torch.empty(rows, vocab_size, device=device)
        self.probs = torch.empty(rows, vocab_size, device=device)


@torch.no_grad()
def head_and_sample(final: Tensor, head: Callable[[Tensor, Tensor | None], Tensor], temperature: Tensor, *,
                    generator: torch.Generator | None = None, draw: Draw = "cdf", embed: Tensor | None = None,
                    embed_scale: float = 1.0, chunk_rows: int | None = None,
                    workspace: Workspace | None = None, observed: tuple[Tensor, Tensor] | None = None) -> StepDraws:
    """Head, temperature, sampling statistics and the next self-conditioning input, a row chunk at a time.

    final (B, L, D) -> per chunk: fp32 logits = head(rows, out) (written into `out`, a workspace buffer, when that
    is not None), z = logits / temperature (in place), probabilities, argmax,
    entropy, one draw, and soft = softmax(z in the embedding dtype) @ embed * embed_scale (the twin of
    `DiffusionGemma.soft_embedding` on the tempered logits that the reference feeds back). Neither (B, L, V) logits
    nor probabilities exist whole unless they fit in one chunk of `chunk_rows`. `observed` (tokens (B, L), boost
    (B, L)): added at each row's token before tempering (dgemma/diffusion/noise.py:observe, a model's
    `observed_likelihood`)."""
    B, L, D = final.shape
    R, device = B * L, final.device
    chunk = min(R, chunk_rows or R)
    rows = final.reshape(R, D)
    out_draw = torch.empty(R, dtype=torch.long, device=device)
    out_argmax = torch.empty(R, dtype=torch.long, device=device)
    out_entropy = torch.empty(R, dtype=torch.float32, device=device)
    soft = None if embed is None else torch.empty(R, embed.shape[1], dtype=embed.dtype, device=device)
    scale = torch.tensor(embed_scale).to(embed.dtype) if embed is not None else None  # rounded as in embed()
    # All rows' uniforms in one call: the chunk size does not change what is drawn.
    uniforms = torch.rand(R, generator=generator, device=device, dtype=torch.float64) if draw == "cdf" else None
    for lo in range(0, R, chunk):
        hi = min(R, lo + chunk)
        use_ws = workspace is not None and workspace.logits.shape[0] >= hi - lo
        z = head(rows[lo:hi], workspace.logits[:hi - lo] if use_ws else None)  # type: ignore[union-attr]
        if observed is not None:
            z.scatter_add_(1, observed[0].reshape(R, 1)[lo:hi], observed[1].reshape(R, 1)[lo:hi].to(z.dtype))
        z.div_(temperature)  # the reference's logits.div_(temp)
        p_sc = None
        if soft is not None and embed.dtype != torch.float32:  # the reference feeds back z in the embedding dtype
            p_sc = torch.softmax(z.to(embed.dtype), -1, dtype=torch.float32)
        probs, out_argmax[lo:hi], out_entropy[lo:hi] = tempered_stats(
            z, workspace.probs[:hi - lo] if use_ws else None)  # type: ignore[union-attr]
        if soft is not None:
            p = probs if p_sc is None else p_sc.to(embed.dtype)
            torch.mm(p, embed, out=soft[lo:hi]).mul_(scale)
        if uniforms is not None:
            out_draw[lo:hi] = draw_cdf(probs, uniforms[lo:hi])
        else:
            out_draw[lo:hi] = draw_race(probs, torch.empty_like(probs).exponential_(generator=generator))
    return StepDraws(out_draw.view(B, L), out_argmax.view(B, L), out_entropy.view(B, L),
                     None if soft is None else soft.view(B, L, -1))


def default_chunk_rows(vocab_size: int, device: torch.device) -> int:
    budget = CUDA_CHUNK_BYTES if device.type == "cuda" else CPU_CHUNK_BYTES
    return max(1, budget // (4 * vocab_size))


# --- one pass over the vocabulary -----------------------------------------------------------------------------------

VOCAB_BLOCK = 1024  # columns of the head per block: two (rows, block) fp32 tiles stay in a core's L2 cache


@torch.no_grad()
def one_pass_head_and_sample(final: Tensor, weight: Tensor, softcap: float | None, temperature: Tensor, *,
                             generator: torch.Generator | None = None, uniforms: Tensor | None = None,
                             embed_scale: float | None = None, block: int = VOCAB_BLOCK,
                             workspace: Workspace | None = None) -> StepDraws:
    """`head_and_sample` for an fp32 tied head in one pass over the vocabulary (online softmax): block by block of
    `block` tokens, the head's matmul, softcap and temperature, the block's maximum and its index, its exponentials
    (written once, over the logits), their sum, sum(e * d) for the entropy and their product with the block's
    embeddings for the next self-conditioning input; the blocks are then combined with each block's factor
    exp(m_block - m): the maximum and argmax (the first maximal index, as torch.argmax), the entropy
    H = log S - sum(e * d) / S, the soft embedding (p @ E * embed_scale, None without `embed_scale`) and one draw
    per row by inverse CDF over the block masses, then inside the chosen block over its stored exponentials (the
    two levels of `draw_cdf`, one uniform per row from `generator`, or `uniforms` (rows,) fp64 when given).
    `temperature`: 0-d, or (rows, 1) for one per row. The (rows, V) logits are never read again after their block:
    every elementwise pass runs on a block while it is in cache. `workspace` (at least rows x V): its
    buffers hold the exponentials and one block's scratch (allocated if None). Agrees with `head_and_sample` to
    rounding: a block's exponentials are floored at exp(-70) of the block's maximum rather than of the row's."""
    B, L, D = final.shape
    R, V = B * L, weight.shape[0]
    device = final.device
    rows = final.reshape(R, D)
    workspace = workspace or Workspace(R, V, device)
    buf = workspace.logits[:R]
    nb = -(-V // block)
    m = torch.empty(R, nb, device=device)
    first = torch.empty(R, nb, dtype=torch.long, device=device)
    s = torch.empty(R, nb, device=device)
    ed = torch.empty(R, nb, device=device)
    soft = None if embed_scale is None else torch.zeros(R, D, device=device)
    run_max = torch.full((R, 1), -torch.inf, device=device)
    e = workspace.probs.view(-1)[:R * min(block, V)].view(R, -1)  # one block's exponentials
    if uniforms is None:
        uniforms = torch.rand(R, generator=generator, device=device, dtype=torch.float64)
    for j, lo in enumerate(range(0, V, block)):
        hi = min(V, lo + block)
        z = buf[:, lo:hi]
        logits_into(rows, weight[lo:hi], softcap, z)
        z.div_(temperature)
        top, at = z.max(-1, keepdim=True)
        m[:, j:j + 1], first[:, j:j + 1] = top, at + lo
        d = z.sub_(top).clamp_(min=SHIFTED_LOGIT_FLOOR)
        eb = torch.exp(d, out=e[:, :hi - lo])
        s[:, j] = eb.sum(-1)
        ed[:, j] = d.mul_(eb).sum(-1)
        z.copy_(eb)  # the block's exponentials, for the draw
        if soft is not None:  # sum of p @ E in units of exp(the running maximum): rescale, add this block's e @ E
            new_max = torch.maximum(run_max, top)
            soft.mul_(torch.exp(run_max - new_max)).add_(torch.mm(eb, weight[lo:hi]).mul_(torch.exp(top - new_max)))
            run_max = new_max
    # combine the blocks
    M, jm = m.max(-1, keepdim=True)  # the first block holding the row's maximum
    c = torch.exp(m - M)  # (R, nb) each block's factor
    masses = s * c
    S = masses.sum(-1, keepdim=True)
    entropy = S.log().squeeze(-1) - (c * (ed + s * (m - M))).sum(-1) / S.squeeze(-1)
    argmax = first.gather(1, jm).squeeze(-1)
    draw = _inverse_cdf(masses.to(torch.float64).cumsum(-1), uniforms, buf, block, scale=c)
    out_soft = None
    if soft is not None:  # the running maximum is now M
        out_soft = soft.div_(S).to(weight.dtype).mul_(torch.tensor(embed_scale).to(weight.dtype)).view(B, L, D)
    return StepDraws(draw.view(B, L), argmax.view(B, L), entropy.view(B, L), out_soft)
