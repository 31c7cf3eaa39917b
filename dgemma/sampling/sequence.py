"""The outer loop, written once: B rows of output, canvas after canvas, for `generate` (dgemma/sampling/generate.py)
and the serving engine (dgemma/serving/engine.py, one `Sequences` of one row per request).

    seqs = Sequences(config, B, budget, L, device, grammar=..., seen=...)
    commit(prompt)
    loop:
        staged = <one canvas denoised>                 a sampler made with seqs.sampler_options() (sampler.py)
        seqs.advance_grammar(staged)                   the grammar reads the canvas (the engine: on a worker thread)
        end = seqs.end_canvas(staged)                  penalties count it; cut at EOS and the budget; who ended
        if every row ended: stop
        commit(end.tokens)                             every canvas but the last is committed
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dgemma.sampling.canvas import StagedCanvas
from dgemma.sampling.constraint import ConstraintState
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.sampling.request_rules import eos_index
from dgemma.sampling.rules import Seen


@dataclass
class CanvasEnd:
    """A canvas taken into the output."""

    tokens: Tensor  # (B, L) the canvas as finalised (as transformers): with a pad id, the canvases of rows that had
    # ended and the tokens after a row's first EOS are padding; what the next canvas's commit writes
    output: list[list[int]]  # per row, the tokens it adds to the output: cut before the first EOS and at the budget
    eos: list[bool]  # per row, whether an EOS within the budget ended it here (an EOS counts as generated)
    ended: Tensor  # (B,) bool: rows whose output has ended (EOS, budget, `max_length`), here or before


class Sequences:
    """The outer loop's state for B rows: which rows ended, how many tokens each emitted of its `budget` (the
    new-token budget, `request_rules.new_token_budget`), the canvas index, and what moves on with each canvas: the
    rows' grammar states (`grammar`) and what their penalties count (`seen`). `max_length` (generate, as transformers):
    a row also ends once `prompt_length` plus the canvases so far reach it."""

    def __init__(self, config: GenerationConfig, batch_size: int, budget: int, canvas_length: int,
                 device: torch.device, *, grammar: ConstraintState | None = None, seen: Seen | None = None,
                 max_length: int | None = None, prompt_length: int = 0):
        self.config, self.budget, self.canvas_length = config, budget, canvas_length
        self.grammar, self.seen = grammar, seen
        self.max_length, self.length = max_length, prompt_length
        self.finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.emitted = [0] * batch_size
        self.canvas = 0  # the index of the canvas being denoised
        eos = config.eos_token_id
        self.eos = torch.tensor(eos, dtype=torch.long, device=device) if eos else None

    def sampler_options(self) -> dict[str, Any]:
        """What the next canvas's sampler takes from the outer loop (`sampler.new_sampler`'s options)."""
        return dict(finished=self.finished, canvas_index=self.canvas, constraint=self.grammar, seen=self.seen)

    def advance_grammar(self, staged: StagedCanvas) -> None:
        """Move the unfinished rows' parsers on over the canvas (what the grammar did there: `staged.grammar`)."""
        if self.grammar is not None:
            rows = (~self.finished).nonzero().flatten().tolist()
            self.grammar.commit(staged.tokens, rows=rows, marks=staged.grammar)

    def end_canvas(self, staged: StagedCanvas) -> CanvasEnd:
        """Take a finished canvas into the output (after `advance_grammar`): the penalties count it; each row's output
        is cut before its first EOS and at its budget; a row ends once its canvas holds an EOS, its budget is spent
        or `max_length` is reached. With a pad id, the canvas of a row that had ended, and the tokens after a row's
        first EOS, become padding (in a copy: the sampler's records keep what it drew)."""
        new, L = staged.tokens.clone(), self.canvas_length
        if self.seen is not None:  # what the penalties count from the next canvas on
            self.seen.add(new, rows=~self.finished)
        before, rows = self.finished, new.tolist()
        cuts = [eos_index(row, self.config.eos_token_id) for row in rows]
        rooms = [self.budget - e for e in self.emitted]
        ended = before.tolist()
        output = [[] if done else row[:min(cut, room)] for row, cut, room, done in zip(rows, cuts, rooms, ended,
                                                                                      strict=True)]
        eos = [not done and cut < L and cut < room for cut, room, done in zip(cuts, rooms, ended, strict=True)]
        self.emitted = [e + len(o) for e, o in zip(self.emitted, output, strict=True)]
        self.length += L
        this = torch.tensor([e >= self.budget for e in self.emitted], device=before.device)
        if self.max_length is not None and self.length >= self.max_length:
            this |= True
        if self.eos is not None:
            this |= torch.isin(new, self.eos).any(-1)
        self.finished = before | this
        pad = self.config.pad_token_id
        if pad is not None and bool(self.finished.any()):
            new[before] = pad
            if self.eos is not None and bool(this.any()):
                is_eos = torch.isin(new, self.eos)
                seen = is_eos.cumsum(-1)
                new[(seen > 0) & ~((seen == 1) & is_eos)] = pad
        self.canvas += 1
        return CanvasEnd(new, output, eos, self.finished)
