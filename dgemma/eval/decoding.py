"""Decoding runs and sample quality, for evaluation (docs/evaluation.md).

Cost and speed: `sampler_job` and `ar_job` decode the same prompts one at a time (batch 1) with wall-clock timing and
count the backbone passes and tokens after the prefill from what the decoders did (the steps `generate` reports per
canvas, the commits; nothing is patched into the model). `run_interleaved` times several of them in rotation, prompt
by prompt, so that they share whatever load the machine has; `run_sampler` and `run_ar` run one alone;
`machine_load` records that load.

Sample quality: per-sample NLL sums of samples under an AR scorer (the judge of `dgemma eval`, dgemma/eval/judging.py)
and the generative perplexity they give, distinct-n and per-sample token entropy; and the figure `dgemma demo`
prints that needs no judge: the share of generated words that occur in the training corpus (`real_word_share`).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dgemma.io.console import Progress
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling import rules
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationConfig, offset_seed
from dgemma.sampling.request_rules import canvas_count, eos_index
from dgemma.sampling.trace import Trace
from dgemma.train.heldout import ar_token_nll

# --- decoding: diffusion samplers and the AR baseline ---------------------------------------------------------------

@dataclass
class DecodeRun:
    """One sampler over all prompts, batch 1 each. Counts exclude the prompt's prefill."""

    name: str
    samples: list[list[int]]  # useful new tokens per prompt: up to and including the first EOS, at most max_new
    seconds: list[float]  # wall-clock per prompt, prefill included
    passes: int = 0  # backbone passes after the prefill (denoise + commit, or AR commits)
    token_forwards: int = 0  # tokens through the backbone after the prefill
    generated: int = 0  # positions produced (whole canvases for diffusion), useful or not
    denoise_passes: int = 0
    commit_passes: int = 0
    steps_per_canvas: list[int] = field(default_factory=list)
    prompt_passes: list[int] = field(default_factory=list)  # backbone passes per prompt (the paired comparisons)
    prompt_generated: list[int] = field(default_factory=list)  # positions generated per prompt
    traces: list[Trace] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def useful_tokens(self) -> int:
        return sum(map(len, self.samples))

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / max(sum(self.seconds), 1e-12)

    @property
    def tokens_per_forward(self) -> float:
        """Positions generated per backbone pass: L / (T + 1) for a fixed schedule of T steps."""
        return self.generated / max(self.passes, 1)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "settings": self.settings, "prompts": len(self.samples),
                "useful_tokens": self.useful_tokens, "generated_positions": self.generated,
                "seconds": sum(self.seconds), "tokens_per_second": self.tokens_per_second,
                "passes": self.passes, "denoise_passes": self.denoise_passes, "commit_passes": self.commit_passes,
                "token_forwards": self.token_forwards, "tokens_per_forward": self.tokens_per_forward,
                "token_forwards_per_useful_token": self.token_forwards / max(self.useful_tokens, 1),
                "mean_steps_per_canvas": float(np.mean(self.steps_per_canvas)) if self.steps_per_canvas else None,
                "early_stop_share": self.early_stop_share, "seconds_per_prompt": list(self.seconds)}

    @property
    def early_stop_share(self) -> float | None:
        """Share of canvases that stopped before max_denoising_steps: whether the adaptive stop fired (diffusion)."""
        cap = self.settings.get("max_denoising_steps")
        if cap is None or not self.steps_per_canvas:
            return None
        return float(np.mean([s < cap for s in self.steps_per_canvas]))


def useful(tokens: Sequence[int], eos: Sequence[int], max_new: int) -> list[int]:
    """New tokens up to and including the first EOS, at most `max_new`: what a reader gets."""
    kept = [int(t) for t in list(tokens)[:max_new]]
    return kept[:eos_index(kept, eos) + 1]


def fixed_schedule(config: GenerationConfig) -> GenerationConfig:
    """The same sampler with early stopping off: every canvas spends exactly max_denoising_steps passes."""
    if config.sampler == "lite":
        return config.replace(adaptive=False)
    # The entropy-bound stop needs the argmax unchanged over `stability_threshold` earlier steps; a history longer
    # than the schedule never fills, so the rule never fires.
    return config.replace(stability_threshold=config.max_denoising_steps + 1)


@dataclass
class DecodeJob:
    """One decoder over the prompts, a prompt at a time: `warm_up` once (untimed), then `decode(i, prompt)` appends
    prompt i's timed sample and counts to `run`. `run_interleaved` takes turns between jobs."""

    run: DecodeRun
    warm_up: Callable[[Tensor], None]
    decode: Callable[[int, Tensor], None]


def sampler_job(model: DiffusionGemma, config: GenerationConfig, *, seed: int = 0, trace: bool = False,
                name: str = "diffusion") -> DecodeJob:
    """Block-diffusion decoding of each prompt (1-D ids) alone, timed. Per canvas the sampler spends its denoise
    passes and one commit; the last canvas is committed too (as it must be to continue), so a fixed schedule of T
    steps costs exactly T + 1 passes per canvas. The prompt's prefill is timed but not counted. The warm-up is one
    untimed canvas: first calls pay for allocations and lazy initialisation."""
    L = model.config.canvas_length
    max_new = config.max_new_tokens
    num_canvases = canvas_count(max_new, L)
    run = DecodeRun(name, [], [], settings={"max_denoising_steps": config.max_denoising_steps,
                                            "entropy_bound": config.entropy_bound, "sampler": config.sampler,
                                            "max_new_tokens": max_new})

    def warm_up(prompt: Tensor) -> None:
        generate(model, prompt.to(model.device)[None], generation_config=config.replace(max_new_tokens=L), seed=seed)

    def decode(i: int, prompt: Tensor) -> None:
        ids = prompt.to(model.device)[None]
        cache = model.new_cache(1, ids.shape[1] + num_canvases * L)  # preallocated: no growth while timed
        started = time.perf_counter()
        result = generate(model, ids, generation_config=config, seed=offset_seed(seed, i), cache=cache, trace=trace)
        model.commit(result.sequences[:, -L:], result.cache)  # leaves the output committed, ready to continue
        run.seconds.append(time.perf_counter() - started)
        # Batch 1: each step of a canvas is one denoise pass over its L positions, and each canvas is committed
        # once (generate commits all but the last, the line above the last), L tokens each.
        steps = [s[0] for s in result.steps_per_canvas]
        run.denoise_passes += sum(steps)
        run.commit_passes += len(steps)
        run.passes += sum(steps) + len(steps)
        run.prompt_passes.append(sum(steps) + len(steps))
        run.prompt_generated.append(result.sequences.shape[1] - ids.shape[1])
        run.token_forwards += (sum(steps) + len(steps)) * L
        run.generated += result.sequences.shape[1] - ids.shape[1]
        run.steps_per_canvas += steps
        run.samples.append(useful(result.sequences[0, ids.shape[1]:].tolist(), config.eos_token_id, max_new))
        if trace and result.trace is not None:
            run.traces.append(result.trace)

    return DecodeJob(run, warm_up, decode)


@torch.no_grad()
def ar_decode(model: DiffusionGemma, prompt: Tensor, config: GenerationConfig, *, temperature: float,
              generator: torch.Generator | None = None, on_token: Callable[[int], None] | None = None) -> list[int]:
    """An autoregressive run's (objective 'ar') continuation of `prompt` (1-D ids) with the KV cache: commit the
    prompt, then per token read the next-token logits `commit` returns, apply `config`'s sampling controls (the
    penalties and bias, then `temperature`, then top_k / top_p / min_p: rules.penalize and filter_tokens, as the
    diffusion sampler's draw), sample and commit it, so that each new token costs one backbone pass over one token.
    Up to `config.max_new_tokens` tokens, the first of `config.eos_token_id` included; `on_token` sees each."""
    ids = prompt.to(model.device)[None]
    cache = model.new_cache(1, ids.shape[1] + config.max_new_tokens)
    logits = model.next_token_logits(ids, cache)  # (1, P, V)
    seen = rules.Seen.of(ids, logits.shape[-1]) if config.penalizes else None
    nothing = torch.zeros(1, 1, dtype=torch.long, device=ids.device)  # no canvas carries a token here
    out: list[int] = []
    for _ in range(config.max_new_tokens):
        z = logits[:, -1:].float()
        if seen is not None:
            rules.penalize(z, config, seen, nothing, nothing.bool())
        z = z.double() / temperature
        if config.filters_tokens:
            rules.filter_tokens(z, config)
        tok = torch.multinomial(torch.softmax(z[:, 0], dim=-1), 1, generator=generator)  # (1, 1)
        out.append(int(tok))
        if on_token is not None:
            on_token(out[-1])
        logits = model.next_token_logits(tok, cache)  # leaves the output committed, as the sampler's
        if seen is not None:
            seen.add(tok)
        if out[-1] in config.eos_token_id:
            break
    return out


def ar_likelihood(config: GenerationConfig, temperature: float) -> str | None:
    """Which likelihood describes `ar_decode`'s samples: the AR model's own ("AR NLL (exact)": its cross-entropy is
    their NLL per token) at temperature 1 without a sampling control, else None (a tempered or filtered draw has no
    likelihood beside it). The AR twin of dgemma/sampling/families.py:chain_likelihood."""
    return "AR NLL (exact)" if temperature == 1 and not config.active_controls else None


def ar_job(model: DiffusionGemma, *, max_new_tokens: int, eos: Sequence[int], seed: int = 0,
           temperature: float = 1.0, name: str = "ar") -> DecodeJob:
    """Autoregressive decoding of each prompt alone with the KV cache, timed: commit the prompt, then per token read
    the next-token logits `commit` returns, sample (temperature 1: ancestral sampling) and commit the token, so that
    each new token costs one backbone pass over one token. The prompt's prefill is timed but not counted. The
    warm-up, untimed as the sampler's, commits the prompt and two more tokens."""
    run = DecodeRun(name, [], [], settings={"max_new_tokens": max_new_tokens, "temperature": temperature})

    def warm_up(prompt: Tensor) -> None:
        cache = model.new_cache(1, prompt.numel() + 2)
        model.next_token_logits(prompt.to(model.device)[None], cache)
        model.next_token_logits(prompt[:2].to(model.device)[None], cache)

    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=tuple(eos))

    def decode(i: int, prompt: Tensor) -> None:
        g = torch.Generator(device=model.device).manual_seed(offset_seed(seed, i))
        started = time.perf_counter()
        out = ar_decode(model, prompt, config, temperature=temperature, generator=g)
        run.seconds.append(time.perf_counter() - started)
        run.passes += len(out)  # one commit of one token per new token, after the prompt's prefill
        run.token_forwards += len(out)
        run.commit_passes += len(out)
        run.generated += len(out)
        run.prompt_passes.append(len(out))
        run.prompt_generated.append(len(out))
        run.samples.append(out)

    return DecodeJob(run, warm_up, decode)


@torch.no_grad()
def run_interleaved(jobs: Sequence[DecodeJob], prompts: Sequence[Tensor], *, progress: bool = True,
                    desc: str = "decode") -> list[DecodeRun]:
    """Every job on every prompt, in one process, taking turns: prompt by prompt, each job decodes it in rotation
    (prompt i starts with job i mod k), so that a change of load (another process, a thermal limit) falls on every
    setting alike instead of on whichever ran during it, and no job always runs first or last. Each job's warm-up
    runs once, before any timing. Returns the jobs' runs, in order."""
    if prompts:
        for job in jobs:
            job.warm_up(prompts[0])
    with Progress(desc, len(prompts) * len(jobs), "decodes", enabled=progress) as bar:
        for i, prompt in enumerate(prompts):
            for k in range(len(jobs)):
                jobs[(i + k) % len(jobs)].decode(i, prompt)
                bar.update(1)
    return [job.run for job in jobs]


def run_sampler(model: DiffusionGemma, prompts: Sequence[Tensor], config: GenerationConfig, *, seed: int = 0,
                trace: bool = False, name: str = "diffusion", progress: bool = True) -> DecodeRun:
    """`sampler_job` alone over `prompts`."""
    job = sampler_job(model, config, seed=seed, trace=trace, name=name)
    return run_interleaved([job], prompts, progress=progress, desc=f"decode {name}")[0]


def run_ar(model: DiffusionGemma, prompts: Sequence[Tensor], *, max_new_tokens: int, eos: Sequence[int],
           seed: int = 0, temperature: float = 1.0, name: str = "ar", progress: bool = True) -> DecodeRun:
    """`ar_job` alone over `prompts`."""
    job = ar_job(model, max_new_tokens=max_new_tokens, eos=eos, seed=seed, temperature=temperature, name=name)
    return run_interleaved([job], prompts, progress=progress, desc=f"decode {name}")[0]


def machine_load() -> dict[str, Any]:
    """What else the machine was doing, for a report's timings: the load average over 1, 5 and 15 minutes
    (os.getloadavg; None where the system has none), the machine's cores and the threads torch uses."""
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"loadavg_1_5_15": load, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}


# --- sample quality -------------------------------------------------------------------------------------------------

@torch.no_grad()
def sample_nlls(scorer: DiffusionGemma, prompts: Sequence[Tensor], samples: Sequence[Sequence[int]]
                ) -> list[tuple[float, int]]:
    """Per sample: the sum of -log p of its tokens under the AR scorer, given its prompt (teacher forcing), in the
    scorer's dtype, and the number of tokens scored ((0.0, 0) for an empty sample)."""
    out = []
    for prompt, sample in zip(prompts, samples, strict=True):
        if not sample:
            out.append((0.0, 0))
            continue
        x = torch.cat([prompt.cpu(), torch.tensor(sample, dtype=torch.long)])[None].to(scorer.device)
        nll = ar_token_nll(scorer, x)[0, prompt.numel() - 1:]  # the sample's tokens only
        out.append((float(nll.double().sum()), nll.numel()))
    return out


def generative_perplexity(scorer: DiffusionGemma, prompts: Sequence[Tensor], samples: Sequence[Sequence[int]]
                          ) -> dict[str, float]:
    """exp(mean NLL) of the samples' tokens under the AR scorer, each given its prompt (teacher forcing)."""
    nlls = sample_nlls(scorer, prompts, samples)
    total, n = sum(s for s, _ in nlls), sum(c for _, c in nlls)
    return {"gen_ppl": math.exp(total / n) if n else math.nan, "nll_per_token": total / n if n else math.nan,
            "tokens": n}


def distinct_n(samples: Sequence[Sequence[int]], n: int) -> float:
    """Distinct n-grams / all n-grams, pooled over samples (higher = more varied; 1 = no n-gram repeats); of one
    sample (`[sample]`): its own. NaN without an n-gram."""
    grams = [tuple(s[i:i + n]) for s in samples for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else math.nan


def unigram_entropy(samples: Sequence[Sequence[int]]) -> float:
    """Mean over samples of the entropy (nats) of the sample's own unigram distribution: low for repetitive text."""
    values = []
    for s in samples:
        if not s:
            continue
        p = np.array(list(Counter(s).values()), dtype=np.float64) / len(s)
        values.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(values)) if values else math.nan


def quality(samples: Sequence[Sequence[int]]) -> dict[str, float]:
    """Distinct-n pooled over all `samples` (labelled so: `dgemma eval` reports distinct-2 per sample beside it,
    judging.prompt_figures), the mean per-sample token entropy and the mean length."""
    return {"distinct_1_pooled": distinct_n(samples, 1), "distinct_2_pooled": distinct_n(samples, 2),
            "distinct_3_pooled": distinct_n(samples, 3), "token_entropy": unigram_entropy(samples),
            "mean_length": float(np.mean([len(s) for s in samples])) if samples else math.nan}


# --- judge-free figures of a few samples (`dgemma demo`) -------------------------------------------------------------

WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")  # a run of letters, with inner apostrophes (don't, o'er)


def words(text: str) -> list[str]:
    """The words of a text, lower-cased: runs of letters (any script), apostrophes inside a word kept."""
    return [w.lower() for w in WORD.findall(text)]


def marks(text: str) -> int:
    """What a text holds besides words: its line breaks and its runs of other non-space characters (punctuation,
    digits, symbols), each counted once."""
    rest = WORD.sub(" ", text)
    return rest.count("\n") + len(NONSPACE.findall(rest))


NONSPACE = re.compile(r"\S+")


def real_word_share(texts: Sequence[str], vocabulary: set[str]) -> float:
    """Share of what `texts` hold -- words, punctuation marks and line breaks (`words`, `marks`) -- that is a word of
    `vocabulary` (the training corpus's `words`): about 0.8 for fluent verse, low for word salad made of sub-word
    pieces and for text of newlines and punctuation (the words alone would flatter both). NaN for empty text."""
    found = [w for text in texts for w in words(text)]
    total = len(found) + sum(marks(text) for text in texts)
    return sum(w in vocabulary for w in found) / total if total else math.nan


def words_per_64_tokens(texts: Sequence[str], tokens: int) -> float:
    """Words of `texts` per 64 of the `tokens` they were decoded from: how much of an output is words (held-out text
    gives the reference); NaN for no token."""
    return 64 * sum(len(words(t)) for t in texts) / tokens if tokens else math.nan
