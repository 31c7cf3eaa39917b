"""One choice of a generation request as the server returns it (dgemma/serving/app.py): the committed token ids
decoded to text, held back while the text may end in an incomplete UTF-8 sequence or the beginning of a stop string,
cut at the first stop string, split by the output parser (thinking, tool calls), and the bookkeeping the response
and the metrics read (tokens returned, log-probabilities, canvases and steps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dgemma.data.templates import ParsedOutput, partial_suffix
from dgemma.serving.errors import APIError, short

MAX_STOP = 64  # stop strings of a request (OpenAI takes 4; lm-eval appends EOS to its own, vLLM takes more)
MAX_STOP_CHARS = 256  # characters of one stop string: with MAX_STOP, what bounds the stop matching per canvas


def stop_strings(stop: Any) -> tuple[str, ...]:
    """A request's `stop` (a string or a list of them) as the distinct strings a Choice cuts at, or a 400: at most
    MAX_STOP non-empty strings of at most MAX_STOP_CHARS characters (docs/serving.md)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(f"stop: must be a non-empty string or a list of at most {MAX_STOP} of them, got {short(stop)}",
                       param="stop")
    if len(stops) > MAX_STOP:
        raise APIError(f"stop: at most {MAX_STOP} strings, got {len(stops)}", param="stop")
    long = next((i for i, s in enumerate(stops) if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise APIError(f"stop[{long}]: at most {MAX_STOP_CHARS} characters, got {len(stops[long])}", param="stop")
    return tuple(dict.fromkeys(stops))


class Choice:
    """One choice's text: committed ids -> decoded text, held back while it may end in an incomplete UTF-8 sequence
    or the beginning of a stop string, cut at the first stop string, then split by the output parser."""

    def __init__(self, index: int, decode: Callable[[list[int]], str], stop: tuple[str, ...], parser: Any,
                 calls_only: bool = False):
        self.index, self.decode, self.stop, self.parser = index, decode, stop, parser
        self.calls_only = calls_only  # a forced tool call: only parsed calls are returned, never unclosed markup
        self.ids: list[int] = []
        self.text, self.sent = "", 0
        self.parsed = ParsedOutput()
        self.handle: Any = None
        self.done, self.stopped = False, False
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.calls_sent = 0
        self.submitted_at = 0.0  # for the metrics: submission, canvases seen, denoising steps spent
        self.canvases = self.steps = 0
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []  # (id, logprob, top) per token
        self.logprobs_sent = 0

    def on_canvas(self, tokens: list[int], logprobs: list[float] | None = None,
                  top: list[list[tuple[int, float]]] | None = None) -> list[tuple[str, Any]]:
        if logprobs is not None:
            self.logprobs += list(zip(tokens, logprobs, top or [[] for _ in tokens], strict=True))
        self.ids += tokens
        self.completion_tokens += len(tokens)
        return self._advance(self.decode(self.ids).rstrip("\ufffd"), final=False)

    def finish(self) -> list[tuple[str, Any]]:
        """The rest of the text once the engine is done with this choice (nothing more can follow)."""
        return self._advance(self.decode(self.ids), final=True) + self.close()

    def returned_tokens(self) -> int:
        """The tokens behind the text returned: every committed one, or where a stop string cut the text, the
        fewest whose text reaches the cut (usage counts what the client got, not the rest of the canvas)."""
        if not self.stopped:
            return self.completion_tokens
        lo, hi = 0, len(self.ids)
        while lo < hi:  # the text of a prefix of ids grows with it
            mid = (lo + hi) // 2
            if len(self.decode(self.ids[:mid]).rstrip("\ufffd")) >= self.sent:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def close(self) -> list[tuple[str, Any]]:
        """What the parser still holds (an unclosed span), once no more text will come."""
        if self.parser is None:
            return []
        tail = self._kept(self.parser.finish())
        self.parsed.add(tail)
        return tail

    def _advance(self, text: str, final: bool) -> list[tuple[str, Any]]:
        if self.stopped:
            return []
        self.text = text
        hits = [i for s in self.stop if (i := text.find(s, self.sent)) >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(text)
        else:
            end = len(text) - partial_suffix(text, self.stop)
        new = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        if self.parser is None:
            return [("content", new)] if new else []
        pieces = self._kept(self.parser.feed(new))
        self.parsed.add(pieces)
        return pieces

    def _kept(self, pieces: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The pieces returned: a forced call's output is its calls (the grammar writes nothing else; what does not
        parse is a call the budget or a stop string cut, markup that is no answer)."""
        return [p for p in pieces if p[0] == "tool_call"] if self.calls_only else pieces
