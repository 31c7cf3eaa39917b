"""The rules of one generation request, in one place: which settings apply, how many new tokens it may make, which
seeds it accepts, what a sliding layer sees and where its output ends. `generate`, the serving engine, `dgemma chat`
and the decode runs of `dgemma eval` call these functions, so that a request means the same thing wherever it runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dgemma.config import ModelConfig
from dgemma.generation_config import SEED_RANGE, GenerationConfig, GenerationError, is_seed

if TYPE_CHECKING:
    from dgemma.model import DiffusionGemma

TRANSFORMERS_MAX_NEW_TOKENS = 256  # transformers' default max_new_tokens: only at this value does max_length apply


def resolve_generation_config(model: DiffusionGemma, generation_config: GenerationConfig | None,
                              overrides: dict[str, Any]) -> GenerationConfig:
    """The settings of a request. Precedence: `overrides` > `generation_config` > the model's generation_config.json
    > GenerationConfig's defaults."""
    base = generation_config or model.generation_config or GenerationConfig()
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


def check_seed(seed: Any) -> int:
    """`seed` if it is one dgemma accepts (`generation_config.is_seed`), else GenerationError naming it."""
    if not is_seed(seed):
        raise GenerationError(f"seed must be {SEED_RANGE}, got {seed!r}")
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
