"""Paired comparisons of two frontier rows on the same prompts (docs/evaluation.md section 3), prompts the unit.

Every row of `dgemma eval`'s frontier keeps its per-prompt figures (`per_prompt`: the judge's NLL per token, the
per-sample distinct-2, ... each the mean over the prompt's sampling seeds; and the timed run's useful tokens,
seconds, generated positions and backbone passes). Two rows decoded the same prompts, so their difference is taken
prompt by prompt, and the spread of those differences -- not of each row's own numbers -- is the comparison's SE:

    seed_means(draws)                          per prompt: the mean over its seeds (NaN draws left out)
    mean_se(values, idx)                       mean, SE = std / sqrt(n) (ddof 1), n over the prompts `idx`
    paired_difference(a, b, idx)               per-prompt a - b: its mean, SE = std / sqrt(n), n
    ratio_of_rates(a_num, a_den, b_num, b_den, idx)
                                               (sum a_num / sum a_den) / (sum b_num / sum b_den) with a 95% interval,
                                               the delta method on the log ratio with per-prompt pairing
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Z95 = 1.959963984540054  # the 97.5% point of the standard normal
RATIO_INTERVAL = ("delta method on the log ratio, paired by prompt: prompt i contributes a_num_i / mean a_num - "
                  "a_den_i / mean a_den - (b_num_i / mean b_num - b_den_i / mean b_den); SE = std / sqrt(n); "
                  "interval ratio x exp(+-1.96 SE)")


def seed_means(draws: Sequence[Sequence[float]]) -> list[float]:
    """Per prompt, the mean of its values over the seeds (`draws[k][i]`: seed k, prompt i); NaN values (an empty
    sample) are left out, NaN when every seed's is."""
    x = np.asarray(draws, dtype=np.float64)  # (S, n)
    if x.ndim != 2:
        raise ValueError(f"draws must be seeds x prompts, got shape {x.shape}")
    seen = np.isfinite(x)
    total = np.where(seen, x, 0.0).sum(0)
    count = seen.sum(0)
    return [float(t / c) if c else math.nan for t, c in zip(total, count, strict=True)]


def _values(values: Sequence[float], idx: Sequence[int] | None) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    return x if idx is None else x[list(idx)]


def mean_se(values: Sequence[float], idx: Sequence[int] | None = None) -> dict[str, Any]:
    """Mean over the prompts `idx` (all if None) of per-prompt values, NaN ones left out; SE = std (ddof 1) /
    sqrt(n), NaN for fewer than two."""
    x = _values(values, idx)
    x = x[np.isfinite(x)]
    if not x.size:
        return {"mean": math.nan, "se": math.nan, "n": 0}
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size >= 2 else math.nan
    return {"mean": float(x.mean()), "se": se, "n": int(x.size)}


def paired_difference(a: Sequence[float], b: Sequence[float], idx: Sequence[int] | None = None) -> dict[str, Any]:
    """The per-prompt difference a_i - b_i over the prompts `idx` where both are finite: its mean, SE = std (ddof 1)
    / sqrt(n), and n."""
    if len(a) != len(b):
        raise ValueError(f"paired rows must cover the same prompts: {len(a)} against {len(b)}")
    return mean_se(_values(a, None) - _values(b, None), idx)


def _influence(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Per unit, the linearised contribution to log(sum num / sum den): num_i / mean num - den_i / mean den."""
    return num / max(num.mean(), 1e-300) - den / max(den.mean(), 1e-300)


def ratio_of_rates(a_num: Sequence[float], a_den: Sequence[float], b_num: Sequence[float], b_den: Sequence[float],
                   idx: Sequence[int] | None = None) -> dict[str, Any]:
    """The ratio of two ratio estimators on the same prompts, (sum a_num / sum a_den) / (sum b_num / sum b_den)
    (tokens/s: useful tokens over seconds; tokens per forward: positions over passes), with its SE on the log scale
    and 95% interval by the delta method, paired by prompt (RATIO_INTERVAL). NaN where a sum is zero; the interval
    needs two prompts."""
    an, ad, bn, bd = (_values(v, idx) for v in (a_num, a_den, b_num, b_den))
    if not (an.size == ad.size == bn.size == bd.size):
        raise ValueError("paired rates must cover the same prompts")
    nan = {"ratio": math.nan, "log_se": math.nan, "ci95": [math.nan, math.nan], "n": int(an.size)}
    if not an.size or min(an.sum(), ad.sum(), bn.sum(), bd.sum()) <= 0:
        return nan
    ratio = float((an.sum() / ad.sum()) / (bn.sum() / bd.sum()))
    e = _influence(an, ad) - _influence(bn, bd)
    se = float(e.std(ddof=1) / math.sqrt(e.size)) if e.size >= 2 else math.nan
    return {"ratio": ratio, "log_se": se, "ci95": [ratio * math.exp(-Z95 * se), ratio * math.exp(Z95 * se)],
            "n": int(an.size)}


__all__ = ["RATIO_INTERVAL", "Z95", "mean_se", "paired_difference", "ratio_of_rates", "seed_means"]
