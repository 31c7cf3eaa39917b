"""The noise schedule of uniform-state diffusion and what the model's posterior takes from it, shared by training
(dgemma/train/diffusion.py), the bounds (dgemma/train/nelbo.py) and the samplers (dgemma/generate.py,
dgemma/fast_sampler.py).

    alpha(s) = cos^2(pi/2 * s)       probability that a token is still clean at level s in [0, 1] (1: clean, 0: noise);
                                     the discrete chain's step t of T is the level t / T
    q(x_s | x0)                      keep x0 with probability alpha(s), else a uniform draw (any of the V, x0 included)

`observe` is the model option `observed_likelihood` (dgemma/config.py): the posterior over a token's clean value is
the network's prediction times the likelihood of what the token holds at level s, q(x_s^l | x0^l = k) = alpha [k =
x_s^l] + (1 - alpha) / V. By Bayes this is exact for the token's own evidence (x_s^l depends on x0 only through x0^l),
so the network is left to predict a token from its context, and the near-certainty a clean-looking token deserves
at small s (which the continuous-time bound charges for: docs/evaluation.md section 1.3) comes from the schedule
instead of having to be learned.
"""

from __future__ import annotations

import math

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
