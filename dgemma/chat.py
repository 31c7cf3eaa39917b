"""A multi-turn chat over one KV cache (`dgemma chat`, and anything else that holds a conversation).

Each turn encodes only what is new: the previous answer's last canvas (generate never commits it) and the new user
turn, closed and opened with the Gemma turn template, so the cache holds exactly what `format_chat` renders for the
whole history."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dgemma.generate import GenerationResult, generate
from dgemma.generation_config import offset_seed
from dgemma.request_rules import eos_index
from dgemma.tokenizer import TURN_END, TURN_START, Tokenizer, chat_token_ids, encode_template


class ContextFullError(ValueError):
    """A turn would not fit in the session's cache; the session is unchanged (`reset()` starts over)."""


def next_turn_text(user: str) -> str:
    """Template text that closes the previous model turn and opens the next: the history then reads exactly as
    format_chat renders [..., model answer, user turn] (the answer's EOS, <turn|> or <eos>, becomes <turn|>)."""
    return f"{TURN_END}\n{TURN_START}user\n{user.strip()}{TURN_END}\n{TURN_START}model\n"


class ChatSession:
    """A conversation with `model`: `reply(text)` generates the model's answer to one user turn, keeping the KV cache
    between turns; `reset()` forgets the history. `overrides` are generate()'s keyword overrides for every turn;
    turn k draws with seed `seed + k` (None: unseeded)."""

    def __init__(self, model: Any, tokenizer: Tokenizer, *, system: str | None = None, max_context: int = 8192,
                 seed: int | None = None, **overrides: Any):
        self.model, self.tokenizer, self.system, self.seed, self.overrides = model, tokenizer, system, seed, overrides
        self.max_context = min(max_context, model.config.max_position_embeddings)
        L = model.config.canvas_length
        max_new = overrides.get("max_new_tokens", model.generation_config.max_new_tokens)
        self.answer_room = -(-max_new // L) * L  # every canvas but the last is committed: whole canvases of room
        self.cache = model.new_cache(batch_size=1, max_length=self.max_context)
        self.pending: list[int] | None = None  # None: no history; else the last answer's uncommitted canvas
        self.turn = 0

    def reset(self) -> None:
        """Forget the conversation (the cache is kept, emptied)."""
        self.cache.truncate(0)
        self.pending = None

    def prompt_ids(self, text: str) -> list[int]:
        """The tokens this turn encodes: the whole first turn (system prompt included), or what follows the cache."""
        if self.pending is None:
            system = [{"role": "system", "content": self.system}] if self.system else []
            return chat_token_ids(self.tokenizer, [*system, {"role": "user", "content": text.strip()}])
        return self.pending + encode_template(self.tokenizer, next_turn_text(text))

    def reply(self, text: str, *, on_step: Callable[[Any], None] | None = None,
              on_canvas: Callable[[int, torch.Tensor], None] | None = None) -> GenerationResult:
        """Generate the answer to the user turn `text` (streamed through `on_step` / `on_canvas`, as generate's).
        Raises ContextFullError, leaving the session as it was, if the turn and its answer would not fit."""
        ids = self.prompt_ids(text)
        if self.cache.length + len(ids) + self.answer_room > self.max_context:
            raise ContextFullError(f"context full: {self.cache.length} + {len(ids)} prompt + {self.answer_room} "
                                   f"answer tokens exceed max_context {self.max_context}")
        last: list[list[int]] = []

        def keep_last(index: int, tokens: torch.Tensor) -> None:
            last[:] = tokens.tolist()
            if on_canvas is not None:
                on_canvas(index, tokens)

        seed = None if self.seed is None else offset_seed(self.seed, self.turn)
        result = generate(self.model, torch.tensor([ids], device=self.model.device), cache=self.cache, seed=seed,
                          on_step=on_step, on_canvas=keep_last, **self.overrides)
        row = last[0] if last else []
        self.pending = row[:eos_index(row, result.eos_token_id)]  # cut before EOS
        self.cache, self.turn = result.cache, self.turn + 1
        return result
