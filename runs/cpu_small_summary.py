"""The cpu-small comparison of docs/results.md across training seeds: each seed's `dgemma eval` report side by side,
their mean and spread, and the compute-matched AR comparator scored on the same tokens (runs/cpu_small_results.sh
writes the reports and runs this).

    python runs/cpu_small_summary.py REPORT_DIR [REPORT_DIR ...] [--compute-matched AR_RUN] --out DIR

Writes DIR/summary.md and DIR/summary.json. Every likelihood comes with its between-window SE and, for the diffusion
bounds, its Monte Carlo SE (docs/evaluation.md section 1.4); the seed spread is the half-range of the seeds' values
(two seeds: a second training seed, not an error bar). The judge, the comparator's place on its schedule and the
scored tokens are stated as each report states them; reports that scored different tokens are refused.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _f(x, fmt: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _pm(e: dict | None, mc: float | None = None) -> str:
    if not e:
        return "–"
    out = f"{_f(e['mean'])} ± {_f(e['se'])}"
    return out + (f" (MC ± {_f(mc)})" if mc is not None else "")


def seed_row(path: Path) -> dict:
    """The figures of one report that the summary compares."""
    report = json.loads((path / "report.json").read_text())
    lk, v = report["likelihood"], report.get("verdict") or {}
    bound = report.get("headline_bound", "nelbo")
    nelbo, ar = lk[bound], lk.get("ar_ce")
    row = {"report": str(path), "bound": bound, "num_steps": lk["nelbo"]["num_steps"],
           "nelbo": nelbo["estimate"], "nelbo_mc_se": nelbo.get("mc_se"),
           "nelbo_T": lk["nelbo"]["estimate"], "nelbo_T_mc_se": lk["nelbo"].get("mc_se"),
           "ar_ce": None if ar is None else ar["estimate"], "unigram": lk.get("unigram"),
           "reference": lk.get("reference_nelbo"), "iw": lk.get("iw"), "scored": lk.get("scored"),
           "judge": report.get("judge"), "baseline": report.get("baseline"), "verdict": v,
           "prompts": report.get("prompts", {}).get("count"),
           "sample_seeds": report.get("settings", {}).get("sample_seeds", 1)}
    if ar is not None:
        a, d = ar["estimate"]["mean"], nelbo["estimate"]["mean"]
        row["ratio"] = d / a
        u = (lk.get("unigram") or {}).get("mean")
        row["share_of_ar_gain"] = None if u is None or u == a else (u - d) / (u - a)
    return row


def compute_matched(run: Path, report_dir: Path) -> dict:
    """The compute-matched AR run's cross-entropy on the report's scored tokens (the same windows and rule)."""
    from dgemma.data.shards import TokenDataset
    from dgemma.eval.evaluate import run_info
    from dgemma.eval.judging import schedule_position
    from dgemma.eval.likelihoods import heldout_ar_ce, scored_digest
    from dgemma.weights.loading import load_model

    report = json.loads((report_dir / "report.json").read_text())
    st = report["settings"]
    data = Path(report["data"]["path"])  # as the report names it: relative to where dgemma eval ran
    val = TokenDataset(data if data.is_absolute() or data.exists() else report_dir.parent / data, "val")
    info = run_info(run)
    model = load_model(info.model_dir).eval()
    r = heldout_ar_ce(model, val, seq_len=st["seq_len"], max_windows=st["max_windows"], progress=False)
    digest = scored_digest(val, st["seq_len"], st["max_windows"])
    if digest["sha256"] != report["likelihood"]["scored"]["sha256"]:
        raise SystemExit(f"cpu_small_summary.py: {run} would score other tokens than {report_dir}")
    cfg = info.train_config or {}
    return {"run": str(run), "estimate": r["estimate"].to_dict(), "seed": cfg.get("seed"),
            **schedule_position(info.path, info.model_dir, cfg)}


def summarize(rows: list[dict], matched: dict | None) -> dict:
    shas = {(r["scored"] or {}).get("sha256") for r in rows}
    if len(shas) != 1:
        raise SystemExit("cpu_small_summary.py: the reports scored different tokens (likelihood.scored.sha256 "
                         "differs); evaluate every seed with the same --data, --seq-len and --max-windows")

    figure = lambda key: spread([r.get(key) for r in rows])
    return {"seeds": len(rows), "scored": rows[0]["scored"],
            "nelbo": figure("nelbo"), "ar_ce": figure("ar_ce"), "ratio": figure("ratio"),
            "share_of_ar_gain": figure("share_of_ar_gain"),
            "speedup": spread([r["verdict"].get("speedup") for r in rows]), "compute_matched_ar": matched,
            "rows": rows}


def spread(values: list) -> dict | None:
    """The seeds' mean and half-range of one figure (an estimate's mean, or a number); None if a seed lacks it."""
    vals = [v["mean"] if isinstance(v, dict) else v for v in values]
    if any(not isinstance(v, (int, float)) for v in vals):
        return None
    return {"mean": sum(vals) / len(vals), "half_range": (max(vals) - min(vals)) / 2, "values": vals}


def markdown(s: dict) -> str:
    rows = s["rows"]
    sc = s["scored"] or {}
    lines = ["# cpu-small: diffusion against AR across training seeds", "",
             f"Scored: {sc.get('rule')} ({sc.get('windows')} windows, {sc.get('tokens', 0):,} tokens, sha256 "
             f"{str(sc.get('sha256'))[:12]}), the same tokens in every report. ± SE: between windows; MC: the Monte "
             "Carlo SE of the diffusion bound (docs/evaluation.md section 1.4).", "",
             "| | " + " | ".join(f"seed {i}" for i in range(len(rows))) + " | mean (half-range) |",
             "|---|" + "---:|" * (len(rows) + 1)]

    def line(name: str, cells: list[str], agg: dict | None, fmt: str = ".3f") -> None:
        tail = "–" if agg is None else f"{format(agg['mean'], fmt)} ({format(agg['half_range'], fmt)})"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {tail} |")

    line(f"diffusion {rows[0]['bound']} (nats/token)", [_pm(r["nelbo"], r["nelbo_mc_se"]) for r in rows], s["nelbo"])
    line("AR comparator CE (annealed at the budget)", [_pm(r["ar_ce"]) for r in rows], s["ar_ce"])
    line("bound / AR CE", [_f(r.get("ratio")) for r in rows], s["ratio"])
    line("share of the AR's gain over the unigram", [_f(r.get("share_of_ar_gain"), ".0%") for r in rows],
         s["share_of_ar_gain"], ".0%")
    line("unigram on the scored tokens", [_pm(r["unigram"]) for r in rows], None)
    line("exact unigram model's NELBO (same code)", [_pm((r["reference"] or {}).get("estimate"),
                                                         (r["reference"] or {}).get("mc_se")) for r in rows], None)
    iws = [r["iw"] for r in rows]
    line("IW bound gap K=1 -> 16 (NELBO at least this loose)",
         [f"{_f(i['gap']['mean'])} ± {_f(i['gap']['se'])}" if i else "–" for i in iws], None)
    def ci(v: dict, key: str) -> str:
        lo_hi = v.get(f"{key}_ci95") or [None, None]
        return f"{_f(v.get(key), '.2f')} [{_f(lo_hi[0], '.2f')}, {_f(lo_hi[1], '.2f')}]"

    line("tokens/s vs AR at matched quality [95%]", [ci(r["verdict"], "speedup") for r in rows], s["speedup"], ".2f")
    line("tokens per forward vs AR there [95%]", [ci(r["verdict"], "tokens_per_forward_ratio") for r in rows],
         spread([r["verdict"].get("tokens_per_forward_ratio") for r in rows]), ".2f")
    line("judge NLL/token minus AR's (paired over prompts)",
         [f"{_f((r['verdict'].get('nll_difference') or {}).get('mean'), '+.3f')} ± "
          f"{_f((r['verdict'].get('nll_difference') or {}).get('se'))}" for r in rows], None)
    line("setting, against AR at temperature",
         [f"{(r['verdict'].get('speedup_setting') or {}).get('label')}, T={r['verdict'].get('ar_temperature')}"
          + ("" if r["verdict"].get("quality_matched") else " (not matched)") for r in rows], None)
    lines += ["", "Comparators and judge, as each report names them:", ""]
    for i, r in enumerate(rows):
        b, j = r["baseline"] or {}, r["judge"] or {}
        lines.append(f"- seed {i}: baseline `{b.get('checkpoint')}` (step {b.get('step')} of "
                     f"{b.get('schedule_steps')}, annealed: {b.get('annealed')}); judge: {j.get('judge')} "
                     f"`{j.get('path')}` (seed {j.get('seed')}, {_f(j.get('trained_tokens'), ',')} tokens); "
                     f"{r['prompts']} prompts x {r['sample_seeds']} sampling seeds")
    m = s["compute_matched_ar"]
    if m:
        lines += ["", f"Compute-matched AR comparator `{m['run']}` (seed {m['seed']}, step {m['step']} of "
                  f"{m['schedule_steps']}, annealed: {m['annealed']}): AR CE {_pm(m['estimate'])} on the same tokens "
                  "(about the diffusion run's training compute with its AR start's)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="dgemma eval output directories, one per training seed")
    p.add_argument("--compute-matched", type=Path, help="the compute-matched AR run, scored on the same tokens")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    for r in args.reports:
        if not (r / "report.json").is_file():
            p.error(f"{r}: no report.json (run dgemma eval --out {r} first)")
    rows = [seed_row(r) for r in args.reports]
    matched = compute_matched(args.compute_matched, args.reports[0]) if args.compute_matched else None
    s = summarize(rows, matched)
    from dgemma.io.fsio import write_text

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "summary.json", json.dumps(s, indent=1, default=str))
    write_text(args.out / "summary.md", markdown(s))
    print(args.out / "summary.md")


if __name__ == "__main__":
    main()
