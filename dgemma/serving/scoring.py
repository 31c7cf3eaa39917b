"""Scoring a prompt on /v1/completions (`echo: true`, `max_tokens: 0`, docs/serving.md "Scoring a continuation"): each
prompt token's NELBO term (`likelihood.score_continuation` with an empty context), returned in the completions
endpoint's `logprobs` shape with `token_logprobs` = minus the terms, so that a sum over any run of tokens ending the
prompt is a lower bound on their log-probability given the tokens before them.

It runs on a worker thread, straight on the engine's model and beside the engine's loop: the forward is a pure
function of the weights (no KV cache, no module state written, no gradient), which PyTorch runs safely alongside
the engine's own passes on CPU and CUDA. One scoring pass runs at a time (`_ONE_AT_A_TIME`), so scoring requests
share the device with generation rather than crowd it. A request naming one of the engine's LoRA adapters is scored
with it (its rows' deltas are an argument of the pass, dgemma/weights/adapters.py, not a state of the model). Not safe
with a model whose forward moves state (CUDA expert offload's fetch/evict): such a model must score on the engine's
thread.
"""

from __future__ import annotations

import itertools
import math
import secrets
import threading
import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from dgemma.diffusion.likelihood import score_continuation
from dgemma.serving.api import GenerationRequest
from dgemma.serving.errors import APIError
from dgemma.weights.offload import offloaded_to

_ONE_AT_A_TIME = threading.Lock()
NOTE = ("token_logprobs are minus per-token NELBO terms (nats) of a block-diffusion model, not log-probabilities: "
        "summed over the tokens that end a prompt, they are a lower bound on the log-probability of those tokens "
        "given the rest; each canvas of the prompt (from its first token) is bounded given the canvases before it")


class ScoringRun:
    """An echo + max_tokens 0 request, answered in place of an engine run (`app._State.respond` calls `submit`,
    `complete`, `cancel`)."""

    def __init__(self, state: Any, req: GenerationRequest, request: Any, adapter: str | None = None):
        self.state, self.req, self.adapter = state, req, adapter
        self.id, self.created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        self.started = time.perf_counter()

    def submit(self) -> None:
        """No engine request (`complete` scores on a worker thread); refused where that would not be safe."""
        if offloaded_to(self.state.engine.model):
            raise APIError("echo: scoring is not available on a server with offloaded experts (--offload-experts: "
                           "the engine's passes move the expert weights while a scoring pass would read them)",
                           param="echo")

    def cancel(self) -> None:
        pass  # a scoring pass is not interrupted; its result is dropped

    def _score(self) -> list[list[float]]:
        engine, s, name = self.state.engine, self.req.scoring, self.adapter
        adapters = None if name is None else lambda rows: engine.adapters.rows([name] * rows)
        with _ONE_AT_A_TIME:
            try:
                terms = [score_continuation(engine.model, [], p, num_steps=s.num_steps, num_t_samples=s.num_t_samples,
                                            seed=s.seed, adapters=adapters).tolist() for p in self.req.prompts]
            except ValueError as e:  # a prompt longer than the model's positions, ids outside the vocabulary
                raise APIError(f"prompt: {e}", param="prompt") from None
        bad = [i for i, t in enumerate(terms) if not all(map(math.isfinite, t))]
        if bad:  # JSON has no inf or NaN: the one number the response would carry wrong is an error instead
            whose = "the model's" if name is None else f"adapter {name!r}'s"
            raise APIError(f"echo: scoring prompt(s) {bad[:8]} gave non-finite NELBO terms: {whose} weights or "
                           "activations hold NaN or inf", param=None if name is None else "model",
                           status=500 if name is None else 400,
                           type="server_error" if name is None else "invalid_request_error")
        return terms

    async def complete(self) -> dict[str, Any]:
        terms = await run_in_threadpool(self._score)
        piece, decode = self.state.piece, self.state.decoder(())
        choices = []
        for i, (prompt, nats) in enumerate(zip(self.req.prompts, terms, strict=True)):
            logprobs = None
            if self.req.logprobs is not None:
                tokens = [piece(t) for t in prompt]
                offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=0))
                logprobs = {"tokens": tokens, "token_logprobs": [-x for x in nats], "top_logprobs": None,
                            "text_offset": offsets}
            choices.append({"index": i, "text": decode(prompt), "logprobs": logprobs, "finish_reason": "length",
                            "nelbo": sum(nats)})
        s, prompt_tokens = self.req.scoring, sum(len(p) for p in self.req.prompts)
        self.state.metrics.usage(prompt_tokens, 0)
        self.state.metrics.e2e.observe(time.perf_counter() - self.started)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.adapter or self.state.model_name,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                              "total_tokens": prompt_tokens},
                "scoring": {"bound": "nelbo", "nelbo_steps": "continuous" if s.num_steps is None else s.num_steps,
                            "nelbo_samples": s.num_t_samples, "seed": s.seed, "note": NOTE}}
