"""Grammar work off the engine thread: the sampler steps of requests with a grammar (response_format, a forced
tool_choice; dgemma/sampling/constraint.py) run on a small pool of worker threads, so a grammar that is slow to mask
holds its own row only. The engine hands a row's logits over (`submit`), leaves the row out of its batched passes while
the step runs (`busy`), and takes the result back between passes (`done`): the staged canvas and its log-probabilities
when the step finished it (its grammar already advanced over it), else None.

Each step's grammar work has a budget (`step_seconds`, GRAMMAR_STEP_SECONDS by default): past it, or once its
request is cancelled, the row's grammar stops (`ConstraintState.failed`), the rest of its canvas is EOS and the
engine ends the request with finish_reason "length" (docs/serving.md, "Structured output").
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

GRAMMAR_STEP_SECONDS = 2.0  # the grammar work one denoising step of one request may take
GRAMMAR_THREADS = 2  # worker threads (the masks are mostly Python between llguidance calls)
log = logging.getLogger(__name__)


@torch.no_grad()
def _step(sampler: Any, out: Any, logits: Any, rid: int, logprobs: int | None) -> Any:
    """One sampler step (on a worker; dgemma/sampling/sampler.py:Sampler). If it finished the canvas: (the staged
    canvas, its `sampler.logprobs` with `logprobs` alternatives or None), the grammar then advanced over it by the
    request's outer loop (`out`, dgemma/sampling/sequence.py:Sequences; the log-probabilities read the masks from the
    state before it); else None."""
    constraint = out.grammar
    failed = constraint.failed[0]
    try:
        if not sampler.step(logits):
            return None
        staged = sampler.staged()
        scores = None if logprobs is None else sampler.logprobs(staged.tokens, logprobs)
        out.advance_grammar(staged)
        return staged, scores
    finally:
        if failed is None and constraint.failed[0] not in (None, "cancelled"):
            log.warning("request %d: %s; it ends with finish_reason length", rid, constraint.failed[0])


class GrammarSteps:
    """The engine's pool for grammar-constrained sampler steps; `wake` is called (from a worker) when one ends."""

    def __init__(self, wake: Any, step_seconds: float = GRAMMAR_STEP_SECONDS, threads: int = GRAMMAR_THREADS):
        if not step_seconds > 0:
            raise ValueError(f"grammar_step_seconds must be > 0, got {step_seconds!r}")
        self.step_seconds = step_seconds
        self._wake = wake
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dgemma-grammar")
        self._running: dict[int, tuple[Any, Future]] = {}  # request id -> (request, its step); the engine thread's

    def submit(self, r: Any, logits: Any) -> None:
        """Run request `r`'s sampler step on `logits` on a worker, under the step budget and its cancel flag."""
        r.constraint.step_seconds, r.constraint.cancelled = self.step_seconds, r._cancelled.is_set
        future = self._pool.submit(_step, r.sampler, r.out, logits, r.id, r.logprobs)
        self._running[r.id] = (r, future)
        future.add_done_callback(lambda _: self._wake())

    def busy(self, r: Any) -> bool:
        return r.id in self._running

    def ready(self) -> bool:
        """Whether a step has ended that `done` has not handed back."""
        return any(f.done() for _, f in self._running.values())

    def done(self) -> list[tuple[Any, Any, str | None]]:
        """The steps that ended since the last call, of requests still running: (request, `_step`'s result, what
        went wrong: a GenerationError's message (non-finite logits), else the exception, or None)."""
        out = []
        for key, (r, future) in list(self._running.items()):
            if future.done():
                del self._running[key]
                e = future.exception()
                if not r.done:
                    out.append((r, None if e is not None else future.result(),
                                None if e is None else str(e) if isinstance(e, ValueError) else repr(e)))
        return out

    def close(self) -> None:
        """Stop: the steps running stop at their next position (their requests are cancelled), the queued never run."""
        for r, _ in list(self._running.values()):
            r._cancelled.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
