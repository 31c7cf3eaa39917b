"""The NELBO of uniform-state block diffusion and the statistics of held-out estimates (docs/evaluation.md, section 1).

    NELBO   an upper bound on the held-out NLL of the uniform-state D3PM with the cosine schedule
            (`dgemma.diffusion.alpha_bar`, the schedule training uses) and T steps, canvas by canvas given the clean
            prefix (block-autoregressive):
                NLL(x) <= sum_b NELBO(canvas_b | canvases < b)
            = prior KL + sum over t of the reverse-step KLs (`reverse_kl`), estimated by Monte Carlo over stratified t
            (`stratified_t`, `window_nelbo`) with the model's p(x0 | x_t) from one of the training forwards
            (`clean_context_posterior`, `noisy_context_posterior`).

`Estimate` is a per-token mean over held-out windows with its standard error; `dgemma.evaluate` runs the loops.
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

from dgemma.attention import clean_context_masks, noisy_context_masks
from dgemma.diffusion import alpha_bar, q_sample
from dgemma.model import DiffusionGemma

KL_CHUNK_ROWS = 256  # rows of (rows, V) float64 temporaries in `reverse_kl`

# posterior(x0 (B, S), x_t (B, S), t (B, C)) -> logits (B, S, V) of p(x0 | x_t of the canvas, clean canvases before)
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

# --- the NELBO of the uniform-state process -------------------------------------------------------------------------
def prior_kl(num_steps: int, vocab_size: int) -> float:
    """KL(q(x_T | x0) || uniform) per token: q keeps x0 with alpha_bar(T) (~1e-33 for the cosine schedule)."""
    ab = float(alpha_bar(torch.tensor(float(num_steps)), num_steps, torch.float64))
    V = vocab_size
    c = (1 - ab) / V
    return (ab + c) * math.log(V * (ab + c)) + (V - 1) * c * math.log(V * c) if c > 0 else math.log(V)


def reverse_kl(logits: Tensor, x0: Tensor, xt: Tensor, t: Tensor, num_steps: int,
               chunk_rows: int = KL_CHUNK_ROWS) -> Tensor:
    """Per-token KL(q(x_{t-1} | x_t, x0) || p(x_{t-1} | x_t)) of the x0-parameterised reverse step, in nats, float64.

    logits (N, V): the model's p(x0' | x_t); x0, xt, t (N,) with t in 1..T. p(x_{t-1} | x_t) = sum_x0'
    q(x_{t-1} | x_t, x0') p(x0' | x_t). At t = 1 this is -log p(x0 | x_1), the reconstruction term. The common
    factor q(x_t | x_{t-1}) of both distributions cancels in the log-ratio (docs/evaluation.md, equation 6)."""
    out = torch.empty(x0.shape[0], dtype=torch.float64, device=logits.device)
    for lo in range(0, x0.shape[0], chunk_rows):
        sl = slice(lo, lo + chunk_rows)
        out[sl] = _reverse_kl(logits[sl], x0[sl], xt[sl], t[sl], num_steps)
    return out


def _reverse_kl(logits: Tensor, x0: Tensor, xt: Tensor, t: Tensor, num_steps: int) -> Tensor:
    V = logits.shape[-1]
    logp = torch.log_softmax(logits.double(), dim=-1)  # (N, V)
    ab_t = alpha_bar(t, num_steps, torch.float64)[:, None]
    ab_s = alpha_bar(t - 1, num_steps, torch.float64)[:, None]  # s = t - 1
    alpha = ab_t / ab_s  # the one-step keep probability from t-1 to t
    at_k = F.one_hot(xt, V).bool()  # j == x_t
    at_i = F.one_hot(x0, V).bool()  # j == x0
    Z = (1 - ab_t) / V + ab_t * at_k  # (N, V): q(x_t | x0 = j) for every j
    log_w = logp - Z.log()  # p(j | x_t) / q(x_t | j)
    log_S = torch.logsumexp(log_w, dim=-1, keepdim=True)
    prior_s = ab_s * at_i + (1 - ab_s) / V  # q(x_{t-1} = j | x0)
    # p(x_{t-1} = j | x_t) / q(x_t | x_{t-1} = j) = ab_s * w_j + (1 - ab_s) / V * S
    log_den = torch.logaddexp(ab_s.log() + log_w, ((1 - ab_s) / V).log() + log_S)
    q = (alpha * at_k + (1 - alpha) / V) * prior_s  # q(x_t | x_{t-1} = j) q(x_{t-1} = j | x0), unnormalised
    q = q / q.sum(-1, keepdim=True)  # the sum is q(x_t | x0) = Z[x0]
    log_ratio = prior_s.log() - Z.gather(1, x0[:, None]).log() - log_den
    return torch.where(q > 0, q * log_ratio, torch.zeros_like(q)).sum(-1)  # 0 log 0 = 0 (t = 1: q is one-hot)


def stratified_t(num_samples: int, num_steps: int, shape: tuple[int, ...],
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """t for `num_samples` passes, and the weight of each pass (K,): sum_k weight_k * L(t_k) is an unbiased estimate
    of sum_{t=1..T} L(t). With K = 1, t is uniform on {1..T} (weight T). With K >= 2, pass 0 is t = 1 exactly (the
    reconstruction term, the largest and most variable one) and pass k >= 1 draws t uniformly in the k-th of K - 1
    equal strata of {2..T} (weight: the stratum's size). K = T visits every t once. Returns t (K, *shape) int64."""
    if not 1 <= num_samples <= num_steps:
        raise ValueError(f"t samples per canvas must be in [1, T={num_steps}], got {num_samples}")
    first, strata = (1, num_samples) if num_samples == 1 else (2, num_samples - 1)
    edges = np.round(np.linspace(first - 1, num_steps, strata + 1)).astype(int)
    sizes = np.diff(edges)
    view = (-1, *[1] * len(shape))
    u = torch.rand((strata, *shape), generator=generator, dtype=torch.float64)
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
        logits = posterior(x0, xt, t)  # (B, S, V)
        t_tok = t.repeat_interleave(L, dim=1)
        kl = reverse_kl(logits.reshape(B * S, -1), x0.reshape(-1), xt.reshape(-1), t_tok.reshape(-1), num_steps)
        per_canvas = kl.view(B, C, L).sum(-1).cpu()  # (B, C)
        nelbo += weights[k] * per_canvas
        t_sums.index_add_(0, ts[k].reshape(-1) - 1, per_canvas.reshape(-1))
        t_counts.index_add_(0, ts[k].reshape(-1) - 1, torch.full((B * C,), float(L), dtype=torch.float64))
    return NelboTerms(nelbo, t_sums, t_counts)


def _level(t: Tensor, num_steps: int, L: int) -> Tensor:
    return (t.float() / num_steps).repeat_interleave(L, dim=1)  # (B, S): each token's canvas noise level in [0, 1]


def clean_context_posterior(model: DiffusionGemma, num_steps: int) -> Posterior:
    """p(x0 | x_t, clean prefix) from the clean-context training forward: [x0 ; x_t] in one pass, each noisy canvas
    attending to the clean canvases before it and to itself, exactly what denoise sees after the prefix is
    committed. No self-conditioning input (the first denoising step's situation). Time-embedding models get t/T."""
    cfg = model.config

    def posterior(x0: Tensor, xt: Tensor, t: Tensor) -> Tensor:
        S = x0.shape[1]
        pos = torch.arange(S, device=x0.device)
        level = _level(t, num_steps, cfg.canvas_length)
        hidden = model.sequence_hidden(torch.cat([x0, xt], 1), torch.cat([pos, pos])[None],
                                       clean_context_masks(S, cfg.canvas_length, cfg.sliding_window, x0.device),
                                       num_clean=S, t=torch.cat([torch.zeros_like(level), level], 1))
        return model.logits(hidden[:, S:])

    return posterior


def noisy_context_posterior(model: DiffusionGemma, num_steps: int) -> Posterior:
    """p(x0 | x_t) from the noisy-context training forward: canvas b sees the corrupted canvases before it."""
    cfg = model.config

    def posterior(x0: Tensor, xt: Tensor, t: Tensor) -> Tensor:
        S = x0.shape[1]
        hidden = model.sequence_hidden(xt, torch.arange(S, device=x0.device)[None],
                                       noisy_context_masks(S, cfg.canvas_length, cfg.sliding_window, x0.device),
                                       num_clean=0, t=_level(t, num_steps, cfg.canvas_length))
        return model.logits(hidden)

    return posterior


__all__ = ["KL_CHUNK_ROWS", "Estimate", "EvalError", "NelboTerms", "Posterior", "clean_context_posterior", "estimate",
           "noisy_context_posterior", "prior_kl", "reverse_kl", "stratified_t", "window_nelbo"]
