"""Learning curves for `dgemma eval` (docs/evaluation.md, section 7): the held-out evaluations `dgemma train` logged
in RUN/metrics.jsonl, for the diffusion run and its AR baseline, against tokens seen.

    read_metrics(path)              the records of a metrics.jsonl (a torn last line is skipped)
    eval_points(run, metric)        one run's evaluations of `metric`: step, tokens, value, SE, CPU seconds
    matched_ratio(diffusion, ar)    diffusion NELBO / AR CE at every token count both runs evaluated (and the share
                                    of the AR model's gain over the unigram model that diffusion captures)
    token_multiplier(diffusion, ar) how many times the AR run's tokens the diffusion run needed to reach its loss
    learning_curves(...)            the report's `curves` section (None when neither run has a metrics.jsonl)
    curves_markdown(curves)         report.md's table

A diffusion run's curve is its `val_nelbo` (the NELBO at the run's training T), or for a run that logged only the
continuous-time one `val_nelbo_continuous` (both upper bounds on its NLL; records without it are skipped), an AR run's
its `val_loss` (next-token cross-entropy). The reference line is the
held-out cross-entropy of the training split's unigram distribution (`dgemma.data.shards.unigram_cross_entropy`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dgemma.train import run_dir
from dgemma.train.run_dir import METRICS


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every JSON object of a metrics.jsonl, in order; lines that do not parse (a torn last line) are skipped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


BOUNDS = (("val_nelbo", "NELBO at the training T"), ("val_nelbo_continuous", "NELBO (continuous time)"))


def bound_of(record: dict[str, Any]) -> tuple[str, str] | None:
    """The key and name of the bound an evaluation record's curve follows: the NELBO at the run's training T when
    logged (every diffusion run logs it by default), else the continuous-time one; None for a record with neither
    (an AR run's). (`dgemma eval`'s verdict reads the tighter of the two: evaluate.headline_bound.)"""
    return next(((key, name) for key, name in BOUNDS if key in record), None)


def tighter_bound(record: dict[str, Any]) -> tuple[str, str] | None:
    """The key and name of the lower of the bounds an evaluation record carries (the rule of `dgemma eval`'s verdict,
    evaluate.headline_bound, on a learning-curve record); None for a record with neither."""
    present = [(key, name) for key, name in BOUNDS if isinstance(record.get(key), (int, float))]
    return min(present, key=lambda b: record[b[0]]) if present else None


def eval_points(run: str | Path, metric: str) -> list[dict[str, Any]] | None:
    """The evaluation records of a training run directory (those with val_loss) that carry `metric`, one per step (the
    last one logged, if a resume evaluated a step again), in step order: step, tokens, value, se (`metric`_se; None
    when not finite, as with one evaluation batch), and
    cpu_s / elapsed_s of the training record of the same step when there is one. A checkpoint of a run
    (RUN/checkpoints/step-N) gives its run's whole curve. A run started from another run's checkpoint counts the
    tokens and CPU seconds that one had spent (run.json's `inherited`): tokens seen by the model, not by this run
    alone. None without RUN/metrics.jsonl."""
    root = Path(run)
    if not (root / METRICS).is_file() and root.parent.name == "checkpoints":  # RUN/checkpoints/step-N: the run's curve
        root = root.parent.parent
    path = root / METRICS
    if not path.is_file():
        return None
    try:
        start = (run_dir.read_record(root) or {}).get("inherited") or {}
    except run_dir.RunStateError:
        start = {}
    tokens0, cpu0 = start.get("tokens") or 0, start.get("cpu_s") or 0.0
    train: dict[int, dict[str, Any]] = {}
    points: dict[int, dict[str, Any]] = {}
    for rec in read_metrics(path):
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        if "val_loss" not in rec:
            if "cpu_s" in rec or "elapsed_s" in rec:
                train[step] = rec
            continue
        if metric not in rec or "tokens" not in rec:
            continue
        t = train.get(step, {})
        se = rec.get(f"{metric}_se")  # NaN (one micro-batch has no SE) as None
        cpu = t.get("cpu_s")
        points[step] = {"step": step, "tokens": tokens0 + rec["tokens"], "value": rec[metric],
                        "se": se if isinstance(se, (int, float)) and math.isfinite(se) else None,
                        "cpu_s": None if cpu is None else cpu0 + cpu, "elapsed_s": t.get("elapsed_s")}
    return [points[k] for k in sorted(points)]


def matched_ratio(diffusion: list[dict[str, Any]], ar: list[dict[str, Any]], unigram: float | None = None
                  ) -> list[dict[str, Any]]:
    """At every token count both runs evaluated: diffusion NELBO / AR CE, with the delta-method SE of the ratio
    (the two SEs independent), and (with the unigram cross-entropy U) the share of the AR run's gain over the
    unigram model that the diffusion run captures, (U - NELBO) / (U - AR CE)."""
    by_tokens = {p["tokens"]: p for p in ar}
    out = []
    for d in diffusion:
        a = by_tokens.get(d["tokens"])
        if a is None or not a["value"]:
            continue
        ratio = d["value"] / a["value"]
        se = None
        if d["se"] is not None and a["se"] is not None and d["value"]:
            se = abs(ratio) * math.sqrt((d["se"] / d["value"]) ** 2 + (a["se"] / a["value"]) ** 2)
        share = None if unigram is None or unigram == a["value"] else (unigram - d["value"]) / (unigram - a["value"])
        out.append({"tokens": d["tokens"], "step_diffusion": d["step"], "step_ar": a["step"], "nelbo": d["value"],
                    "ar_ce": a["value"], "ratio": ratio, "ratio_se": se, "share_of_ar_gain": share})
    return out


def tokens_to_reach(curve: list[dict[str, Any]], value: float) -> float | None:
    """The tokens at which a curve first reaches `value`, linearly interpolated in log tokens between the two
    evaluations around it (the first point's tokens if it starts below; None if it never gets there)."""
    previous = None
    for p in curve:
        if p["value"] <= value:
            if previous is None or previous["tokens"] <= 0:
                return float(p["tokens"])
            f = (previous["value"] - value) / (previous["value"] - p["value"])
            lo, hi = math.log(previous["tokens"]), math.log(p["tokens"])
            return math.exp(lo + f * (hi - lo))
        previous = p
    return None


def token_multiplier(diffusion: list[dict[str, Any]], ar: list[dict[str, Any]]) -> dict[str, Any] | None:
    """At the diffusion run's last evaluation (tokens n, bound v): the tokens the AR run needed to reach v and the
    multiplier n / those tokens (how many times the AR's tokens diffusion needs for the same held-out loss)."""
    if not diffusion or not ar:
        return None
    last = diffusion[-1]
    needed = tokens_to_reach(ar, last["value"])
    return {"tokens": last["tokens"], "nelbo": last["value"], "ar_tokens_for_same_loss": needed,
            "multiplier": None if not needed else last["tokens"] / needed}


def learning_curves(model_path: str | Path, baseline_path: str | Path | None, data_dir: str | Path
                    ) -> dict[str, Any] | None:
    """The report's `curves` section: each run's curve (None for a run without metrics.jsonl or without points),
    the unigram cross-entropy of `data_dir`, and the matched-token ratio; None when neither run has a curve."""
    from dgemma.data.shards import DataError, unigram_cross_entropy

    discrete = eval_points(model_path, BOUNDS[0][0])
    runs = {"diffusion": (model_path, BOUNDS[0][0] if discrete else BOUNDS[1][0]),
            "ar": (baseline_path, "val_loss")}
    curves: dict[str, Any] = {}
    for side, (path, metric) in runs.items():
        points = eval_points(path, metric) if path is not None else None
        curves[side] = {"path": str(path), "metric": metric, "points": points} if points else None
    if curves["diffusion"] is None and curves["ar"] is None:
        return None
    try:
        unigram = unigram_cross_entropy(data_dir)
    except (DataError, FileNotFoundError, ValueError):  # no train split to count: no reference line
        unigram = None
    both = curves["diffusion"] is not None and curves["ar"] is not None
    d, a = (curves["diffusion"]["points"], curves["ar"]["points"]) if both else ([], [])
    return curves | {"unigram_ce": unigram, "ratio": matched_ratio(d, a, unigram) if both else [],
                     "token_multiplier": token_multiplier(d, a) if both else None}


def _f(x: Any, fmt: str) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def curves_markdown(curves: dict[str, Any]) -> list[str]:
    """report.md's learning-curve section: one row per token count either run evaluated."""
    sides = {side: {p["tokens"]: p for p in (curves[side] or {}).get("points") or []} for side in ("diffusion", "ar")}
    ratios = {r["tokens"]: r for r in curves["ratio"]}
    lines = ["## Learning curves (from the runs' metrics.jsonl)", "",
             "Held-out evaluations logged by `dgemma train`: the diffusion run's bound (`" +
             ((curves.get("diffusion") or {}).get("metric") or "val_nelbo") + "`: the continuous-time NELBO of a "
             "continuous-time run, else the NELBO at its training T; an upper bound on its NLL) and the AR run's "
             "next-token cross-entropy, nats/token, ± SE, on the first `eval_batches` x `batch_size` validation "
             "windows (the likelihood section's windows when those are as many). Unigram cross-entropy "
             f"of the training split on the validation split: {_f(curves['unigram_ce'], '.4f')}; share: of the AR "
             "run's gain over the unigram model, (unigram - NELBO) / (unigram - AR CE).", "",
             "| tokens | step | diffusion NELBO | ± SE | AR CE | ± SE | NELBO / AR CE | share |",
             "|---|---|---|---|---|---|---|---|"]
    for tokens in sorted(set(sides["diffusion"]) | set(sides["ar"])):
        d, a, r = sides["diffusion"].get(tokens, {}), sides["ar"].get(tokens, {}), ratios.get(tokens, {})
        ratio = f"{_f(r.get('ratio'), '.3f')} ± {_f(r.get('ratio_se'), '.3f')}" if r else "–"
        share = _f(r.get("share_of_ar_gain"), ".0%") if r else "–"
        lines.append(f"| {tokens:,} | {d.get('step', a.get('step'))} | {_f(d.get('value'), '.4f')} | "
                     f"{_f(d.get('se'), '.4f')} | {_f(a.get('value'), '.4f')} | {_f(a.get('se'), '.4f')} | {ratio} | "
                     f"{share} |")
    m = curves.get("token_multiplier")
    if m and m.get("multiplier"):
        lines += ["", f"Token multiplier: the diffusion run's last bound, {m['nelbo']:.4f} after {m['tokens']:,} "
                  f"tokens, is the AR run's loss after {m['ar_tokens_for_same_loss']:,.0f} tokens (interpolated in "
                  f"log tokens): diffusion needed **{m['multiplier']:.1f}x** the tokens."]
    return [*lines, "", "![curves](curves.png)", ""]


__all__ = ["BOUNDS", "bound_of", "curves_markdown", "eval_points", "learning_curves", "matched_ratio", "read_metrics",
           "token_multiplier", "tokens_to_reach"]
