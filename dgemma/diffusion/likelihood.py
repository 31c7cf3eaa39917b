"""The likelihood of uniform-state block diffusion: the NELBO, an upper bound on -log p, with the model's posterior
p(x0 | x_t) from one of the training forwards (docs/evaluation.md section 1). Training's learning curves
(dgemma/train/loop.py), `dgemma eval` (dgemma/eval/evaluate.py) and the server's scoring of a prompt
(`score_tokens`, docs/serving.md) all compute it here.

    NELBO   an upper bound on the NLL of the uniform-state D3PM with the cosine schedule
    (`dgemma.diffusion.noise.alpha`),
            canvas by canvas given the clean prefix (block-autoregressive):
                NLL(x) <= sum_b NELBO(canvas_b | canvases < b)
            T steps: prior KL + sum over t of the reverse-step KLs (`reverse_kl`), estimated by Monte Carlo over
            stratified t (`stratified_t`, `window_nelbo`); continuous time (T -> infinity): prior KL + the integral
            over s in (0, 1] of `continuous_kl`, by stratified Monte Carlo over s (`window_nelbo_continuous`). The
            model's p(x0 | x_t) comes from one of the training forwards (`clean_context_posterior`,
            `noisy_context_posterior`).

Every term is a sum over tokens (both distributions of each KL factorise over the canvas's positions), so the bound
is also reported per token (`NelboTerms.per_token`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dgemma.diffusion.noise import alpha, alpha_bar, alpha_rate, corrupt, observe, q_sample
from dgemma.model.attention import clean_context_masks, noisy_context_masks
from dgemma.model.diffusiongemma import check_token_ids

if TYPE_CHECKING:  # the model is only passed through: importing it would put the bound above the model's layer
    from dgemma.model.adapter_rows import AdapterRows
    from dgemma.model.diffusiongemma import DiffusionGemma

# posterior(x0 (B, S), x_t (B, S), level (B, C) in [0, 1]) -> logits (B, S, V) of p(x0 | x_t of the canvas, clean
# canvases before); the discrete chain's step t is the level t / T.
Posterior = Callable[[Tensor, Tensor, Tensor], Tensor]


# --- the reverse-step KL of the NELBO (docs/evaluation.md section 1.3) --------------------------------------------

KL_CHUNK_ROWS = 256  # rows of (rows, V) float64 temporaries in `reverse_kl`


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
    q, log_ratio = _reverse_step(logits, x0, xt, t, num_steps)
    return torch.where(q > 0, q * log_ratio, torch.zeros_like(q)).sum(-1)  # 0 log 0 = 0 (t = 1: q is one-hot)


def _reverse_step(logits: Tensor, x0: Tensor, xt: Tensor, t: Tensor, num_steps: int) -> tuple[Tensor, Tensor]:
    """Both distributions of one reverse step, over every j (N, V) float64: q(x_{t-1} = j | x_t, x0) (normalised),
    and log q(x_{t-1} = j | x_t, x0) - log p(x_{t-1} = j | x_t) (-inf where q is 0)."""
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
    return q, log_ratio



def continuous_kl(logits: Tensor, x0: Tensor, xt: Tensor, level: Tensor, chunk_rows: int = KL_CHUNK_ROWS) -> Tensor:
    """Per-token integrand of the continuous-time NELBO at level s (N,) in (0, 1], float64 nats per unit of s: its
    mean over s ~ U(0, 1] (and x_s ~ q) is the limit T -> infinity of the sum over t of `reverse_kl`, the bound of
    the continuous-time chain (docs/evaluation.md section 1.3). For the same x0-parameterised reverse model (the
    mixture sum_x0' q(x_{s-ds} | x_s, x0') p(x0' | x_s)), the step's KL is, to first order in ds, ds times the
    generalized KL between the true and the model's reverse jump rates out of i = x_s:

        (beta / V) * sum_{j != i} [ r'_j - r_j + r_j log(r_j / r'_j) ],     beta = -alpha'/alpha, c = (1 - alpha) / V
        r_j  = (alpha [j == x0] + c) / (alpha [i == x0] + c)                 the true rate, over beta / V
        r'_j = alpha w_j + c sum_k w_k,   w_k = p(k | x_s) / q(x_s | x0 = k)  the model's

    O(V) per token, one forward per sampled s. It is finite only for a model that becomes certain of a token that
    looks clean as s -> 0 (1 - p(x_s | x_s) = o(s)): a model without a time input cannot, and its bound grows
    without limit with T (docs/training.md). UDLM (arXiv 2412.10193) and Duo (arXiv 2506.10892) write the same
    limit for the plug-in model q(x_{s-ds} | x_s, x0 = p); this is the mixture's, the model `reverse_kl` bounds."""
    out = torch.empty(x0.shape[0], dtype=torch.float64, device=logits.device)
    for lo in range(0, x0.shape[0], chunk_rows):
        sl = slice(lo, lo + chunk_rows)
        out[sl] = _continuous_kl(logits[sl], x0[sl], xt[sl], level[sl])
    return out


def _continuous_kl(logits: Tensor, x0: Tensor, xt: Tensor, level: Tensor) -> Tensor:
    V = logits.shape[-1]
    logp = torch.log_softmax(logits.double(), dim=-1)  # (N, V)
    a = alpha(level, torch.float64)[:, None]
    c = (1 - a) / V
    at_i = F.one_hot(xt, V).bool()  # j == x_s
    log_a, log_c, log_ac = a.log(), c.log(), (a + c).log()
    log_w = logp - torch.where(at_i, log_ac, log_c)  # w_k = p(k | x_s) / q(x_s | k)
    log_S = torch.logsumexp(log_w, dim=-1, keepdim=True)
    log_model = torch.logaddexp(log_a + log_w, log_c + log_S)  # log r'_j
    clean = (xt == x0)[:, None]
    log_true = torch.where(F.one_hot(x0, V).bool(), log_ac, log_c) - torch.where(clean, log_ac, log_c)  # log r_j
    r = log_true.exp()
    term = log_model.exp() - r + r * (log_true - log_model)
    return alpha_rate(level) / V * term.masked_fill(at_i, 0.0).sum(-1)


# --- the model's posterior -----------------------------------------------------------------------------------

def posterior_logits(model: DiffusionGemma, hidden: Tensor, tokens: Tensor | None = None,
                     level: Tensor | None = None) -> Tensor:
    """The logits of p(x0 | x_s) on final hidden states (..., D): the head's, and for a model with
    `observed_likelihood` plus each position's observation `tokens` at its `level` (dgemma/diffusion/noise.py:observe;
    both required then). The one place training and the bounds turn hidden states into the posterior."""
    logits = model.logits(hidden)
    if not model.config.observed_likelihood:
        return logits
    if tokens is None or level is None:
        raise ValueError("a model with observed_likelihood needs each position's x_s and level for its posterior")
    return observe(logits, tokens, level)


# --- the NELBO of windows ------------------------------------------------------------------------------------

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
    per_token: Tensor  # (B, S) the same per token: its prior + its reverse KLs (a canvas's tokens sum to its nelbo)
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
    per_token = torch.full((B, S), prior_kl(num_steps, vocab_size), dtype=torch.float64)
    for k in range(num_t_samples):
        t = ts[k].to(x0.device)
        xt = q_sample(x0, t, num_steps, L, vocab_size, generator)
        logits = posterior(x0, xt, t.float() / num_steps)  # (B, S, V)
        t_tok = t.repeat_interleave(L, dim=1)
        kl = reverse_kl(logits.reshape(B * S, -1), x0.reshape(-1), xt.reshape(-1), t_tok.reshape(-1), num_steps)
        per_canvas = kl.view(B, C, L).sum(-1).cpu()  # (B, C)
        nelbo += weights[k] * per_canvas
        per_token += weights[k] * kl.view(B, S).cpu()
        t_sums.index_add_(0, ts[k].reshape(-1) - 1, per_canvas.reshape(-1))
        t_counts.index_add_(0, ts[k].reshape(-1) - 1, torch.full((B * C,), float(L), dtype=torch.float64))
    return NelboTerms(nelbo, per_token, t_sums, t_counts)


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
    per_token = torch.full((B, S), prior_kl(1, vocab_size), dtype=torch.float64)
    for k in range(K):
        u = torch.rand((B, C), generator=generator, dtype=torch.float64, device=x0.device)
        level = 1.0 - (k + u) / K  # (B, C) in (1 - (k + 1) / K, 1 - k / K]
        xt = corrupt(x0, alpha(level), L, vocab_size, generator)
        logits = posterior(x0, xt, level.float())
        lv = level.repeat_interleave(L, dim=1)
        kl = continuous_kl(logits.reshape(B * S, -1), x0.reshape(-1), xt.reshape(-1), lv.reshape(-1))
        per_canvas = kl.view(B, C, L).sum(-1).cpu()
        nelbo += per_canvas / K
        per_token += kl.view(B, S).cpu() / K
        bins = (level.cpu() * LEVEL_BINS).ceil().long().clamp_(1, LEVEL_BINS).reshape(-1) - 1
        t_sums.index_add_(0, bins, per_canvas.reshape(-1))
        t_counts.index_add_(0, bins, torch.full((B * C,), float(L), dtype=torch.float64))
    return NelboTerms(nelbo, per_token, t_sums, t_counts)


# --- the importance-weighted bound (docs/evaluation.md section 1.5) ---------------------------------------------

def reverse_step_draw(logits: Tensor, x0: Tensor, xt: Tensor, t: Tensor, num_steps: int,
                      generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """One step of a trajectory of the forward process run backwards, and its log importance weight: x_{t-1} drawn
    from q(x_{t-1} | x_t, x0), and log p(x_{t-1} | x_t) - log q(x_{t-1} | x_t, x0) at the draw (N,), float64, with
    p the x0-parameterised reverse model of `reverse_kl` (whose expectation over the draw is minus that KL). At t = 1
    the draw is x0 itself and the weight is log p(x0 | x_1). logits (N, V); x0, xt, t (N,), t in 1..T."""
    q, log_ratio = _reverse_step(logits, x0, xt, t, num_steps)
    xs = torch.multinomial(q, 1, generator=generator)  # (N, 1)
    return xs[:, 0], -log_ratio.gather(1, xs)[:, 0]


def window_log_weights(posterior: Posterior, x0: Tensor, *, canvas_length: int, vocab_size: int, num_steps: int,
                       num_samples: int, generator: torch.Generator | None = None, chunk_rows: int = KL_CHUNK_ROWS
                       ) -> Tensor:
    """log p(x0, x_{1:T}) - log q(x_{1:T} | x0) of each canvas of the windows x0 (B, S) given its clean prefix, for
    `num_samples` whole trajectories x_T -> x_1 drawn from q backwards (x_T ~ q(x_T | x0), then `reverse_step_draw`):
    (K, B, C) float64. Each is an unbiased estimate of minus the canvas's NELBO at T (its mean is the ELBO);
    -log mean_k exp(.) over K of them is the importance-weighted bound, which tightens towards the NLL as K grows
    (Burda et al. 2016, arXiv 1509.00519). T forwards per trajectory."""
    B, S = x0.shape
    L, V = canvas_length, vocab_size
    if S % L:
        raise ValueError(f"windows of {S} tokens are not a whole number of canvases of {L}")
    C = S // L
    out = torch.empty(num_samples, B, C, dtype=torch.float64)
    ab_T = float(alpha_bar(torch.tensor(float(num_steps)), num_steps, torch.float64))
    for k in range(num_samples):
        t = torch.full((B, C), num_steps, dtype=torch.long, device=x0.device)
        xt = q_sample(x0, t, num_steps, L, V, generator)
        # log p(x_T) - log q(x_T | x0): the uniform prior against the forward process's end.
        lw = (-math.log(V) - torch.log((1 - ab_T) / V + ab_T * (xt == x0).double())).cpu()
        for _ in range(num_steps, 0, -1):
            logits = posterior(x0, xt, t.float() / num_steps).reshape(B * S, -1)
            flat_t = t.repeat_interleave(L, dim=1).reshape(-1)
            nxt = torch.empty(B * S, dtype=torch.long, device=x0.device)
            for lo in range(0, B * S, chunk_rows):
                sl = slice(lo, lo + chunk_rows)
                nxt[sl], w = reverse_step_draw(logits[sl], x0.reshape(-1)[sl], xt.reshape(-1)[sl], flat_t[sl],
                                               num_steps, generator)
                lw.view(-1)[sl] += w.cpu()
            xt, t = nxt.view(B, S), t - 1
        out[k] = lw.view(B, C, L).sum(-1)
    return out


def iw_bound(log_weights: Tensor, k: int) -> Tensor:
    """The K-sample importance-weighted bound on -log p of each canvas, from `window_log_weights` (N, ...) with N a
    multiple of K: the N / K disjoint groups of K trajectories each give -log mean exp over the group, averaged over
    groups (an unbiased estimate of the K-sample bound using every trajectory). (...)."""
    n = log_weights.shape[0]
    if k < 1 or n % k:
        raise ValueError(f"{n} trajectories do not split into groups of K = {k}")
    groups = log_weights.reshape(n // k, k, *log_weights.shape[1:])
    return -(torch.logsumexp(groups, dim=1) - math.log(k)).mean(0)


def _level(level: Tensor, L: int) -> Tensor:
    return level.float().repeat_interleave(L, dim=1)  # (B, S): each token's canvas noise level in [0, 1]


def clean_context_posterior(model: DiffusionGemma, context: Tensor | None = None, *, num_scored: int | None = None,
                            generator: torch.Generator | None = None,
                            adapters: Callable[[int], AdapterRows | None] | None = None) -> Posterior:
    """p(x0 | x_t, clean prefix) from the clean-context training forward: [x0 ; x_t] in one pass, each noisy canvas
    attending to the clean canvases before it and to itself, exactly what denoise sees after the prefix is
    committed. No self-conditioning input (the first denoising step's situation). Time-embedding models are told
    each canvas's level.

    `context` (1, P): committed tokens before the window ([context ; x0 ; x_t], canvases starting right after it:
    `clean_context_masks(context=P)`). `num_scored`: only the first tokens of the window are text; the positions
    after them (the rest of the last canvas) hold fresh uniform noise from `generator` at every level, observed at
    level 1, as the sampler's not yet drawn positions are (`noise.observation_levels`), and their terms are not part
    of the bound (`score_tokens`). `adapters(B)`: the LoRA adapter of each of a pass's B rows
    (dgemma/weights/adapters.py; None: the base model)."""
    cfg = model.config
    P = 0 if context is None else context.shape[1]

    def posterior(x0: Tensor, xt: Tensor, t: Tensor) -> Tensor:
        B, S = x0.shape
        pos = torch.arange(P + S, device=x0.device)
        level = _level(t, cfg.canvas_length)
        observed = level
        if num_scored is not None and num_scored < S:
            xt = xt.clone()
            xt[:, num_scored:] = torch.randint(0, cfg.vocab_size, (B, S - num_scored), generator=generator,
                                               device=x0.device)
            observed = level.clone()
            observed[:, num_scored:] = 1.0
        clean = x0 if context is None else torch.cat([context.expand(B, -1), x0], 1)
        hidden = model.sequence_hidden(torch.cat([clean, xt], 1), torch.cat([pos, pos[P:]])[None],
                                       clean_context_masks(S, cfg.canvas_length, cfg.sliding_window, x0.device,
                                                           context=P),
                                       num_clean=P + S, t=torch.cat([torch.zeros_like(clean, dtype=level.dtype),
                                                                     level], 1),
                                       adapters=None if adapters is None else adapters(B))
        return posterior_logits(model, hidden[:, P + S:], xt, observed)

    return posterior

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


# --- scoring a continuation (the server's echo + max_tokens 0, docs/serving.md) --------------------------------------

def _scored_window(model: DiffusionGemma, context: Sequence[int], tokens: Sequence[int], name: str
                   ) -> tuple[Tensor | None, Tensor]:
    """The committed context (1, P) (None when empty) and the scored `tokens` (named `name` in errors) cut into whole
    canvases right after it, (1, S) with S the tokens rounded up to canvases of L (zeros after them), on the model's
    device: ValueError when they pass the model's positions or hold ids outside its vocabulary."""
    cfg = model.config
    L, V = cfg.canvas_length, cfg.vocab_size
    n, P = len(tokens), len(context)
    S = -(-n // L) * L
    if P + S > cfg.max_position_embeddings:
        raise ValueError(f"context and {name}: {P} + {n} tokens (rounded up to whole canvases of {L}: {S}) exceed "
                         f"the model's {cfg.max_position_embeddings} positions")
    device = model.device
    x0 = torch.zeros(1, S, dtype=torch.long, device=device)
    x0[0, :n] = torch.as_tensor(list(tokens), dtype=torch.long, device=device)
    check_token_ids(x0[:, :n], V, name)
    ctx = torch.as_tensor(list(context), dtype=torch.long, device=device)[None] if P else None
    if ctx is not None:
        check_token_ids(ctx, V, "context")
    return ctx, x0


@torch.no_grad()
def score_continuation(model: DiffusionGemma, context: Sequence[int], continuation: Sequence[int], *,
                       num_steps: int | None, num_t_samples: int, seed: int = 0,
                       adapters: Callable[[int], AdapterRows | None] | None = None) -> Tensor:
    """The NELBO of `continuation` given `context`, per token: (N,) float64 nats, one term per continuation token,
    summing to an upper bound on -log p(continuation | context) (discrete time at T = `num_steps`, or the
    continuous-time bound for None; `num_t_samples` stratified t per canvas: `window_nelbo`).

    The context is committed as a clean prefix and the continuation is cut into canvases starting right after it, as
    generation does; each canvas is bounded given the context and the clean canvases before it (the clean-context
    forward, `clean_context_posterior`). A last canvas the continuation does not fill holds fresh uniform noise in
    its other positions, whose terms are left out: the terms of a set of positions bound -log p of those tokens under
    the chain in which the canvas's other positions are given (their x_t drawn as here), since the reverse model
    factorises over positions. With an empty context and whole canvases this is exactly `window_nelbo` of the
    continuation (the same draws from the same seed), the bound `dgemma eval` reports.

    Deterministic given `seed` (one generator draws t, x_t and the filler noise; CPU or the model's device). The
    Monte Carlo error is over t and x_t only: see docs/serving.md for its size. A pure function of the model's
    weights: no KV cache, no state written. `adapters(B)`: a LoRA adapter for the B rows of each pass (None: the base
    model; dgemma/weights/adapters.py)."""
    L, V = model.config.canvas_length, model.config.vocab_size
    n = len(continuation)
    if n == 0:
        raise ValueError("continuation: nothing to score (no tokens)")
    ctx, x0 = _scored_window(model, context, continuation, "continuation")
    g = torch.Generator(device=model.device).manual_seed(seed)
    posterior = clean_context_posterior(model, ctx, num_scored=n, generator=g, adapters=adapters)
    common = dict(canvas_length=L, vocab_size=V, num_t_samples=num_t_samples, generator=g)
    terms = (window_nelbo_continuous(posterior, x0, **common) if num_steps is None
             else window_nelbo(posterior, x0, num_steps=num_steps, **common))
    return terms.per_token[0, :n]


@torch.no_grad()
def first_step_log_probs(model: DiffusionGemma, context: Sequence[int], tokens: Sequence[int], *, seed: int = 0,
                         adapters: Callable[[int], AdapterRows | None] | None = None) -> Tensor:
    """The model's denoising posterior at full noise over the positions of `tokens`, (N, V) float32 log-probs:
    `tokens` are cut into canvases right after the committed `context`, as generation cuts them, and position i's row
    is log p(x0_i | the context and the clean canvases before i's canvas, i's canvas all uniform noise at level 1)
    (`clean_context_posterior`), what the sampler's first denoising step of that canvas sees (no self-conditioning).
    One forward. The server's ranking of alternatives when it scores a prompt, and its greedy next token
    (dgemma/serving/scoring.py; docs/serving.md). `tokens` only fill the clean copy the later canvases see; the ids of
    a last canvas's other positions do not matter (nothing sees them). Deterministic given `seed` (the noise)."""
    L, V = model.config.canvas_length, model.config.vocab_size
    n, device = len(tokens), model.device
    if n == 0:
        raise ValueError("tokens: no positions to score")
    ctx, x0 = _scored_window(model, context, tokens, "tokens")
    S = x0.shape[1]
    g = torch.Generator(device=device).manual_seed(seed)
    xt = torch.randint(0, V, (1, S), generator=g, device=device)
    posterior = clean_context_posterior(model, ctx, adapters=adapters)
    logits = posterior(x0, xt, torch.ones(1, S // L, device=device))
    return torch.log_softmax(logits[0, :n].float(), dim=-1)


@torch.no_grad()
def greedy_continuation(model: DiffusionGemma, context: Sequence[int], continuation: Sequence[int], *, seed: int = 0,
                        adapters: Callable[[int], AdapterRows | None] | None = None) -> Tensor:
    """Whether each token of `continuation` is the argmax of the model's denoising posterior at its position, (N,)
    bool (`first_step_log_probs`: the continuation's canvases at pure noise, given `context` and the clean canvases
    before): what a sampler's first denoising step would commit at temperature 0. The diffusion model's counterpart
    of an AR model's "each token is the argmax of its next-token distribution" (lm-eval's is_greedy)."""
    rows = first_step_log_probs(model, context, continuation, seed=seed, adapters=adapters)
    return (rows.argmax(-1) == torch.as_tensor(list(continuation), device=rows.device)).cpu()
