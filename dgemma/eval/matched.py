"""Decode speed at matched quality: the frontier half of `dgemma eval`'s verdict (docs/evaluation.md section 4).

A diffusion setting is *matched* with an AR point (the AR baseline at one temperature) on a set of prompts when

    its judge NLL per token is within one paired SE of the AR point's (mean of the per-prompt differences, diffusion
    minus AR, at most 1 SE of those differences: `paired.paired_difference`), and
    its per-sample distinct-2 is at least DIVERSITY_FLOOR (0.95) times the AR point's (means over the prompts):
    degenerate, repetitive samples score a low NLL, so the NLL alone would reward them.

On the selection prompts (even, `judging.split_prompts`) the verdict takes, among the AR points some setting matches,
the best-quality one (lowest judge NLL), and the fastest setting (tokens/s) matched with it. Then, on the report
prompts (odd) only, it reports that pair: tokens/s and tokens per forward of diffusion over AR with 95% intervals
(`paired.ratio_of_rates`), the paired NLL difference +- SE, the distinct-2 ratio, and whether the rule still holds
there. If nothing matches, it says so and reports the closest pair: among pairs that pass the diversity check (else
all), the one whose NLL difference is fewest paired SEs above zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dgemma.eval.judging import split_prompts
from dgemma.eval.paired import RATIO_INTERVAL, mean_se, paired_difference, ratio_of_rates

DIVERSITY_FLOOR = 0.95
MATCH_RULE = ("judge NLL per token within one paired SE of the AR point's (mean per-prompt difference, diffusion "
              f"minus AR, <= 1 SE) and per-sample distinct-2 >= {DIVERSITY_FLOOR:g}x the AR point's")
NLL, DISTINCT = "nll_per_token", "distinct_2_per_sample"


def compare(d: dict[str, Any], a: dict[str, Any], idx: Sequence[int]) -> dict[str, Any]:
    """One diffusion row against one AR row on the prompts `idx`: the paired NLL difference, the distinct-2 ratio,
    whether the rule holds (MATCH_RULE), and how far from it the NLL is (`excess`: (difference - SE) / SE)."""
    diff = paired_difference(d["per_prompt"][NLL], a["per_prompt"][NLL], idx)
    dd, da = mean_se(d["per_prompt"][DISTINCT], idx)["mean"], mean_se(a["per_prompt"][DISTINCT], idx)["mean"]
    ratio = dd / da if da else math.nan
    se = diff["se"] if math.isfinite(diff["se"]) else 0.0
    within = math.isfinite(diff["mean"]) and diff["mean"] <= se
    varied = math.isfinite(ratio) and ratio >= DIVERSITY_FLOOR
    excess = (diff["mean"] - se) / se if se > 0 else (math.copysign(math.inf, diff["mean"]) if diff["mean"] else 0.0)
    return {"nll_difference": diff, "distinct_2_ratio": ratio, "nll_within_se": within, "diverse_enough": varied,
            "matched": within and varied, "excess": excess if math.isfinite(diff["mean"]) else math.inf}


def _speed(row: dict[str, Any], idx: Sequence[int]) -> float:
    p = row["per_prompt"]
    seconds = sum(p["seconds"][i] for i in idx)
    return sum(p["tokens"][i] for i in idx) / seconds if seconds > 0 else 0.0


def choose(frontier: Sequence[dict[str, Any]], ar_points: Sequence[dict[str, Any]], idx: Sequence[int]
           ) -> tuple[int, int, bool]:
    """(diffusion index, AR index, matched) on the prompts `idx`: the fastest setting matched with the lowest-NLL
    AR point any setting matches; else the closest pair (see the module's docstring)."""
    pairs = {(i, j): compare(d, a, idx) for i, d in enumerate(frontier) for j, a in enumerate(ar_points)}
    matched = [k for k, c in pairs.items() if c["matched"]]
    if matched:
        ar_nll = lambda j: mean_se(ar_points[j]["per_prompt"][NLL], idx)["mean"]
        best_ar = min({j for _, j in matched}, key=lambda j: (ar_nll(j), j))
        i = max((i for i, j in matched if j == best_ar), key=lambda i: (_speed(frontier[i], idx), -i))
        return i, best_ar, True
    pool = [k for k, c in pairs.items() if c["diverse_enough"]] or list(pairs)
    i, j = min(pool, key=lambda k: (pairs[k]["excess"], k))
    return i, j, False


def frontier_verdict(frontier: Sequence[dict[str, Any]], ar_points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The verdict's speed-at-matched-quality keys (docs/evaluation.md section 4): chosen on the selection prompts,
    measured on the report prompts. Needs the judge's NLL per prompt on every row."""
    n = len(frontier[0]["per_prompt"]["tokens"])
    select, report = split_prompts(n)
    i, j, matched = choose(frontier, ar_points, select)
    d, a = frontier[i], ar_points[j]
    on_report = compare(d, a, report)
    pd, pa = d["per_prompt"], a["per_prompt"]
    speed = ratio_of_rates(pd["tokens"], pd["seconds"], pa["tokens"], pa["seconds"], report)
    per_forward = ratio_of_rates(pd["generated"], pd["passes"], pa["generated"], pa["passes"], report)
    side = lambda row, key: mean_se(row["per_prompt"][key], report)
    return {
        "match_rule": MATCH_RULE, "interval_method": RATIO_INTERVAL,
        "speedup": speed["ratio"], "speedup_ci95": speed["ci95"],
        "tokens_per_forward_ratio": per_forward["ratio"], "tokens_per_forward_ratio_ci95": per_forward["ci95"],
        "speedup_setting": {"label": d["label"], "sampler": d["sampler"],
                            "max_denoising_steps": d["max_denoising_steps"], "entropy_bound": d["entropy_bound"]},
        "frontier_index": i, "ar_temperature": a["temperature"], "ar_index": j,
        "quality_matched": matched, "quality_matched_on_report": on_report["matched"],
        "selection": compare(d, a, select),
        "nll_difference": on_report["nll_difference"], "distinct_2_ratio": on_report["distinct_2_ratio"],
        "nll_per_token": side(d, NLL), "ar_nll_per_token": side(a, NLL),
        "distinct_2_per_sample": side(d, DISTINCT), "ar_distinct_2_per_sample": side(a, DISTINCT),
        "tokens_per_second": _speed(d, report), "ar_tokens_per_second": _speed(a, report),
        "prompts_select": len(select), "prompts_report": len(report),
    }


__all__ = ["DIVERSITY_FLOOR", "MATCH_RULE", "choose", "compare", "frontier_verdict"]
