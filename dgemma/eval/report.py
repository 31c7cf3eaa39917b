"""The report of `dgemma eval`: report.json, report.md and its figures (frontier.png, likelihood.png, and curves.png
when the runs logged learning curves), from the dict `dgemma.eval.evaluate.evaluate` returns (docs/evaluation.md,
section 4).

    write_report(report, out, command=..., traces=...)   everything into `out`, traces into out/traces/
    render_markdown(report)                              report.md
    plot_frontier, plot_likelihood, plot_curves          the figures (matplotlib, as `dgemma viz`: dgemma.eval.viz)

Every figure carries the command that produced it in its footer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dgemma.eval.curves import curves_markdown
from dgemma.eval.judging import BASELINE_JUDGE
from dgemma.eval.viz import figure, pyplot, save_figure
from dgemma.io import fsio
from dgemma.sampling.trace import Trace

# --- the report -----------------------------------------------------------------------------------------------------

def _finite(obj: Any) -> Any:
    """NaN / inf as null, so report.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _f(x: Any, fmt: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def write_report(report: dict[str, Any], out: str | Path, *, command: str, traces: dict[str, Trace] | None = None
                 ) -> list[Path]:
    """report.json, report.md and the figures (frontier.png, likelihood.png, curves.png) into `out`; traces into
    out/traces/."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = _finite({**report, "command": command, "out": str(out)})
    written = []
    if traces:
        (out / "traces").mkdir(exist_ok=True)
    for name, trace in (traces or {}).items():
        written += list(trace.save(out / "traces" / name))
    written.append(plot_frontier(report, out / "frontier.png", command))
    written.append(plot_likelihood(report, out / "likelihood.png", command))
    if report.get("curves"):
        written.append(plot_curves(report, out / "curves.png", command))
    fsio.write_text(out / "report.json", json.dumps(report, indent=2, allow_nan=False) + "\n")
    fsio.write_text(out / "report.md", render_markdown(report, sorted(traces or {})))
    return [*written, out / "report.json", out / "report.md"]


def _t_scheme(k: int) -> str:
    return "t uniform on 1..T" if k == 1 else f"t = 1 exactly, then one t uniform in each of {k - 1} equal strata"


def _ci(values: Any, fmt: str) -> str:
    return "–" if not values else f"[{_f(values[0], fmt)}, {_f(values[1], fmt)}]"


def _timing_lines(timing: dict[str, Any] | None) -> list[str]:
    """How tokens/s were timed and under what load (the load average over 1, 5, 15 minutes, before and after)."""
    if not timing:
        return []
    load = lambda m: "n/a" if m["loadavg_1_5_15"] is None else " / ".join(f"{x:.2f}" for x in m["loadavg_1_5_15"])
    b, a = timing["before"], timing["after"]
    return [f"Timing: {timing['order']}. Machine: {b['cpu_count']} cores, torch on {b['torch_threads']} thread(s); "
            f"load average (1 / 5 / 15 min) {load(b)} before the timed runs, {load(a)} after (a load above the "
            "cores means other work shared them: tokens/s are then low for every setting alike).", ""]


def _dependence(q: dict[str, Any]) -> str:
    if q.get("prompt_dependence") is None:
        return "–"
    return f"{_f(q['prompt_dependence'], '.3f')} ± {_f(q.get('prompt_dependence_se'), '.3f')}"


def _judge_line(judge: dict[str, Any] | None) -> str:
    if judge is None:
        return "- judge: none (no generative perplexity without --baseline or --judge)"
    trained = ", ".join(f"{v:,} {k}" for k, v in (("steps", judge["trained_step"]), ("tokens", judge["trained_tokens"]))
                        if v is not None)
    seed = f", seed {judge['seed']}" if judge.get("seed") is not None else ""
    return (f"- judge (scores generative perplexity): {judge['judge']}, `{judge['checkpoint']}` (objective "
            f"{judge['objective'] or 'unknown'}{seed}{', ' + trained if trained else ''}), in {judge['dtype']}")


def _baseline_line(base: dict[str, Any] | None) -> str:
    if not base:
        return "- baseline: none"
    where = ""
    if base.get("annealed") is not None:
        where = (f" (step {base['step']:,} of its {base['schedule_steps']:,}-step schedule: "
                 + ("annealed, trained for this budget)" if base["annealed"] else
                    "**not annealed**: a mid-schedule checkpoint, its learning rate not decayed, so the comparison "
                    "favours the diffusion model)"))
    return f"- baseline: `{base['checkpoint']}`{where}"


def render_markdown(report: dict[str, Any], trace_names: Sequence[str] = ()) -> str:
    lk, v, st = report["likelihood"], report["verdict"], report["settings"]
    lines = [f"# dgemma eval: {report['model']['path']}", "", f"Command: `{report['command']}`", "",
             f"- model: `{report['model']['checkpoint']}` (objective {report['model']['objective']})",
             _baseline_line(report["baseline"]),
             _judge_line(report.get("judge")),
             f"- data: `{report['data']['path']}`, validation split: {report['data']['tokens']:,} tokens, "
             f"{report['data']['documents']:,} documents",
             f"- held-out windows of {st['seq_len']} tokens; NELBO and x0 CE with T = {st['num_steps']}; "
             f"{report['prompts']['count']} prompts of {report['prompts']['tokens']} tokens, "
             f"{st['max_new_tokens']} new tokens each; the verdict's setting and AR temperature are chosen on the "
             f"{report['prompts']['selection']} prompts, its numbers measured on the {report['prompts']['report']} "
             "ones", ""]
    lines += ["## Verdict (seed 003)", ""]
    if not v["available"]:
        lines += [f"Not available: {v['reason']}.", ""]
    else:
        ok = "yes" if v["nelbo_within_tolerance"] else "no"
        bound = v.get("bound", "nelbo")
        which = (("the continuous-time NELBO" if bound == "nelbo_continuous" else
                  f"the NELBO at T={lk['nelbo']['num_steps']}") + " (the tighter of the bounds computed)")
        gain = "" if v.get("share_of_ar_gain") is None else (
            f" The diffusion model captures **{v['share_of_ar_gain']:.0%}** of the AR model's gain over the unigram "
            f"model ({_f(v['unigram_ce'])} nats/token).")
        m = v.get("token_multiplier") or {}
        if m.get("multiplier"):
            gain += (f" Its learning curve reaches its last bound after {m['tokens']:,} tokens, where the AR run "
                     f"needed {m['ar_tokens_for_same_loss']:,.0f}: **{m['multiplier']:.1f}x** the tokens.")
        lines += [f"- Held-out NLL within +{v['tolerance']:.0%} of AR? **{ok}**: NELBO / AR CE = "
                  f"{_f(v['nelbo_over_ar'])} (with 2 SE: {_f(v['nelbo_upper_ratio'])}), with {which}. The NELBO is "
                  "an upper bound on the diffusion model's NLL, so a pass is conservative." + gain +
                  " Seed 003's own measure, x0 CE / AR CE = "
                  f"{_f(v['x0_ce_over_ar'])}, is not a likelihood (see docs/evaluation.md).",
                  *_speed_lines(v), ""]
    lines += _likelihood_table(lk)
    lines += ["", f"NELBO: {lk['nelbo']['num_t_samples']} t per canvas ({_t_scheme(lk['nelbo']['num_t_samples'])} "
              f"of 2..{lk['nelbo']['num_steps']}), each canvas conditioned on the clean canvases before it in its "
              "window; prior term "
              f"{_f(lk['nelbo']['prior_kl_per_token'], '.2e')} nats/token. x0 CE: "
              f"{lk['x0_ce']['t_sampling']}, objective {lk['x0_ce']['objective']}, no self-conditioning. "
              + ("Continuous time: the T -> infinity limit of the same chain, "
                 f"{lk['nelbo_continuous']['num_t_samples']} stratified levels per canvas. "
                 if lk.get("nelbo_continuous") else "No continuous-time bound: the model has no time input, and "
                 "without one the bound is infinite (docs/evaluation.md section 1.3). ") +
              "SE: between windows (data and Monte Carlo noise together); MC SE: Monte Carlo alone, from "
              f"{lk['nelbo'].get('replicates', 1)} independent passes, each from its own seed (docs/evaluation.md "
              "section 2).", "",
              "![likelihood](likelihood.png)", "", f"*likelihood.png: `{report['command']}`*", ""]
    lines += ["## Speed / quality frontier", "",
              "Batch 1, one prompt at a time, same prompts and new-token budget for every sampler; tokens/s counts "
              "useful tokens (up to the first EOS, at most max_new_tokens), prefill included in the time. "
              "Tokens/forward: generated positions per backbone pass after the prefill (a fixed schedule of N steps: "
              "N denoise passes + 1 commit per canvas, L/(N+1)). Quality: samples drawn with the diffusion model in "
              f"{st['quality_dtype']}; the judge scores them re-tokenized (decoded, then encoded again). Prompt "
              "dependence: the judge's NLL per token of each continuation given another prompt minus given its own, "
              "averaged (nats/token; 0 = the prompt does not matter).", "",
              *_timing_lines(report.get("timing")),
              *_protocol_lines(report.get("quality_protocol")),
              "| sampler setting / AR temperature | tok/s ± SE | speedup | tok/forward adaptive | fixed (rule) | "
              "steps/canvas | judge NLL/token ± SE | paired Δ NLL vs its matched AR point ± SE | gen PPL [95%] | "
              "distinct-2 per sample ± SE | real text ± SE | entropy | re-noised | prompt dependence |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ar = report["ar_decode"]
    found = v.get("matches") or [None] * len(report["frontier"])
    for f, match in zip(report["frontier"], found, strict=True):
        a, q, al = f["adaptive"], f["quality"], f["stats"]["all"]
        speed = a["tokens_per_second"] / ar["tokens_per_second"] if ar and ar["tokens_per_second"] else None
        fixed = "–" if not f.get("fixed") else (f"{_f(f['fixed']['tokens_per_forward'], '.2f')} "
                                                 f"({_f(f['fixed_rule_tokens_per_forward'], '.2f')})")
        lines.append(f"| {f['label']} | {_f(a['tokens_per_second'], '.1f')} ± "
                     f"{_f(al['tokens_per_second_se'], '.1f')} | {_f(speed, '.2f')} | "
                     f"{_f(a['tokens_per_forward'], '.2f')} | {fixed}"
                     f" | {_f(a['mean_steps_per_canvas'], '.1f')} | {_quality_cells(f, match)} | "
                     f"{_f(q['renoised']['fraction'], '.3%')} | {_dependence(q)} |")
    for p in report["ar_frontier"]:
        q, al = p["quality"], p["stats"]["all"]
        speed = p["tokens_per_second"] / ar["tokens_per_second"] if ar["tokens_per_second"] else None
        lines.append(f"| AR T={p['temperature']:g} | {_f(p['tokens_per_second'], '.1f')} ± "
                     f"{_f(al['tokens_per_second_se'], '.1f')} | {_f(speed, '.2f')} | "
                     f"{_f(p['tokens_per_forward'], '.2f')} | – | – | {_quality_cells(p, None)} | – | "
                     f"{_dependence(q)} |")
    if ar:
        lines += ["", f"Speedup: against the AR baseline at temperature {ar['temperature']:g} (the verdict's). Paired "
                  "Δ NLL: against the row's matched AR point on all prompts (the lowest-NLL AR temperature it "
                  "matches, else the closest), the mean over prompts of the per-prompt difference of the judge's NLL "
                  "per token (this row minus the AR's), ± the SE of those differences. Judge NLL, "
                  "distinct-2 and real text: per prompt the mean over its seeds, then mean ± SE over prompts. Gen "
                  "PPL: the pooled NLL's, 95% bootstrap interval over prompts; tok/s: ± SE across prompts."]
    lines += ["", "### Adaptive stopping", "",
              "Per setting, the denoising steps the adaptive sampler spent per canvas against its cap "
              "(max_denoising_steps), and the share of canvases that stopped before the cap (timed runs).", "",
              "| sampler setting | mean steps/canvas | canvases | stopped early |", "|---|---|---|---|"]
    for f in report["frontier"]:
        a = f["adaptive"]
        canvases = a["commit_passes"]  # one commit per canvas
        lines.append(f"| {f['label']} | "
                     f"{_f(a['mean_steps_per_canvas'], '.2f')} / {f['max_denoising_steps']} | {canvases} | "
                     f"{_f(a.get('early_stop_share'), '.0%')} |")
    lines += _likelihood_lines(report)
    lines += ["", "![frontier](frontier.png)", "", f"*frontier.png: `{report['command']}`*", ""]
    if trace_names:
        lines += ["## Traces", "", "The first prompt of each setting, traced (draw them with `dgemma viz`):", ""]
        lines += [f"- `traces/{n}`: `dgemma viz {Path(report['out']) / 'traces' / n} --out "
                  f"{Path(report['out']) / 'viz' / n}`" for n in trace_names]
        lines.append("")
    if report.get("curves"):
        lines += curves_markdown(report["curves"])
        lines += [f"*curves.png: `{report['command']}`*", ""]
    lines += ["## Samples (first prompt)", ""]
    for f in report["frontier"]:
        lines += [f"**{f['label']}:**", "", "```",
                  f["example"].strip()[:600], "```", ""]
    if ar:
        lines += [f"**AR baseline, temperature {ar['temperature']:g}:**", "", "```", ar["example"].strip()[:600], "```",
                  ""]
    return "\n".join(lines)


def _likelihood_table(lk: dict[str, Any]) -> list[str]:
    """Every likelihood figure with its between-window SE and, for the Monte Carlo estimates, its Monte Carlo SE."""
    sc = lk.get("scored") or {}
    lines = ["## Likelihood (held-out, nats/token)", "",
             f"Scored: {sc.get('rule', 'held-out windows')} ({sc.get('windows', '?')} windows, "
             f"{sc.get('tokens', 0):,} tokens, sha256 {str(sc.get('sha256', ''))[:12]}), the same tokens for every "
             "row.",
             "", "| metric | nats/token | ± SE | ± MC SE | bits/byte | windows | windows for SE "
             f"{_f(lk['nelbo']['estimate']['target_se'], 'g')} |", "|---|---|---|---|---|---|---|"]
    rows = [(f"NELBO at T={lk['nelbo']['num_steps']} (upper bound on NLL)", lk.get("nelbo")),
            ("NELBO, continuous time (upper bound on NLL)", lk.get("nelbo_continuous")),
            ("x0 cross-entropy at sampled t (not a likelihood)", lk.get("x0_ce")),
            ("AR cross-entropy (baseline; exact)", lk.get("ar_ce"))]
    iw = lk.get("iw")
    if iw:
        rows += [(f"importance-weighted bound at T={iw['num_steps']}, K={k} (first {iw['windows']} windows)",
                  {"estimate": e}) for k, e in iw["by_k"].items()]
    if lk.get("unigram"):
        rows.append(("unigram of the training split (exact, no context)", {"estimate": lk["unigram"]}))
    if lk.get("reference_nelbo"):
        rows.append((f"that unigram's NELBO at T={lk['reference_nelbo']['num_steps']} (an exact model: equals the "
                     "row above in expectation)", lk["reference_nelbo"]))
    for name, r in rows:
        if r is None:
            continue
        e = r["estimate"]
        lines.append(f"| {name} | {_f(e['mean'], '.4f')} | {_f(e['se'], '.4f')} | {_f(r.get('mc_se'), '.4f')} | "
                     f"{_f(e.get('bits_per_byte'), '.4f')} | {e['windows']} | {e.get('windows_for_target_se')} |")
    if iw and iw["gap"]["se"] is not None:
        lines += ["", f"The importance-weighted bound falls by {_f(iw['gap']['mean'], '.4f')} ± "
                  f"{_f(iw['gap']['se'], '.4f')} nats/token from K = {iw['gap']['from_k']} to K = {iw['gap']['to_k']} "
                  "trajectories (paired over windows): the NELBO at T is at least that far above the NLL."]
    return lines


def _speed_lines(v: dict[str, Any]) -> list[str]:
    """The verdict's speed at matched quality (dgemma/eval/matched.py), as measured on the report prompts."""
    d, nll, ar_nll = v["nll_difference"], v["nll_per_token"], v["ar_nll_per_token"]
    div, ar_div = v["distinct_2_per_sample"], v["ar_distinct_2_per_sample"]
    how = ("matched on the selection prompts" if v["quality_matched"] else
           "**no setting matched any AR temperature** on the selection prompts; this is the closest pair")
    return [f"- Speed at matched quality: **{_f(v['speedup'], '.2f')}x** the AR baseline's useful tokens/s (95% "
            f"interval {_ci(v['speedup_ci95'], '.2f')}) and **{_f(v['tokens_per_forward_ratio'], '.2f')}x** its tokens "
            f"per forward ({_ci(v['tokens_per_forward_ratio_ci95'], '.2f')}), {v['speedup_setting']['label']} against "
            f"AR at temperature {v['ar_temperature']:g} ({how}; on the report prompts the rule "
            f"{'holds' if v['quality_matched_on_report'] else 'does not hold'}). Judge NLL/token "
            f"{_f(nll['mean'])} ± {_f(nll['se'])} vs {_f(ar_nll['mean'])} ± {_f(ar_nll['se'])}: paired difference "
            f"{_f(d['mean'], '+.3f')} ± {_f(d['se'])} over {d['n']} prompts; per-sample distinct-2 "
            f"{_f(div['mean'])} vs {_f(ar_div['mean'])} (ratio {_f(v['distinct_2_ratio'])}).",
            f"- Matched quality: {v['match_rule']}. Setting and AR temperature chosen on {v['prompts_select']} "
            f"selection prompts (the fastest setting that matches an AR point, against the lowest-NLL AR point it "
            "matches), "
            f"numbers from {v['prompts_report']} report prompts; intervals: {v['interval_method']}."]


def _protocol_lines(p: dict[str, Any] | None) -> list[str]:
    """How the scored samples were drawn (seeds, length) and the real-text share's reference and floors."""
    if not p:
        return []
    lines = [f"Samples: {p['sample_seeds']} seed(s) per prompt ({p['seeds']}). Length: {p['length_rule']}. "
             f"Diversity: {p['diversity']}.", ""]
    r = p.get("real_text")
    if r:
        m = lambda key: f"{_f(r[key]['mean'])} ± {_f(r[key]['se'])}"
        lines += [f"Real text: {r['rule']}. On {r['count']} texts of {r['length']} tokens: held-out text "
                  f"{m('heldout_text')}; floors: {r['unigram']} {m('unigram_floor')}, {r['uniform']} "
                  f"{m('uniform_floor')}.", ""]
    return lines


def _quality_cells(row: dict[str, Any], match: dict[str, Any] | None) -> str:
    """Judge NLL ± SE | paired Δ NLL vs the row's matched AR point ± SE (`match`: the verdict's `matches` entry) |
    gen PPL [95%] | distinct-2 per sample ± SE | real text ± SE | token entropy."""
    q = row["quality"]

    def pm(key: str) -> str:
        return "–" if q.get(key) is None else f"{_f(q[key])} ± {_f(q.get(key + '_se'))}"

    paired = "–"
    if match is not None:
        d = match["nll_difference"]
        paired = (f"{_f(d['mean'], '+.3f')} ± {_f(d['se'])} vs T={match['ar_temperature']:g}"
                  + ("" if match["matched"] else " (closest; not matched)"))
    return (f"{_nll(q)} | {paired} | "
            f"{_f(q.get('gen_ppl'), '.1f')} {_ci(q.get('gen_ppl_ci95'), '.1f')} | {pm('distinct_2_per_sample')} | "
            f"{pm('real_text')} | {_f(q['token_entropy'], '.2f')}")


def _likelihood_lines(report: dict[str, Any]) -> list[str]:
    """The frontier's rows with the likelihood that describes each one's samples (the rows' `likelihood`)."""
    lines = ["", "### Which likelihood describes each setting", "",
             "A figure of a likelihood (the NELBO, the AR cross-entropy above) describes a setting's samples only "
             "where it is that setting's own: the ancestral chain at temperature 1 throughout without "
             "self-conditioning and without any sampling control (`t_min=1 t_max=1 self_conditioning=off`) is the "
             "chain the NELBO at T = N bounds; the AR baseline at temperature 1 samples from the AR model whose "
             "cross-entropy is reported. Every other setting (tempered, self-conditioned, accept / re-noise, "
             "committing) has no likelihood: none.", "", "| sampler setting / AR temperature | likelihood |",
             "|---|---|"]
    lines += [f"| {f['label']} | {f['likelihood']} |" for f in report["frontier"]]
    lines += [f"| AR T={p['temperature']:g} | {p['likelihood']} |" for p in report["ar_frontier"]]
    return lines


# --- the figures ----------------------------------------------------------------------------------------------------

def plot_frontier(report: dict[str, Any], path: Path, command: str) -> Path:
    """Speed against quality over every sampler setting: generated tokens/s (wall clock) and tokens per forward
    against the judge's NLL per token of the samples (the quantity the matched-quality rule compares), and tokens/s
    against per-sample distinct-2 (NLL alone rewards repetitive text); the AR baseline at each temperature as a line
    of stars. Error bars: 2 SE over prompts."""
    plt = pyplot()
    fig = figure(plt, "Speed / quality frontier (each point: one sampler setting; labels N = max_denoising_steps)",
                  command)
    ar = report["ar_decode"]
    ar_points = report["ar_frontier"]
    panels = [("tokens_per_second", "useful generated tokens / s (wall clock, batch 1)", "distinct_2_per_sample",
               "distinct-2 per sample (higher = more varied)")]
    if ar is not None:
        judge = report.get("judge") or {}
        nll = "NLL per token under the " + ("AR baseline" if judge.get("judge") == BASELINE_JUDGE else "judge")
        panels = [("tokens_per_second", "useful generated tokens / s (wall clock, batch 1)", "nll_per_token", nll),
                  ("tokens_per_forward", "generated positions per backbone pass", "nll_per_token", nll), *panels]
    groups = list(dict.fromkeys(f["group"] for f in report["frontier"]))
    for n, (xkey, xlabel, ykey, ylabel) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), n + 1)
        for k, group in enumerate(groups):
            pts = [f for f in report["frontier"] if f["group"] == group]
            xs = [f["adaptive"][xkey] for f in pts]
            ys = [_num(f["quality"].get(ykey)) for f in pts]
            ax.errorbar(xs, ys, yerr=_yerr(pts, ykey), fmt="os^vD<>ph"[k % 9] + "-", capsize=3, label=group,
                        markersize=5)
            for f, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(_point_name(f), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if ar_points:
            ar_points = sorted(ar_points, key=lambda p: p["temperature"])
            xs = [p[xkey] for p in ar_points]
            ys = [_num(p["quality"].get(ykey)) for p in ar_points]
            ax.errorbar(xs, ys, yerr=_yerr(ar_points, ykey), fmt="*-", markersize=12, capsize=3, color="k",
                        label="AR baseline (KV cache), by temperature")
            for p, x, y in zip(ar_points, xs, ys, strict=True):
                ax.annotate(f"T={p['temperature']:g}", (x, y), fontsize=7, xytext=(3, -9), textcoords="offset points")
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        if n == min(1, len(panels) - 1):  # one legend (the lines are the same in each): tokens/forward's upper right,
            ax.legend(fontsize=6, loc="upper right", framealpha=0.8)  # where only slow bad samplers could be
        ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.9, bottom=0.12, wspace=0.3)
    return save_figure(fig, path)


def _point_name(f: dict[str, Any]) -> str:
    """What tells a point from the others of its line: N, and the grid's values other than the sampler."""
    o = f["overrides"]
    parts = [f"N={o['max_denoising_steps']}"] + [f"{v:g}" if isinstance(v, float) else str(v) for k, v in o.items()
                                                 if k not in ("sampler", "max_denoising_steps", "entropy_bound")]
    return " ".join(parts)


def _nll(q: dict[str, Any]) -> str:
    """The judge's NLL per token of the samples, ± its SE (a missing one: –)."""
    if q.get("nll_per_token") is None:
        return "–"
    return f"{_f(q['nll_per_token'], '.3f')} ± {_f(q.get('nll_per_token_se'), '.3f')}"


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def _yerr(points: Sequence[dict[str, Any]], key: str) -> np.ndarray | None:
    """Error bars of 2 SE (over prompts) from each point's `key`_se; None when no point has one."""
    ses = [_num(p["quality"].get(f"{key}_se")) for p in points]
    if not any(math.isfinite(x) for x in ses):
        return None
    return np.nan_to_num(2 * np.array(ses, dtype=np.float64))


def plot_curves(report: dict[str, Any], path: Path, command: str) -> Path:
    """Learning curves from the runs' metrics.jsonl: the diffusion run's held-out NELBO and the AR run's
    cross-entropy against tokens seen, with 2-SE bands, the unigram cross-entropy as a line; and, on a second panel,
    NELBO / AR CE at the token counts both runs evaluated."""
    plt = pyplot()
    c = report["curves"]
    fig = figure(plt, "Learning curves (held-out, from the runs' metrics.jsonl; bands: 2 standard errors)", command)
    ax = fig.add_subplot(1, 2, 1)
    for side, name, color in (("diffusion", "diffusion NELBO (upper bound on NLL)", "tab:purple"),
                              ("ar", "AR cross-entropy", "k")):
        if not c.get(side):
            continue
        pts = c[side]["points"]
        x = np.array([p["tokens"] for p in pts], dtype=np.float64)
        y = np.array([_num(p["value"]) for p in pts])
        se = np.array([_num(p["se"]) for p in pts])
        ax.plot(x, y, "o-", color=color, label=name, markersize=3)
        ax.fill_between(x, y - 2 * np.nan_to_num(se), y + 2 * np.nan_to_num(se), color=color, alpha=0.2)
    if c.get("unigram_ce") is not None:
        ax.axhline(c["unigram_ce"], color="tab:gray", linestyle="--", label="unigram cross-entropy (no context)")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("nats per token")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = fig.add_subplot(1, 2, 2)
    if c["ratio"]:
        x = np.array([r["tokens"] for r in c["ratio"]], dtype=np.float64)
        y = np.array([_num(r["ratio"]) for r in c["ratio"]])
        se = np.nan_to_num(np.array([_num(r["ratio_se"]) for r in c["ratio"]]))
        ax.errorbar(x, y, yerr=2 * se, fmt="o-", capsize=3, color="tab:purple", label="NELBO / AR CE (matched tokens)")
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.axhline(1.05, color="tab:red", linestyle=":", label="+5% (seed 003's parity)")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no token count evaluated by both runs", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("diffusion NELBO / AR cross-entropy")
    ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=0.1, wspace=0.25)
    return save_figure(fig, path)


def plot_likelihood(report: dict[str, Any], path: Path, command: str) -> Path:
    """Held-out nats/token with 2 standard errors: the NELBO bound, the x0 cross-entropy, the AR cross-entropy; and,
    by noise level t, the x0 cross-entropy and the NELBO's per-step KL terms."""
    plt = pyplot()
    lk = report["likelihood"]
    fig = figure(plt, "Held-out likelihood (nats/token; error bars: 2 standard errors over windows)", command)
    ax = fig.add_subplot(1, 2, 1)
    rows = [(f"NELBO T={lk['nelbo']['num_steps']}", lk["nelbo"], "tab:purple"),
            ("NELBO continuous", lk.get("nelbo_continuous"), "tab:blue"),
            ("x0 CE at sampled t", lk["x0_ce"], "tab:orange"), ("AR CE", lk["ar_ce"], "k")]
    colors = [c for _, r, c in rows if r is not None]
    rows = [(name, r["estimate"]) for name, r, _ in rows if r is not None]
    ax.bar(range(len(rows)), [e["mean"] for _, e in rows], yerr=[2 * e["se"] for _, e in rows], capsize=6,
           color=colors)
    ax.set_xticks(range(len(rows)), [n for n, _ in rows])
    for i, (_, e) in enumerate(rows):
        bpb = f"\n{e['bits_per_byte']:.3f} bpb" if e.get("bits_per_byte") else ""
        ax.annotate(f"{e['mean']:.3f}{bpb}", (i, e["mean"]), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 6), textcoords="offset points")
    ax.set_ylabel("nats per token")
    ax = fig.add_subplot(1, 2, 2)
    for key, values, style, name in (("x0_ce", "ce_by_t", "o-", "x0 CE at level s"),
                                     ("nelbo", "kl_by_t", "s-", "NELBO term at t/T (t = 1: reconstruction)")):
        y = np.array([math.nan if v is None else v for v in lk[key][values]], dtype=np.float64)
        level = np.arange(1, len(y) + 1) / len(y)  # bin k of n (a step t of T) ends at level k / n
        seen = np.isfinite(y)  # levels no canvas drew are left out
        ax.plot(level[seen], y[seen], style, label=name)
    if lk["ar_ce"] is not None:
        ax.axhline(lk["ar_ce"]["estimate"]["mean"], color="k", linestyle="--", label="AR CE")
    ax.set_xlabel("noise level s = t/T (1 = pure noise)")
    ax.set_ylabel("nats per token")
    ax.set_yscale("symlog", linthresh=1e-2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=0.1, wspace=0.25)
    return save_figure(fig, path)


__all__ = ["plot_curves", "plot_frontier", "plot_likelihood", "render_markdown", "write_report"]
