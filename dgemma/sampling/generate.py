"""Block-diffusion generation: prefill, then per canvas [denoise x N -> accept / renoise -> stop] -> commit.

    commit(prompt)
    for each canvas:
        x = uniform noise (B, L)                      the canvas starts as pure noise
        repeat up to N times:                         `denoise_canvas`: reads the cache, never writes it
            logits = denoise(x, cache, self-conditioning = last step's logits: tempered, raw for Lite)
            accept / renoise / stop                   dgemma.sampling.rules
        tokens = argmax of the last step              staged; EOS and padding applied
        commit(tokens)                                (the last canvas is left uncommitted, as in transformers)

With the default settings and the same seed this reproduces transformers' `DiffusionGemmaForBlockDiffusion.generate`
token for token on CPU (same random draws in the same order: one randint for the initial canvas, then per step a
multinomial and a randint). The switches in `GenerationConfig` (`commit`, `stop_rule`, `sliding_prefix`,
`truncate`, `sampler`) select the documented behaviours of other implementations; `time_level` and `lite_commit`
choose between dgemma's measured rules and seed 003's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dgemma.diffusion.noise import observation_levels, observe
from dgemma.io import dirkind, fsio
from dgemma.model.attention import Impl, check_impl
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.model.inputs import check_token_ids
from dgemma.model.kv_cache import KVCache
from dgemma.model.memory import check_memory
from dgemma.sampling import fast_sampler, rules
from dgemma.sampling.canvas import CanvasState, StagedCanvas, StepInfo
from dgemma.sampling.constraint import Constraint, ConstraintState
from dgemma.sampling.generation_config import CHAINS, COMMITTING, GenerationConfig, GenerationError, non_finite_logits
from dgemma.sampling.request_rules import (
    canvas_count,
    check_logit_bias,
    check_seed,
    committed_length,
    eos_index,
    new_token_budget,
    resolve_generation_config,
    sliding_prefix,
)

LOOPS = ("readable", "sync-free")  # generate's sampler loops
TRACE_FORMAT = "dgemma-trace-1"  # in every trace summary; bump when the arrays change meaning


@dataclass
class Trace:
    """Per-step records of a generation, without full-vocabulary tensors. `save(path)` writes path.npz (arrays
    stacked over all steps) and path.json (a summary)."""

    steps: list[StepInfo]
    summary: dict[str, Any]

    def arrays(self) -> dict[str, np.ndarray]:
        s = self.steps
        stack = lambda name, dtype: np.stack([getattr(x, name).cpu().numpy().astype(dtype) for x in s])
        return {
            "canvas": np.array([x.canvas for x in s], dtype=np.int32),
            "step": np.array([x.step for x in s], dtype=np.int32),
            "temperature": np.array([x.temperature for x in s], dtype=np.float32),
            "seconds": np.array([x.seconds for x in s], dtype=np.float64),
            "input_canvas": stack("input_canvas", np.int32),
            "argmax": stack("argmax", np.int32),
            "accepted": stack("accepted", np.bool_),
            "entropy": stack("entropy", np.float16),
            "mean_entropy": stack("mean_entropy", np.float32),
            "done": stack("done", np.bool_),
            "active": stack("active", np.bool_),
            "level": stack("level", np.float32),
        } | ({"grammar": np.stack([x.grammar.cpu().numpy().astype(np.int8) for x in s])}
             if s and all(x.grammar is not None for x in s) else {})

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Write path.npz, then path.json, each atomically, where `check_trace_path` allows."""
        npz, js = check_trace_path(path)
        arrays = self.arrays()
        fsio.atomic_write(npz, lambda _tmp, f: np.savez_compressed(f, **arrays),
                          needed=sum(a.nbytes for a in arrays.values()))
        fsio.write_text(js, json.dumps(self.summary, indent=2) + "\n")
        return npz, js


def check_trace_path(path: str | Path) -> tuple[Path, Path]:
    """(path.npz, path.json), where a trace may be written: in an existing directory (none is created) that is not
    a checkpoint's, a run's, a data or an adapter directory (dgemma/io/dirkind.py), over nothing or over an earlier
    trace only. GenerationError otherwise, naming the path; `dgemma generate --trace` checks before generating."""
    path = Path(path)
    npz, js = path.with_suffix(".npz"), path.with_suffix(".json")
    if not npz.parent.is_dir():
        raise GenerationError(f"--trace {path}: its directory {npz.parent} does not exist; create it first (a trace "
                              "is written into an existing directory)")
    try:
        dirkind.require(npz.parent, {dirkind.EMPTY, dirkind.OTHER}, "--trace",
                        expected="in a directory of your own, not a checkpoint, run, data or adapter directory")
    except dirkind.DirectoryKindError as e:
        raise GenerationError(f"--trace {path}: {e}") from None
    existing = [f for f in (npz, js) if os.path.lexists(f)]
    if existing and not _is_trace(js):
        raise GenerationError(f"--trace {path}: {existing[0]} exists and is not a {TRACE_FORMAT} trace; choose "
                              "another path (only an earlier trace is replaced)")
    return npz, js


def _is_trace(js: Path) -> bool:
    """Whether `js` is a trace summary (a regular JSON file with "format": TRACE_FORMAT)."""
    try:
        summary = json.loads(fsio.read_text(js))
    except (OSError, ValueError):  # missing, unreadable, a FIFO, not JSON
        return False
    return isinstance(summary, dict) and summary.get("format") == TRACE_FORMAT


@dataclass
class GenerationResult:
    sequences: Tensor  # (B, T + generated): prompt and whole canvases, pad after EOS (as transformers)
    prompt_length: int
    tokens_per_forward: Tensor  # (B,) useful tokens per denoising pass (pad excluded)
    steps_per_canvas: list[list[int]]  # [canvas][row]
    stop_reasons: list[list[str]]  # [canvas][row]
    cache: KVCache  # everything committed; the last canvas is not (re-feed it to continue)
    trace: Trace | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # with a constraint: per row, whether the output is a whole sentence of its grammar (False: max_new_tokens ran
    # out first; the output is still a valid prefix)
    constraint_complete: list[bool] | None = None
    constraint_seconds: float | None = None  # wall-clock spent computing the grammar's masks and draws
    # committed tokens the grammar pinned (the only token it allowed) and that its budget's closer chose, all rows
    constraint_pinned: int | None = None
    constraint_closed: int | None = None
    # per row: why its grammar work stopped (llguidance gave up; ConstraintState.failed), else None; such a row's
    # output is an incomplete prefix and constraint_complete is False for it
    constraint_failed: list[str | None] | None = None

    def new_tokens(self) -> list[list[int]]:
        """Generated ids per row, up to and including the first EOS, padding removed."""
        out = []
        pad, eos = self.pad_token_id, self.eos_token_id
        for row in self.sequences[:, self.prompt_length:].tolist():
            kept = [t for t in row if pad is None or t != pad or t in eos]
            out.append(kept[:eos_index(kept, eos) + 1])
        return out


def denoise_canvas(model: DiffusionGemma, cache: KVCache, config: GenerationConfig, *,
                   generator: torch.Generator | None = None, canvas: Tensor | None = None,
                   self_conditioning_logits: Tensor | None = None, finished: Tensor | None = None,
                   canvas_index: int = 0, on_step: Callable[[StepInfo], None] | None = None,
                   trace: bool = False, impl: Impl | None = None,
                   constraint: ConstraintState | None = None, seen: rules.Seen | None = None) -> StagedCanvas:
    """Denoise one canvas against what the cache holds, without writing it (stage; `model.commit` writes).

    `canvas` (B, L) replaces the initial noise (which is still drawn, keeping the random stream aligned);
    `finished` (B,) marks rows whose sequence already ended (they run along but are not counted). `impl` selects
    the model's kernels (default: the model's); this loop is the readable one whatever the kernels. `constraint`: the
    rows' grammar states (dgemma/sampling/constraint.py), which each step's draw and argmax follow; `seen`: what the
    penalties count (`CanvasSampler`)."""
    sampler = CanvasSampler(model, config, cache.batch_size, generator=generator, canvas=canvas,
                            self_conditioning_logits=self_conditioning_logits, finished=finished,
                            canvas_index=canvas_index, on_step=on_step, trace=trace, constraint=constraint,
                            seen=seen)
    prefix = sliding_prefix(model.config, config)
    while True:
        x, sc, level = sampler.inputs()
        logits = model.denoise(x, cache, self_conditioning_logits=sc, sliding_prefix=prefix, t=level,
                               impl=impl)
        del x, sc  # the step frees the previous logits before it allocates its own
        if sampler.step(logits):
            return sampler.staged()


class CanvasSampler:
    """The readable sampler's state and step for one canvas of B rows: `inputs()` is what the next denoising pass
    reads, `step(logits)` applies the sampler to that pass's logits. `denoise_canvas` drives it over one batch; the
    serving engine (dgemma/serving/engine.py) drives one per request, batching different requests' passes."""

    def __init__(self, model: DiffusionGemma, config: GenerationConfig, batch_size: int, *,
                 generator: torch.Generator | None = None, canvas: Tensor | None = None,
                 self_conditioning_logits: Tensor | None = None, finished: Tensor | None = None,
                 canvas_index: int = 0, on_step: Callable[[StepInfo], None] | None = None, trace: bool = False,
                 constraint: ConstraintState | None = None, seen: rules.Seen | None = None):
        """`seen`: the prompt and output so far that the penalties count (`rules.Seen`; without it, with a penalty
        set, only the canvas itself is counted)."""
        B, L, V = batch_size, model.config.canvas_length, model.config.vocab_size
        self.constraint = constraint
        if config.penalizes and seen is None:
            seen = rules.Seen(torch.zeros(B, V, dtype=torch.bool, device=model.device),
                                 torch.zeros(B, V, device=model.device))
        self.seen = seen
        self.marks: Tensor | None = None  # with a constraint: what the grammar did at each committed position
        self.unfiltered: Tensor | None = None  # with a constraint and a filter: the last step's logits before it
        device = model.device
        self.config, self.generator, self.vocab_size, self.dtype = config, generator, V, model.dtype
        self.time_embedding = model.config.time_embedding
        self.observed = model.config.observed_likelihood
        self.state = CanvasState.start((B, L), V, device, config, generator=generator, canvas=canvas,
                                       finished=finished, canvas_index=canvas_index, on_step=on_step, trace=trace)
        self.lite, self.raw = config.sampler == "lite", config.posterior_rule == "raw"
        # The chain samplers: ancestral, and predictor-corrector (each ancestral step followed by `corrector_steps`
        # passes that noise the canvas back up one level and step down again)
        self.ancestral = config.sampler in CHAINS
        self.correctors = config.corrector_passes
        self.corrector_pass = 0  # 0: the step's predictor pass; 1..correctors: its corrector passes
        self.committing = config.sampler in COMMITTING  # block-refinement, confidence: commits stay (unless edited)
        self.keeps_commits = self.lite or self.committing  # the samplers with a committed set (`self.committed`)
        self.num_steps = self.remaining = config.max_denoising_steps
        sc = self_conditioning_logits
        if sc is None and config.initial_self_conditioning == "uniform":  # seed 000: a uniform first posterior
            sc = torch.zeros(B, L, V, dtype=model.dtype, device=device)
        self.sc = sc  # the next pass's self-conditioning logits (None: the first step's zero signal)
        self.draw = self.state.x
        # Lite state: the committed set, and the previous step's mode and confidence (+inf: nothing commits at step 1).
        self.committed = torch.zeros(B, L, dtype=torch.bool, device=device)
        self.prev_argmax = torch.full((B, L), -1, dtype=torch.long, device=device)
        self.prev_confidence = torch.full((B, L), math.inf, device=device)

    def inputs(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Begin a step: the pass's canvas (B, L), self-conditioning logits (B, L, V) or None, and the noise level
        (B,) for a time-embedding model (`rules.time_level`; None without a time embedding). Call once per step,
        then `step` with the pass's logits."""
        self._begun = self.state.begin_step()
        if self.correctors:  # the pass's level is the chain's, s = index / N (`_chain_index`)
            s, N = self._chain_index(), self.num_steps
            if self.corrector_pass:  # noise x_{s'} forward to s: the corrector's first half
                self.state.x = rules.forward_noise(self.state.x, (s - 1) / N, s / N, self.vocab_size,
                                                      self.generator)
            self.state.level = torch.full_like(self.state.level, s / N)
        return self.state.x, self.sc, self.state.level if self.time_embedding else None

    def _chain_index(self) -> int:
        """n of the pass's level s = n / N: the steps remaining for a predictor pass, one more for a corrector pass
        (it steps down to the level the predictor reached)."""
        return self.remaining + (1 if self.corrector_pass else 0)

    def step(self, logits: Tensor) -> bool:
        """The sampler on the pass's fp32 logits (B, L, V), consumed in place. Returns whether the canvas is
        finished (every row stopped, or no step left)."""
        state, config, generator, V, n, N = self.state, self.config, self.generator, self.vocab_size, \
            self._chain_index(), self.num_steps
        lite, raw, sc = self.lite, self.raw, self.sc
        was_done, active = self._begun
        check_finite_logits(logits, state.canvas_index, N - n + 1)
        if self.observed:  # the posterior takes each position's observation in (diffusion/noise.py): the ancestral
            # chain's canvas is a forward-process draw at n / N; the others' carried positions are at the canvas level
            # and their fresh noise tells nothing
            levels = torch.tensor(n / N) if self.ancestral else \
                observation_levels(rules.canvas_level(state.clean), state.carried)
            observe(logits, state.x, levels, inplace=True)
        if config.penalizes:  # the sampling controls (rules.penalize, filter_tokens): none at their neutral values
            rules.penalize(logits, config, self.seen, state.x, state.carried)
        # Keep only the stopped rows of the previous logits (they ride along on them); free the rest now.
        sc_done = sc[was_done] if sc is not None and bool(was_done.any()) else None
        self.sc = sc = None
        temp = rules.temperature(n, N, config.t_min, config.t_max, logits.device)
        z = logits.div_(temp)  # the tempered logits; in place, so only `probs` is a second (B, L, V) fp32 tensor
        # under a grammar, the tempered logits before the filter: where it cut every token the grammar allows
        self.unfiltered = z.clone() if config.filters_tokens and self.constraint is not None else None
        if config.filters_tokens:
            rules.filter_tokens(z, config)
        constrained = new_draw = confidence = None
        if self.constraint is not None and not self.ancestral:  # left to right under the grammar's masks
            # (dgemma/sampling/constraint.py): the draw, the grammar's argmax, the entropy of what it allows and what
            # the grammar did at each position. Entropy-bound reads all four; Lite and the committing samplers draw
            # their proposals so and read the posterior as it is (their committed canvas is projected: `staged`)
            rows = (active & ~was_done).nonzero().flatten().tolist()
            new_draw, greedy, masked_entropy, marks = self.constraint.draw(z, generator, rows, self.unfiltered)
            self.marks = marks if sc_done is None else torch.where(was_done[:, None], self.marks, marks)
            if not (lite or self.committing):
                constrained = greedy, masked_entropy
        if constrained is None:
            probs = torch.softmax(z, dim=-1, dtype=torch.float32)
            if new_draw is None and not self.ancestral:
                new_draw = rules.draw_tokens(probs, generator)
            confidence = probs.amax(-1) if lite and not raw else None
            if self.committing:  # the tempered probability of each drawn token (diffusers' confidence)
                confidence = probs.gather(-1, new_draw[..., None])[..., 0]
            del probs
        # What entropy, confidence and self-conditioning read: z, or the raw logits again (z * T, within a rounding).
        z = z.mul_(temp) if raw else z
        if lite and raw:
            confidence = rules.max_probability(z)
        if constrained is None:
            new_argmax, entropy = torch.argmax(z, dim=-1), rules.token_entropy(z)
        else:
            new_argmax, entropy = constrained
        committed = self.committed
        if self.ancestral:  # x_{s'} from the reverse step, s = n / N -> s' = (n - 1) / N ("accepted": unchanged)
            new_x = rules.draw_tokens(rules.ancestral_step(z, state.x, n / N, (n - 1) / N), generator)
            new_draw, accepted = new_x, new_x == state.x
        elif self.committing:
            quota = rules.commit_quota(committed, N - n + 1, N) if config.sampler == "block-refinement" else \
                torch.ones(committed.shape[0], dtype=torch.long, device=committed.device)
            new_commits = rules.threshold_commits(confidence, committed, config.commit_threshold, quota)
            edited = rules.edits(new_draw, state.x, committed, confidence, config.edit_threshold)
            kept = rules.renoise(torch.where(edited, new_draw, state.x), committed, V, generator)
            new_x = torch.where(new_commits, new_draw, kept)
            accepted = committed | new_commits
        elif lite:
            new_commits = rules.lite_commit(config, N - n + 1, new_argmax, confidence, self.prev_argmax,
                                               self.prev_confidence, committed)
            new_x = torch.where(new_commits, new_draw, rules.renoise(state.x, committed, V, generator))
            accepted = committed | new_commits
            self.prev_argmax, self.prev_confidence = new_argmax, confidence
        else:
            accepted = rules.accept_by_entropy(entropy, config.entropy_bound)
            new_x = rules.renoise(new_draw, accepted, V, generator)
        if sc_done is not None:  # rows that already stopped keep everything; they only ride along in the batch
            keep = was_done[:, None]
            new_argmax = torch.where(keep, state.argmax, new_argmax)
            new_x = torch.where(keep, state.x, new_x)
            new_draw = torch.where(keep, self.draw, new_draw)
            accepted = torch.where(keep, committed if self.keeps_commits else accepted, accepted)
            z[was_done] = sc_done.to(z.dtype)
            entropy[was_done] = rules.token_entropy(z[was_done])
        self.committed = accepted if self.keeps_commits else committed
        state.end_step(was_done, active, new_x, new_argmax, accepted, entropy, temp,
                       grammar=self.marks if constrained is not None else None)
        self.draw = new_draw
        self.sc = z.to(self.dtype)  # self-conditioning reads the posterior's logits, in the embedding dtype
        if self.corrector_pass:
            self.corrector_pass = (self.corrector_pass + 1) % (self.correctors + 1)
        else:
            self.remaining -= 1
            self.corrector_pass = 1 if self.correctors else 0
        return (self.remaining == 0 and not self.corrector_pass) or state.all_done()

    def logprobs(self, tokens: Tensor, top: int = 0) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
        """`rules.token_logprobs` of `tokens` (B, L) under the posterior the last step read (after `step`); with a
        grammar, the masked distribution each token was drawn from (the masks along `tokens`, from the parser's
        committed state; where the filter cut every allowed token, the unfiltered logits', as the draw)."""
        z = self.sc if self.constraint is None else \
            self.constraint.masked_logits(tokens, self.sc, self.unfiltered)
        return rules.token_logprobs(z, tokens, top)

    def staged(self) -> StagedCanvas:
        """The finished canvas. Lite and the committing samplers end every position on its best guess: the committed
        token, else the last draw (seed 003, 4.2 rule 5). With a constraint, a canvas other than entropy-bound's
        grammar argmax is projected onto the grammar (`ConstraintState.project`): its tokens where they are valid,
        the grammar's argmax of the last posterior elsewhere."""
        staged = self.state.staged(torch.where(self.committed, self.state.x, self.draw) if self.keeps_commits
                                   else self.state.x)
        if self.constraint is not None:
            if self.config.sampler != "entropy-bound" or self.config.commit_rule == "sample":
                rows = (~self.state.finished).nonzero().flatten().tolist()
                staged.tokens, self.marks = self.constraint.project(staged.tokens, self.sc.float(), rows,
                                                                    self.unfiltered)
            staged.grammar = self.marks
        return staged


def check_finite_logits(logits: Tensor, canvas_index: int, step: int) -> None:
    """Refuse NaN or +-inf logits (non-finite weights or an overflow) before they reach the draw, where
    torch.multinomial would fail obscurely or a sampler would silently pick token 0."""
    finite = torch.isfinite(logits.sum(-1))  # (B, L): NaN or inf anywhere in a row of V makes its sum non-finite
    if not bool(finite.all()):
        rows = (~finite).any(-1).nonzero().flatten().tolist()
        raise non_finite_logits(canvas_index, step, rows)


def generate(model: DiffusionGemma, input_ids: Tensor, *, generation_config: GenerationConfig | None = None,
             attention_mask: Tensor | None = None, seed: int | None = None, generator: torch.Generator | None = None,
             on_step: Callable[[StepInfo], None] | None = None,
             on_canvas: Callable[[int, Tensor], None] | None = None, trace: bool = False,
             cache: KVCache | None = None, decoder_input_ids: Tensor | None = None,
             impl: Impl | None = None, loop: str | None = None, compile: bool = False, force: bool = False,
             around_commit: Callable[[Callable[[], None]], None] | None = None,
             constraint: Constraint | None = None, **overrides: Any) -> GenerationResult:
    """Generate whole canvases after `input_ids` (B, T).

    Settings come from `overrides` (any GenerationConfig field), then `generation_config`, then the checkpoint's
    generation_config.json. Randomness: `generator`, else a generator seeded with `seed`, else torch's global
    generator (what transformers uses: seeding it with torch.manual_seed(s) and passing seed=s draw the same
    numbers on CPU). `attention_mask` (B, T) marks left padding. `cache`: continue from a cache (multi-turn);
    `input_ids` are then only the tokens not yet committed. `decoder_input_ids` replaces the first canvas's
    initial noise. `on_step(StepInfo)` runs after every denoising step, `on_canvas(index, tokens)` after each
    canvas is finalised (EOS/padding applied). `around_commit(run)` is called for each cache write (the prefill,
    then each canvas before the next) with `run`, the write, which it must call once: `dgemma bench` times the
    commits this way (default: the write alone).
    `impl` (default: the model's, `model.impl`): the kernels, "reference" or "fast". `loop`: the sampler loop,
    "readable" (`denoise_canvas`, on either kernels) or "sync-free" (dgemma/sampling/fast_sampler.py: the same
    decisions, other random draws; fast kernels); default "sync-free" with impl="fast" where it implements the settings
    (the entropy-bound sampler without sampling controls), else "readable". An explicit loop="sync-free" with settings
    it does not implement (the Lite sampler, ...) is a GenerationError naming them, never a silent switch of loop;
    `compile=True` (sync-free only) compiles its denoise step. With a `constraint` the default loop is the readable
    one (on either kernels: the grammar draws left to right). The model is never modified: calls on different caches
    may run concurrently. Before anything is allocated, the memory pre-flight (`model.check_memory`) refuses a
    cache and sampler buffers larger than the free memory unless `force`; NaN or inf logits raise GenerationError
    naming the canvas and step. `constraint` (dgemma/sampling/constraint.py: a JSON schema, regex or grammar): every
    committed canvas keeps each row's output a valid prefix of its language, and the result's
    `constraint_complete` says which rows finished a sentence of it; each row is closed within max_new_tokens
    where the grammar's closer fits (dgemma/sampling/constraint.py). Every sampler: entropy-bound draws under the
    grammar, the others' committed canvases are projected onto it."""
    impl = model.impl if impl is None else impl
    check_impl(impl)
    config = resolve_generation_config(model, generation_config, overrides)
    if loop is None:  # the sync-free loop where it implements the settings: impl="fast" is fast on every sampler
        loop = "sync-free" if impl == "fast" and constraint is None and not fast_sampler.unsupported(config) \
            else "readable"
    if loop not in LOOPS:
        raise GenerationError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    if loop == "sync-free" and impl != "fast":
        raise GenerationError("loop='sync-free' runs the fast kernels: pass impl='fast' (or loop='readable')")
    if compile and loop != "sync-free":
        raise ValueError("compile=True needs impl='fast' and the sync-free loop (the static denoise step lives in "
                         "dgemma/sampling/fast_sampler.py)")
    if loop == "sync-free":
        if constraint is not None:
            raise GenerationError("a constraint runs on the readable loop: pass loop='readable' (the sync-free loop "
                                  "draws every position at once)")
        fast_sampler.check_supported(config)  # before anything is allocated
    _check_inputs(model, input_ids, cache, config)
    B, T = input_ids.shape
    L, device = model.config.canvas_length, model.device
    input_ids = input_ids.to(device)
    past = cache.length if cache is not None else 0
    cur_len = past + T
    max_new = new_token_budget(config, cur_len)
    num_canvases = canvas_count(max_new, L)
    end = cur_len + num_canvases * L
    if end > model.config.max_position_embeddings:
        raise ValueError(f"{cur_len} context tokens + {num_canvases} canvases of {L} = {end} positions exceed the "
                         f"model's context (max_position_embeddings={model.config.max_position_embeddings})")
    if decoder_input_ids is not None:
        if not isinstance(decoder_input_ids, Tensor) or tuple(decoder_input_ids.shape) != (B, L):
            got = tuple(decoder_input_ids.shape) if isinstance(decoder_input_ids, Tensor) else type(decoder_input_ids)
            raise GenerationError(f"decoder_input_ids must be one canvas per row, shape (batch={B}, "
                                  f"canvas_length={L}), got {got}")
        check_token_ids(decoder_input_ids, model.config.vocab_size, "decoder_input_ids")
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(check_seed(seed))
    committed = committed_length(cur_len, max_new, L)
    new_slots = committed - (cache.max_length if cache is not None else 0)
    check_memory(model.config, model.dtype, device, batch_size=B, cache_length=max(new_slots, 0), prompt_length=T,
                 force=force)
    if cache is None:
        cache = model.new_cache(B, committed)
    else:
        cache.ensure_capacity(committed)

    commit = around_commit or (lambda run: run())
    commit(lambda: model.commit(input_ids, cache, attention_mask=attention_mask, impl=impl))  # prefill
    eos = torch.tensor(config.eos_token_id, dtype=torch.long, device=device) if config.eos_token_id else None
    sequences = input_ids
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    passes = torch.zeros(B, dtype=torch.long, device=device)
    steps_per_canvas, stop_reasons, records = [], [], []
    grammar = constraint.start(B, max_new_tokens=max_new) if constraint is not None else None
    seen = rules.Seen.of(input_ids, model.config.vocab_size, attention_mask) if config.penalizes else None
    for c in range(num_canvases):
        if c > 0:
            previous = sequences[:, -L:]  # the previous canvas, as finalised
            commit(lambda previous=previous: model.commit(previous, cache, impl=impl))
        kwargs: dict[str, Any] = dict(generator=generator, finished=finished, canvas_index=c, on_step=on_step,
                                      trace=trace, canvas=decoder_input_ids if c == 0 else None)
        if loop == "sync-free":
            staged = fast_sampler.denoise_canvas(model, cache, config, compile=compile, **kwargs)
        else:
            staged = denoise_canvas(model, cache, config, impl=impl, constraint=grammar, seen=seen, **kwargs)
        if grammar is not None:  # the committed canvas moves the parsers on
            grammar.commit(staged.tokens, rows=(~finished).nonzero().flatten().tolist(), marks=staged.grammar)
        if seen is not None:  # what the penalties count from the next canvas on
            seen.add(staged.tokens, rows=~finished)
        passes += staged.passes
        steps_per_canvas.append(staged.steps.tolist())
        stop_reasons.append(["finished" if f else r for f, r in zip(finished.tolist(), staged.stop_reasons,
                                                                      strict=True)])
        records.extend(staged.trace)
        sequences = torch.cat([sequences, staged.tokens], dim=-1)
        finished = _finalize_canvas(sequences, finished, config, eos, L)
        if on_canvas is not None:
            on_canvas(c, sequences[:, -L:])
        if bool(finished.all()):
            break

    if config.truncate:  # before counting: the tokens cut off are not useful output
        sequences = sequences[:, : T + max_new]
    new = sequences[:, T:]
    # As transformers: without a pad id the count is a Python int, and int / tensor rounds differently (reciprocal).
    valid = (new != config.pad_token_id).sum(-1) if config.pad_token_id is not None else new.shape[1]
    tokens_per_forward = valid / passes
    result = GenerationResult(sequences, T, tokens_per_forward, steps_per_canvas, stop_reasons, cache,
                              eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                              constraint_complete=None if grammar is None else grammar.complete(),
                              constraint_seconds=None if grammar is None else grammar.seconds,
                              constraint_pinned=None if grammar is None else grammar.pinned,
                              constraint_closed=None if grammar is None else grammar.closed,
                              constraint_failed=None if grammar is None else list(grammar.failed))
    if trace:
        result.trace = Trace(records, {
            "format": TRACE_FORMAT, "batch_size": B, "prompt_length": T, "canvas_length": L,
            "num_canvases": len(steps_per_canvas),
            "steps_per_canvas": steps_per_canvas, "stop_reasons": stop_reasons,
            "tokens_per_forward": tokens_per_forward.tolist(), "generation_config": config.summary() | {"seed": seed},
            "arrays": "per step: canvas, step, temperature, seconds (S,); input_canvas, argmax, accepted, entropy "
                      "(S, B, L); mean_entropy, done, active, level (S, B); with a constraint, grammar (S, B, L): "
                      "0 free, 1 pinned (the only token the grammar allows), 2 closed (the budget's closer chose it)",
        })
    return result


def _finalize_canvas(sequences: Tensor, finished: Tensor, config: GenerationConfig, eos: Tensor | None,
                     L: int) -> Tensor:
    """EOS and length bookkeeping after a canvas, in place on `sequences` (as transformers): a row is finished once
    its canvas holds an EOS (or the sequence reaches max_length). With a pad id, the canvases of rows finished
    earlier become padding, and tokens after the first EOS of this canvas too. Returns the finished mask."""
    new = sequences[:, -L:]
    this = torch.zeros_like(finished)
    if config.max_length is not None and sequences.shape[1] >= config.max_length:
        this |= True
    if eos is not None:
        this |= torch.isin(new, eos).any(-1)
    before, finished = finished, finished | this
    if config.pad_token_id is not None and bool(finished.any()):
        new[before] = config.pad_token_id
        if eos is not None and bool(this.any()):
            is_eos = torch.isin(new, eos)
            seen = is_eos.cumsum(-1)
            new[(seen > 0) & ~((seen == 1) & is_eos)] = config.pad_token_id
    return finished


def _check_inputs(model: DiffusionGemma, input_ids: Tensor, cache: KVCache | None, config: GenerationConfig) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.dtype not in (torch.long, torch.int32):
        got = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be an integer tensor of shape (batch, length), got {got}")
    if input_ids.shape[1] == 0 and (cache is None or cache.length == 0):
        raise ValueError("empty prompt: input_ids has no tokens and there is no committed context to continue from")
    V = model.config.vocab_size
    check_token_ids(input_ids, V)  # before anything is allocated or a caller's cache is grown
    if cache is not None and cache.batch_size != input_ids.shape[0]:
        raise ValueError(f"cache holds batch size {cache.batch_size} but input_ids has {input_ids.shape[0]} rows")
    if config.pad_token_id is not None and config.pad_token_id >= V:
        raise ValueError(f"pad_token_id={config.pad_token_id} is outside the vocabulary (vocab_size={V})")
    bad = [e for e in config.eos_token_id if e >= V]
    if bad:
        raise ValueError(f"eos_token_id {bad} outside the vocabulary (vocab_size={V})")
    check_logit_bias(config, V)
