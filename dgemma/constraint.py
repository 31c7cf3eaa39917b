"""Structured output: a grammar every generated canvas keeps the output a valid prefix of (docs/sampling.md,
"Structured output"), computed by llguidance (`pip install 'dgemma[grammar]'`) from the model's tokenizer.json.

    Constraint.json_schema(schema, tokenizer)   a JSON Schema (dict or text); Constraint.json_object: any JSON object
    Constraint.regex(pattern, tokenizer)        a regular expression
    Constraint.lark(grammar, tokenizer)         a Lark grammar (llguidance's dialect)
    constraint.start(batch_size)                one parser state per row (ConstraintState), advanced canvas by canvas

Block diffusion draws every position of a canvas at once. Given the logits, the positions are independent, so the
product distribution restricted to the grammar's language factorises left to right: position i is drawn from its
distribution masked to the tokens the grammar allows after the i tokens drawn before it (`ConstraintState.draw`,
exact for that masked product, as AR constrained decoding is for its chain). Each denoising step draws its canvas so;
the entropy-bound rule then accepts and re-noises as without a constraint, and the finished canvas (its argmax, drawn
greedily under the same masks) is valid by construction. Only the committed canvases advance the parser
(`ConstraintState.commit`); a step's draw is rolled back. Once the grammar is complete the rest is EOS.
"""

from __future__ import annotations

import functools
import json
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

# The JSON layout of a schema's output unless the schema's "x-guidance" says otherwise: one space after ":" and ",",
# no other whitespace (OpenAI's compact layout). With free whitespace, a model unsure what comes next may fill a
# canvas with newlines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that cannot be built: llguidance missing, or a schema, pattern or grammar it cannot compile (the
    message names which, and why)."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # the bitmask helpers
    except ImportError:
        raise ConstraintError("structured output needs llguidance: pip install 'dgemma[grammar]'") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar (llguidance's text form) for one tokenizer; `kind` and `source` say what it came from."""

    kind: str  # "json_schema", "json_object", "regex" or "lark"
    source: str
    grammar: str
    tokenizer: Any  # llguidance.LLTokenizer

    @classmethod
    def _build(cls, kind: str, source: str, grammar: str, tokenizer: Any,
               eos_token_id: Sequence[int] | int | None) -> Constraint:
        llg = _llguidance()
        eos = tuple([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []))
        tok = _ll_tokenizer_of(tokenizer, eos)
        is_error, problems = llg.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            why = " ".join((problems[0] if problems else "invalid").split())  # llguidance's message, on one line
            raise ConstraintError(f"cannot compile the {kind.replace('_', ' ')}: {why}")
        return cls(kind, source, grammar, tok)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, tokenizer: Any, *,
                    eos_token_id: Sequence[int] | int | None = None) -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            json.loads(text)
            grammar = _llguidance().LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"json_schema: not JSON ({e})") from None
        except ValueError as e:
            raise ConstraintError(f"json_schema: {e}") from None
        return cls._build("json_schema", text, grammar, tokenizer, eos_token_id)

    @classmethod
    def json_object(cls, tokenizer: Any, *,
                    eos_token_id: Sequence[int] | int | None = None) -> Constraint:
        """Any JSON object (OpenAI's response_format json_object)."""
        c = cls.json_schema({"type": "object"}, tokenizer, eos_token_id=eos_token_id)
        return Constraint("json_object", "", c.grammar, c.tokenizer)

    @classmethod
    def regex(cls, pattern: str, tokenizer: Any, *,
              eos_token_id: Sequence[int] | int | None = None) -> Constraint:
        try:
            grammar = _llguidance().LLMatcher.grammar_from_regex(pattern)
        except ValueError as e:
            raise ConstraintError(f"regex {pattern!r}: {e}") from None
        return cls._build("regex", pattern, grammar, tokenizer, eos_token_id)

    @classmethod
    def lark(cls, grammar: str, tokenizer: Any, *,
             eos_token_id: Sequence[int] | int | None = None) -> Constraint:
        try:
            text = _llguidance().LLMatcher.grammar_from_lark(grammar)
        except ValueError as e:
            raise ConstraintError(f"lark: {e}") from None
        return cls._build("lark", grammar, text, tokenizer, eos_token_id)

    def start(self, batch_size: int) -> ConstraintState:
        llg = _llguidance()
        return ConstraintState(self, [llg.LLMatcher(self.tokenizer, self.grammar) for _ in range(batch_size)])


def _tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer.json text of a dgemma Tokenizer, a `tokenizers.Tokenizer`, or a path to the file."""
    backend = getattr(tokenizer, "backend", tokenizer)
    if hasattr(backend, "to_str"):
        return backend.to_str()
    path = Path(tokenizer)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConstraintError(f"{path}: cannot read the tokenizer.json the constraint is compiled against ({e})"
                              ) from None


_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()


def _ll_tokenizer_of(tokenizer: Any, eos: tuple[int, ...]) -> Any:
    """llguidance's tokenizer for a dgemma Tokenizer, kept with it (a server builds one constraint per request, and
    serializing a large vocabulary each time would cost as much as the request); else by its tokenizer.json text."""
    try:
        kept = _BY_TOKENIZER.setdefault(tokenizer, {})
    except TypeError:  # a path or a `tokenizers.Tokenizer`: no weak reference to hold it by
        return _ll_tokenizer(_tokenizer_json(tokenizer), eos)
    if eos not in kept:
        kept[eos] = _ll_tokenizer(_tokenizer_json(tokenizer), eos)
    return kept[eos]


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(text: str, eos: tuple[int, ...]) -> Any:
    """llguidance's view of a tokenizer (about a second to build for a large vocabulary, so kept)."""
    try:
        return _llguidance().LLTokenizer(text, eos_token=list(eos) or None)
    except (ValueError, RuntimeError) as e:
        raise ConstraintError(f"llguidance cannot read this tokenizer ({e})") from None


class ConstraintState:
    """One parser state per row, at the end of what the rows have committed."""

    def __init__(self, constraint: Constraint, matchers: list[Any]):
        self.constraint, self.matchers = constraint, matchers
        llg = _llguidance()
        self._fill = llg.numpy.fill_next_token_bitmask
        self._bits = llg.numpy.allocate_token_bitmask(1, constraint.tokenizer.vocab_size)
        self.eos = constraint.tokenizer.eos_token
        self.mask_calls = 0  # masks computed
        self.seconds = 0.0  # wall-clock spent in `draw` and `commit`: the constraint's cost

    def allowed(self, row: int, vocab_size: int, device: torch.device) -> Tensor:
        """(vocab_size,) bool: the tokens the grammar allows next on `row` (none past the tokenizer's vocabulary:
        a model's table may be larger)."""
        self._fill(self.matchers[row], self._bits, 0)
        self.mask_calls += 1
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        n = min(vocab_size, self.constraint.tokenizer.vocab_size)
        out = torch.zeros(vocab_size, dtype=torch.bool)
        out[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        return out.to(device)

    def draw(self, z: Tensor, generator: torch.Generator | None, rows: Sequence[int] | None = None
             ) -> tuple[Tensor, Tensor, Tensor]:
        """For each row, left to right: position i drawn from softmax(z[b, i]) restricted to what the grammar allows
        after the tokens drawn before it, then the greedy canvas under the same rule. Returns the draw, the greedy
        canvas (B, L) and the entropy of each position's masked distribution along the draw (B, L). `z`: the tempered
        logits (B, L, V), unchanged. The parser is left where it was."""
        started = time.perf_counter()
        B, L, V = z.shape
        draw = torch.full((B, L), self.eos, dtype=torch.long, device=z.device)
        greedy, entropy = draw.clone(), torch.zeros(B, L, dtype=torch.float32, device=z.device)
        for b in range(B) if rows is None else rows:
            for out, sample in ((draw[b], True), (greedy[b], False)):
                m, taken = self.matchers[b], 0
                for i in range(L):
                    if m.is_stopped():
                        break
                    masked = z[b, i].float().masked_fill(~self.allowed(b, V, z.device), -torch.inf)
                    if sample:
                        p = torch.softmax(masked, dim=-1)
                        logp = torch.log_softmax(masked, dim=-1)
                        entropy[b, i] = -(p * logp.nan_to_num(neginf=0.0)).sum()
                        t = int(torch.multinomial(p, 1, generator=generator))
                    else:
                        t = int(masked.argmax())
                    if not m.consume_token(t):
                        raise RuntimeError(f"llguidance refused token {t} that its own mask allowed")
                    out[i], taken = t, taken + 1
                m.rollback(taken)
        self.seconds += time.perf_counter() - started
        return draw, greedy, entropy

    def commit(self, tokens: Tensor, rows: Sequence[int] | None = None) -> None:
        """Advance each row's parser over its committed canvas (B, L), up to the grammar's end."""
        started = time.perf_counter()
        for b in range(tokens.shape[0]) if rows is None else rows:
            m = self.matchers[b]
            for t in tokens[b].tolist():
                if m.is_stopped():
                    break
                if not m.consume_token(int(t)):
                    raise RuntimeError(f"row {b}: the committed token {t} leaves the grammar ({m.get_error()})")
        self.seconds += time.perf_counter() - started

    def complete(self) -> list[bool]:
        """Per row: whether what it committed is a whole sentence of the grammar."""
        return [bool(m.is_accepting() or m.is_stopped()) for m in self.matchers]


__all__ = ["Constraint", "ConstraintError", "ConstraintState"]
