"""The speed / quality frontier of `dgemma eval` (docs/evaluation.md): every sampler setting (max_denoising_steps x
entropy_bound, adaptive and fixed schedules) and the AR baseline at each temperature, timed, then their samples drawn
again in the quality dtype and judged.

Timing: all the timed decoders run in one rotation (`decoding.run_interleaved`: prompt by prompt, every setting in
turn), not one setting over all prompts and then the next, so that a burst of load from elsewhere slows every setting
alike instead of deciding a speedup; the machine's load before and after, and its cores, go into the report
(`timing`) beside the numbers they qualify.

Quality: the judge (dgemma/eval/judging.py) scores each sample re-tokenized (`judging.retokenize`), and measures how
much the continuations depend on their prompts (`judging.prompt_dependence`), the same way for diffusion and AR.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from dgemma.eval.decoding import (
    DecodeRun,
    ar_job,
    fixed_schedule,
    machine_load,
    quality,
    run_ar,
    run_interleaved,
    run_sampler,
    sample_nlls,
    sampler_job,
)
from dgemma.eval.judging import point_stats, prompt_dependence, retokenize
from dgemma.eval.viz import renoised_fraction
from dgemma.generate import Trace
from dgemma.generation_config import GenerationConfig
from dgemma.model import DiffusionGemma

TIMING_ORDER = ("interleaved: prompt by prompt, every timed setting (each sampler setting adaptive and fixed, the AR "
                "baseline at each temperature) in rotation, prompt i starting with setting i mod k, in one process")


def decode_frontier(model: DiffusionGemma, baseline: DiffusionGemma | None, scorer: DiffusionGemma | None,
                    tokenizer: Any, prompts: Sequence[Tensor], gcfg: GenerationConfig, s: Any,
                    log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                         dict[str, Trace], dict[str, Any]]:
    """The frontier points, the AR points, the first prompt's trace of each sampler setting, and the timing record
    (order, load before and after). `s` is the EvalSettings (steps, entropy_bounds, ar_temperatures, seed,
    bootstrap, quality_dtype, progress); `gcfg` the sampler's config with the budget and EOS set."""
    L, max_new, eos = model.config.canvas_length, gcfg.max_new_tokens, gcfg.eos_token_id
    settings = [(n, eb) for n in s.steps for eb in s.entropy_bounds]
    configs = [gcfg.replace(max_denoising_steps=n, entropy_bound=eb) for n, eb in settings]
    jobs = [job for (n, eb), cfg in zip(settings, configs, strict=True) for job in (
        sampler_job(model, cfg, seed=s.seed, name=f"N={n} eb={eb:g}"),
        sampler_job(model, fixed_schedule(cfg), seed=s.seed, name=f"N={n} eb={eb:g} fixed"))]
    if baseline is not None:
        jobs += [ar_job(baseline, max_new_tokens=max_new, eos=eos, seed=s.seed, temperature=t, name=f"AR T={t:g}")
                 for t in s.ar_temperatures]
    log(f"timing {len(jobs)} decoders in rotation over {len(prompts)} prompts")
    before = machine_load()
    timed = run_interleaved(jobs, prompts, progress=s.progress, desc="decode (timed, in rotation)")
    timing = {"order": TIMING_ORDER, "before": before, "after": machine_load()}

    dtype = getattr(torch, s.quality_dtype)
    quality_model = copy.deepcopy(model).to(dtype) if s.quality_dtype != "float32" else model

    def judged(timed_run: DecodeRun, scored: DecodeRun) -> dict[str, Any]:
        """Quality of the scored samples (all prompts), both halves' numbers and the prompt dependence, all judged
        on the re-tokenized samples."""
        nlls = dependence = None
        if scorer is not None:
            texts = retokenize(tokenizer, scored.samples, eos)
            nlls = sample_nlls(scorer, prompts, texts)
            dependence = prompt_dependence(scorer, prompts, texts)
        stats = point_stats(timed_run, scored, nlls, s.seed, s.bootstrap)
        q = quality(scored.samples) | {k: v for k, v in stats["all"].items() if k.startswith(("gen_ppl", "nll_"))}
        if dependence is not None:
            q |= {k: dependence[k] for k in ("prompt_dependence", "prompt_dependence_se")}
        return {"quality": q | {"dtype": s.quality_dtype, "judged": "re-tokenized text"}, "stats": stats,
                "prompt_dependence_nll": None if dependence is None else dependence["nll"],
                "samples": scored.samples, "example": tokenizer.decode(scored.samples[0]) if scored.samples else ""}

    frontier, traces = [], {}
    for k, ((n, eb), cfg) in enumerate(zip(settings, configs, strict=True)):
        label = f"N={n} eb={eb:g}"
        scored = run_sampler(quality_model, prompts, cfg, seed=s.seed, trace=True, name=label + " " + s.quality_dtype,
                             progress=s.progress)
        adaptive, fixed = timed[2 * k], timed[2 * k + 1]
        point = judged(adaptive, scored)
        point["quality"]["renoised"] = renoised_fraction(scored.traces)
        frontier.append({"max_denoising_steps": n, "entropy_bound": eb, "adaptive": adaptive.summary(),
                         "fixed": fixed.summary(), "fixed_rule_tokens_per_forward": L / (n + 1), **point})
        traces[f"N{n}_eb{eb:g}".replace(".", "p")] = scored.traces[0]  # no dot: Path.with_suffix would eat it
    ar_frontier = []
    if baseline is not None:
        quality_baseline = copy.deepcopy(baseline).to(dtype) if s.quality_dtype != "float32" else baseline
        for temp, timed_run in zip(s.ar_temperatures, timed[2 * len(settings):], strict=True):
            log(f"sampling with the AR baseline at temperature {temp:g} in {s.quality_dtype}")
            scored = run_ar(quality_baseline, prompts, max_new_tokens=max_new, eos=eos, seed=s.seed,
                            temperature=temp, name=f"AR T={temp:g} {s.quality_dtype}", progress=s.progress)
            ar_frontier.append({"temperature": temp, **timed_run.summary(), **judged(timed_run, scored)})
    return frontier, ar_frontier, traces, timing


__all__ = ["TIMING_ORDER", "decode_frontier"]
