"""Decode speed at matched quality: the frontier half of `dgemma eval`'s verdict (docs/evaluation.md section 4).

A diffusion setting is *matched* with an AR point (the AR baseline at one temperature) on a set of prompts when

    its judge NLL per token is within one paired SE of the AR point's (mean of the per-prompt differences, diffusion
    minus AR, at most 1 SE of those differences: `paired.paired_difference`), and
    its per-sample distinct-2 is at least DIVERSITY_FLOOR (0.95) times the AR point's (means over the prompts):
    degenerate, repetitive samples score a low NLL, so the NLL alone would reward them.

Each setting's *matched AR point* is the best-quality one (lowest judge NLL) among the AR points it matches: the AR
temperature grid is there to find it (`best_match`). On the selection prompts (even, `judging.split_prompts`) the
verdict takes the fastest setting (tokens/s) that matches some AR point, with its matched AR point. Then, on the
report prompts (odd) only, it reports that pair: tokens/s and tokens per forward of diffusion over AR with 95%
intervals (`paired.ratio_of_rates`), the paired NLL difference +- SE, the distinct-2 ratio, and whether the rule still
holds there. If nothing matches, it says so and reports the closest pair: among pairs that pass the diversity check
(else all), the one whose NLL difference is the fewest paired SEs above the rule. `matches` gives every setting's
matched (or closest) AR point on all prompts, for the report's table.
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


def best_match(d: dict[str, Any], ar_points: Sequence[dict[str, Any]], idx: Sequence[int]
               ) -> tuple[int, dict[str, Any]]:
    """A setting's matched AR point on the prompts `idx` (its index and `compare`'s figures): the lowest-NLL AR point
    it matches; else the closest (among the AR points it is diverse enough for, else all: the smallest `excess`)."""
    pairs = [compare(d, a, idx) for a in ar_points]
    matched = [j for j, c in enumerate(pairs) if c["matched"]]
    if matched:
        j = min(matched, key=lambda j: (mean_se(ar_points[j]["per_prompt"][NLL], idx)["mean"], j))
    else:
        pool = [j for j, c in enumerate(pairs) if c["diverse_enough"]] or list(range(len(pairs)))
        j = min(pool, key=lambda j: (pairs[j]["excess"], j))
    return j, pairs[j]


def choose(frontier: Sequence[dict[str, Any]], ar_points: Sequence[dict[str, Any]], idx: Sequence[int]
           ) -> tuple[int, int, bool]:
    """(diffusion index, AR index, matched) on the prompts `idx`: the fastest setting that matches an AR point, with
    its matched AR point (`best_match`); else the closest pair (see the module's docstring)."""
    best = [best_match(d, ar_points, idx) for d in frontier]
    matched = [i for i, (_, c) in enumerate(best) if c["matched"]]
    if matched:
        i = max(matched, key=lambda i: (_speed(frontier[i], idx), -i))
        return i, best[i][0], True
    pool = [i for i, (_, c) in enumerate(best) if c["diverse_enough"]] or list(range(len(frontier)))
    i = min(pool, key=lambda i: (best[i][1]["excess"], i))
    return i, best[i][0], False


def matches(frontier: Sequence[dict[str, Any]], ar_points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every setting's matched (or closest) AR point on all prompts: its temperature, whether it matches, the paired
    NLL difference and the distinct-2 ratio (report.md's table)."""
    n = len(frontier[0]["per_prompt"]["tokens"]) if frontier else 0
    out = []
    for d in frontier:
        j, c = best_match(d, ar_points, range(n))
        out.append({"label": d["label"], "ar_temperature": ar_points[j]["temperature"], "ar_index": j,
                    "matched": c["matched"], "nll_difference": c["nll_difference"],
                    "distinct_2_ratio": c["distinct_2_ratio"]})
    return out


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
        "matches": matches(frontier, ar_points),
    }


__all__ = ["DIVERSITY_FLOOR", "MATCH_RULE", "best_match", "choose", "compare", "frontier_verdict", "matches"]
