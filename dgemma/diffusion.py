"""The training side of uniform-state block diffusion (seed 003): forward process and losses (the masks of each
objective: dgemma/attention.py).

Forward process (D3PM, uniform state). A clean canvas x0 at noise level t in {1..T} is corrupted in one shot:

    alpha_bar(t) = cos^2(pi/2 * t/T)                 1 at t=0 (clean) -> 0 at t=T (pure noise)
    q(x_t | x0): keep x0 with probability alpha_bar(t), else a uniform random token (any of the V, x0 included)

Every canvas of a training sequence draws its own t. The model predicts x0 (cross-entropy against the clean
tokens at every canvas position).

Objectives, all one forward pass through `DiffusionGemma.sequence_hidden` with a mask per layer type:

    clean-context   [x0 ; x_t]: the clean copy runs in the encoder role (causal, what `commit` does) and each
                    noisy canvas b attends to the clean canvases before it plus itself (what `denoise` does):
                    exactly the sampling-time situation, in one pass (as Block Diffusion trains).
    noisy-context   x_t alone: canvas b attends to the (noisy) canvases before it and itself; block-causal
                    (seed 003 section 2.1).
    ar              x0 alone, causal, next-token loss: the autoregressive baseline on the same backbone.
    sft             (`sft_loss`) chats: the clean prompt and answer canvases in the encoder role, each noisy answer
                    canvas against the clean tokens before it (dgemma/sft.py packs the rows and builds the masks);
                    the loss covers the answer tokens only.

Sliding-window layers keep their sampling-time visibility in every mask: an encoder query sees `sliding_window`
keys including itself; a canvas sees the last `sliding_window - 1` tokens before it plus itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dgemma.attention import causal_masks, clean_context_masks, noisy_context_masks
from dgemma.model import DiffusionGemma
from dgemma.sft import ChatBatch, sft_masks

Objective = Literal["clean-context", "noisy-context", "ar"]
OBJECTIVES = ("clean-context", "noisy-context", "ar")


# --- forward process ------------------------------------------------------------------------------------------

def alpha_bar(t: Tensor, num_steps: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Probability that a token is still clean at noise level t (cosine schedule), computed in float64 and returned
    in `dtype`: float32 for corruption, float64 for the NELBO (dgemma/nelbo.py), whose logs need it near t = 0."""
    return torch.cos(math.pi / 2 * t.double() / num_steps).pow(2).to(dtype)


def sample_canvas_t(batch: int, num_canvases: int, num_steps: int, generator: torch.Generator | None = None,
                    device: torch.device | None = None) -> Tensor:
    """One noise level per canvas, uniform on {1..T}: (B, num_canvases) int64."""
    return torch.randint(1, num_steps + 1, (batch, num_canvases), generator=generator, device=device)


def q_sample(x0: Tensor, t: Tensor, num_steps: int, canvas_length: int, vocab_size: int,
             generator: torch.Generator | None = None, batch_rows: tuple[int, int] | None = None) -> Tensor:
    """Corrupt x0 (B, S) with per-canvas levels t (B, S / canvas_length) in one step of q(x_t | x0). With
    `batch_rows` (first, total), x0 is rows [first, first + B) of a batch of `total`: the draws are made for the
    whole batch and these rows kept, so they do not depend on how the batch is split (distributed training)."""
    keep_prob = alpha_bar(t, num_steps).repeat_interleave(canvas_length, dim=1)  # (B, S)
    keep = _draw(torch.rand, x0.shape, batch_rows, generator, x0.device) < keep_prob
    noise = _draw(lambda *a, **k: torch.randint(0, vocab_size, *a, **k), x0.shape, batch_rows, generator, x0.device)
    return torch.where(keep, x0, noise)


def _draw(sample: Any, shape: torch.Size | tuple[int, ...], batch_rows: tuple[int, int] | None,
          generator: torch.Generator | None, device: torch.device) -> Tensor:
    """sample(shape) for rows [first, first + shape[0]) of a draw over `total` rows (batch_rows = (first, total))."""
    if batch_rows is None:
        return sample(shape, generator=generator, device=device)
    first, total = batch_rows
    return sample((total, *shape[1:]), generator=generator, device=device)[first:first + shape[0]]


# --- losses -----------------------------------------------------------------------------------------------------

def x0_cross_entropy(model: DiffusionGemma, final: Tensor, targets: Tensor, chunk_rows: int | None = 1024
                     ) -> Tensor:
    """Mean cross-entropy of the model's head on final hidden states (N, D) against `targets` (N,).

    With `chunk_rows`, rows go through the head a chunk at a time under activation checkpointing, so at most
    (chunk_rows, V) fp32 logits are alive, forward or backward, instead of (N, V); the per-row math is the
    eager loss's (chunk_rows=None), so loss and gradients agree to rounding."""
    if chunk_rows is None or final.shape[0] <= chunk_rows:
        return F.cross_entropy(model.logits(final), targets)

    def chunk_loss(h: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(model.logits(h), y, reduction="sum")

    total = final.new_zeros((), dtype=torch.float32)
    for lo in range(0, final.shape[0], chunk_rows):
        total = total + checkpoint(chunk_loss, final[lo:lo + chunk_rows], targets[lo:lo + chunk_rows],
                                   use_reentrant=False)
    return total / final.shape[0]


@torch.no_grad()
def soft_embedding(model: DiffusionGemma, final: Tensor, chunk_rows: int = 1024) -> Tensor:
    """Self-conditioning input from a pre-pass's final hidden states (B, L, D): softmax(head) @ E * sqrt(D), in row
    chunks so only (chunk_rows, V) probabilities exist at a time (the full-vocabulary product is the hazard)."""
    flat = final.reshape(-1, final.shape[-1])
    return torch.cat([model.soft_embedding(model.logits(flat[lo:lo + chunk_rows]))
                      for lo in range(0, flat.shape[0], chunk_rows)]).view(final.shape)


@dataclass
class LossOutput:
    loss: Tensor  # what backward runs on
    x0_loss: Tensor  # diffusion x0 cross-entropy (nats/token), or the AR loss for `ar`
    ar_loss: Tensor | None  # next-token loss on the clean stream (clean-context with ar_weight > 0)
    tokens: int  # target tokens in the loss
    self_conditioned: bool


def training_loss(model: DiffusionGemma, x0: Tensor, *, objective: Objective = "clean-context", num_steps: int = 16,
                  self_conditioning_prob: float = 0.5, ar_weight: float = 0.0, chunk_rows: int | None = 1024,
                  generator: torch.Generator | None = None, batch_rows: tuple[int, int] | None = None
                  ) -> LossOutput:
    """One training loss on clean token windows x0 (B, S); for `ar`, x0 holds S = seq_len + 1 tokens.

    Every random draw (noise levels, corruption, the self-conditioning coin) comes from `generator`, so a step is
    reproducible from its seed. With `batch_rows` (first, total), x0 is rows [first, first + B) of a micro-batch of
    `total` windows split across ranks: every draw is made for all `total` rows and these rows kept, and the coin
    is the whole micro-batch's, so the ranks together compute what one process with the whole batch does."""
    cfg = model.config
    L, W, V = cfg.canvas_length, cfg.sliding_window, cfg.vocab_size
    device = x0.device
    if objective == "ar":
        inputs, targets = x0[:, :-1], x0[:, 1:]
        T = inputs.shape[1]
        pos = torch.arange(T, device=device)[None]
        hidden = model.sequence_hidden(inputs, pos, causal_masks(T, W, device), num_clean=T)
        loss = x0_cross_entropy(model, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), chunk_rows)
        return LossOutput(loss, loss.detach(), None, targets.numel(), False)
    B, T = x0.shape
    if T % L:
        raise ValueError(f"training windows of {T} tokens are not a whole number of canvases of {L}")
    t = _draw(lambda shape, **k: sample_canvas_t(shape[0], shape[1], num_steps, **k), (B, T // L), batch_rows,
              generator, device)
    xt = q_sample(x0, t, num_steps, L, V, generator, batch_rows)
    use_sc = bool(torch.rand((), generator=generator, device=device) < self_conditioning_prob)
    pos = torch.arange(T, device=device)
    level = (t.float() / num_steps).repeat_interleave(L, dim=1)  # (B, T): each token's canvas noise level
    if objective == "clean-context":
        tokens, positions, num_clean = torch.cat([x0, xt], 1), torch.cat([pos, pos])[None], T
        masks = clean_context_masks(T, L, W, device)
        level = torch.cat([torch.zeros_like(level), level], 1)  # the clean copy is at t = 0
    elif objective == "noisy-context":
        tokens, positions, num_clean = xt, pos[None], 0
        masks = noisy_context_masks(T, L, W, device)
    else:
        raise ValueError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    soft = None
    if use_sc:  # pre-pass without gradient; its re-embedded posterior conditions the real pass (detached)
        with torch.no_grad():
            pre = model.sequence_hidden(tokens, positions, masks, num_clean=num_clean, t=level)
            soft = soft_embedding(model, pre[:, num_clean:], chunk_rows or 1024)
    hidden = model.sequence_hidden(tokens, positions, masks, num_clean=num_clean, soft=soft, t=level)
    D = hidden.shape[-1]
    x0_loss = x0_cross_entropy(model, hidden[:, num_clean:].reshape(-1, D), x0.reshape(-1), chunk_rows)
    loss, ar_loss = x0_loss, None
    if objective == "clean-context" and ar_weight > 0:  # the clean stream is a causal LM too
        ar_loss = x0_cross_entropy(model, hidden[:, : T - 1].reshape(-1, D), x0[:, 1:].reshape(-1), chunk_rows)
        loss = loss + ar_weight * ar_loss
    return LossOutput(loss, x0_loss.detach(), None if ar_loss is None else ar_loss.detach(), x0.numel(), use_sc)


def sft_loss(model: DiffusionGemma, batch: ChatBatch, *, num_steps: int = 16, self_conditioning_prob: float = 0.5,
             chunk_rows: int | None = 1024, generator: torch.Generator | None = None,
             batch_rows: tuple[int, int] | None = None) -> LossOutput:
    """The fine-tuning loss on packed chat rows (dgemma/sft.py): each answer canvas (B, N / L per row) draws its own
    noise level and is corrupted by q_sample; one pass over [clean ; x_t] under `sft.py:sft_masks`; cross-entropy of
    the x0 prediction over the answer tokens only (`batch.loss_mask`). Random draws in training_loss's order."""
    cfg = model.config
    L, V = cfg.canvas_length, cfg.vocab_size
    (B, N), C, device = batch.x0.shape, batch.clean.shape[1], batch.x0.device
    t = _draw(lambda shape, **k: sample_canvas_t(shape[0], shape[1], num_steps, **k), (B, N // L), batch_rows,
              generator, device)  # batch_rows: this rank's rows of the global batch's draws (training_loss's rule)
    xt = q_sample(batch.x0, t, num_steps, L, V, generator, batch_rows)
    use_sc = bool(torch.rand((), generator=generator, device=device) < self_conditioning_prob)
    tokens, positions = torch.cat([batch.clean, xt], 1), batch.positions
    masks = sft_masks(batch, L, cfg.sliding_window)
    level = torch.cat([torch.zeros(B, C, device=device), (t.float() / num_steps).repeat_interleave(L, dim=1)], 1)
    soft = None
    if use_sc:
        with torch.no_grad():
            pre = model.sequence_hidden(tokens, positions, masks, num_clean=C, t=level)
            soft = soft_embedding(model, pre[:, C:], chunk_rows or 1024)
    hidden = model.sequence_hidden(tokens, positions, masks, num_clean=C, soft=soft, t=level)
    keep = batch.loss_mask
    loss = x0_cross_entropy(model, hidden[:, C:][keep], batch.x0[keep], chunk_rows)
    return LossOutput(loss, loss.detach(), None, int(keep.sum()), use_sc)
