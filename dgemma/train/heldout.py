"""The statistics of held-out estimates and the held-out cross-entropies (docs/evaluation.md, section 1): `Estimate`
(a per-token mean over held-out windows with its standard error), the x0 cross-entropy (`x0_ce_per_canvas`) and the
next-token one (`ar_token_nll`). The NELBO itself is `dgemma.diffusion.likelihood`'s; `dgemma.eval.evaluate` runs the
loops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dgemma.diffusion.likelihood import posterior_of
from dgemma.diffusion.noise import alpha, corrupt, draw_rows, q_sample
from dgemma.model.attention import causal_masks
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.train.diffusion import sample_canvas_t, sample_levels


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
    return ar_token_scores(model, x)[0]


def ar_token_scores(model: DiffusionGemma, x: Tensor) -> tuple[Tensor, Tensor]:
    """`ar_token_nll` of x (B, S), and whether each x_{i+1} is the argmax of p(. | x_{<=i}) (B, S - 1) bool: lm-eval's
    is_greedy (dgemma/eval/continuations.py)."""
    inputs = x[:, :-1]
    T = inputs.shape[1]
    hidden = model.sequence_hidden(inputs, torch.arange(T, device=x.device)[None],
                                   causal_masks(T, model.config.sliding_window, x.device), num_clean=T)
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # a float64 judge scores in float64
    nll, greedy = [], []
    for b in range(x.shape[0]):
        logits = model.logits(hidden[b], dtype)
        nll.append(F.cross_entropy(logits, x[b, 1:], reduction="none"))
        greedy.append(logits.argmax(-1) == x[b, 1:])
    return torch.stack(nll), torch.stack(greedy)


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
