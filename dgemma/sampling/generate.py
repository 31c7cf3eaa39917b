"""Block-diffusion generation, the outer orchestration: check the request, size the cache, prefill, then canvas after
canvas denoise, take it into the output, commit it.

    commit(prompt)
    for each canvas:                                  dgemma/sampling/sequence.py: the outer loop's state
        staged = denoise_canvas(...)                  dgemma/sampling/sampler.py: the inner loop, any sampler; reads
                                                      the cache, never writes it
        end = sequences.end_canvas(staged)            EOS, budget and padding applied; the rows that ended
        commit(end.tokens)                            (the last canvas is left uncommitted, as in transformers)

With the default settings and the same seed this reproduces transformers' `DiffusionGemmaForBlockDiffusion.generate`
token for token on CPU (same random draws in the same order: one randint for the initial canvas, then per step a
multinomial and a randint). The switches in `GenerationConfig` (`commit`, `stop_rule`, `sliding_prefix`,
`truncate`, `sampler`) select the documented behaviours of other implementations; `time_level` and `lite_commit`
choose between dgemma's measured rules and seed 003's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dgemma.model.attention import Impl, check_impl
from dgemma.model.costs import check_memory
from dgemma.model.diffusiongemma import DiffusionGemma, check_token_ids
from dgemma.model.kv_cache import KVCache
from dgemma.sampling import rules
from dgemma.sampling.canvas import StepInfo
from dgemma.sampling.constraint import Constraint
from dgemma.sampling.generation_config import GenerationConfig, GenerationError
from dgemma.sampling.request_rules import (
    canvas_count,
    check_logit_bias,
    check_seed,
    committed_length,
    eos_index,
    new_token_budget,
    resolve_generation_config,
)
from dgemma.sampling.sampler import choose_loop, denoise_canvas
from dgemma.sampling.sequence import Sequences
from dgemma.sampling.trace import Trace


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


def generate(model: DiffusionGemma, input_ids: Tensor, *, generation_config: GenerationConfig | None = None,
             attention_mask: Tensor | None = None, seed: int | None = None, generator: torch.Generator | None = None,
             on_step: Callable[[StepInfo], None] | None = None,
             on_canvas: Callable[[int, Tensor], None] | None = None, trace: bool = False,
             cache: KVCache | None = None, decoder_input_ids: Tensor | None = None,
             impl: Impl | None = None, loop: str | None = None, compile: bool = False, force: bool = False,
             around_commit: Callable[[Callable[[], None]], None] | None = None,
             constraint: Constraint | None = None, **overrides: Any) -> GenerationResult:
    """Generate whole canvases after `input_ids` (B, T).

    Settings come from `overrides` (any GenerationConfig field), then `generation_config` (a checkpoint's:
    `dgemma.load_generation_config(path)`), else GenerationConfig's defaults (transformers').
    Randomness: `generator`, else a generator seeded with `seed`, else torch's global
    generator (what transformers uses: seeding it with torch.manual_seed(s) and passing seed=s draw the same
    numbers on CPU). `attention_mask` (B, T) marks left padding. `cache`: continue from a cache (multi-turn);
    `input_ids` are then only the tokens not yet committed. `decoder_input_ids` replaces the first canvas's
    initial noise. `on_step(StepInfo)` runs after every denoising step, `on_canvas(index, tokens)` after each
    canvas is finalised (EOS/padding applied). `around_commit(run)` is called for each cache write (the prefill,
    then each canvas before the next) with `run`, the write, which it must call once: `dgemma bench` times the
    commits this way (default: the write alone).
    `impl` (default: the model's, `model.impl`): the kernels, "reference" or "fast". `loop`: the sampler
    (`sampler.choose_loop`), "readable" (dgemma/sampling/readable.py, on either kernels) or "sync-free"
    (dgemma/sampling/fast_sampler.py: the same decisions, other random draws; fast kernels); default "sync-free" with
    impl="fast" where it implements the settings (the entropy-bound sampler without sampling controls), else
    "readable". An explicit loop="sync-free" with settings
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
    config = resolve_generation_config(generation_config, overrides)
    loop = choose_loop(config, impl, constraint=constraint, loop=loop, compile=compile)
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
    grammar = constraint.start(B, max_new_tokens=max_new) if constraint is not None else None
    seen = rules.Seen.of(input_ids, model.config.vocab_size, attention_mask) if config.penalizes else None
    out = Sequences(config, B, max_new, L, device, grammar=grammar, seen=seen, max_length=config.max_length,
                    prompt_length=T)
    sequences = input_ids
    passes = torch.zeros(B, dtype=torch.long, device=device)
    steps_per_canvas, stop_reasons, records = [], [], []
    for c in range(num_canvases):
        if c > 0:
            previous = sequences[:, -L:]  # the previous canvas, as finalised
            commit(lambda previous=previous: model.commit(previous, cache, impl=impl))
        finished = out.finished
        staged = denoise_canvas(model, cache, config, loop=loop, impl=impl, compile=compile, generator=generator,
                                on_step=on_step, trace=trace, canvas=decoder_input_ids if c == 0 else None,
                                **out.sampler_options())
        out.advance_grammar(staged)
        passes += staged.passes
        steps_per_canvas.append(staged.steps.tolist())
        stop_reasons.append(["finished" if f else r for f, r in zip(finished.tolist(), staged.stop_reasons,
                                                                      strict=True)])
        records.extend(staged.trace)
        sequences = torch.cat([sequences, out.end_canvas(staged).tokens], dim=-1)
        if on_canvas is not None:
            on_canvas(c, sequences[:, -L:])
        if bool(out.finished.all()):
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
        result.trace = Trace.of(records, config, seed=seed, batch_size=B, prompt_length=T, canvas_length=L,
                                steps_per_canvas=steps_per_canvas, stop_reasons=stop_reasons,
                                tokens_per_forward=tokens_per_forward.tolist())
    return result


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
