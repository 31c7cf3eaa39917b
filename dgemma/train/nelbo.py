"""The NELBO of uniform-state block diffusion and the statistics of held-out estimates (docs/evaluation.md, section 1).

    NELBO   an upper bound on the held-out NLL of the uniform-state D3PM with the cosine schedule
            (`dgemma.train.diffusion.alpha`, the schedule training uses), canvas by canvas given the clean prefix
            (block-autoregressive):
                NLL(x) <= sum_b NELBO(canvas_b | canvases < b)
            T steps: prior KL + sum over t of the reverse-step KLs (`reverse_kl`), estimated by Monte Carlo over
            stratified t (`stratified_t`, `window_nelbo`); continuous time (T -> infinity): prior KL + the integral
            over s in (0, 1] of `continuous_kl`, by stratified Monte Carlo over s (`window_nelbo_continuous`). The
            model's p(x0 | x_t) comes from one of the training forwards (`clean_context_posterior`,
            `noisy_context_posterior`).

`Estimate` is a per-token mean over held-out windows with its standard error; `dgemma.eval.evaluate` runs the loops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dgemma.attention import causal_masks, clean_context_masks, noisy_context_masks
from dgemma.model import DiffusionGemma
from dgemma.train.diffusion import (
    KL_CHUNK_ROWS,
    alpha,
    continuous_kl,
    corrupt,
    draw_rows,
    posterior_logits,
    prior_kl,
    q_sample,
    reverse_kl,
    sample_canvas_t,
    sample_levels,
)

# posterior(x0 (B, S), x_t (B, S), level (B, C) in [0, 1]) -> logits (B, S, V) of p(x0 | x_t of the canvas, clean
# canvases before); the discrete chain's step t is the level t / T.
Posterior = Callable[[Tensor, Tensor, Tensor], Tensor]


class EvalError(ValueError):
    """An input `dgemma eval` / `dgemma viz` cannot use; the message says which and why (exit 2 in the CLI)."""


# --- statistics ---------------------------------------------------------------------------------------------------

@dataclass
class Estimate:
    """A per-token mean over held-out windows, with the standard error of that mean (windows as the unit)."""

    mean: float  # nats per token
    se: float  # standard error of `mean`; nan with fewer than 2 windows
    windows: int
    tokens: int
    sd: float  # standard deviation of the per-window per-token values
    bytes: int | None = None  # UTF-8 bytes of the scored tokens' text, for bits per byte

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.bytes else self.mean * self.tokens / (math.log(2) * self.bytes)

    def windows_for_se(self, target_se: float) -> int | None:
        """Windows needed for a standard error of `target_se` nats/token: (sd / target)^2."""
        return None if not math.isfinite(self.sd) else max(2, math.ceil((self.sd / target_se) ** 2))

    def to_dict(self, target_se: float = 0.01) -> dict[str, Any]:
        return {**asdict(self), "bits_per_byte": self.bits_per_byte, "target_se": target_se,
                "windows_for_target_se": self.windows_for_se(target_se)}


def estimate(per_window_nats: Sequence[float], per_window_tokens: Sequence[int], num_bytes: int | None = None
             ) -> Estimate:
    """Per-token mean (total nats / total tokens) and its standard error across windows (equal-length windows, so
    the ratio estimator's SE is that of the per-window means)."""
    nats, toks = np.asarray(per_window_nats, dtype=np.float64), np.asarray(per_window_tokens, dtype=np.float64)
    if len(nats) == 0:
        raise EvalError("nothing to average: no held-out window was scored")
    per_token = nats / toks
    sd = float(per_token.std(ddof=1)) if len(nats) > 1 else math.nan
    return Estimate(float(nats.sum() / toks.sum()), sd / math.sqrt(len(nats)), len(nats), int(toks.sum()), sd,
                    num_bytes)

# --- the NELBO of the uniform-state process (its reverse KLs: dgemma/train/diffusion.py) ------------------------------

def stratified_t(num_samples: int, num_steps: int, shape: tuple[int, ...],
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """t for `num_samples` passes, and the weight of each pass (K,): sum_k weight_k * L(t_k) is an unbiased estimate
    of sum_{t=1..T} L(t). With K = 1, t is uniform on {1..T} (weight T). With K >= 2, pass 0 is t = 1 exactly (the
    reconstruction term, the largest and most variable one) and pass k >= 1 draws t uniformly in the k-th of K - 1
    equal strata of {2..T} (weight: the stratum's size). K = T visits every t once. Returns t (K, *shape) int64 on
    the CPU, drawn on the generator's device (the one `q_sample` draws the noise on, a GPU's included)."""
    if not 1 <= num_samples <= num_steps:
        raise ValueError(f"t samples per canvas must be in [1, T={num_steps}], got {num_samples}")
    first, strata = (1, num_samples) if num_samples == 1 else (2, num_samples - 1)
    edges = np.round(np.linspace(first - 1, num_steps, strata + 1)).astype(int)
    sizes = np.diff(edges)
    view = (-1, *[1] * len(shape))
    u = torch.rand((strata, *shape), generator=generator, dtype=torch.float64,
                   device=None if generator is None else generator.device).cpu()
    t = 1 + torch.tensor(edges[:-1], dtype=torch.float64).view(view) + torch.floor(
        u * torch.tensor(sizes, dtype=torch.float64).view(view))
    weights = torch.tensor(sizes, dtype=torch.float64)
    if num_samples > 1:
        t = torch.cat([torch.ones((1, *shape), dtype=torch.float64), t])
        weights = torch.cat([torch.ones(1, dtype=torch.float64), weights])
    return t.long(), weights


@dataclass
class NelboTerms:
    """Per-canvas NELBO estimates of a batch of windows and what went into them."""

    nelbo: Tensor  # (B, C) nats per canvas: prior + sum over t of the reverse KLs (estimated)
    t_sums: Tensor  # (T,) per-token KL summed over the sampled (canvas, t) pairs, by t
    t_counts: Tensor  # (T,) canvas tokens behind each sum


def window_nelbo(posterior: Posterior, x0: Tensor, *, canvas_length: int, vocab_size: int, num_steps: int,
                 num_t_samples: int, generator: torch.Generator | None = None) -> NelboTerms:
    """NELBO of each canvas of the windows x0 (B, S) given its clean prefix, by stratified Monte Carlo over t.

    Each pass k corrupts every canvas at its own t drawn by `stratified_t` (one `posterior` call scores all
    canvases, as the clean-context training forward does); the reverse KLs of the canvas's tokens are weighted by the
    pass's weight."""
    B, S = x0.shape
    L = canvas_length
    if S % L:
        raise ValueError(f"windows of {S} tokens are not a whole number of canvases of {L}")
    C = S // L
    ts, weights = stratified_t(num_t_samples, num_steps, (B, C), generator)
    nelbo = torch.full((B, C), prior_kl(num_steps, vocab_size) * L, dtype=torch.float64)
    t_sums = torch.zeros(num_steps, dtype=torch.float64)
    t_counts = torch.zeros(num_steps, dtype=torch.float64)
    for k in range(num_t_samples):
        t = ts[k].to(x0.device)
        xt = q_sample(x0, t, num_steps, L, vocab_size, generator)
        logits = posterior(x0, xt, t.float() / num_steps)  # (B, S, V)
        t_tok = t.repeat_interleave(L, dim=1)
        kl = reverse_kl(logits.reshape(B * S, -1), x0.reshape(-1), xt.reshape(-1), t_tok.reshape(-1), num_steps)
        per_canvas = kl.view(B, C, L).sum(-1).cpu()  # (B, C)
        nelbo += weights[k] * per_canvas
        t_sums.index_add_(0, ts[k].reshape(-1) - 1, per_canvas.reshape(-1))
        t_counts.index_add_(0, ts[k].reshape(-1) - 1, torch.full((B * C,), float(L), dtype=torch.float64))
    return NelboTerms(nelbo, t_sums, t_counts)


LEVEL_BINS = 16  # `window_nelbo_continuous` reports the integrand by level in this many equal bins of (0, 1]


def window_nelbo_continuous(posterior: Posterior, x0: Tensor, *, canvas_length: int, vocab_size: int,
                            num_t_samples: int, generator: torch.Generator | None = None) -> NelboTerms:
    """The continuous-time NELBO of each canvas of the windows x0 (B, S) given its clean prefix: the prior KL (zero at
    s = 1 to float64 precision) plus the integral over s in (0, 1] of `continuous_kl`, by Monte Carlo with
    `num_t_samples` K stratified levels per canvas (pass k draws s uniformly in (1 - (k + 1) / K, 1 - k / K], weight
    1 / K; K = 1 is a single uniform draw). `t_sums` / `t_counts` bin the integrand by level (LEVEL_BINS bins)."""
    B, S = x0.shape
    L = canvas_length
    if S % L:
        raise ValueError(f"windows of {S} tokens are not a whole number of canvases of {L}")
    if num_t_samples < 1:
        raise ValueError(f"level samples per canvas must be >= 1, got {num_t_samples}")
    C, K = S // L, num_t_samples
    nelbo = torch.full((B, C), prior_kl(1, vocab_size) * L, dtype=torch.float64)
    t_sums = torch.zeros(LEVEL_BINS, dtype=torch.float64)
    t_counts = torch.zeros(LEVEL_BINS, dtype=torch.float64)
    for k in range(K):
        u = torch.rand((B, C), generator=generator, dtype=torch.float64, device=x0.device)
        level = 1.0 - (k + u) / K  # (B, C) in (1 - (k + 1) / K, 1 - k / K]
        xt = corrupt(x0, alpha(level), L, vocab_size, generator)
        logits = posterior(x0, xt, level.float())
        lv = level.repeat_interleave(L, dim=1)
        kl = continuous_kl(logits.reshape(B * S, -1), x0.reshape(-1), xt.reshape(-1), lv.reshape(-1))
        per_canvas = kl.view(B, C, L).sum(-1).cpu()
        nelbo += per_canvas / K
        bins = (level.cpu() * LEVEL_BINS).ceil().long().clamp_(1, LEVEL_BINS).reshape(-1) - 1
        t_sums.index_add_(0, bins, per_canvas.reshape(-1))
        t_counts.index_add_(0, bins, torch.full((B * C,), float(L), dtype=torch.float64))
    return NelboTerms(nelbo, t_sums, t_counts)


def _level(level: Tensor, L: int) -> Tensor:
    return level.float().repeat_interleave(L, dim=1)  # (B, S): each token's canvas noise level in [0, 1]


def clean_context_posterior(model: DiffusionGemma) -> Posterior:
    """p(x0 | x_t, clean prefix) from the clean-context training forward: [x0 ; x_t] in one pass, each noisy canvas
    attending to the clean canvases before it and to itself, exactly what denoise sees after the prefix is
    committed. No self-conditioning input (the first denoising step's situation). Time-embedding models are told
    each canvas's level."""
    cfg = model.config

    def posterior(x0: Tensor, xt: Tensor, t: Tensor) -> Tensor:
        S = x0.shape[1]
        pos = torch.arange(S, device=x0.device)
        level = _level(t, cfg.canvas_length)
        hidden = model.sequence_hidden(torch.cat([x0, xt], 1), torch.cat([pos, pos])[None],
                                       clean_context_masks(S, cfg.canvas_length, cfg.sliding_window, x0.device),
                                       num_clean=S, t=torch.cat([torch.zeros_like(level), level], 1))
        return posterior_logits(model, hidden[:, S:], xt, level)

    return posterior


def posterior_of(objective: str) -> Callable[[DiffusionGemma], Posterior]:
    """The posterior of a diffusion run's training forward: `clean_context_posterior` or `noisy_context_posterior`."""
    if objective not in ("clean-context", "noisy-context"):
        raise ValueError(f"a NELBO or x0 cross-entropy needs a diffusion objective, got {objective!r}")
    return clean_context_posterior if objective == "clean-context" else noisy_context_posterior


def nelbo_per_window(model: DiffusionGemma, x0: Tensor, *, objective: str, num_steps: int | None,
                     num_t_samples: int, generator: torch.Generator | None = None) -> Tensor:
    """The NELBO (nats) of each window of x0 (B, S), (B,): `window_nelbo` with the posterior of a run trained with
    `objective`, at T = `num_steps` with `num_t_samples` stratified t per canvas; `num_steps` None: the continuous-time
    bound (`window_nelbo_continuous`, `num_t_samples` stratified levels). An evaluation function: training's learning
    curves run it inside the wrapped model's forward (distributed.LossModule, `measure=`)."""
    cfg = model.config
    posterior = posterior_of(objective)(model)
    if num_steps is None:
        terms = window_nelbo_continuous(posterior, x0, canvas_length=cfg.canvas_length, vocab_size=cfg.vocab_size,
                                        num_t_samples=num_t_samples, generator=generator)
    else:
        terms = window_nelbo(posterior, x0, canvas_length=cfg.canvas_length, vocab_size=cfg.vocab_size,
                             num_steps=num_steps, num_t_samples=num_t_samples, generator=generator)
    return terms.nelbo.sum(1)


def x0_ce_per_canvas(model: DiffusionGemma, x0: Tensor, *, objective: str, num_steps: int, time: str = "discrete",
                     generator: torch.Generator | None = None, batch_rows: tuple[int, int] | None = None
                     ) -> tuple[Tensor, Tensor]:
    """The held-out x0 cross-entropy of windows x0 (B, S), the one definition behind training's learning curves
    (`train.heldout_metrics`, run through `distributed.LossModule`'s `measure`) and `dgemma eval`
    (`evaluate.heldout_x0_ce`): (nats per canvas (B, S / L), each canvas's level (B, S / L) in (0, 1]). Levels and
    x_t drawn as `diffusion.training_loss` draws them from `generator` (`batch_rows`: these rows of a larger batch's
    draws): t / T with t ~ U{1..T} (`time` "discrete"), or s ~ U(0, 1] ("continuous"); the training forward of
    `objective` without self-conditioning, one window at a time (at most (S, V) logits)."""
    L, V = model.config.canvas_length, model.config.vocab_size
    B, S = x0.shape
    if time == "continuous":
        level = draw_rows(lambda shape, **k: sample_levels(shape[0], shape[1], **k), (B, S // L), batch_rows,
                          generator, x0.device)
        xt = corrupt(x0, alpha(level), L, V, generator, batch_rows)
        level = level.float()
    else:
        t = draw_rows(lambda shape, **k: sample_canvas_t(shape[0], shape[1], num_steps, **k), (B, S // L),
                      batch_rows, generator, x0.device)
        xt = q_sample(x0, t, num_steps, L, V, generator, batch_rows)
        level = t.float() / num_steps
    posterior = posterior_of(objective)(model)
    ce = torch.cat([F.cross_entropy(posterior(x0[b:b + 1], xt[b:b + 1], level[b:b + 1])[0], x0[b], reduction="none")
                    for b in range(B)])
    return ce.view(B, S // L, L).sum(-1), level


def ar_token_nll(model: DiffusionGemma, x: Tensor) -> Tensor:
    """-log p(x_{i+1} | x_{<=i}) for i = 0..S-2 of x (B, S): (B, S - 1), one causal encoder pass, the head one window
    at a time (at most (S, V) logits); fp32, or float64 for a float64 model. The one next-token cross-entropy of
    an AR run's learning curve (`train.heldout_metrics`), `dgemma eval` (`evaluate.heldout_ar_ce`) and the judge's
    generative perplexity."""
    inputs = x[:, :-1]
    T = inputs.shape[1]
    hidden = model.sequence_hidden(inputs, torch.arange(T, device=x.device)[None],
                                   causal_masks(T, model.config.sliding_window, x.device), num_clean=T)
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # a float64 judge scores in float64
    return torch.stack([F.cross_entropy(model.logits(hidden[b], dtype), x[b, 1:], reduction="none")
                        for b in range(x.shape[0])])


def window_cross_entropy(model: DiffusionGemma, x: Tensor, *, objective: str, num_steps: int, time: str = "discrete",
                         generator: torch.Generator | None = None, batch_rows: tuple[int, int] | None = None
                         ) -> tuple[Tensor, int]:
    """(nats summed, target tokens) of held-out windows x for a run trained with `objective`: the x0 cross-entropy
    (`x0_ce_per_canvas`) of a diffusion objective, the next-token cross-entropy (`ar_token_nll`; x holds seq_len + 1
    tokens) of "ar". What training's learning curves log as val_loss (`train.heldout_metrics`)."""
    if objective == "ar":
        nll = ar_token_nll(model, x)
        return nll.sum(), nll.numel()
    ce, _ = x0_ce_per_canvas(model, x, objective=objective, num_steps=num_steps, time=time, generator=generator,
                             batch_rows=batch_rows)
    return ce.sum(), x.numel()


def noisy_context_posterior(model: DiffusionGemma) -> Posterior:
    """p(x0 | x_t) from the noisy-context training forward: canvas b sees the corrupted canvases before it."""
    cfg = model.config

    def posterior(x0: Tensor, xt: Tensor, t: Tensor) -> Tensor:
        S = x0.shape[1]
        level = _level(t, cfg.canvas_length)
        hidden = model.sequence_hidden(xt, torch.arange(S, device=x0.device)[None],
                                       noisy_context_masks(S, cfg.canvas_length, cfg.sliding_window, x0.device),
                                       num_clean=0, t=level)
        return posterior_logits(model, hidden, xt, level)

    return posterior


__all__ = ["KL_CHUNK_ROWS", "LEVEL_BINS", "Estimate", "EvalError", "NelboTerms", "Posterior", "clean_context_posterior",
           "continuous_kl", "estimate", "noisy_context_posterior", "prior_kl", "reverse_kl", "stratified_t",
           "window_nelbo", "window_nelbo_continuous"]
