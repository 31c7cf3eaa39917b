"""Who scores the samples of `dgemma eval`, and how sure the numbers are (docs/evaluation.md, sections 2-4).

    split_prompts(n)                  the selection half (even prompts) and the report half (odd prompts)
    bootstrap_ppl(nlls, ...)          generative perplexity and its 95% interval, resampling samples (seeded)
    rate_interval(tokens, seconds)    tokens/s over prompts and its SE / 95% interval (ratio estimator)
    prompt_figures(timed, draws, ...) one frontier row's figures per prompt, each the mean over its seeds
    point_stats(timed, draws, ...)    one frontier row's numbers on all prompts and on each half
    judge_relation(judge, compared)   what a --judge run is to the compared models, found from the runs themselves
    judge_description(...)            the report's `judge`: that relation, path, objective, seed, data, steps, tokens
    retokenize(tokenizer, samples)    what the judge scores: each sample's text, tokenized again (canonically)
    prompt_dependence(scorer, ...)    how much a continuation fits its own prompt better than another one

Every judge (`dgemma eval`'s, `dgemma demo`'s AR baseline) scores re-tokenized samples: a diffusion model fills its
positions in parallel and may spell a word in pieces the tokenizer never produces (" th" "e" for " the"); an AR
judge finds such a spelling unlikely, which inflates the NLL for how the text was spelt rather than what it says.

The judge is `dgemma eval --judge RUN` (an AR run, in float64) when given: a model that is neither of the two
compared, so that neither side scores its own samples. Without it the AR baseline scores both sides, and the report
says so.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from dgemma.eval.curves import METRICS, read_metrics
from dgemma.eval.decoding import DecodeRun, distinct_n, sample_nlls, unigram_entropy
from dgemma.eval.paired import Z95, mean_se, seed_means
from dgemma.sampling.request_rules import eos_index

BOOTSTRAP_RESAMPLES = 1000
BASELINE_JUDGE = "the AR baseline (one of the compared models)"
# What a --judge run is, found from the runs themselves (`judge_relation`), never asserted by the flag alone.
SAME_RUN_JUDGE = "another checkpoint of a compared run (not independent of it)"
START_RUN_JUDGE = "the AR run the diffusion model started from (not independent of it)"
SEPARATE_JUDGE = "a separately trained AR run"


def retokenize(tokenizer: Any, samples: Sequence[Sequence[int]], eos: Sequence[int]) -> list[list[int]]:
    """Each sample as a reader gets it, tokenized canonically: the text between its EOS tokens (special tokens
    dropped) encoded again, each EOS kept where it was (an end is part of what is judged; a length-matched sample
    that ran on past an end holds the next document after it). A sample with one EOS at its end is its text encoded
    again, then the EOS. Usually as long as the sample or shorter; a byte piece that breaks a UTF-8 character reads
    as U+FFFD, which is what is scored (and may take a few more ids)."""
    out = []
    for sample in samples:
        ids, tokens = [int(t) for t in sample], []
        while ids:
            cut = eos_index(ids, eos)
            text = tokenizer.decode(ids[:cut], skip_special_tokens=True)
            tokens += (tokenizer.encode(text, add_special_tokens=False) if text else []) + ids[cut:cut + 1]
            ids = ids[cut + 1:]
        out.append(tokens)
    return out


DEPENDENCE_OTHERS = 8  # other prompts each continuation is scored after (all of them with up to 9 prompts)


def prompt_dependence(scorer: Any, prompts: Sequence[Tensor], samples: Sequence[Sequence[int]],
                      others: int = DEPENDENCE_OTHERS) -> dict[str, Any]:
    """How much each continuation depends on its own prompt, comparably across model types: for continuation c_i of
    prompt p_i (as the judge scores it: `retokenize` first), the scorer's NLL per token of c_i given another prompt
    p_j minus given p_i, averaged over the `others` prompts after it (j = i + 1, ..., i + others, cyclically; every
    j != i when there are at most others + 1 prompts), then over the continuations (nats/token). The cost is
    n (others + 1) scorings, not n^2, so hundreds of prompts stay affordable. 0: the prompt does not matter to the
    continuation; higher: it fits its own prompt. No sampling enters, so AR and diffusion continuations are measured
    alike. `nll` is the matrix of NLLs per token (row: continuation i, column: prompt j; NaN where not scored or for
    an empty continuation); the SE is over continuations. Needs two prompts with a non-empty continuation (else
    NaN)."""
    n = len(prompts)
    k = min(others, n - 1)
    nll = np.full((n, n), math.nan)
    for i, sample in enumerate(samples):
        if sample:
            cols = [(i + d) % n for d in range(k + 1)]  # its own prompt first
            scored = sample_nlls(scorer, [prompts[j] for j in cols], [sample] * len(cols))
            for j, (total, count) in zip(cols, scored, strict=True):
                nll[i, j] = total / count
    # Per continuation: its mean gap over the other prompts it was scored after.
    gaps = [float(np.mean([nll[i, (i + d) % n] - nll[i, i] for d in range(1, k + 1)]))
            for i in range(n) if n >= 2 and math.isfinite(nll[i, i])]
    return {"prompt_dependence": float(np.mean(gaps)) if gaps else math.nan,
            "prompt_dependence_se": float(np.std(gaps, ddof=1) / math.sqrt(len(gaps))) if len(gaps) >= 2 else math.nan,
            "continuations": len(gaps), "others": k, "nll": nll.tolist()}


def split_prompts(n: int) -> tuple[list[int], list[int]]:
    """Indices of the selection half (0, 2, 4, ...) and of the report half (1, 3, 5, ...) of `n` prompts in the order
    `pick_prompts` gives them (validation documents in order), so both halves spread over the split."""
    return list(range(0, n, 2)), list(range(1, n, 2))


def bootstrap_ppl(nlls: Sequence[tuple[float, int]], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                  level: float = 0.95) -> dict[str, Any]:
    """Generative perplexity exp(sum NLL / sum tokens) over samples ((NLL sum, token count) each, as
    `decoding.sample_nlls` gives them), the NLL per token with its SE across samples, and the perplexity's percentile
    interval from `resamples` bootstrap resamples of the samples
    (with replacement; a seeded generator, so the interval is reproducible). Empty samples carry no tokens and are
    left out."""
    s = np.array([x for x, n in nlls if n > 0], dtype=np.float64)
    n = np.array([n for _, n in nlls if n > 0], dtype=np.float64)
    if not n.size:
        return {"gen_ppl": math.nan, "gen_ppl_ci95": [math.nan, math.nan], "nll_per_token": math.nan,
                "nll_per_token_se": math.nan, "tokens": 0, "samples": 0, "resamples": resamples}
    nll = float(s.sum() / n.sum())
    se = ratio_se(s, n, nll)  # across samples, for the NLL per token itself
    idx = np.random.default_rng(seed).integers(0, n.size, size=(resamples, n.size))
    boot = np.exp(s[idx].sum(1) / n[idx].sum(1))
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return {"gen_ppl": math.exp(nll), "gen_ppl_ci95": [float(lo), float(hi)], "nll_per_token": nll,
            "nll_per_token_se": float(se), "tokens": int(n.sum()), "samples": int(n.size), "resamples": resamples}


def ratio_se(num: np.ndarray, den: np.ndarray, ratio: float) -> float:
    """The delta-method SE of the ratio estimator R = sum num / sum den over k units,
    sqrt(sum (num_i - R den_i)^2 / (k (k - 1))) / mean den; NaN for fewer than two units."""
    if num.size < 2:
        return math.nan
    return float(math.sqrt(((num - ratio * den) ** 2).sum() / (num.size * (num.size - 1))) / max(den.mean(), 1e-12))


def rate_interval(tokens: Sequence[int], seconds: Sequence[float]) -> dict[str, Any]:
    """Tokens/s = sum tokens / sum seconds over prompts (the ratio estimator) with its delta-method SE across prompts,
    sqrt(sum (tokens_i - R seconds_i)^2 / (n (n - 1))) / mean seconds, and R +- 1.96 SE. SE needs two prompts."""
    t, s = np.asarray(tokens, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if not t.size:
        return {"tokens_per_second": math.nan, "tokens_per_second_se": math.nan,
                "tokens_per_second_ci95": [math.nan, math.nan]}
    rate = float(t.sum() / max(s.sum(), 1e-12))
    se = ratio_se(t, s, rate)
    return {"tokens_per_second": rate, "tokens_per_second_se": se,
            "tokens_per_second_ci95": [rate - Z95 * se, rate + Z95 * se]}


def prompt_figures(timed: DecodeRun, draws: Sequence[DecodeRun],
                   nll_draws: Sequence[Sequence[tuple[float, int]]] | None,
                   real_text_draws: Sequence[Sequence[float]] | None) -> dict[str, list[float]]:
    """A frontier row's figures per prompt, the unit of every SE and paired comparison (dgemma/eval/paired.py): the
    timed run's useful tokens, seconds, generated positions and backbone passes; and, each the mean over the quality
    draws (one per sampling seed, `draws`): the judge's NLL per token of the sample (`nll_draws`: (sum, count) per
    sample, as `decoding.sample_nlls`), its distinct-2 (distinct bigrams / bigrams of that sample), its token
    entropy and its real-text share (`real_text_draws`, dgemma/eval/realtext.py)."""
    per = {"tokens": [len(x) for x in timed.samples], "seconds": list(timed.seconds),
           "generated": list(timed.prompt_generated), "passes": list(timed.prompt_passes),
           "distinct_2_per_sample": seed_means([[distinct_n([x], 2) for x in d.samples] for d in draws]),
           "token_entropy": seed_means([[unigram_entropy([x]) for x in d.samples] for d in draws])}
    if real_text_draws is not None:
        per["real_text"] = seed_means(real_text_draws)
    if nll_draws is not None:
        per["nll_per_token"] = seed_means([[t / c if c else math.nan for t, c in nl] for nl in nll_draws])
    return per


def prompt_nlls(nll_draws: Sequence[Sequence[tuple[float, int]]]) -> list[tuple[float, int]]:
    """Per prompt, its draws' NLL sums and token counts added: the units `bootstrap_ppl` resamples."""
    return [(sum(d[i][0] for d in nll_draws), sum(d[i][1] for d in nll_draws)) for i in range(len(nll_draws[0]))]


PER_PROMPT_MEANS = ("nll_per_token", "distinct_2_per_sample", "token_entropy", "real_text")


def half_stats(timed: DecodeRun, draws: Sequence[DecodeRun], per_prompt: dict[str, list[float]],
               nlls: Sequence[tuple[float, int]] | None, idx: Sequence[int], seed: int,
               resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, Any]:
    """The numbers of the prompts `idx`: speed from the timed run; quality from the scored draws, each per-prompt
    figure (`prompt_figures`) as its mean and SE over the prompts; generative perplexity pooled over the judged
    tokens with a bootstrap over prompts (`nlls`: `prompt_nlls`); distinct-2 pooled over all the samples too."""
    out = {"prompts": list(idx)} | rate_interval([per_prompt["tokens"][i] for i in idx],
                                                 [per_prompt["seconds"][i] for i in idx])
    if nlls is not None:
        boot = bootstrap_ppl([nlls[i] for i in idx], resamples=resamples, seed=seed)
        boot["nll_per_token_pooled"], boot["nll_per_token_pooled_se"] = boot.pop("nll_per_token"), \
            boot.pop("nll_per_token_se")
        out |= boot | {"prompts_scored": boot.pop("samples")}
    for key in PER_PROMPT_MEANS:
        if key in per_prompt:
            m = mean_se(per_prompt[key], idx)
            out |= {key: m["mean"], f"{key}_se": m["se"]}
    out["distinct_2_pooled"] = distinct_n([d.samples[i] for d in draws for i in idx], 2)
    return out


def point_stats(timed: DecodeRun, draws: Sequence[DecodeRun], per_prompt: dict[str, list[float]],
                nlls: Sequence[tuple[float, int]] | None, seed: int, resamples: int = BOOTSTRAP_RESAMPLES
                ) -> dict[str, dict[str, Any]]:
    """`half_stats` on all prompts ("all"), the selection half ("select") and the report half ("report")."""
    n = len(timed.samples)
    select, report = split_prompts(n)
    return {name: half_stats(timed, draws, per_prompt, nlls, idx, seed, resamples)
            for name, idx in (("all", range(n)), ("select", select), ("report", report))}


def run_progress(path: Path, model_dir: Path) -> dict[str, Any]:
    """Steps and tokens a checkpoint was trained for, when known: its step from the directory name (step-NNNNNNN),
    its tokens from the last metrics.jsonl record of the run at or before that step."""
    m = re.fullmatch(r"step-(\d+)", model_dir.name)
    step = int(m.group(1)) if m else None
    metrics = next((p for p in (path / METRICS, model_dir.parent.parent / METRICS) if p.is_file()), None)
    tokens = None
    if metrics is not None:
        for rec in read_metrics(metrics):  # in order: the last record at or before the checkpoint's step
            if isinstance(rec.get("step"), int) and "tokens" in rec and (step is None or rec["step"] <= step):
                tokens = (rec["step"], rec["tokens"])
    return {"step": step if step is not None else (tokens[0] if tokens else None),
            "tokens": tokens[1] if tokens else None}


def schedule_position(path: Path, model_dir: Path, train_config: dict[str, Any] | None) -> dict[str, Any]:
    """Where a checkpoint sits on its run's learning-rate schedule: its step, the schedule's end (max_steps) and
    whether it is there (`annealed`). A comparator is trained for the budget it is compared at only when annealed: a
    mid-schedule checkpoint still has a high learning rate (docs/evaluation.md, "What a reviewer can check")."""
    step = run_progress(path, model_dir)["step"]
    end = (train_config or {}).get("max_steps")
    return {"step": step, "schedule_steps": end,
            "annealed": None if step is None or end is None else step >= end}


def run_of(model_dir: Path) -> Path:
    """The training run a checkpoint belongs to (RUN/checkpoints/step-N -> RUN), or the checkpoint itself."""
    model_dir = model_dir.resolve()
    return model_dir.parent.parent if model_dir.parent.name == "checkpoints" else model_dir


def judge_relation(judge_dir: Path, compared_dirs: Sequence[Path], start: str | None) -> str:
    """What a judge checkpoint is to the compared models: a checkpoint of one of their runs (SAME_RUN_JUDGE), of the
    run the diffusion model started from (`start`, its train config's init_from: START_RUN_JUDGE), or of neither
    (SEPARATE_JUDGE; its seed and data go beside it in the report, so a reader sees how separate)."""
    run = run_of(judge_dir)
    if any(run == run_of(d) for d in compared_dirs):
        return SAME_RUN_JUDGE
    if start is not None and run == run_of(Path(start)):
        return START_RUN_JUDGE
    return SEPARATE_JUDGE


def judge_description(relation: str, path: Path, model_dir: Path, train_config: dict[str, Any] | None,
                      dtype: str) -> dict[str, Any]:
    """The report's `judge`: which model scores the samples (generative perplexity), what it is to the compared
    models (`relation`: BASELINE_JUDGE or `judge_relation`'s), its seed and what it was trained on."""
    cfg = train_config or {}
    return {"judge": relation, "path": str(path), "checkpoint": str(model_dir), "objective": cfg.get("objective"),
            "preset": cfg.get("preset"), "seed": cfg.get("seed"), "data": cfg.get("data"), "dtype": dtype,
            **{f"trained_{k}": v for k, v in run_progress(path, model_dir).items()}}


__all__ = ["BASELINE_JUDGE", "DEPENDENCE_OTHERS", "PER_PROMPT_MEANS", "SAME_RUN_JUDGE", "SEPARATE_JUDGE",
           "START_RUN_JUDGE", "Z95",
           "bootstrap_ppl", "half_stats", "judge_description", "judge_relation", "point_stats", "prompt_dependence",
           "prompt_figures", "prompt_nlls", "rate_interval", "ratio_se", "retokenize", "run_of", "run_progress",
           "schedule_position", "split_prompts"]
