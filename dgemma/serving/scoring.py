"""Scoring a prompt on /v1/completions (`echo: true` with `max_tokens` 0 or 1, docs/serving.md "Scoring a prompt"),
answered in the completions endpoint's `logprobs` shape, as lm-eval's `local-completions` reads it:

- `token_logprobs`: for a diffusion model minus each prompt token's NELBO term (`likelihood.score_continuation` with
  an empty context), so that a sum over any run of tokens ending the prompt is a lower bound on their log-probability
  given the tokens before them (an upper bound on the NLL, not the NLL); for an autoregressive run (objective 'ar')
  the exact log p(token | the tokens before it), null for the first token (nothing before it).
- `top_logprobs` (with `logprobs` k >= 1): per position the k most likely ids of the model's distribution there (an
  AR run's next-token distribution; a diffusion model's denoising posterior at full noise,
  `likelihood.first_step_log_probs`), each valued by `alternatives`: the position's own value shifted by the log-odds
  of the alternative against the prompt's token. For an AR run these are exact log-probs; for a diffusion model they
  rank and space the alternatives in the units of the bound. Either way the largest equals the token's own value
  exactly when the token is the distribution's argmax, which is lm-eval's `is_greedy` check.
- with `max_tokens` 1, one more entry: the model's greedy next token after the whole prompt (the argmax of the AR
  next-token distribution; of a diffusion model's first-step posterior at the first position of a noisy canvas after
  the committed prompt, one forward, not the sampler's run), valued by its log-prob under that distribution.

It runs on a worker thread, straight on the engine's model and beside the engine's loop: the forward is a pure
function of the weights (no shared KV cache, no module state written, no gradient), which PyTorch runs safely
alongside the engine's own passes on CPU and CUDA. One scoring pass runs at a time (`_ONE_AT_A_TIME`), so scoring
requests share the device with generation rather than crowd it. A request naming one of the engine's LoRA adapters is
scored with it (its rows' deltas are an argument of the pass, dgemma/weights/adapters.py, not a state of the model).
Not safe with a model whose forward moves state (CUDA expert offload's fetch/evict): such a model must score on the
engine's thread.
"""

from __future__ import annotations

import itertools
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from starlette.concurrency import run_in_threadpool
from torch import Tensor

from dgemma.diffusion.likelihood import first_step_log_probs, score_continuation
from dgemma.serving.api import GenerationRequest
from dgemma.serving.errors import APIError
from dgemma.weights.offload import offloaded_to

_ONE_AT_A_TIME = threading.Lock()
NOTE = ("token_logprobs are minus per-token NELBO terms (nats) of a block-diffusion model, not log-probabilities: "
        "summed over the tokens that end a prompt, they are a lower bound on the log-probability of those tokens "
        "given the rest; each canvas of the prompt (from its first token) is bounded given the canvases before it. "
        "top_logprobs rank the model's denoising posterior at full noise, shifted to the token's own term")
AR_NOTE = ("token_logprobs are exact log-probabilities of an autoregressive model (each token given the tokens before "
           "it; null for the first); top_logprobs are its next-token log-probabilities")

Alternatives = list[tuple[int, float]]


def alternatives(row: Tensor, token: int, value: float, k: int) -> Alternatives:
    """The k most likely ids of `row` (V,) log-probs, each valued `value + row[j] - row[token]`: the position's own
    value shifted by the log-odds of j against `token`. With value = row[token] (an AR model's exact log-prob, or the
    appended greedy token's) these are row's own values, exactly; with a diffusion model's bound term they are in the
    bound's units. The largest equals `value` exactly when `token` is row's argmax (lm-eval's is_greedy)."""
    top = torch.topk(row, k)
    own = float(row[token])
    return [(j, value if j == token else value + (v - own)) for v, j in zip(top.values.tolist(),
                                                                           top.indices.tolist(), strict=True)]


@dataclass
class Scored:
    """One prompt's answer: `values` (token_logprobs, None where there is none), `top` (per position, None without
    `logprobs` k >= 1), the appended greedy token (`next`: id, value, alternatives) and the NELBO (diffusion)."""

    values: list[float | None]
    top: list[Alternatives | None] | None
    next: tuple[int, float, Alternatives | None] | None
    nelbo: float | None


def ar_log_probs(model: Any, ids: list[int]) -> Tensor:
    """An autoregressive run's next-token log-probs after each prefix of `ids`, (N, V) float32: row i is
    log p(. | ids[:i + 1]), from the causal encoder pass its decoding runs (`next_token_logits`, a fresh cache)."""
    if len(ids) > model.config.max_position_embeddings:
        raise ValueError(f"{len(ids)} tokens exceed the model's {model.config.max_position_embeddings} positions")
    logits = model.next_token_logits(torch.as_tensor(ids, device=model.device)[None], model.new_cache(1, len(ids)))
    return torch.log_softmax(logits[0].float(), dim=-1)


class ScoringRun:
    """An echo + max_tokens 0 or 1 request, answered in place of an engine run (`app._State.respond` calls `submit`,
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
        if self.state.autoregressive and self.adapter is not None:
            raise APIError(f"model: {self.adapter!r} is a LoRA adapter of an autoregressive run; scoring an AR run "
                           "takes the base model only", param="model")

    def cancel(self) -> None:
        pass  # a scoring pass is not interrupted; its result is dropped

    def _score_one(self, prompt: list[int]) -> Scored:
        engine, s, k = self.state.engine, self.req.scoring, self.req.logprobs or 0
        adapters = None if self.adapter is None else lambda rows: engine.adapters.rows([self.adapter] * rows)
        model = engine.model
        if self.state.autoregressive:
            rows = ar_log_probs(model, prompt)
            values: list[float | None] = [None, *(float(rows[i - 1, t]) for i, t in enumerate(prompt) if i)]
            top = [None, *(alternatives(rows[i - 1], t, values[i], k) for i, t in enumerate(prompt) if i)] \
                if k else None
            after, nelbo = rows[-1], None
        else:
            terms = score_continuation(model, [], prompt, num_steps=s.num_steps, num_t_samples=s.num_t_samples,
                                       seed=s.seed, adapters=adapters)
            values, nelbo = [-float(x) for x in terms], float(terms.sum())
            top = None
            if k:
                rows = first_step_log_probs(model, [], prompt, seed=s.seed, adapters=adapters)
                top = [alternatives(rows[i], t, values[i], k) for i, t in enumerate(prompt)]
            after = first_step_log_probs(model, prompt, [0], seed=s.seed, adapters=adapters)[0] \
                if s.next_token else None
        nxt = None
        if s.next_token:
            j = int(after.argmax())
            nxt = (j, float(after[j]), alternatives(after, j, float(after[j]), k) if k else None)
        return Scored(values, top, nxt, nelbo)

    def _score(self) -> list[Scored]:
        with _ONE_AT_A_TIME, torch.no_grad():
            try:
                scored = [self._score_one(p) for p in self.req.prompts]
            except ValueError as e:  # a prompt longer than the model's positions, ids outside the vocabulary
                room = " and, with max_tokens 1, one canvas after it" if self.req.scoring.next_token else ""
                raise APIError(f"prompt: {e} (scoring needs the prompt{room} within the model's positions)",
                               param="prompt") from None
        bad = [i for i, x in enumerate(scored) if not all(map(math.isfinite, _numbers(x)))]
        if bad:  # JSON has no inf or NaN: the one number the response would carry wrong is an error instead
            whose = "the model's" if self.adapter is None else f"adapter {self.adapter!r}'s"
            raise APIError(f"echo: scoring prompt(s) {bad[:8]} gave non-finite scores: {whose} weights or "
                           "activations hold NaN or inf", param=None if self.adapter is None else "model",
                           status=500 if self.adapter is None else 400,
                           type="server_error" if self.adapter is None else "invalid_request_error")
        return scored

    async def complete(self) -> dict[str, Any]:
        scored = await run_in_threadpool(self._score)
        piece, decode, k = self.state.piece, self.state.decoder(()), self.req.logprobs
        choices = []
        for i, (prompt, x) in enumerate(zip(self.req.prompts, scored, strict=True)):
            ids, values, top = list(prompt), list(x.values), x.top
            if x.next is not None:
                ids.append(x.next[0])
                values.append(x.next[1])
                top = None if top is None else [*top, x.next[2]]
            logprobs = None
            if k is not None:
                tokens = [piece(t) for t in ids]
                offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
                logprobs = {"tokens": tokens, "token_logprobs": values, "text_offset": offsets,
                            "top_logprobs": None if top is None else
                            [None if alts is None else _by_text(alts, piece) for alts in top]}
            choice = {"index": i, "text": decode(ids), "logprobs": logprobs, "finish_reason": "length"}
            choices.append(choice if x.nelbo is None else choice | {"nelbo": x.nelbo})
        s, prompt_tokens = self.req.scoring, sum(len(p) for p in self.req.prompts)
        completion_tokens = len(self.req.prompts) if s.next_token else 0
        self.state.metrics.usage(prompt_tokens, completion_tokens)
        self.state.metrics.e2e.observe(time.perf_counter() - self.started)
        scoring = {"bound": "exact", "note": AR_NOTE} if self.state.autoregressive else \
            {"bound": "nelbo", "nelbo_steps": "continuous" if s.num_steps is None else s.num_steps,
             "nelbo_samples": s.num_t_samples, "seed": s.seed, "note": NOTE}
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.adapter or self.state.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}, "scoring": scoring}


def _by_text(alts: Alternatives, piece: Any) -> dict[str, float]:
    """Alternatives as OpenAI's dict of decoded token -> value: ids that decode alike (the parts of one UTF-8
    character all show as U+FFFD) keep the largest value, so the dict's largest is the list's."""
    out: dict[str, float] = {}
    for j, v in alts:  # largest first
        out.setdefault(piece(j), v)
    return out


def _numbers(x: Scored) -> list[float]:
    """Every number of one prompt's answer (the finiteness check's)."""
    out = [v for v in x.values if v is not None] + ([] if x.nelbo is None else [x.nelbo])
    out += [v for alts in x.top or () if alts is not None for _, v in alts]
    if x.next is not None:
        out += [x.next[1], *(v for _, v in x.next[2] or ())]
    return out
