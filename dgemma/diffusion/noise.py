"""The noise schedule of uniform-state diffusion, its forward process and what the model's posterior takes from it,
shared by training (dgemma/train/diffusion.py), the bounds (dgemma/diffusion/likelihood.py) and the samplers
(dgemma/sampling/readable.py, dgemma/sampling/fast_sampler.py).

    alpha(s) = cos^2(pi/2 * s)       probability that a token is still clean at level s in [0, 1] (1: clean, 0: noise);
                                     the discrete chain's step t of T is the level t / T
    q(x_s | x0)                      keep x0 with probability alpha(s), else a uniform draw (any of the V, x0 included):
                                     `corrupt`, `q_sample` on the grid

`observe` is the model option `observed_likelihood` (dgemma/model/config.py): the posterior over a token's clean value
is the network's prediction times the likelihood of what the token holds at level s, q(x_s^l | x0^l = k) = alpha [k =
x_s^l] + (1 - alpha) / V. By Bayes this is exact for the token's own evidence (x_s^l depends on x0 only through x0^l),
so the network is left to predict a token from its context, and the near-certainty a clean-looking token deserves
at small s (which the continuous-time bound charges for: docs/evaluation.md section 1.3) comes from the schedule
instead of having to be learned.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

MAX_BOOST = 1e4  # nats: `observation_boost` at s = 0, where the observation is certain


def alpha(level: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """alpha(s) = cos^2(pi/2 * s), computed in float64 and returned in `dtype`."""
    return torch.cos(math.pi / 2 * level.double()).pow(2).to(dtype)


def alpha_rate(level: Tensor) -> Tensor:
    """-alpha'(s) / alpha(s) = pi * tan(pi/2 * s), float64: the rate at which the forward process replaces a token by
    a uniform draw at level s."""
    return math.pi * torch.tan(math.pi / 2 * level.double())


def observation_boost(level: Tensor, vocab_size: int) -> Tensor:
    """log q(x_s = k | x0 = k) - log q(x_s = k | x0 = j != k) = log(1 + alpha V / (1 - alpha)) at each level, float32:
    how much more likely a token's own observation makes its observed value (0 at s = 1, growing as s -> 0; capped at
    MAX_BOOST, which already makes the posterior certain of the observed value in float32, so s = 0 is finite)."""
    a = alpha(level, torch.float64)
    return torch.log1p(a * vocab_size / (1 - a)).clamp(max=MAX_BOOST).float()


def observe(logits: Tensor, tokens: Tensor, level: Tensor, *, inplace: bool = False) -> Tensor:
    """The posterior's logits (..., V) from the network's: + `observation_boost` at each position's observed token
    `tokens` (...), at its level `level` (..., broadcastable to `tokens`), in the logits' dtype; out of place unless
    `inplace` (the samplers, which consume their logits)."""
    boost = observation_boost(torch.as_tensor(level, device=logits.device).expand(tokens.shape), logits.shape[-1])
    add = logits.scatter_add_ if inplace else logits.scatter_add
    return add(-1, tokens[..., None], boost[..., None].to(logits.dtype))


def observation_levels(canvas_level: Tensor, carried: Tensor) -> Tensor:
    """The level of each position's observation in a sampler's canvas (B, L): the canvas level (B,) of the share
    carried over (`sampling.canvas_level`, whatever `time_level` tells the network) where the previous step carried a
    token over (accepted, committed), 1 where the sampler has just drawn fresh uniform noise,
    which says nothing about x0 (its boost is 0). The training canvas is a forward-process draw, where no position is
    known to be noise; the sampler knows which are, and its posterior takes that in, so it does not copy noise that a
    canvas-wide level would make it favour (docs/sampling.md)."""
    return torch.where(carried, canvas_level.to(torch.float32)[:, None], 1.0)


# --- the forward process q(x_s | x0), canvas by canvas ----------------------------------------------------------

def alpha_bar(t: Tensor, num_steps: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Probability that a token is still clean at noise level t (cosine schedule), computed in float64 and returned
    in `dtype`: float32 for corruption, float64 for the NELBO (dgemma/diffusion/likelihood.py), whose logs need it near
    t = 0."""
    return torch.cos(math.pi / 2 * t.double() / num_steps).pow(2).to(dtype)



def q_sample(x0: Tensor, t: Tensor, num_steps: int, canvas_length: int, vocab_size: int,
             generator: torch.Generator | None = None, batch_rows: tuple[int, int] | None = None) -> Tensor:
    """Corrupt x0 (B, S) with per-canvas levels t (B, S / canvas_length) in one step of q(x_t | x0). With
    `batch_rows` (first, total), x0 is rows [first, first + B) of a batch of `total`: the draws are made for the
    whole batch and these rows kept, so they do not depend on how the batch is split (distributed training)."""
    return corrupt(x0, alpha_bar(t, num_steps), canvas_length, vocab_size, generator, batch_rows)


def corrupt(x0: Tensor, keep: Tensor, canvas_length: int, vocab_size: int, generator: torch.Generator | None = None,
            batch_rows: tuple[int, int] | None = None) -> Tensor:
    """q(x_s | x0) with each canvas's keep probability `keep` (B, S / canvas_length), float32: `q_sample` on the
    grid, `alpha(level)` in continuous time; the same draws either way."""
    keep_prob = keep.float().repeat_interleave(canvas_length, dim=1)  # (B, S)
    keep = draw_rows(torch.rand, x0.shape, batch_rows, generator, x0.device) < keep_prob
    noise = draw_rows(lambda *a, **k: torch.randint(0, vocab_size, *a, **k), x0.shape, batch_rows, generator, x0.device)
    return torch.where(keep, x0, noise)


def draw_rows(sample: Any, shape: torch.Size | tuple[int, ...], batch_rows: tuple[int, int] | None,
          generator: torch.Generator | None, device: torch.device) -> Tensor:
    """sample(shape) for rows [first, first + shape[0]) of a draw over `total` rows (batch_rows = (first, total))."""
    if batch_rows is None:
        return sample(shape, generator=generator, device=device)
    first, total = batch_rows
    return sample((total, *shape[1:]), generator=generator, device=device)[first:first + shape[0]]
