"""The compact frontier table of docs/sampling.md from a `dgemma eval` report (runs/cpu_small_results.sh writes it to
docs/results/cpu-small/frontier.md): every sampler setting and the AR baseline at each temperature, sorted by
tokens per forward within each sampler, with the judge's NLL per token and its SE, the gen-PPL interval, diversity
and prompt dependence; then, per sampler, its best judge NLL and whether it beats entropy-bound's best at equal or
higher tokens per forward and no less varied samples (token entropy and distinct-2 at least 0.95 times its).
Distinct-2 is per sample where the report has it (`distinct_2_per_sample`), else the older reports' pooled figure,
labelled so. "Beyond 2 SE" compares with the SE of the per-prompt NLL differences where the report keeps per-prompt
figures (`per_prompt`: the two samplers decoded the same prompts), else with the SE of the point's own NLL.

    python runs/frontier_table.py [REPORT_DIR/report.json] [--out FILE]   (default: docs/results/cpu-small's)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def _f(x, fmt: str = ".2f") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def distinct_2(q: dict) -> float | None:
    """Distinct-2 per sample, else (reports before it) the pooled figure."""
    return q.get("distinct_2_per_sample", q.get("distinct_2"))


def _distinct_name(report: dict) -> str:
    rows = [*report["frontier"], *report["ar_frontier"]]
    return "distinct-2 per sample" if any("distinct_2_per_sample" in p["quality"] for p in rows) else \
        "distinct-2 (pooled)"


def _se(p: dict, best: dict) -> float:
    """The SE a difference of judge NLLs between `p` and `best` has: paired by prompt where both rows keep per-prompt
    NLLs, else `p`'s own."""
    a, b = (x.get("per_prompt", {}).get("nll_per_token") for x in (p, best))
    if a is not None and b is not None and len(a) == len(b):
        from dgemma.eval.paired import paired_difference

        se = paired_difference(a, b)["se"]
    else:
        se = p["quality"].get("nll_per_token_se")
    return se if se is not None and math.isfinite(se) else math.inf


def table(report: dict) -> list[str]:
    lines = ["| sampler setting | tokens/forward | tokens/s | judge NLL/token ± SE | gen-PPL [95%] | "
             f"{_distinct_name(report)} | token entropy | prompt dependence |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def row(name: str, speed: dict, q: dict) -> str:
        ci = q.get("gen_ppl_ci95") or [None, None]
        return (f"| {name} | {_f(speed['tokens_per_forward'])} | {_f(speed['tokens_per_second'], '.0f')} | "
                f"{_f(q.get('nll_per_token'), '.3f')} ± {_f(q.get('nll_per_token_se'), '.3f')} | "
                f"{_f(q.get('gen_ppl'), '.0f')} [{_f(ci[0], '.0f')}, {_f(ci[1], '.0f')}] | "
                f"{_f(distinct_2(q), '.3f')} | {_f(q.get('token_entropy'))} | "
                f"{_f(q.get('prompt_dependence'), '.3f')} |")

    points = report["frontier"]
    order = list(dict.fromkeys(p["sampler"] for p in points))
    for sampler in order:
        for p in sorted((p for p in points if p["sampler"] == sampler),
                        key=lambda p: (p["group"], p["adaptive"]["tokens_per_forward"])):
            lines.append(row(p["label"], p["adaptive"], p["quality"]))
    for p in report["ar_frontier"]:
        lines.append(row(f"AR, temperature {p['temperature']:g}", p, p["quality"]))
    return lines


def verdicts(report: dict) -> list[str]:
    """Per sampler: its best judge NLL and its tokens/forward, against entropy-bound's best."""
    points = [p for p in report["frontier"] if p["quality"].get("nll_per_token") is not None]
    nll = lambda p: p["quality"]["nll_per_token"]
    base = [p for p in points if p["sampler"] == "entropy-bound"]
    if not base:
        return []
    best = min(base, key=nll)
    se = lambda p: _f(p["quality"].get("nll_per_token_se"), ".3f")
    out = ["", f"Entropy-bound's best judge NLL: {best['label']}, {nll(best):.3f} ± {se(best)} at "
           f"{best['adaptive']['tokens_per_forward']:.2f} tokens/forward.",
           "", "| sampler | its best setting | judge NLL/token ± SE | tokens/forward | beats entropy-bound's best at "
           "equal or more tokens/forward? |", "|---|---|---:|---:|---|"]
    for sampler in dict.fromkeys(p["sampler"] for p in points):
        mine = [p for p in points if p["sampler"] == sampler]
        top = min(mine, key=nll)
        faster = [p for p in mine if p["adaptive"]["tokens_per_forward"] >= best["adaptive"]["tokens_per_forward"]]
        # no less varied than entropy-bound's best: token entropy and distinct-2 at least 0.95 times its (a sampler
        # that repeats itself more scores a lower NLL for it)
        varied = [p for p in faster if p["quality"]["token_entropy"] >= 0.95 * best["quality"]["token_entropy"]
                  and distinct_2(p["quality"]) >= 0.95 * distinct_2(best["quality"])]
        wins = [p for p in varied if nll(p) + 2 * _se(p, best) < nll(best)]
        lower = [p for p in varied if nll(p) < nll(best)]
        repeats = [p for p in faster if nll(p) < nll(best) and p not in varied]
        answer = (f"yes, beyond 2 SE: {', '.join(p['label'] for p in wins)}" if wins else
                  f"lower, within 2 SE: {', '.join(p['label'] for p in lower)}" if lower else
                  f"no: {len(repeats)} setting(s) score lower by repeating themselves more" if repeats else "no")
        out.append(f"| {sampler} | {top['label']} | {nll(top):.3f} ± {se(top)} | "
                   f"{top['adaptive']['tokens_per_forward']:.2f} | {'–' if sampler == 'entropy-bound' else answer} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", type=Path, nargs="?", default=Path(__file__).resolve().parents[1] / "docs" / "results"
                    / "cpu-small" / "report.json", help="report.json of dgemma eval (default: the README's)")
    ap.add_argument("--out", type=Path, help="write the markdown here too")
    args = ap.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"frontier_table: error: {args.report}: {e}", file=sys.stderr)
        return 2
    text = "\n".join([f"From `{report['command']}`", "", *table(report), *verdicts(report)]) + "\n"
    if args.out is not None:
        from dgemma.io.fsio import write_text
        write_text(args.out, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
