"""A multi-turn chat over one KV cache (`dgemma chat`, and anything else that holds a conversation).

The conversation is rendered with the model's chat template (`serving.templates.ChatTemplate`: the checkpoint's
`chat_template.jinja` or tokenizer_config.json template, sandboxed, else dgemma's built-in Gemma template), the one
template system of chat, `generate --chat`, serve and fine-tuning. Each turn encodes only what is new: the previous
answer's last canvas (generate never commits it) and the template's text after an answer
(`ChatTemplate.continuation`), so the cache holds what the template renders for the whole history. A template that
re-renders earlier turns differently (one that drops past thinking) gets the whole conversation re-encoded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dgemma.data.templates import ChatTemplate
from dgemma.data.tokenizer import Tokenizer, encode_template
from dgemma.sampling.generate import GenerationResult, generate
from dgemma.sampling.generation_config import GenerationConfig, offset_seed
from dgemma.sampling.request_rules import canvas_count, eos_index, resolve_generation_config


class ContextFullError(ValueError):
    """A turn would not fit in the session's cache; the session is unchanged (`reset()` starts over)."""


class ChatSession:
    """A conversation with `model`: `reply(text)` generates the model's answer to one user turn, keeping the KV cache
    between turns; `reset()` forgets the history. `template`: the chat template (default: dgemma's built-in Gemma
    template; `dgemma chat` passes the checkpoint's, `serving.templates.load_chat_template`). `generation_config`:
    the model's settings (`dgemma.load_generation_config`; default GenerationConfig's); `overrides` are
    generate()'s keyword overrides for every turn; turn k draws with seed `seed + k` (None: unseeded)."""

    def __init__(self, model: Any, tokenizer: Tokenizer, *, system: str | None = None, max_context: int = 8192,
                 seed: int | None = None, template: ChatTemplate | None = None,
                 generation_config: GenerationConfig | None = None, **overrides: Any):
        self.model, self.tokenizer, self.system, self.seed, self.overrides = model, tokenizer, system, seed, overrides
        self.generation_config = generation_config
        self.template = template or ChatTemplate(None)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.max_context = min(max_context, model.config.max_position_embeddings)
        L = model.config.canvas_length
        settings = {k: v for k, v in overrides.items() if k in GenerationConfig.__dataclass_fields__}
        max_new = resolve_generation_config(generation_config, settings).max_new_tokens
        # whole canvases of room: the answer's last canvas, which generate leaves uncommitted, is committed with the
        # next turn
        self.answer_room = canvas_count(max_new, L) * L
        self.cache = model.new_cache(batch_size=1, max_length=self.max_context)
        self.pending: list[int] | None = None  # None: no history; else the last answer's uncommitted canvas
        self.turn = 0

    def reset(self) -> None:
        """Forget the conversation (the cache is kept, emptied)."""
        self.cache.truncate(0)
        self.pending = None
        self.messages = self.messages[:1] if self.system else []

    def prompt_ids(self, text: str) -> list[int]:
        """The tokens this turn encodes: the whole conversation on the first turn (system prompt included) or when
        the template re-renders the history, else what follows the cache."""
        return self._turn(text)[0]

    def _turn(self, text: str) -> tuple[list[int], int]:
        """This turn's tokens and the cache length they follow (0: the conversation encoded whole)."""
        if self.pending is not None:
            follow = self.template.continuation(self.messages[:-1], text.strip())
            if follow is not None:
                return self.pending + encode_template(self.tokenizer, follow), self.cache.length
        return self.template.encode(self.tokenizer, [*self.messages, {"role": "user", "content": text.strip()}]), 0

    def reply(self, text: str, *, on_step: Callable[[Any], None] | None = None,
              on_canvas: Callable[[int, torch.Tensor], None] | None = None) -> GenerationResult:
        """Generate the answer to the user turn `text` (streamed through `on_step` / `on_canvas`, as generate's).
        Raises ContextFullError, leaving the session as it was, if the turn and its answer would not fit."""
        ids, start = self._turn(text)
        if start + len(ids) + self.answer_room > self.max_context:
            raise ContextFullError(f"context full: {start} + {len(ids)} prompt + {self.answer_room} "
                                   f"answer tokens exceed max_context {self.max_context}")
        last: list[list[int]] = []

        def keep_last(index: int, tokens: torch.Tensor) -> None:
            last[:] = tokens.tolist()
            if on_canvas is not None:
                on_canvas(index, tokens)

        seed = None if self.seed is None else offset_seed(self.seed, self.turn)
        self.cache.truncate(start)
        result = generate(self.model, torch.tensor([ids], device=self.model.device), cache=self.cache, seed=seed,
                          on_step=on_step, on_canvas=keep_last, generation_config=self.generation_config,
                          **self.overrides)
        row = last[0] if last else []
        self.pending = row[:eos_index(row, result.eos_token_id)]  # cut before EOS
        answer = result.new_tokens()[0]
        answer = self.tokenizer.decode(answer[:eos_index(answer, result.eos_token_id)])
        self.messages += [{"role": "user", "content": text.strip()}, {"role": "assistant", "content": answer}]
        self.cache, self.turn = result.cache, self.turn + 1
        return result
