"""The rules of one generation request, in one place: which settings apply, how many new tokens it may make, how
many canvases it takes and what of them it leaves committed, which seeds it accepts, what a sliding layer sees and
where its output ends. `generate`, the serving engine, `dgemma chat` and the decode runs of `dgemma eval` call these
functions, so that a request means the same thing wherever it runs."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from dgemma.model.config import ModelConfig
from dgemma.sampling.generation_config import GenerationConfig, GenerationError, seed_problem

TRANSFORMERS_MAX_NEW_TOKENS = 256  # transformers' default max_new_tokens: only at this value does max_length apply
MAX_CANVAS_PASSES = 1024  # the default cap on one canvas's model passes (`dgemma serve --limit-denoising-steps`, and
# every point of `dgemma eval`'s decoding grid)


def resolve_generation_config(generation_config: GenerationConfig | None, overrides: dict[str, Any]
                              ) -> GenerationConfig:
    """The settings of a request. Precedence: `overrides` > `generation_config` (a checkpoint's:
    `dgemma.load_generation_config`) > GenerationConfig's defaults (transformers')."""
    base = generation_config or GenerationConfig()
    return base.replace(**overrides) if overrides else base


def new_token_budget(config: GenerationConfig, context_length: int) -> int:
    """How many new tokens a request may make after `context_length` tokens of context. transformers' rule, its
    literal included: `max_length` (a total length) applies only while `max_new_tokens` is at its default of 256.
    Raises GenerationError when max_length leaves no room."""
    if config.max_length is None or config.max_new_tokens != TRANSFORMERS_MAX_NEW_TOKENS:
        return config.max_new_tokens
    budget = config.max_length - context_length
    if budget <= 0:
        raise GenerationError(f"max_length={config.max_length} leaves no room after {context_length} context tokens")
    return budget


def canvas_count(new_tokens: int, canvas_length: int) -> int:
    """The canvases `new_tokens` new tokens take: whole canvases, the last one denoised whole however few of its
    tokens are asked for (20 new tokens on 16-token canvases take 2)."""
    return -(-new_tokens // canvas_length)


def committed_length(context_length: int, new_tokens: int, canvas_length: int) -> int:
    """The tokens a request leaves in its KV cache: its context and every canvas but the last, which is never
    committed (a canvas is committed when the next one starts; to continue, the last is fed again)."""
    return context_length + (canvas_count(new_tokens, canvas_length) - 1) * canvas_length


def new_token_room(context_length: int, cache_length: int, positions: int, canvas_length: int) -> int:
    """The most new tokens (whole canvases) a request after `context_length` tokens may ask for, 0 when the context
    does not fit: what it commits (`committed_length`) fits a cache of `cache_length` tokens, and all its canvases fit
    the model's `positions`."""
    L = canvas_length
    if context_length > cache_length or context_length > positions:
        return 0
    return max(0, min((cache_length - context_length) // L * L + L, (positions - context_length) // L * L))


def check_seed(seed: Any) -> int:
    """`seed` if it is one dgemma accepts (`generation_config.is_seed`), else GenerationError naming it."""
    problem = seed_problem(seed)
    if problem is not None:
        raise GenerationError(f"seed {problem}")
    return seed


def sliding_prefix(model_config: ModelConfig, config: GenerationConfig) -> int | None:
    """The committed tokens a canvas sees in sliding-window layers: `sliding_window` for `sliding_prefix="jax"`,
    None (the model's default, sliding_window - 1 as transformers) for "hf"."""
    return model_config.sliding_window if config.sliding_prefix == "jax" else None


def eos_index(tokens: Sequence[int], eos: Sequence[int]) -> int:
    """The position of the first EOS in `tokens`, `len(tokens)` when there is none: where a request's output ends
    (`tokens[:eos_index(...)]` is the text before the EOS)."""
    stop = set(eos)
    return next((j for j, t in enumerate(tokens) if t in stop), len(tokens))


def check_logit_bias(config: GenerationConfig, vocab_size: int) -> None:
    """GenerationError for a logit_bias token id outside the model's vocabulary."""
    bad = [i for i, _ in config.logit_bias if i >= vocab_size]
    if bad:
        raise GenerationError(f"logit_bias: token id(s) {bad[:8]} outside the vocabulary (vocab_size={vocab_size})")


def check_prompt(prompt_ids: Any, vocab_size: int) -> list[int]:
    """A prompt as a list of token ids (a tensor is flattened), or a GenerationError: not integers, empty, or an id
    outside [0, vocab_size)."""
    if hasattr(prompt_ids, "flatten") and hasattr(prompt_ids, "tolist"):  # a tensor
        prompt_ids = prompt_ids.flatten().tolist()
    try:
        if isinstance(prompt_ids, str | bytes) or any(isinstance(t, bool) for t in prompt_ids):
            raise TypeError
        prompt = [operator.index(t) for t in prompt_ids]
    except TypeError:
        raise GenerationError("the prompt must be a list of integer token ids") from None
    if not prompt:
        raise GenerationError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise GenerationError(f"prompt token ids must lie in [0, vocab_size={vocab_size}), got {bad[:4]}")
    return prompt


def request_passes(config: GenerationConfig, canvas_length: int, choices: int = 1) -> int:
    """The most model passes a request may cost, the one count every cap on work uses: `choices` x its canvases (the
    new-token budget `max_new_tokens` over `canvas_length`, rounded up) x a canvas's passes (`config.max_passes`:
    max_denoising_steps, each with its corrector passes)."""
    return choices * canvas_count(config.max_new_tokens, canvas_length) * config.max_passes


def canvas_passes_problem(config: GenerationConfig, cap: int, where: str) -> tuple[str, str] | None:
    """(the field, a message naming it) when one canvas of `config` may cost more than `cap` model passes
    (`config.max_passes`), else None: `max_denoising_steps` over the cap, else `corrector_steps` (predictor-corrector)
    whose passes take a canvas over it. `where` says whose cap it is ("on this server (--limit-denoising-steps)")."""
    if config.max_denoising_steps > cap:
        return "max_denoising_steps", f"max_denoising_steps: at most {cap} {where}, got {config.max_denoising_steps}"
    if config.max_passes > cap:
        return "corrector_steps", (f"corrector_steps: max_denoising_steps={config.max_denoising_steps} x (1 + "
                                   f"corrector_steps={config.corrector_steps}) make {config.max_passes:,} model passes "
                                   f"a canvas; at most {cap} {where}")
    return None
