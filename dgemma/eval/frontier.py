"""The speed / quality frontier of `dgemma eval` (docs/evaluation.md, docs/sampling.md): every sampler setting and the
AR baseline at each temperature, timed, then their samples drawn again in the quality dtype and judged.

Settings (`frontier_points`): transformers' entropy-bound sampler over max_denoising_steps x entropy_bound, each timed
adaptive and with early stopping off (fixed), then every point of each `--sampler-grid` spec (`parse_sampler_grid`):

    NAME[:FIELD=V1/V2/...[,FIELD=V...]]     e.g.  confidence:commit_threshold=0.9/0.7,max_denoising_steps=32

a sampler of generation_config.SAMPLERS and a grid over GenerationConfig fields (the Cartesian product), over every
max_denoising_steps of the main grid unless the spec sets it. Each spec is one line of the plot; `all` stands for
every other sampler at its defaults (ALL).

Timing: all the timed decoders run in one rotation (`decoding.run_interleaved`: prompt by prompt, every setting in
turn), not one setting over all prompts and then the next, so that a burst of load from elsewhere slows every setting
alike instead of deciding a speedup; the machine's load before and after, and its cores, go into the report
(`timing`) beside the numbers they qualify.

Quality: every setting and AR temperature draws its quality samples `--sample-seeds` times per prompt (`draw_seed`),
each exactly max_new_tokens long (LENGTH_RULE: an end of text does not stop a quality draw); the judge
(dgemma/eval/judging.py) scores each sample re-tokenized (`judging.retokenize`), every per-prompt figure is the mean
over the prompt's draws (`judging.prompt_figures`: judge NLL, per-sample distinct-2, token entropy, the real-text share
of dgemma/eval/realtext.py, measured beside its floors), and the first draw measures how much the continuations depend
on their prompts (`judging.prompt_dependence`), the same way for diffusion and AR. The rows keep those per-prompt
figures (`per_prompt`) for the paired comparisons of dgemma/eval/paired.py and the verdict (dgemma/eval/matched.py).

Every row says which likelihood, if any, describes its samples (`likelihood`: "NELBO at T=N" for the bounded chain,
dgemma/sampling/families.py:chain_likelihood; "AR NLL (exact)" for the AR baseline at temperature 1,
decoding.ar_likelihood; else "none").
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from dgemma.eval import realtext
from dgemma.eval.decoding import (
    DecodeRun,
    ar_job,
    ar_likelihood,
    fixed_schedule,
    machine_load,
    quality,
    run_ar,
    run_interleaved,
    run_sampler,
    sample_nlls,
    sampler_job,
)
from dgemma.eval.judging import point_stats, prompt_dependence, prompt_figures, prompt_nlls, retokenize
from dgemma.eval.viz import renoised_fraction
from dgemma.model.config import ConfigError
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.families import chain_likelihood
from dgemma.sampling.generation_config import SAMPLERS, GenerationConfig, offset_seed
from dgemma.sampling.request_rules import MAX_CANVAS_PASSES, canvas_passes_problem
from dgemma.sampling.trace import Trace
from dgemma.train.heldout import EvalError

# What every point shares, so that the points compare: the new-token budget, the stop tokens and padding.
SHARED_FIELDS = ("max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "bos_token_id", "truncate")
GRID_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationConfig) if f.name not in (*SHARED_FIELDS, "sampler"))


@dataclasses.dataclass(frozen=True)
class FrontierPoint:
    """One sampler setting of the frontier: `overrides` on the model's GenerationConfig (sampler included)."""

    label: str  # "entropy-bound N=16 eb=0.1", "confidence N=32 commit_threshold=0.9"
    group: str  # its line on the plot: "entropy-bound eb=0.1", or the --sampler-grid spec it came from
    overrides: dict[str, Any]
    fixed_twin: bool  # also timed with early stopping off (the entropy-bound grid)

    @property
    def trace_name(self) -> str:
        """A file name for its trace: N16_eb0p1 for the entropy-bound grid; no dot (Path.with_suffix would eat it)."""
        o = self.overrides
        if o["sampler"] == "entropy-bound" and set(o) == {"sampler", "max_denoising_steps", "entropy_bound"}:
            name = f"N{o['max_denoising_steps']}_eb{o['entropy_bound']:g}"
        else:
            name = self.label
        return re.sub(r"[^A-Za-z0-9]+", "_", name.replace(".", "p")).strip("_")


ALL = tuple(name for name in SAMPLERS if name != "entropy-bound")


def _value(text: str) -> Any:
    """A grid value: none, true or false, an int, a float, else the string."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_sampler_grid(spec: str, base: GenerationConfig | None = None) -> list[dict[str, Any]]:
    """The settings of one `--sampler-grid` spec, NAME[:FIELD=V1/V2/...[,FIELD=...]]: a dict of GenerationConfig
    overrides per point of the grid (the sampler included), each checked by GenerationConfig. EvalError naming the
    spec and the field for a bad one."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    where = f"--sampler-grid {spec!r}"
    if name not in SAMPLERS:
        raise EvalError(f"{where}: unknown sampler {name!r} (one of {', '.join(SAMPLERS)})")
    axes: dict[str, list[Any]] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))) if rest.strip() else ():
        field, eq, values = item.partition("=")
        field = field.strip()
        if not eq or not values.strip():
            raise EvalError(f"{where}: {item!r} is not FIELD=VALUE[/VALUE...]")
        if field in SHARED_FIELDS:
            raise EvalError(f"{where}: {field} is shared by every point of the frontier (set it for the whole "
                            "evaluation), not per sampler")
        if field not in GRID_FIELDS:
            raise EvalError(f"{where}: unknown field {field!r} (GenerationConfig fields: {', '.join(GRID_FIELDS)})")
        if field in axes:
            raise EvalError(f"{where}: {field} given twice")
        axes[field] = [_value(v) for v in values.split("/")]
    points = []
    for combo in itertools.product(*axes.values()):
        overrides = {"sampler": name, **dict(zip(axes, combo, strict=True))}
        try:
            (base or GenerationConfig()).replace(**overrides)
        except ConfigError as e:
            raise EvalError(f"{where}: {e}") from None
        points.append(overrides)
    return points


def frontier_points(steps: Sequence[int], entropy_bounds: Sequence[float], sampler_grids: Sequence[str],
                    base: GenerationConfig | None = None) -> list[FrontierPoint]:
    """The frontier's settings, in order: the entropy-bound grid (steps x entropy_bounds, with fixed twins), then
    each spec of `sampler_grids` (at every max_denoising_steps of `steps` unless the spec sets it)."""
    points = [FrontierPoint(f"entropy-bound N={n} eb={eb:g}", f"entropy-bound eb={eb:g}",
                            {"sampler": "entropy-bound", "max_denoising_steps": n, "entropy_bound": eb}, True)
              for n in steps for eb in entropy_bounds]
    specs = [x for spec in sampler_grids for x in (ALL if spec.strip() == "all" else (spec,))]
    for spec in specs:
        for overrides in parse_sampler_grid(spec, base):
            for o in ([overrides] if "max_denoising_steps" in overrides
                      else [{**overrides, "max_denoising_steps": n} for n in steps]):
                n = o["max_denoising_steps"]
                extra = " ".join(f"{k}={_show(v)}" for k, v in o.items() if k not in ("sampler", "max_denoising_steps"))
                points.append(FrontierPoint(f"{o['sampler']} N={n}" + (f" {extra}" if extra else ""), spec.strip(), o,
                                            False))
    for p in points:  # the default cap on a canvas's model passes, corrector passes counted: no point runs unbounded
        problem = canvas_passes_problem((base or GenerationConfig()).replace(**p.overrides), MAX_CANVAS_PASSES,
                                        "in dgemma eval")
        if problem is not None:
            flag = ("--max-denoising-steps-grid" if p.group.startswith("entropy-bound")
                    else f"--sampler-grid {p.group!r}")
            raise EvalError(f"{flag}: {p.label}: {problem[1]}")
    seen: dict[tuple, str] = {}
    for p in points:  # the same settings twice would only cost time (labels differ: eb= vs entropy_bound=)
        key = tuple(sorted((k, repr(v)) for k, v in p.overrides.items()))
        if key in seen:
            raise EvalError(f"--sampler-grid: {p.label} is the setting {seen[key]} again")
        seen[key] = p.label
    return points


def _show(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


TIMING_ORDER = ("interleaved: prompt by prompt, every timed setting (each sampler setting adaptive and fixed, the AR "
                "baseline at each temperature) in rotation, prompt i starting with setting i mod k, in one process")


def draw_seed(seed: int, draw: int, prompts: int) -> int:
    """The base seed of quality draw `draw` (prompt i then uses it + i, as the timed runs): draw 0 is `seed`, the
    timed runs' own, and draw k's seeds follow the last prompt's of draw k - 1, so no two draws share one."""
    return offset_seed(seed, draw * prompts)


LENGTH_RULE = ("every scored sample is exactly max_new_tokens ({n}) new tokens: the quality draws do not stop at "
               "end-of-text (an end is kept where it falls and the next document after it is scored too), the timed "
               "runs do")
SEEDS_RULE = ("draw k (k = 0..sample_seeds-1) of prompt i is sampled with seed --seed + k x prompts + i (draw 0: "
              "the timed runs' seeds); every per-prompt figure is the mean over the prompt's draws first, so prompts "
              "are the unit of every SE and paired comparison")
DIVERSITY_RULE = ("distinct_2_per_sample: distinct bigrams / bigrams of each sample (all of equal length), the mean "
                  "over its draws per prompt, then mean and SE over prompts; distinct_*_pooled: over all samples "
                  "together, for reference")


def decode_frontier(model: DiffusionGemma, baseline: DiffusionGemma | None, scorer: DiffusionGemma | None,
                    tokenizer: Any, prompts: Sequence[Tensor], gcfg: GenerationConfig, s: Any,
                    log: Callable[[str], None], *, data_dir: Any = None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Trace], dict[str, Any],
                               dict[str, Any]]:
    """The frontier points, the AR points, the first prompt's trace of each sampler setting, the timing record
    (order, load before and after) and the quality protocol (the report's `quality_protocol`: seeds, the length
    rule, the real-text floors when `data_dir` is given). `s` is the EvalSettings (steps, entropy_bounds,
    ar_temperatures, sample_seeds, seed, bootstrap, quality_dtype, progress); `gcfg` the sampler's config with the
    budget and EOS set."""
    L, max_new, eos = model.config.canvas_length, gcfg.max_new_tokens, gcfg.eos_token_id
    points = frontier_points(s.steps, s.entropy_bounds, s.sampler_grids, gcfg)
    configs = [gcfg.replace(**p.overrides) for p in points]
    jobs, slots = [], []  # slots[k]: the indices in `jobs` of point k's adaptive run and its fixed twin (or None)
    for p, cfg in zip(points, configs, strict=True):
        slots.append((len(jobs), len(jobs) + 1 if p.fixed_twin else None))
        jobs.append(sampler_job(model, cfg, seed=s.seed, name=p.label))
        if p.fixed_twin:
            jobs.append(sampler_job(model, fixed_schedule(cfg), seed=s.seed, name=p.label + " fixed"))
    first_ar = len(jobs)
    if baseline is not None:
        jobs += [ar_job(baseline, max_new_tokens=max_new, eos=eos, seed=s.seed, temperature=t, name=f"AR T={t:g}")
                 for t in s.ar_temperatures]
    log(f"timing {len(jobs)} decoders in rotation over {len(prompts)} prompts")
    before = machine_load()
    timed = run_interleaved(jobs, prompts, progress=s.progress, desc="decode (timed, in rotation)")
    timing = {"order": TIMING_ORDER, "before": before, "after": machine_load()}

    dtype = getattr(torch, s.quality_dtype)
    quality_model = copy.deepcopy(model).to(dtype) if s.quality_dtype != "float32" else model
    seeds = [draw_seed(s.seed, k, len(prompts)) for k in range(s.sample_seeds)]
    vocab = realtext.vocabulary(data_dir) if data_dir is not None else None
    protocol = {"sample_seeds": s.sample_seeds, "seeds": SEEDS_RULE, "length_rule": LENGTH_RULE.format(n=max_new),
                "new_tokens": max_new, "diversity": DIVERSITY_RULE,
                "real_text": None if vocab is None else realtext.floors(
                    data_dir, tokenizer, vocab, count=len(prompts) * s.sample_seeds, length=max_new, seed=s.seed)}

    def judged(timed_run: DecodeRun, draws: list[DecodeRun]) -> dict[str, Any]:
        """Quality of the scored draws (all prompts, every seed), both halves' numbers and the prompt dependence
        (first draw), all judged on the re-tokenized samples; the figures per prompt (`per_prompt`)."""
        lengths = {len(x) for d in draws for x in d.samples}
        if lengths - {max_new}:  # the length rule: what makes per-sample figures comparable
            raise AssertionError(f"quality samples of {sorted(lengths)} tokens, not all {max_new}")
        nll_draws = dependence = None
        if scorer is not None:
            texts = [retokenize(tokenizer, d.samples, eos) for d in draws]
            nll_draws = [sample_nlls(scorer, prompts, t) for t in texts]
            dependence = prompt_dependence(scorer, prompts, texts[0])
        real = None if vocab is None else [realtext.shares(tokenizer, d.samples, vocab) for d in draws]
        per_prompt = prompt_figures(timed_run, draws, nll_draws, real)
        stats = point_stats(timed_run, draws, per_prompt, None if nll_draws is None else prompt_nlls(nll_draws),
                            s.seed, s.bootstrap)
        q = quality([x for d in draws for x in d.samples]) | {
            k: v for k, v in stats["all"].items()
            if k.startswith(("gen_ppl", "nll_", "distinct_2_per_sample", "token_entropy", "real_text"))}
        if dependence is not None:
            q |= {k: dependence[k] for k in ("prompt_dependence", "prompt_dependence_se")}
        q |= {"dtype": s.quality_dtype, "judged": "re-tokenized text", "sample_seeds": len(draws),
              "scored_samples": sum(len(d.samples) for d in draws)}
        return {"quality": q, "stats": stats, "per_prompt": per_prompt,
                "prompt_dependence_nll": None if dependence is None else dependence["nll"],
                "samples": draws[0].samples,
                "example": tokenizer.decode(draws[0].samples[0]) if draws[0].samples else ""}

    frontier, traces = [], {}
    for p, cfg, (i, j) in zip(points, configs, slots, strict=True):
        log(f"sampling {p.label} in {s.quality_dtype}, {len(seeds)} seed(s)")
        quality_cfg = cfg.replace(eos_token_id=())  # the length rule: an end of text does not stop a quality draw
        draws = [run_sampler(quality_model, prompts, quality_cfg, seed=seed, trace=k == 0,
                             name=f"{p.label} {s.quality_dtype} draw {k}", progress=s.progress)
                 for k, seed in enumerate(seeds)]
        adaptive, fixed = timed[i], None if j is None else timed[j]
        point = judged(adaptive, draws)
        point["quality"]["renoised"] = renoised_fraction(draws[0].traces)
        n = cfg.max_denoising_steps
        frontier.append({"label": p.label, "group": p.group, "sampler": cfg.sampler, "overrides": p.overrides,
                         "max_denoising_steps": n, "entropy_bound": cfg.entropy_bound, "adaptive": adaptive.summary(),
                         "fixed": None if fixed is None else fixed.summary(),
                         "fixed_rule_tokens_per_forward": L / (n + 1) if fixed is not None else None,
                         "likelihood": chain_likelihood(cfg) or "none", **point})
        traces[p.trace_name] = draws[0].traces[0]
    ar_frontier = []
    if baseline is not None:
        quality_baseline = copy.deepcopy(baseline).to(dtype) if s.quality_dtype != "float32" else baseline
        for temp, timed_run in zip(s.ar_temperatures, timed[first_ar:], strict=True):
            log(f"sampling with the AR baseline at temperature {temp:g} in {s.quality_dtype}, {len(seeds)} seed(s)")
            draws = [run_ar(quality_baseline, prompts, max_new_tokens=max_new, eos=(), seed=seed, temperature=temp,
                            name=f"AR T={temp:g} {s.quality_dtype} draw {k}", progress=s.progress)
                     for k, seed in enumerate(seeds)]
            ar_frontier.append({"temperature": temp, **timed_run.summary(), **judged(timed_run, draws),
                                "likelihood": ar_likelihood(GenerationConfig(), temp) or "none"})
    return frontier, ar_frontier, traces, timing, protocol


__all__ = ["LENGTH_RULE", "TIMING_ORDER", "FrontierPoint", "decode_frontier", "draw_seed", "frontier_points",
           "parse_sampler_grid"]
