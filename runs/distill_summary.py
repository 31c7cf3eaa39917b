"""Distilled students against their teacher (issue 40), from `dgemma eval` reports of the teacher and each student made
with the same judge, baseline, prompts and settings (runs/distill_results.sh writes them and runs this).

    python runs/distill_summary.py --teacher REPORT_DIR --teacher-steps N --student REPORT_DIR [--student ...] --out DIR

For each sampler on the reports' frontiers, every model at every step count against the teacher at its full N, paired
over the same prompts: the judge's NLL per token (difference, student minus teacher, +- its paired SE), per-sample
distinct-2 (ratio), tokens per forward, and whether the quality is kept by the matched rule of docs/evaluation.md
(NLL within one paired SE and distinct-2 >= 0.95x). Then each report's own verdict (seed 003's: tokens/s relative to
the AR baseline at matched quality, with its interval), each model's held-out bound, and the students' training cost
in CPU-minutes. Writes DIR/summary.md and DIR/summary.json. Reports whose prompts differ are refused.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dgemma.eval.matched import DIVERSITY_FLOOR
from dgemma.eval.paired import mean_se, paired_difference

NLL, DISTINCT = "nll_per_token", "distinct_2_per_sample"


def _f(x, fmt: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def load(path: Path) -> dict:
    report = json.loads((path / "report.json").read_text())
    report["_dir"] = str(path)
    return report


def run_cost(report: dict) -> dict | None:
    """A distillation run's training cost from its metrics: steps, tokens and CPU seconds of its last record."""
    cfg = report["model"].get("train_config") or {}
    if cfg.get("objective") != "distill":
        return None
    metrics = Path(report["_dir"]).parent / report["model"]["path"] / "metrics.jsonl"
    last = None
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        rec = json.loads(line)
        if "cpu_s" in rec:
            last = rec
    return None if last is None else {"teacher": cfg.get("teacher"), "student_steps": cfg.get("student_steps"),
                                      "steps": last["step"], "tokens": last["tokens"],
                                      "cpu_minutes": last["cpu_s"] / 60}


def rows_by_setting(report: dict) -> dict[tuple[str, int], dict]:
    return {(r["group"], r["max_denoising_steps"]): r for r in report["frontier"]}


def per_forward(row: dict) -> float:
    p = row["per_prompt"]
    return sum(p["generated"]) / sum(p["passes"])


def against_teacher(row: dict, ref: dict) -> dict:
    n = len(ref["per_prompt"][NLL])
    idx = list(range(n))
    diff = paired_difference(row["per_prompt"][NLL], ref["per_prompt"][NLL], idx)
    d, t = mean_se(row["per_prompt"][DISTINCT], idx), mean_se(ref["per_prompt"][DISTINCT], idx)
    ratio = d["mean"] / t["mean"] if t["mean"] else math.nan
    within = diff["mean"] <= diff["se"]
    return {"nll": mean_se(row["per_prompt"][NLL], idx), "nll_difference": diff, "distinct_2": d,
            "distinct_2_ratio": ratio, "tokens_per_forward": per_forward(row),
            "kept": bool(within and ratio >= DIVERSITY_FLOOR)}


def summarize(teacher: dict, teacher_steps: int, students: list[dict]) -> dict:
    reports = [teacher, *students]
    prompts = {json.dumps(r["prompts"], sort_keys=True) for r in reports}
    if len(prompts) != 1:
        raise SystemExit("distill_summary.py: the reports decoded different prompts (report.json 'prompts')")
    t_rows = rows_by_setting(teacher)
    table = []
    for report in reports:
        name = Path(report["_dir"]).name.removeprefix("report-")
        for (group, n), row in rows_by_setting(report).items():
            ref = t_rows.get((group, teacher_steps))
            if ref is None:
                continue
            table.append({"model": name, "sampler": group, "steps": n, **against_teacher(row, ref)})
    verdicts = []
    for report in reports:
        v = report.get("verdict") or {}
        verdicts.append({"model": Path(report["_dir"]).name.removeprefix("report-"),
                         **{k: v.get(k) for k in ("speedup", "speedup_ci95", "tokens_per_forward_ratio",
                                                  "tokens_per_forward_ratio_ci95", "speedup_setting",
                                                  "ar_temperature", "quality_matched", "quality_matched_on_report",
                                                  "nll_per_token", "ar_nll_per_token", "distinct_2_per_sample",
                                                  "ar_distinct_2_per_sample")},
                         "bound": {k: (report["likelihood"].get(k) or {}).get("estimate")
                                   for k in ("nelbo", "nelbo_continuous")},
                         "bound_mc_se": {k: (report["likelihood"].get(k) or {}).get("mc_se")
                                         for k in ("nelbo", "nelbo_continuous")},
                         "nelbo_steps": report["likelihood"]["nelbo"].get("num_steps"),
                         "ar_ce": (report["likelihood"].get("ar_ce") or {}).get("estimate"),
                         "timing_load": report.get("timing", {}).get("before", {}).get("loadavg_1_5_15"),
                         "cost": run_cost(report)})
    return {"teacher": teacher["_dir"], "teacher_steps": teacher_steps, "judge": teacher.get("judge"),
            "prompts": teacher["prompts"], "sample_seeds": teacher["settings"].get("sample_seeds"),
            "rule": f"kept: judge NLL per token within one paired SE of the teacher at N = {teacher_steps} (student "
                    f"minus teacher <= 1 SE) and per-sample distinct-2 >= {DIVERSITY_FLOOR}x the teacher's",
            "table": table, "verdicts": verdicts}


def _judge(j: dict | None) -> str:
    if not j:
        return "–"
    return f"{j['judge']} ({j['path']}, seed {j.get('seed')}, {j.get('trained_step')} steps, {j.get('dtype')})"


def markdown(s: dict) -> str:
    lines = [f"# Distilled students against their teacher ({s['teacher']}, N = {s['teacher_steps']})", "",
             f"{s['prompts']['count']} prompts x {s['sample_seeds']} sampling seeds, the same in every report; judge: "
             f"{_judge(s.get('judge'))}.", "", s["rule"] + ".", "",
             "| model | sampler | N | tokens/forward | judge NLL | minus teacher's (± paired SE) | distinct-2 | ratio "
             "| kept |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in s["table"]:
        d = r["nll_difference"]
        lines.append(f"| {r['model']} | {r['sampler']} | {r['steps']} | {_f(r['tokens_per_forward'], '.2f')} | "
                     f"{_f(r['nll']['mean'])} ± {_f(r['nll']['se'])} | {d['mean']:+.3f} ± {_f(d['se'])} | "
                     f"{_f(r['distinct_2']['mean'])} | {_f(r['distinct_2_ratio'], '.2f')} | "
                     f"{'yes' if r['kept'] else 'no'} |")
    lines += ["", "Seed 003's verdict per report (the best frontier point matched to an AR temperature, chosen on the "
              "selection prompts, measured on the report prompts; docs/evaluation.md section 4):", "",
              "| model | setting | AR T | matched (report half) | tokens/s vs AR (95% CI) | tokens/forward vs AR | "
              "held-out bound (MC SE) | AR CE | load | distillation |",
              "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    for v in s["verdicts"]:
        ci = v.get("speedup_ci95") or [None, None]
        b = v["bound"].get("nelbo_continuous") or v["bound"].get("nelbo") or {}
        mc = v["bound_mc_se"].get("nelbo_continuous") or v["bound_mc_se"].get("nelbo")
        cost = v.get("cost")
        cost_s = "–" if not cost else (f"{cost['steps']} steps from {cost['teacher']}, "
                                       f"{cost['cpu_minutes']:.1f} CPU-min")
        setting = (v.get("speedup_setting") or {}).get("label", "–")
        lines.append(f"| {v['model']} | {setting} | {_f(v.get('ar_temperature'), 'g')} | "
                     f"{v.get('quality_matched')} ({v.get('quality_matched_on_report')}) | "
                     f"{_f(v.get('speedup'), '.2f')} ({_f(ci[0], '.2f')}-{_f(ci[1], '.2f')}) | "
                     f"{_f(v.get('tokens_per_forward_ratio'), '.2f')} | {_f(b.get('mean'))} ± {_f(b.get('se'))} "
                     f"({_f(mc)}) | {_f((v.get('ar_ce') or {}).get('mean'))} | {v.get('timing_load')} | {cost_s} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--teacher-steps", type=int, required=True)
    ap.add_argument("--student", type=Path, action="append", default=[])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    s = summarize(load(args.teacher), args.teacher_steps, [load(p) for p in args.student])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    (args.out / "summary.md").write_text(markdown(s))
    print(markdown(s))


if __name__ == "__main__":
    main()
