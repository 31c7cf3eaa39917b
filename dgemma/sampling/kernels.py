"""The sampling kernels: the head fused with temperature, sampling statistics, draw and the next self-conditioning
input, plain functions of tensors that the fast sampler (dgemma/sampling/fast_sampler.py) runs. Each computes what a
readable twin computes, and tests/sampling/test_kernels.py pins the two together.

    kernel                            readable twin
    tempered_stats, draw_cdf,         rules.token_entropy, torch.argmax, rules.draw_tokens (multinomial) and
      draw_race, head_and_sample      DiffusionGemma.soft_embedding, fused and row-chunked
    one_pass_head_and_sample          the same, in one pass over the vocabulary (online softmax, block by block)

They agree with their twins to rounding (1e-4 on fp32 logits), not bit for bit, and the draws differ: inverse-CDF or
exponential-race sampling instead of torch.multinomial, which is slow on CPU and synchronises on CUDA. The head itself
(`logits_into`) is a model kernel (dgemma/model/kernels.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from dgemma.model.kernels import logits_into

Draw = Literal["cdf", "race"]

CPU_CHUNK_BYTES = 256 * 2**20  # rows of (rows, V) fp32 logits per chunk; the head matmul wants many rows at once
CUDA_CHUNK_BYTES = 2**30  # on both, chunks only bound memory (a batch of 262k-vocabulary canvases is GBs)
SHIFTED_LOGIT_FLOOR = -70.0  # z - max(z) is clamped here: exp(-70) ~ 4e-31 keeps every probability a normal float
# (subnormals are ~100x slower on x86); the mass this gives the unlikely tokens is below 1e-24 in all


def tempered_stats(z: Tensor, work: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Probabilities, argmax and entropy (nats) of softmax(z) for tempered logits z (R, V) fp32: fast twin of
    softmax + torch.argmax + rules.token_entropy. H = log s - sum(e * d) / s with d = z - max, e = exp(d), which
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
