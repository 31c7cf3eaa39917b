"""The training side of uniform-state block diffusion (seed 003): the noise levels of a batch and the losses (the
forward process: dgemma/diffusion/noise.py; the bound's KLs and the posterior: dgemma/diffusion/likelihood.py; the masks
of each objective: dgemma/model/attention.py).

Forward process (D3PM, uniform state). A clean canvas x0 at noise level s in [0, 1] is corrupted in one shot:

    alpha(s) = cos^2(pi/2 * s)                       1 at s=0 (clean) -> 0 at s=1 (pure noise)
    q(x_s | x0): keep x0 with probability alpha(s), else a uniform random token (any of the V, x0 included)

Every canvas of a training sequence draws its own level: on the grid s = t/T, t in {1..T} (`time="discrete"`,
the T-step chain of seed 003: `alpha_bar(t, T) = alpha(t/T)`), or anywhere in (0, 1] (`time="continuous"`, the
chain's T -> infinity limit, whose bound is `continuous_kl`'s). The model predicts x0 (cross-entropy against the
clean tokens at every canvas position); a time-embedding model is told s.

Objectives, all one forward pass through `DiffusionGemma.sequence_hidden` with a mask per layer type:

    clean-context   [x0 ; x_t]: the clean copy runs in the encoder role (causal, what `commit` does) and each
                    noisy canvas b attends to the clean canvases before it plus itself (what `denoise` does):
                    exactly the sampling-time situation, in one pass (as Block Diffusion trains).
    noisy-context   x_t alone: canvas b attends to the (noisy) canvases before it and itself; block-causal
                    (seed 003 section 2.1).
    ar              x0 alone, causal, next-token loss: the autoregressive baseline on the same backbone.
    sft             (`sft_loss`) chats: the clean prompt and answer canvases in the encoder role, each noisy answer
                    canvas against the clean tokens before it (dgemma/data/sft.py packs the rows and builds the masks);
                    the loss covers the answer tokens only.

Sliding-window layers keep their sampling-time visibility in every mask: an encoder query sees `sliding_window`
keys including itself; a canvas sees the last `sliding_window - 1` tokens before it plus itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dgemma.data.sft import ChatBatch, sft_masks
from dgemma.diffusion.likelihood import continuous_kl, posterior_logits, reverse_kl
from dgemma.diffusion.noise import alpha, corrupt, draw_rows, observation_boost, q_sample
from dgemma.model.attention import causal_masks, clean_context_masks, noisy_context_masks
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.train.head_loss import fused_head_loss

Objective = Literal["clean-context", "noisy-context", "ar"]
OBJECTIVES = ("clean-context", "noisy-context", "ar")
T_SAMPLING = ("uniform", "stratified")  # how a micro-batch's canvases draw their noise levels
TIME = ("discrete", "continuous")  # levels on the grid {1..T} / T, or anywhere in (0, 1]
LOSS_WEIGHTING = ("x0", "elbo")  # how the levels' losses are weighted


# --- forward process ------------------------------------------------------------------------------------------

def sample_levels(batch: int, num_canvases: int, generator: torch.Generator | None = None,
                  device: torch.device | None = None, *, stratified: bool = False) -> Tensor:
    """One continuous noise level per canvas, uniform on (0, 1]: (B, num_canvases) float64. `stratified`: the
    n = B * num_canvases levels are the low-discrepancy set 1 - (i + U_i) / n, shuffled (`sample_canvas_t`'s rule
    without the grid), so each is still uniform and the batch covers (0, 1] evenly."""
    n = batch * num_canvases
    u = torch.rand(n, generator=generator, device=device, dtype=torch.float64)
    if stratified:
        u = (torch.arange(n, device=device, dtype=torch.float64) + u) / n
        u = u[torch.randperm(n, generator=generator, device=device)]
    return (1.0 - u).view(batch, num_canvases)  # (0, 1]: never exactly clean, where the bound's rate vanishes


def sample_canvas_t(batch: int, num_canvases: int, num_steps: int, generator: torch.Generator | None = None,
                    device: torch.device | None = None, *, stratified: bool = False) -> Tensor:
    """One noise level per canvas, uniform on {1..T}: (B, num_canvases) int64.

    `stratified`: the n = B * num_canvases levels of the call are a low-discrepancy set instead of n independent
    draws: u_i = (i + U_i) / n for i < n, shuffled, and t = ceil(u * T). Each level is still uniform on {1..T}
    (so every loss stays unbiased), but the batch covers the noise range evenly, which lowers the variance of the
    batch's loss (Kingma et al. 2021's low-discrepancy sampler, on the discrete grid)."""
    shape = (batch, num_canvases)
    if not stratified:
        return torch.randint(1, num_steps + 1, shape, generator=generator, device=device)
    n = batch * num_canvases
    u = (torch.arange(n, device=device, dtype=torch.float64)
         + torch.rand(n, generator=generator, device=device, dtype=torch.float64)) / n
    u = u[torch.randperm(n, generator=generator, device=device)]
    return torch.ceil(u * num_steps).long().clamp_(1, num_steps).view(shape)


# --- losses -----------------------------------------------------------------------------------------------------

def x0_cross_entropy(model: DiffusionGemma, final: Tensor, targets: Tensor, chunk_rows: int | None = 1024,
                     observed: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Mean cross-entropy of the model's head on final hidden states (N, D) against `targets` (N,): of the x0
    posterior given `observed` (x_s (N,), level (N,): `posterior_logits`), of the raw head without (next-token).

    With `chunk_rows`, rows go through the head a chunk at a time under activation checkpointing, so at most
    (chunk_rows, V) fp32 logits are alive, forward or backward, instead of (N, V); the per-row math is the
    eager loss's (chunk_rows=None), so loss and gradients agree to rounding. With the fast kernels (`fusable`) the
    fused head loss (dgemma/train/head_loss.py) computes the same loss and gradients chunk by chunk, without the
    checkpoint's second forward."""
    def chunk_loss(h: Tensor, y: Tensor, *obs: Tensor) -> Tensor:
        return F.cross_entropy(posterior_logits(model, h, *obs) if obs else model.logits(h), y, reduction="sum")

    if fusable(model, final):  # the same loss with the gradient computed chunk by chunk (train/head_loss.py)
        tokens, boost = (None, None) if observed is None or not model.config.observed_likelihood else \
            (observed[0], observation_boost(observed[1].expand(observed[0].shape), model.config.vocab_size))
        return fused_head_loss(final, model.embed_tokens.weight, targets, model.config.final_logit_softcapping,
                               chunk_rows, tokens, boost) / final.shape[0]
    obs = () if observed is None else observed
    if chunk_rows is None or final.shape[0] <= chunk_rows:
        return chunk_loss(final, targets, *obs) / final.shape[0]
    total = final.new_zeros((), dtype=torch.float32)
    for lo in range(0, final.shape[0], chunk_rows):
        sl = slice(lo, lo + chunk_rows)
        total = total + checkpoint(chunk_loss, final[sl], targets[sl], *[o[sl] for o in obs], use_reentrant=False)
    return total / final.shape[0]


def fusable(model: DiffusionGemma, final: Tensor) -> bool:
    """Whether `x0_cross_entropy` runs the fused head loss: the fast kernels (`impl="fast"`, training's default), an
    fp32 head outside autocast, a plain (not sharded) weight. Else the readable chunk loss runs."""
    weight = model.embed_tokens.weight
    return model.impl == "fast" and weight.dtype == final.dtype == torch.float32 and torch.is_grad_enabled() and \
        not torch.is_autocast_enabled(final.device.type) and type(weight.data) is torch.Tensor


@torch.no_grad()
def chunked_soft_embedding(model: DiffusionGemma, final: Tensor, chunk_rows: int = 1024,
                           observed: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Self-conditioning input from a pre-pass's final hidden states (B, L, D): `DiffusionGemma.soft_embedding` of
    the posterior's logits (`posterior_logits`; `observed`: x_s and levels (B, L)), softmax @ E * sqrt(D), in row
    chunks so only (chunk_rows, V) probabilities exist at a time (the full-vocabulary product is the hazard)."""
    flat = final.reshape(-1, final.shape[-1])
    obs = () if observed is None else tuple(o.reshape(-1) for o in observed)
    return torch.cat([model.soft_embedding(posterior_logits(model, flat[lo:lo + chunk_rows],
                                                            *[o[lo:lo + chunk_rows] for o in obs]))
                      for lo in range(0, flat.shape[0], chunk_rows)]).view(final.shape)


def self_conditioned_hidden(model: DiffusionGemma, tokens: Tensor, positions: Tensor, masks: Any, *, num_clean: int,
                            level: Tensor, self_conditioned: bool, chunk_rows: int | None) -> Tensor:
    """The training pass over `tokens` (the clean copy's `num_clean` tokens, then the noisy ones). With
    `self_conditioned`, a pre-pass without gradient first: its re-embedded posterior of the noisy tokens
    (`chunked_soft_embedding`, detached) conditions the real pass, as the sampler feeds back its last posterior."""
    soft = None
    if self_conditioned:
        with torch.no_grad():
            pre = model.sequence_hidden(tokens, positions, masks, num_clean=num_clean, t=level)
            soft = chunked_soft_embedding(model, pre[:, num_clean:], chunk_rows or 1024,
                                          (tokens[:, num_clean:], level[:, num_clean:]))
    return model.sequence_hidden(tokens, positions, masks, num_clean=num_clean, soft=soft, t=level)


def elbo_cross_entropy(model: DiffusionGemma, final: Tensor, targets: Tensor, xt: Tensor, t: Tensor,
                       num_steps: int | None, chunk_rows: int | None = 1024) -> tuple[Tensor, Tensor]:
    """The NELBO-weighted loss: an unbiased estimate of the bound's reverse-step terms per token, so the model is
    trained on exactly what `dgemma eval` reports (the prior term is a constant). Discrete time (`num_steps` T, t (N,)
    each token's canvas level in 1..T, t ~ U{1..T}): the mean over tokens of T * `reverse_kl`; continuous time
    (`num_steps` None, t (N,) the level in (0, 1], uniform): the mean of `continuous_kl`. Also returns the x0
    cross-entropy of the same logits (detached), for the log. Row chunks under activation checkpointing, as
    `x0_cross_entropy`; the KL runs in float64 (its logs need it near clean levels)."""

    def chunk(h: Tensor, y: Tensor, x: Tensor, tt: Tensor) -> tuple[Tensor, Tensor]:
        logits = posterior_logits(model, h, x, tt if num_steps is None else tt / num_steps)
        kl = (continuous_kl(logits, y, x, tt, chunk_rows=logits.shape[0]) if num_steps is None
              else num_steps * reverse_kl(logits, y, x, tt, num_steps, chunk_rows=logits.shape[0]))
        return kl.sum().float(), F.cross_entropy(logits.detach(), y, reduction="sum")

    rows = final.shape[0] if chunk_rows is None else chunk_rows
    kl_total = final.new_zeros((), dtype=torch.float32)
    ce_total = torch.zeros((), dtype=torch.float32, device=final.device)
    for lo in range(0, final.shape[0], rows):
        sl = slice(lo, lo + rows)
        args = (final[sl], targets[sl], xt[sl], t[sl])
        kl, ce = checkpoint(chunk, *args, use_reentrant=False) if chunk_rows is not None else chunk(*args)
        kl_total, ce_total = kl_total + kl, ce_total + ce
    return kl_total / final.shape[0], ce_total / final.shape[0]


@dataclass
class LossOutput:
    loss: Tensor  # what backward runs on
    cross_entropy: Tensor  # the objective's cross-entropy (nats/token): of the x0 prediction, or next-token for `ar`
    ar_loss: Tensor | None  # next-token loss on the clean stream (clean-context with ar_weight > 0)
    tokens: int  # target tokens in the loss
    self_conditioned: bool


def training_loss(model: DiffusionGemma, x0: Tensor, *, objective: Objective = "clean-context", num_steps: int = 16,
                  self_conditioning_prob: float = 0.5, ar_weight: float = 0.0, chunk_rows: int | None = 1024,
                  t_sampling: str = "uniform", loss_weighting: str = "x0", time: str = "discrete",
                  generator: torch.Generator | None = None, batch_rows: tuple[int, int] | None = None) -> LossOutput:
    """One training loss on clean token windows x0 (B, S); for `ar`, x0 holds S = seq_len + 1 tokens.

    Diffusion recipe switches: `t_sampling` "uniform" (each canvas's level drawn independently) or "stratified"
    (`sample_canvas_t`'s low-discrepancy set over the micro-batch); `loss_weighting` "x0" (plain cross-entropy of
    the x0 prediction: every level weighs its cross-entropy equally) or "elbo" (`elbo_cross_entropy`: each level
    weighs what it weighs in the NELBO); `time` "discrete" (levels t / T, t in {1..T}) or "continuous" (levels
    anywhere in (0, 1], `sample_levels`). `cross_entropy` is the x0 cross-entropy either way.

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
    if t_sampling not in T_SAMPLING or loss_weighting not in LOSS_WEIGHTING:
        raise ValueError(f"t_sampling must be one of {T_SAMPLING} and loss_weighting one of {LOSS_WEIGHTING}, got "
                         f"{t_sampling!r} and {loss_weighting!r}")
    stratified = t_sampling == "stratified"
    if time not in TIME:
        raise ValueError(f"time must be one of {TIME}, got {time!r}")
    if time == "continuous":
        t = draw_rows(lambda shape, **k: sample_levels(shape[0], shape[1], stratified=stratified, **k), (B, T // L),
                      batch_rows, generator, device)  # (B, C) float64 levels in (0, 1]
        xt = corrupt(x0, alpha(t), L, V, generator, batch_rows)
        level = t.float().repeat_interleave(L, dim=1)
    else:
        t = draw_rows(lambda shape, **k: sample_canvas_t(shape[0], shape[1], num_steps, stratified=stratified, **k),
                      (B, T // L), batch_rows, generator, device)
        xt = q_sample(x0, t, num_steps, L, V, generator, batch_rows)
        level = (t.float() / num_steps).repeat_interleave(L, dim=1)  # (B, T): each token's canvas noise level
    use_sc = bool(torch.rand((), generator=generator, device=device) < self_conditioning_prob)
    pos = torch.arange(T, device=device)
    if objective == "clean-context":
        tokens, positions, num_clean = torch.cat([x0, xt], 1), torch.cat([pos, pos])[None], T
        masks = clean_context_masks(T, L, W, device)
        level = torch.cat([torch.zeros_like(level), level], 1)  # the clean copy is at t = 0
    elif objective == "noisy-context":
        tokens, positions, num_clean = xt, pos[None], 0
        masks = noisy_context_masks(T, L, W, device)
    else:
        raise ValueError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    hidden = self_conditioned_hidden(model, tokens, positions, masks, num_clean=num_clean, level=level,
                                     self_conditioned=use_sc, chunk_rows=chunk_rows)
    D = hidden.shape[-1]
    final = hidden[:, num_clean:].reshape(-1, D)
    if loss_weighting == "elbo":
        loss, ce = elbo_cross_entropy(model, final, x0.reshape(-1), xt.reshape(-1),
                                      t.repeat_interleave(L, dim=1).reshape(-1),
                                      None if time == "continuous" else num_steps, chunk_rows)
    else:
        loss = ce = x0_cross_entropy(model, final, x0.reshape(-1), chunk_rows,
                                     (xt.reshape(-1), level[:, num_clean:].reshape(-1)))
    ar_loss = None
    if objective == "clean-context" and ar_weight > 0:  # the clean stream is a causal LM too
        ar_loss = x0_cross_entropy(model, hidden[:, : T - 1].reshape(-1, D), x0[:, 1:].reshape(-1), chunk_rows)
        loss = loss + ar_weight * ar_loss
    return LossOutput(loss, ce.detach(), None if ar_loss is None else ar_loss.detach(), x0.numel(), use_sc)


def sft_loss(model: DiffusionGemma, batch: ChatBatch, *, num_steps: int = 16, self_conditioning_prob: float = 0.5,
             chunk_rows: int | None = 1024, generator: torch.Generator | None = None,
             batch_rows: tuple[int, int] | None = None) -> LossOutput:
    """The fine-tuning loss on packed chat rows (dgemma/data/sft.py): each answer canvas (B, N / L per row) draws its
    own noise level and is corrupted by q_sample; one pass over [clean ; x_t] under `data/sft.py:sft_masks`;
    cross-entropy of the x0 prediction over the answer tokens only (`batch.loss_mask`). Random draws in training_loss's
    order."""
    cfg = model.config
    L, V = cfg.canvas_length, cfg.vocab_size
    (B, N), C, device = batch.x0.shape, batch.clean.shape[1], batch.x0.device
    t = draw_rows(lambda shape, **k: sample_canvas_t(shape[0], shape[1], num_steps, **k), (B, N // L), batch_rows,
              generator, device)  # batch_rows: this rank's rows of the global batch's draws (training_loss's rule)
    xt = q_sample(batch.x0, t, num_steps, L, V, generator, batch_rows)
    use_sc = bool(torch.rand((), generator=generator, device=device) < self_conditioning_prob)
    tokens, positions = torch.cat([batch.clean, xt], 1), batch.positions
    masks = sft_masks(batch, L, cfg.sliding_window)
    level = torch.cat([torch.zeros(B, C, device=device), (t.float() / num_steps).repeat_interleave(L, dim=1)], 1)
    hidden = self_conditioned_hidden(model, tokens, positions, masks, num_clean=C, level=level,
                                     self_conditioned=use_sc, chunk_rows=chunk_rows)
    keep = batch.loss_mask
    loss = x0_cross_entropy(model, hidden[:, C:][keep], batch.x0[keep], chunk_rows, (xt[keep], level[:, C:][keep]))
    return LossOutput(loss, loss.detach(), None, int(keep.sum()), use_sc)
