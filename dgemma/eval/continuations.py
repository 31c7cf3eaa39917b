"""Scoring continuations given contexts, for a batch of requests: lm-eval's `loglikelihood` (dgemma/eval/
lm_eval_model.py, docs/evaluation.md "lm-evaluation-harness").

    AR run           the exact log p(continuation | context): the sum of the causal forward's log-softmax at each
                     continuation token (`train.heldout.ar_token_scores`); is_greedy: every continuation token is the
                     argmax of its next-token distribution
    diffusion run    minus the continuation's NELBO given the committed context (`likelihood.score_continuation`):
                     a LOWER bound on log p(continuation | context) (the NELBO is an upper bound on the NLL), a Monte
                     Carlo estimate over t and x_t; `mc_replicates` R > 1 averages R independent estimates (each
                     from its own seed) and reports their standard error; is_greedy: every continuation token is the
                     argmax of the denoising posterior p(x0 | x_1) at its position, its canvas at pure noise given the
                     context and the clean canvases before (`likelihood.greedy_continuation`)

Each request's Monte Carlo draws come from a seed that is a hash of (seed, replicate, context, continuation): a
request scores the same whatever batch or order it comes in, and two replicates never share draws. The pure noise
behind is_greedy is drawn from (seed, context) alone: every choice of a multiple-choice question is judged against
the same x_1.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dgemma.diffusion.likelihood import first_step_log_probs, greedy_continuation, score_continuation
from dgemma.train.heldout import ar_token_scores

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


@dataclass(frozen=True)
class ContinuationScore:
    """One continuation's score: `logprob` (nats) is exact for an AR run, and for a diffusion run minus its NELBO (a
    lower bound on the log-probability, averaged over `replicates` Monte Carlo estimates, `mc_se` their standard
    error, None for one)."""

    logprob: float
    is_greedy: bool
    tokens: int
    exact: bool
    mc_se: float | None = None
    replicates: int = 1


def request_seed(seed: int, replicate: int, context: Sequence[int], continuation: Sequence[int]) -> int:
    """The Monte Carlo seed of one replicate of one request: a hash of the seed, the replicate and the tokens."""
    key = f"{seed}|{replicate}|{','.join(map(str, context))}|{','.join(map(str, continuation))}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def fit_context(context: Sequence[int], continuation_len: int, positions: int) -> list[int]:
    """The context cut from the left so that context + continuation fit in `positions` (the newest tokens kept)."""
    room = positions - continuation_len
    if room < 0:
        raise ValueError(f"continuation: {continuation_len} tokens exceed the window of {positions} tokens")
    return list(context)[max(0, len(context) - room):]


@torch.no_grad()
def score_ar(model: Any, requests: Sequence[Request], *, batch_size: int = 8) -> list[ContinuationScore]:
    """Exact scores of an AR run: requests batched `batch_size` rows at a time (right-padded; the causal mask keeps a
    row's scores independent of its padding). A context must hold at least one token (lm-eval gives the BOS/EOS
    token for an empty one); a context too long for the model's positions is cut from the left."""
    positions = model.config.max_position_embeddings
    rows = []
    for context, continuation in requests:
        if not continuation:
            raise ValueError("continuation: nothing to score (no tokens)")
        if not context:
            raise ValueError("context: an AR model scores a continuation given at least one context token")
        ctx = fit_context(context, len(continuation), positions + 1)  # the last token is never an input
        if not ctx:
            raise ValueError(f"continuation: {len(continuation)} tokens leave no room for context in the model's "
                             f"{positions} positions")
        rows.append((ctx, list(continuation)))
    out: list[ContinuationScore] = []
    for lo in range(0, len(rows), batch_size):
        chunk = rows[lo:lo + batch_size]
        width = max(len(c) + len(x) for c, x in chunk)
        x = torch.zeros(len(chunk), width, dtype=torch.long, device=model.device)
        for i, (c, y) in enumerate(chunk):
            x[i, :len(c) + len(y)] = torch.tensor(c + y, dtype=torch.long)
        nll, greedy = ar_token_scores(model, x)
        for i, (c, y) in enumerate(chunk):
            sl = slice(len(c) - 1, len(c) - 1 + len(y))  # position j predicts token j + 1
            out.append(ContinuationScore(-float(nll[i, sl].double().sum()), bool(greedy[i, sl].all()), len(y),
                                         exact=True))
    return out


BOUNDS = ("continuation", "prompt")  # what score_diffusion bounds (see there)


@torch.no_grad()
def score_diffusion(model: Any, requests: Sequence[Request], *, num_steps: int | None, num_t_samples: int,
                    mc_replicates: int = 1, seed: int = 0, bound: str = "continuation") -> list[ContinuationScore]:
    """Bounds of a diffusion run, one request at a time, averaged over `mc_replicates` independent estimates, with
    their standard error (T = `num_steps`, None for the continuous-time bound, `num_t_samples` stratified t per
    canvas). A context too long for the model's positions is cut from the left.

    bound="continuation": minus the NELBO of the continuation given the committed context (`score_continuation`
    with the context; canvases start right after it, as generation cuts them), draws seeded per request
    (`request_seed`); is_greedy: `greedy_continuation` given the context.
    bound="prompt": what `dgemma serve` answers lm-eval's `local-completions` (which sends context and continuation
    as one prompt): context + continuation bounded canvas by canvas from its first token (`score_continuation` with
    an empty context) and the continuation's terms summed, each replicate r drawing from seed + r, the same for
    every request (r = 0: the server's `seed`); is_greedy: the argmax of `first_step_log_probs` over the whole
    prompt at the continuation's positions (the server's top_logprobs). Also a lower bound on log p(continuation |
    context), usually a looser one (the context's canvases are bounded rather than committed)."""
    if mc_replicates < 1:
        raise ValueError(f"mc_replicates must be >= 1, got {mc_replicates}")
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
    cfg = model.config
    L = cfg.canvas_length
    out = []
    for context, continuation in requests:
        n = len(continuation)
        if n == 0:
            raise ValueError("continuation: nothing to score (no tokens)")
        if bound == "prompt":
            ctx = fit_context(context, n, cfg.max_position_embeddings // L * L)
            whole = [*ctx, *continuation]
            nats = [float(score_continuation(model, [], whole, num_steps=num_steps, num_t_samples=num_t_samples,
                                             seed=seed + r)[len(ctx):].sum()) for r in range(mc_replicates)]
            rows = first_step_log_probs(model, [], whole, seed=seed)[len(ctx):]
            greedy = (rows.argmax(-1).cpu() == torch.as_tensor(list(continuation)))
        else:
            ctx = fit_context(context, -(-n // L) * L, cfg.max_position_embeddings)
            nats = [float(score_continuation(model, ctx, continuation, num_steps=num_steps,
                                             num_t_samples=num_t_samples,
                                             seed=request_seed(seed, r, ctx, continuation)).sum())
                    for r in range(mc_replicates)]
            greedy = greedy_continuation(model, ctx, continuation, seed=request_seed(seed, -1, ctx, ()))
        mean = sum(nats) / len(nats)
        se = None if len(nats) < 2 else math.sqrt(sum((v - mean) ** 2 for v in nats) / (len(nats) - 1) / len(nats))
        out.append(ContinuationScore(-mean, bool(greedy.all()), n, exact=False, mc_se=se, replicates=len(nats)))
    return out


__all__ = ["BOUNDS", "ContinuationScore", "Request", "fit_context", "request_seed", "score_ar", "score_diffusion"]
