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

import dataclasses
import functools
import json
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dgemma.sampling.schema_rules import ConstraintError, calendar_dates, distinct_keys

# The JSON layout of a schema's output unless the schema's "x-guidance" says otherwise: one space after ":" and ",",
# no other whitespace (OpenAI's compact layout). With free whitespace, a model unsure what comes next may fill a
# canvas with newlines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# What one grammar may cost (docs/sampling.md, "Structured output"): the characters of its source (a schema's JSON
# text, a pattern, a Lark grammar), the tokens of the dry run that compiling makes (the closer's path from the start:
# an llguidance error on it refuses the grammar up front) and the seconds that run may take. llguidance's own
# per-step limits (lexer fuel, Earley items) stay at their defaults; their errors end a row (`ConstraintState.failed`).
MAX_GRAMMAR_CHARS = 65536
PROBE_TOKENS = 32
COMPILE_SECONDS = 10.0


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
    # the parser at the start, checked when compiled; `start` copies it (None: `start` makes new ones)
    matcher: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def _build(cls, kind: str, source: str, grammar: str, tokenizer: Any,
               eos_token_id: Sequence[int] | int | None) -> Constraint:
        """Compile and check: llguidance's validation, then a parser at the start whose first mask must allow
        something (or the empty output) and on which the closer's dry run of up to PROBE_TOKENS tokens
        (COMPILE_SECONDS at most) must not make llguidance give up (a recursion it cannot expand, a lexer too
        large, ...): such a grammar is refused here, before any generation."""
        llg, started = _llguidance(), time.perf_counter()
        what = f"the {kind.replace('_', ' ')}"
        eos = tuple([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []))
        tok = _ll_tokenizer_of(tokenizer, eos)
        is_error, problems = llg.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=_limits())
        if is_error:
            raise ConstraintError(f"cannot compile {what}: {_one_line(problems[0] if problems else 'invalid')}")
        m = _matcher(tok, grammar)
        bits = llg.numpy.allocate_token_bitmask(1, tok.vocab_size)
        if not m.is_error():
            llg.numpy.fill_next_token_bitmask(m, bits, 0)
        if m.is_error():
            raise ConstraintError(f"the grammar engine cannot start {what}: {_one_line(m.get_error())}")
        if not bits.any() and not m.is_accepting():
            raise ConstraintError(f"{what} allows no output at all (its language is empty)")
        _closer_of(tok).path(m, PROBE_TOKENS, deadline=started + COMPILE_SECONDS)
        if m.is_error():
            raise ConstraintError(f"the grammar engine gives up on {what} within its first {PROBE_TOKENS} tokens: "
                                  f"{_one_line(m.get_error())}")
        if time.perf_counter() > started + COMPILE_SECONDS:
            raise ConstraintError(f"{what} took over {COMPILE_SECONDS:g} s to compile (the limit); simplify it")
        return cls(kind, source, grammar, tok, m)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, tokenizer: Any, *,
                    eos_token_id: Sequence[int] | int | None = None) -> Constraint:
        text = _sized("json schema", schema if isinstance(schema, str) else json.dumps(schema))
        try:
            loaded = json.loads(text)
            distinct_keys(loaded)
            strict = json.dumps(calendar_dates(loaded))
            grammar = _llguidance().LLMatcher.grammar_from_json_schema(strict, defaults=JSON_LAYOUT)
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
        return dataclasses.replace(c, kind="json_object", source="")

    @classmethod
    def regex(cls, pattern: str, tokenizer: Any, *,
              eos_token_id: Sequence[int] | int | None = None) -> Constraint:
        if not _sized("regex", pattern):
            raise ConstraintError("regex: the pattern is empty (it would allow only the empty output); give a pattern")
        try:
            grammar = _llguidance().LLMatcher.grammar_from_regex(pattern)
        except ValueError as e:
            raise ConstraintError(f"regex {pattern!r}: {e}") from None
        return cls._build("regex", pattern, grammar, tokenizer, eos_token_id)

    @classmethod
    def lark(cls, grammar: str, tokenizer: Any, *,
             eos_token_id: Sequence[int] | int | None = None) -> Constraint:
        try:
            text = _llguidance().LLMatcher.grammar_from_lark(_sized("lark grammar", grammar))
        except ValueError as e:
            raise ConstraintError(f"lark: {e}") from None
        return cls._build("lark", grammar, text, tokenizer, eos_token_id)

    def shortest(self, limit: int) -> int | None:
        """The tokens the budget's closer (`Closer.path`) writes from the start to the grammar's end, EOS included:
        the fewest `max_new_tokens` with which every output is closed (`ConstraintState.draw`); None if over
        `limit`."""
        path = _closer_of(self.tokenizer).path(_llguidance().LLMatcher(self.tokenizer, self.grammar), limit)
        return None if path is None else len(path)

    def start(self, batch_size: int, max_new_tokens: int | None = None) -> ConstraintState:
        """One parser state per row (copies of the checked one: no grammar work here). With `max_new_tokens`, every
        row's output is closed within that many tokens where the grammar allows it (`ConstraintState.draw`)."""
        return ConstraintState(self, [self.matcher.deep_copy() if self.matcher is not None else
                                      _matcher(self.tokenizer, self.grammar) for _ in range(batch_size)],
                               max_new_tokens)


def _limits() -> Any:
    """llguidance's parser limits, at its defaults, with short errors (no parser state dumped into a message)."""
    return _llguidance().LLParserLimits(verbose_errors=False)


def _matcher(tokenizer: Any, grammar: str) -> Any:
    return _llguidance().LLMatcher(tokenizer, grammar, limits=_limits(), log_level=0)


def _one_line(message: str) -> str:
    """llguidance's message on one line, without its trailer (`<non-verbose/>`, a state dump)."""
    return " ".join(message.split("<")[0].split()) or "invalid"


def _sized(what: str, text: str) -> str:
    """`text`, or a ConstraintError if it is over MAX_GRAMMAR_CHARS."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"the {what} is {len(text):,} characters; at most {MAX_GRAMMAR_CHARS:,} are compiled")
    return text


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


# What the grammar did at a position of the committed (greedy) canvas, as traces record it (`ConstraintState.draw`):
FREE, PINNED, CLOSED = 0, 1, 2  # more than one token allowed; exactly one (the grammar fixes it); the closer's


class Closer:
    """The shortest way this module knows to finish a sentence of the grammar from a parser state: a greedy path
    that prefers, in order, a closing quote, `@` (an email's), a closing brace or bracket, a comma, `.`, `:` and `0`,
    then the grammar's forced tokens, then the shortest token it allows (not the one it just took, so `a*b` ends),
    and EOS once the sentence is complete. It is an upper bound of the true shortest completion, found with a few
    microsecond validity checks per token rather than a search; `ConstraintState.draw` keeps every row within its
    budget of it."""

    PREFERRED = ('"', "@", "}", "]", ",", ".", ":", "0")
    STRUCTURAL = (",", "}", "]", ":")  # what may follow a closing quote

    def __init__(self, tokenizer: Any):
        single = {s: ids[0] for s in (*self.PREFERRED, *self.STRUCTURAL)
                  if len(ids := tokenizer.tokenize_str(s)) == 1}
        self.preferred = [single[s] for s in self.PREFERRED if s in single]
        self.quote, self.eos = single.get('"'), tokenizer.eos_token
        self.structural = [single[s] for s in self.STRUCTURAL if s in single]
        lengths = np.array([len(tokenizer.decode_bytes([t])) for t in range(tokenizer.vocab_size)])
        special = np.array([tokenizer.is_special_token(t) for t in range(tokenizer.vocab_size)])
        # Shortest first: a special token (a tool-call marker, say) only when nothing else is allowed.
        self.by_length = np.argsort(np.where(special | (lengths == 0), 1 << 20, lengths), kind="stable")
        llg = _llguidance()
        self._local = threading.local()  # a mask buffer per thread: one Closer serves every request's rows
        self._vocab_size = tokenizer.vocab_size
        self._fill = llg.numpy.fill_next_token_bitmask

    @property
    def _bits(self) -> Any:
        bits = getattr(self._local, "bits", None)
        if bits is None:
            bits = self._local.bits = _llguidance().numpy.allocate_token_bitmask(1, self._vocab_size)
        return bits

    def path(self, m: Any, limit: int, deadline: float = math.inf) -> list[int] | None:
        """The closer's tokens from `m`'s state to the grammar's stop, EOS included (empty where it has stopped), or
        None if that takes more than `limit` tokens, runs past `deadline` (time.perf_counter) or makes llguidance
        give up (`m.is_error()` then says so). The parser is left where it was."""
        tokens: list[int] = []
        while not m.is_stopped() or m.is_error():
            if len(tokens) >= limit or m.is_error() or time.perf_counter() > deadline:
                m.rollback(len(tokens))
                return None
            t = self.eos if m.is_accepting() else self._next(m, tokens[-1] if tokens else None)
            if t is None or not m.consume_token(t):  # a dead end: no token allowed
                m.rollback(len(tokens))
                return None
            tokens.append(t)
        m.rollback(len(tokens))
        return tokens

    def closes(self, m: Any, path: list[int]) -> bool:
        """Whether `path` takes `m` to the grammar's stop (the parser is left where it was): a closer's path from an
        earlier state, checked in one validation rather than found again."""
        if m.validate_tokens(path) != len(path):
            return False
        m.consume_tokens(path)
        stopped = m.is_stopped()
        m.rollback(len(path))
        return stopped

    def _next(self, m: Any, previous: int | None) -> int | None:
        for t in self.preferred:
            if m.validate_tokens([t]) == 1 and (t != self.quote or self._closes(m)):
                return t
        forced = m.compute_ff_tokens()
        if forced:
            return forced[0]
        self._fill(m, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[self.by_length].nonzero()[0]
        if len(allowed) == 0:
            return None
        first = int(self.by_length[allowed[0]])
        return int(self.by_length[allowed[1]]) if first == previous and len(allowed) > 1 else first

    def _closes(self, m: Any) -> bool:
        """Whether the quote `m` allows next ends a string (rather than opening one): after it, another quote is not
        allowed and the sentence ends or a comma, brace, bracket or colon may follow."""
        m.consume_token(self.quote)
        closes = m.validate_tokens([self.quote]) == 0 and (
            m.is_accepting() or any(m.validate_tokens([t]) == 1 for t in self.structural))
        m.rollback(1)
        return closes


@functools.lru_cache(maxsize=8)
def _closer_of(tokenizer: Any) -> Closer:
    """The Closer of an llguidance tokenizer (hashed by identity; kept with it, as a server builds one constraint per
    request and reading a large vocabulary's token lengths takes a while)."""
    return Closer(tokenizer)


MASS_FLOOR = 1e-20  # below this masked share of p (float32 probabilities), the masked softmax is taken from the logits


def _allowed_logits(i: int, allowed: np.ndarray, z: np.ndarray, full: np.ndarray | None) -> np.ndarray:
    """Position i's logits (float64, (n,)) with the tokens the grammar forbids at -inf: from `z`, or where `z` holds
    -inf at every allowed token (top_k/top_p/min_p cut them all), from `full`, the logits before the filter (the
    masked distribution of the unfiltered logits); where that is -inf too, every allowed token alike. So the
    grammar's draw and argmax are defined for every temperature, filter and bias."""
    out = np.where(allowed, z[i].astype(np.float64), -np.inf)
    if np.isneginf(out.max()) and full is not None:
        out = np.where(allowed, full[i].astype(np.float64), -np.inf)
    if np.isneginf(out.max()):
        out = np.where(allowed, 0.0, -np.inf)
    return out


class ConstraintState:
    """One parser state per row, at the end of what the rows have committed, and the tokens each row may still
    write (`left`, None: unbounded).

    A row whose grammar work fails is ended honestly rather than passed off as complete: where llguidance gives up
    (its error state: too many Earley items, a lexer too large, a token it refuses), no token is allowed, one `draw`
    or `project` call runs past `step_seconds`, or `cancelled()` says so, the row's `failed` holds why, the rest of
    its canvases are EOS, its parser is no longer advanced, and `complete()` is False for it."""

    def __init__(self, constraint: Constraint, matchers: list[Any], max_new_tokens: int | None = None):
        self.constraint, self.matchers = constraint, matchers
        self.left: list[int | None] = [max_new_tokens] * len(matchers)
        llg = _llguidance()
        self._fill = llg.numpy.fill_next_token_bitmask
        self._bits = llg.numpy.allocate_token_bitmask(1, constraint.tokenizer.vocab_size)
        self.closer = _closer_of(constraint.tokenizer) if max_new_tokens is not None else None
        self._start_paths: dict[int, list[int] | None] = {}  # per row: the closer's path from the committed state
        self.eos = constraint.tokenizer.eos_token
        self.mask_calls = 0  # masks computed
        self.seconds = 0.0  # wall-clock spent in `draw` and `commit`: the constraint's cost
        self.pinned = 0  # committed tokens the grammar fixed (the only token it allowed)
        self.closed = 0  # committed tokens the closer chose to finish within the budget
        self.failed: list[str | None] = [None] * len(matchers)  # per row: why its grammar work stopped, or None
        self.step_seconds: float | None = None  # the time one draw or project may take (None: unbounded)
        self.cancelled: Callable[[], bool] | None = None  # polled during that work: True stops it
        self._deadline = math.inf

    def _ended(self, b: int, m: Any) -> bool:
        """Whether row `b` takes no more tokens: its grammar is done, or its work failed (recorded in `failed`)."""
        if self.failed[b] is None:
            if m.is_error():
                self.failed[b] = f"the grammar engine gave up: {_one_line(m.get_error())}"
            elif time.perf_counter() > self._deadline:
                self.failed[b] = f"the grammar work took over {self.step_seconds:g} s in one step"
            elif self.cancelled is not None and self.cancelled():
                self.failed[b] = "cancelled"
        return self.failed[b] is not None or m.is_stopped()

    def _going(self, rows: Sequence[int]) -> list[int]:
        """The rows whose grammar work has not failed (a failed row's canvas is all EOS)."""
        return [b for b in rows if self.failed[b] is None]

    def _begin(self) -> float:
        started = time.perf_counter()
        self._deadline = math.inf if self.step_seconds is None else started + self.step_seconds
        return started

    def draw(self, z: Tensor, generator: torch.Generator | None, rows: Sequence[int] | None = None,
             unfiltered: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For each row, left to right: position i drawn from softmax(z[b, i]) restricted to what the grammar allows
        after the tokens drawn before it, then the greedy canvas under the same rule. Returns the draw, the greedy
        canvas (B, L), the entropy of each position's masked distribution along the draw (B, L), and what the
        grammar did at each position of the greedy canvas (B, L) int8: FREE, PINNED or CLOSED. `z`: the tempered
        logits (B, L, V), unchanged; `unfiltered`: the same before top_k/top_p/min_p, read where the filter cut
        every token the grammar allows (`_allowed_logits`). The parser is left where it was.

        A row with a budget (`left`) is kept closable within it: a token after which the closer (`Closer.path`)
        cannot finish the sentence in the positions the budget has left is replaced by the closer's own next token,
        so the last canvas ends the sentence whenever the closer could from where the canvas began."""
        started = self._begin()
        B, L, _ = z.shape
        draw = torch.full((B, L), self.eos, dtype=torch.long, device=z.device)
        greedy, entropy = draw.clone(), torch.zeros(B, L, dtype=torch.float32, device=z.device)
        marks = torch.zeros(B, L, dtype=torch.int8, device=z.device)
        for b in self._going(range(B) if rows is None else rows):
            full = None if unfiltered is None else unfiltered[b]
            self._walk(b, z[b], generator, draw[b], entropy[b], None, full=full)
            self._walk(b, z[b], None, greedy[b], None, marks[b], full=full)
        self.seconds += time.perf_counter() - started
        return draw, greedy, entropy, marks

    def project(self, canvas: Tensor, z: Tensor, rows: Sequence[int] | None = None,
                unfiltered: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A sampler's own canvas (B, L) made a valid continuation, left to right: each token is kept where the
        grammar allows it (and the budget's closer can still finish after it), else replaced by the grammar's argmax
        of `z` (B, L, V) there (`unfiltered`: as `draw`'s). Returns the canvas and what the grammar did (B, L), as
        `draw`'s greedy canvas; the parser is left where it was. The samplers that commit their own draws (Lite, the
        committing samplers, the chains) commit this."""
        started = self._begin()
        out = torch.full_like(canvas, self.eos)
        marks = torch.zeros(canvas.shape, dtype=torch.int8, device=canvas.device)
        for b in self._going(range(canvas.shape[0]) if rows is None else rows):
            self._walk(b, z[b], None, out[b], None, marks[b], proposal=canvas[b].tolist(),
                       full=None if unfiltered is None else unfiltered[b])
        self.seconds += time.perf_counter() - started
        return out, marks

    def _walk(self, b: int, z: Tensor, generator: torch.Generator | None, out: Tensor, entropy: Tensor | None,
              marks: Tensor | None, proposal: list[int] | None = None, full: Tensor | None = None) -> None:
        """One row's canvas left to right under the masks: drawn with `generator` (and each masked entropy into
        `entropy`), else greedy (and what the grammar did into `marks`), or `proposal`'s token where the grammar
        allows it. The parser is rolled back at the end.

        The draw is exact for the masked distribution q = p / p(allowed) without a full masked softmax per position:
        the unmasked draw is kept when the grammar allows it, else the position is drawn from q by inverse CDF (the
        two together give q(t) = p(t) + (1 - p(allowed)) q(t)). Where p(allowed) is below MASS_FLOOR (temperature 0
        puts all of p on one token; a bias or a filter may leave the allowed tokens almost nothing), q is the
        softmax of the allowed tokens' logits (`_allowed_logits`), so the draw at temperature 0 is the allowed argmax.
        Likewise the greedy token is the unmasked argmax when allowed, else the argmax of `_allowed_logits`. Each row
        takes 2L uniforms, used or not, so the random stream does not depend on the grammar's answers."""
        m, left, closer = self.matchers[b], self.left[b], self.closer
        L, V = z.shape
        n = min(V, self.constraint.tokenizer.vocab_size)  # a model's table may be larger than the tokenizer's
        zf = z.float()
        z_np, full_np = zf[:, :n].numpy(), None if full is None else full.float()[:, :n].numpy()
        drawing = generator is not None or entropy is not None
        if drawing:
            logp = torch.log_softmax(zf, dim=-1)
            p = logp.exp()
            u = torch.rand(2, L, generator=generator, dtype=torch.float64)
            # the unmasked draws by inverse CDF (one cumulative sum; torch.multinomial takes longer per row)
            cdf = p.double().cumsum(-1)
            first = torch.searchsorted(cdf, (u[0] * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=V - 1).tolist()
            uniform = u[1].tolist()
            p_np = p[:, :n].double().numpy()
            plogp = (p * logp.nan_to_num(neginf=0.0))[:, :n].double().numpy()
        else:
            top = zf.argmax(-1).tolist()
        path = None  # the closer's tokens from the parser's state (None: no budget, or no way to close within it)
        if closer is not None and left is not None and left >= 1:  # from the committed state, kept until a commit
            if b not in self._start_paths:
                self._start_paths[b] = closer.path(m, left, self._deadline)
            path = self._start_paths[b]
        taken = 0
        for i in range(L):
            if self._ended(b, m):
                break
            self._fill(m, self._bits, 0)
            self.mask_calls += 1
            allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=n).astype(bool)
            if self._ended(b, m) or (not allowed.any() and self._fail(b, "the grammar allows no token here")):
                break
            if left is not None and i >= left and m.is_accepting():  # past the budget, a finished sentence ends
                t, h = self.eos, 0.0
            elif drawing:
                q = np.where(allowed, p_np[i], 0.0)
                mass = q.sum()
                if mass < MASS_FLOOR:  # the allowed tokens' own softmax, from their logits
                    logits = _allowed_logits(i, allowed, z_np, full_np)
                    shifted = logits - logits.max()
                    q = np.exp(shifted)
                    mass = q.sum()  # >= 1: the largest allowed logit gives exp(0)
                    h = float(np.log(mass) - (q * np.where(q > 0, shifted, 0.0)).sum() / mass)
                else:
                    h = float(np.log(mass) - plogp[i][allowed].sum() / mass)
                t = first[i]
                if t >= n or not allowed[t]:
                    t = int(np.searchsorted(np.cumsum(q), uniform[i] * mass, side="right"))
                    t = min(t, n - 1) if allowed[min(t, n - 1)] else int(np.flatnonzero(allowed)[-1])
            elif proposal is not None and proposal[i] < n and allowed[proposal[i]]:
                t, h = proposal[i], 0.0
            else:
                t = top[i] if top[i] < n and allowed[top[i]] else \
                    int(_allowed_logits(i, allowed, z_np, full_np).argmax())
                h = 0.0
            if entropy is not None:
                entropy[i] = max(h, 0.0)
            mark = PINNED if marks is not None and np.count_nonzero(allowed) == 1 else FREE
            if not m.consume_token(t):  # llguidance refused a token its own mask allowed: it gave up
                self._ended(b, m)
                break
            if closer is not None and left is not None and left - i >= 1:
                if path is not None and t == path[0]:
                    path = path[1:]
                elif path is not None and len(path) < left - i and closer.closes(m, path):
                    pass  # the same way still ends the sentence after t (most tokens inside a string or a number)
                else:
                    after = closer.path(m, left - i - 1, self._deadline)
                    if after is None and path is not None:  # t leaves no way to close in time: the closer's token
                        m.rollback(1)
                        t, path = path[0], path[1:]
                        m.consume_token(t)
                        mark = CLOSED
                    else:
                        path = after
            out[i], taken = t, taken + 1
            if marks is not None:
                marks[i] = mark
        m.rollback(taken)

    def masked_logits(self, tokens: Tensor, z: Tensor, unfiltered: Tensor | None = None) -> Tensor:
        """The logits (B, L, V) fp32 of the masked distributions a canvas `tokens` (B, L), from the rows' committed
        state, was drawn from: at each position `_allowed_logits` of `z` (B, L, V) (`unfiltered`: as `draw`'s), the
        rule the draw and the greedy canvas follow; `z` as it is once the grammar has stopped (or from a token it
        refuses on). The log-probabilities a server reports under a grammar. The parser is left where it was."""
        out = z.detach().float().cpu().clone()
        V = out.shape[-1]
        n = min(V, self.constraint.tokenizer.vocab_size)
        for b in range(tokens.shape[0]):
            z_np = out[b, :, :n].numpy().copy()
            full_np = None if unfiltered is None else unfiltered[b].detach().float().cpu()[:, :n].numpy()
            m, taken = self.matchers[b], 0
            for i, t in enumerate(tokens[b].tolist()):
                if m.is_stopped():
                    break
                self._fill(m, self._bits, 0)
                allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=n).astype(bool)
                out[b, i, :n] = torch.from_numpy(_allowed_logits(i, allowed, z_np, full_np))
                out[b, i, n:] = -torch.inf
                if not m.consume_token(int(t)):
                    break
                taken += 1
            m.rollback(taken)
        return out.to(z.device)

    def commit(self, tokens: Tensor, rows: Sequence[int] | None = None, marks: Tensor | None = None) -> None:
        """Advance each row's parser over its committed canvas (B, L), up to the grammar's end or the row's budget
        (`left`: the tokens past it are never output, so a sentence they would finish is not complete); `marks`
        (B, L), what the grammar did there (`draw`), are counted."""
        started = time.perf_counter()
        self._deadline = math.inf
        for b in range(tokens.shape[0]) if rows is None else rows:
            m, left = self.matchers[b], self.left[b]
            for i, t in enumerate(tokens[b].tolist()):
                if (left is not None and i >= left) or self._ended(b, m) or \
                        (not m.consume_token(int(t)) and self._ended(b, m)):
                    break
                if marks is not None:
                    self.pinned += int(marks[b, i]) == PINNED
                    self.closed += int(marks[b, i]) == CLOSED
            if self.left[b] is not None:
                self.left[b] = max(0, self.left[b] - tokens.shape[1])
            self._start_paths.pop(b, None)
        self.seconds += time.perf_counter() - started

    def complete(self) -> list[bool]:
        """Per row: whether what it committed is a whole sentence of the grammar (never for a row that `failed`)."""
        return [self.failed[b] is None and not m.is_error() and bool(m.is_accepting() or m.is_stopped())
                for b, m in enumerate(self.matchers)]

    def _fail(self, b: int, why: str) -> bool:
        self.failed[b] = self.failed[b] or why
        return True


__all__ = ["CLOSED", "FREE", "MAX_GRAMMAR_CHARS", "PINNED", "Closer", "Constraint", "ConstraintError",
           "ConstraintState"]
