"""The sampler's rules as pure functions on logits and canvases (no model, no cache).

The entropy-bound sampler (DiffusionGemma, transformers' `EntropyBoundSampler`), one denoising step:

    T      = t_min + (t_max - t_min) * n / N          n = steps remaining: N at the first step, 1 at the last
    z      = logits / T                               the "processed" logits: everything below reads these
    x_hat  ~ softmax(z)                               one draw per position
    H_i    = entropy(softmax(z_i))
    accept the lowest-entropy positions while  sum(accepted H) - max(accepted H) <= entropy_bound
    canvas = where(accepted, x_hat, uniform)          every other position is redrawn uniformly (memoryless)
    stop   when argmax(z) is unchanged for `stability_threshold` steps and mean(H) < confidence_threshold

The Lite sampler (seed 003, section 4) shares the step but commits positions monotonically: a position may freeze
once its posterior mode is unchanged or its confidence did not drop (the seed's test), and is never redrawn after
that. `lite_commit="scheduled"` (the default) commits the most confident of those positions, at most enough to reach
ceil(L * k / N) committed after step k of N; `lite_commit="seed"` commits all of them at once, as seed 003 does.
Its entropy, confidence and self-conditioning read the raw posterior softmax(logits), not softmax(z) (seed 003,
4.2); the `posterior` switch chooses this for either sampler.

The ancestral chain (`ancestral_step`) draws each step from the model's reverse step; the predictor-corrector sampler
adds corrector passes that noise the canvas back up one level (`forward_noise`) and step down again.

Block refinement and confidence-threshold decoding (`threshold_commits`, `edits`) share the step too, and commit the
positions whose drawn token is more probable than `commit_threshold`, at least ceil(L * k / N) in all after step k
(block refinement) or one a step (confidence); committed tokens stay unless `edits` replaces them.

A time-embedding model is told a noise level per row (`time_level`): by default the level consistent with what its
input canvas holds (`canvas_level` of the share carried over clean), or the seed's schedule n / N, or 1.

Bit-exactness with transformers rests on doing the same float operations in the same order (temperature as a
0-d fp32 tensor, Categorical's entropy formula) and drawing random numbers in the same order: per step one
multinomial over the (B*L, V) probabilities, then one (B, L) randint.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.diffusion.noise import alpha
from dgemma.sampling.generation_config import CHAINS, COMMITTING, GenerationConfig

ENTROPY_CHUNK_ROWS = 4096  # rows of (V,) logits per entropy chunk: bounds the extra memory to 2 x chunk x V fp32


def temperature(steps_remaining: int, num_steps: int, t_min: float, t_max: float, device: torch.device | None = None
                ) -> Tensor:
    """Linear schedule from t_max (first step) towards t_min, as a 0-d fp32 tensor. The last step uses
    t_min + (t_max - t_min) / N: the schedule never reaches t_min itself (as in the reference)."""
    n = torch.tensor(steps_remaining, dtype=torch.int32, device=device)
    return t_min + (t_max - t_min) * (n / num_steps)


def _row_chunks(rows: int, chunk_rows: int | None) -> list[tuple[int, int]]:
    """Row ranges of at most `chunk_rows` (default: at most half the rows, at most ENTROPY_CHUNK_ROWS), so that two
    chunk temporaries together never outgrow one (rows, V) tensor. No chunk has a single row unless there is only
    one (torch sums a lone row in a different order than the same row in a block)."""
    if chunk_rows is None:
        chunk_rows = min(ENTROPY_CHUNK_ROWS, max(2, -(-rows // 2)))
    bounds = [*range(0, rows, chunk_rows), rows]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(itertools.pairwise(bounds))


def token_entropy(logits: Tensor, chunk_rows: int | None = None) -> Tensor:
    """Entropy (nats) of softmax(logits) per position: (..., V) -> (...) fp32, in row chunks (`_row_chunks`).
    Same formula and bits as torch.distributions.Categorical."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for lo, hi in _row_chunks(flat.shape[0], chunk_rows):
        z = flat[lo:hi]
        logp = z - z.logsumexp(dim=-1, keepdim=True)
        p = torch.softmax(logp, dim=-1)
        out[lo:hi] = -logp.clamp_(min=torch.finfo(logp.dtype).min).mul_(p).sum(-1)  # in place: 2 chunk temporaries
        del logp, p
    return out.view(logits.shape[:-1])


def max_probability(logits: Tensor, chunk_rows: int | None = None) -> Tensor:
    """The confidence max_v softmax(logits)_v per position: (..., V) -> (...) fp32, in row chunks."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for lo, hi in _row_chunks(flat.shape[0], chunk_rows):
        out[lo:hi] = torch.softmax(flat[lo:hi], dim=-1, dtype=torch.float32).amax(-1)
    return out.view(logits.shape[:-1])


def accept_by_entropy(entropy: Tensor, entropy_bound: float) -> Tensor:
    """Accept the k lowest-entropy positions with sum(H_1..H_k) - H_k <= entropy_bound (H sorted ascending), an
    upper bound on the accepted tokens' joint mutual information (arXiv:2505.24857). (B, L) -> bool (B, L); the
    lowest-entropy position is always accepted."""
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
    keep_sorted = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= entropy_bound
    return torch.scatter(torch.zeros_like(keep_sorted), -1, order, keep_sorted)


def draw_tokens(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One categorical draw per position: (B, L, V) probabilities -> (B, L) token ids."""
    B, L, V = probs.shape
    return torch.multinomial(probs.view(-1, V), 1, generator=generator).view(B, L)


def uniform_tokens(shape: tuple[int, int], vocab_size: int, device: torch.device,
                   generator: torch.Generator | None = None) -> Tensor:
    """Uniform noise over the whole vocabulary: the uniform-state prior (no mask token)."""
    return torch.randint(0, vocab_size, shape, device=device, generator=generator)


def renoise(canvas: Tensor, keep: Tensor, vocab_size: int, generator: torch.Generator | None = None) -> Tensor:
    """Keep `canvas` where `keep`, draw every other position uniformly afresh."""
    return torch.where(keep, canvas, uniform_tokens(canvas.shape, vocab_size, canvas.device, generator))


def forward_noise(x: Tensor, level: float, next_level: float, vocab_size: int,
                  generator: torch.Generator | None = None) -> Tensor:
    """A draw of the forward process from level `level` to the noisier `next_level`, (B, L): each token kept with
    probability alpha(next_level) / alpha(level), else drawn uniformly (q(x_{s2} | x_s) of uniform-state diffusion;
    dgemma/diffusion/noise.py:alpha). The predictor-corrector sampler's corrector noises x_{s'} up to s with it and
    steps down again with `ancestral_step`: for the exact posterior that pair leaves the law of x_{s'} unchanged (a
    forward-backward corrector, as in Campbell et al. 2022's predictor-corrector for discrete diffusion)."""
    keep = float(alpha(torch.tensor(next_level), torch.float64) / alpha(torch.tensor(level), torch.float64))
    stays = torch.rand(x.shape, device=x.device, generator=generator) < keep
    return renoise(x, stays, vocab_size, generator)


def is_stable(history: Tensor | None, argmax: Tensor, threshold: int) -> tuple[Tensor, Tensor | None]:
    """Whether `argmax` (B, L) equals each of the last `threshold` argmax canvases, and the updated history
    (threshold, B, L). The history starts at -1, so the first step of a canvas is never stable."""
    if threshold == 0:
        return torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device), None
    if history is None:
        history = torch.full((threshold, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device)
    stable = (history == argmax[None]).all(dim=-1).all(dim=0)
    history = torch.roll(history, shifts=-1, dims=0)
    history[-1] = argmax
    return stable, history


def lite_candidates(argmax: Tensor, confidence: Tensor, prev_argmax: Tensor, prev_confidence: Tensor,
                    committed: Tensor) -> Tensor:
    """Seed 003's unchanged-or-stronger test, (B, L) bool: positions not committed yet whose posterior mode is
    unchanged from the previous step or whose confidence did not drop."""
    return ((argmax == prev_argmax) | (confidence >= prev_confidence)) & ~committed


def commit_quota(committed: Tensor, step: int, num_steps: int) -> Tensor:
    """How many more positions each row may commit at `step` (1-based) of `num_steps`, (B,) long: enough to reach
    ceil(L * step / num_steps) committed positions, so that the committed set grows about linearly and may be
    complete at the last step."""
    L = committed.shape[-1]
    target = -(-L * step // num_steps)
    return (target - committed.sum(-1)).clamp_(min=0)


def most_confident(candidates: Tensor, confidence: Tensor, quota: Tensor) -> Tensor:
    """The `quota` (B,) most confident of `candidates` (B, L) per row, (B, L) bool (ties: the lower position first;
    fewer where a row has fewer candidates)."""
    score = torch.where(candidates, confidence, -math.inf)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    rank = torch.argsort(order, dim=-1)  # each position's place in that order
    return candidates & (rank < quota[:, None])


def lite_commit(config: GenerationConfig, step: int, argmax: Tensor, confidence: Tensor, prev_argmax: Tensor,
                prev_confidence: Tensor, committed: Tensor) -> Tensor:
    """The positions that commit at `step` (1-based) of a Lite canvas, (B, L) bool; only positions not committed yet,
    so the committed set only grows. `config.lite_commit`: "scheduled" (default) the `most_confident` of seed
    003's `lite_candidates` within `commit_quota`; "seed" every candidate (seed 003: nearly every position commits
    at step 2, so an N-step schedule collapses to two; docs/sampling.md measures both)."""
    candidates = lite_candidates(argmax, confidence, prev_argmax, prev_confidence, committed)
    if config.lite_commit == "seed":
        return candidates
    return most_confident(candidates, confidence, commit_quota(committed, step, config.max_denoising_steps))


def threshold_commits(confidence: Tensor, committed: Tensor, threshold: float, quota: Tensor) -> Tensor:
    """The positions that commit at this step, (B, L) bool, only among those not committed yet: every one whose
    `confidence` (B, L) (the tempered probability of its drawn token) exceeds `threshold`, and at least the `quota`
    (B,) most confident of the rest (`most_confident`). Two samplers use it:

    block-refinement   quota = `commit_quota` (the committed set reaches L at the last step), as diffusers'
                       BlockRefinementScheduler in its uniform (no mask token) mode [D2]
    confidence         quota = 1: every position above the threshold, at least one a step; a canvas stops once all
                       are committed (Fast-dLLM's threshold parallel decoding [F1])"""
    open_ = ~committed
    return (open_ & (confidence > threshold)) | most_confident(open_, confidence, quota)


def edits(draw: Tensor, canvas: Tensor, committed: Tensor, confidence: Tensor, threshold: float | None) -> Tensor:
    """Committed positions whose new draw differs from the committed token with `confidence` above `threshold`, (B, L)
    bool: block refinement's editing [D2], which lets a committed token change when the model is sure of another;
    none when `threshold` is None (editing off)."""
    if threshold is None:
        return torch.zeros_like(committed)
    return committed & (draw != canvas) & (confidence > threshold)


def canvas_level(clean_share: Tensor) -> Tensor:
    """The noise level s in [0, 1] consistent with a canvas of which the share `clean_share` (...) of positions is
    clean and the rest fresh uniform noise, (...) fp32. The forward process keeps a token with probability
    alpha(s) = cos^2(pi/2 * s) (dgemma/diffusion/noise.py:alpha) and otherwise draws it uniformly, so such a canvas
    is a draw at alpha(s) = a: s = (2 / pi) * arccos(sqrt(a)). a = 0 (pure noise) gives 1, a = 1 gives 0."""
    return torch.arccos(clean_share.double().clamp(0, 1).sqrt()).mul_(2 / math.pi).float()


def time_level(config: GenerationConfig, clean_share: Tensor, steps_remaining: int, num_steps: int) -> Tensor:
    """The noise level of a step's input canvas, per row (B,) fp32: what a time-embedding model is told.
    `config.time_level`: "canvas" (default) `canvas_level` of `clean_share` (B,), the share of positions the
    previous step accepted or committed (every other position is fresh noise; 0 at a canvas's first step);
    "schedule" the seed's n / N (n = steps remaining), which tells late canvases they are nearly clean when they are
    mostly noise, so the model copies the noise into its prediction; "noise" always 1 (every canvas treated as pure
    noise: the model copies almost none of it, but it also discounts what the canvas holds). docs/sampling.md
    measures the three."""
    if config.time_level == "schedule" or config.sampler in CHAINS:  # the chain's canvas is a draw at n / N (a
        # predictor-corrector's corrector passes set their own level)
        return torch.full(clean_share.shape, steps_remaining / num_steps, dtype=torch.float32,
                          device=clean_share.device)
    if config.time_level == "noise":
        return torch.ones(clean_share.shape, dtype=torch.float32, device=clean_share.device)
    return canvas_level(clean_share)


@dataclass
class StopState:
    """What the stop rules remember across the steps of one canvas."""

    history: Tensor | None = None  # entropy-bound/hf: the last `stability_threshold` argmax canvases
    calm_steps: Tensor | None = None  # lite: consecutive steps with mean entropy under the threshold


def stop_rows(config: GenerationConfig, state: StopState, argmax: Tensor, input_canvas: Tensor,
              mean_entropy: Tensor, committed: Tensor | None = None) -> Tensor:
    """Which rows stop after this step, (B,) bool; updates `state`. The rule follows `config`:
    entropy-bound, stop_rule "hf"    argmax stable over `stability_threshold` steps and mean(H) < threshold
    entropy-bound, stop_rule "jax"   argmax == the step's input canvas and mean(H) <= threshold
    lite, adaptive                   mean(H) < threshold for `stability_steps` steps in a row (seed 003, 4.4)
    lite, not adaptive               never (the fixed schedule)
    ancestral                        never (the chain runs its N steps to s = 0)
    confidence, block-refinement     every position committed (`committed` (B, L): the step's committed set)"""
    if config.sampler in COMMITTING:
        assert committed is not None, "the committing samplers stop on their committed set"
        return committed.all(-1)
    if config.sampler in CHAINS:  # the chain runs to s = 0: stopping early would commit noise
        return torch.zeros_like(mean_entropy, dtype=torch.bool)
    if config.sampler == "lite":
        if not config.adaptive:  # the fixed schedule: entropy is never consulted
            return torch.zeros_like(mean_entropy, dtype=torch.bool)
        calm = mean_entropy < config.confidence_threshold
        prev = state.calm_steps if state.calm_steps is not None else torch.zeros_like(calm, dtype=torch.long)
        state.calm_steps = torch.where(calm, prev + 1, 0)
        return state.calm_steps >= config.stability_steps
    if config.stop_rule == "jax":  # the prediction reproduces the canvas it was given, and is confident
        return (argmax == input_canvas).all(-1) & (mean_entropy <= config.confidence_threshold)
    stable, state.history = is_stable(state.history, argmax, config.stability_threshold)
    return stable & (mean_entropy < config.confidence_threshold)


def ancestral_step(z: Tensor, x: Tensor, level: float, next_level: float) -> Tensor:
    """The ancestral chain's step (B, L, V) probabilities of x_{s'} given x_s = `x` (B, L) for s = `level` >
    s' = `next_level`, from the posterior logits `z` (B, L, V) of p(x0 | x_s): the mixture sum_k p(k | x_s)
    q(x_{s'} | x_s, x0 = k), the reverse model whose NELBO dgemma/diffusion/likelihood.py computes. With w_k = p_k /
    q(x_s | k) and S = sum_k w_k, p(x_{s'} = j | x_s) is proportional to q(x_s | x_{s'} = j) (alpha' w_j + (1 - alpha')
    / V S); at s' = 0 it is p(x0 | x_s). O(V) per position, in float32 logs."""
    V = z.shape[-1]
    a = float(alpha(torch.tensor(level), torch.float64))
    a2 = float(alpha(torch.tensor(next_level), torch.float64))
    if a2 >= 1:  # the last step: x0 itself
        return torch.softmax(z.float(), dim=-1)
    at_x = torch.nn.functional.one_hot(x, V).bool()
    log_w = torch.log_softmax(z.float(), dim=-1) - torch.where(at_x, math.log(a + (1 - a) / V), math.log((1 - a) / V))
    step = a / a2  # the forward keep probability from s' to s
    log_back = torch.where(at_x, math.log(step + (1 - step) / V), math.log((1 - step) / V))  # q(x_s | x_{s'} = j)
    log_mix = torch.logaddexp(math.log(a2) + log_w, math.log((1 - a2) / V) + torch.logsumexp(log_w, -1, keepdim=True))
    return torch.softmax(log_back + log_mix, dim=-1)


# --- sampling controls (GenerationConfig.top_k ... logit_bias; docs/sampling.md, "Sampling controls") -------------

@dataclass
class Seen:
    """What the penalties count, per row (B, V): the prompt's tokens (for `repetition_penalty`) and how often each
    token occurs in the output committed so far (all three penalties). `add` counts a committed canvas."""

    prompt: Tensor  # (B, V) bool
    output: Tensor  # (B, V) float32 counts

    @classmethod
    def of(cls, prompts: Tensor, vocab_size: int, mask: Tensor | None = None) -> Seen:
        """From prompts (B, T) (`mask` (B, T): 1 where a token is real, 0 at left padding)."""
        B = prompts.shape[0]
        present = torch.ones_like(prompts, dtype=torch.float32) if mask is None else mask.float()
        seen = torch.zeros(B, vocab_size, device=prompts.device).scatter_add_(1, prompts, present) > 0
        return cls(seen, torch.zeros(B, vocab_size, device=prompts.device))

    def add(self, tokens: Tensor, rows: Tensor | None = None) -> None:
        """Count a committed canvas (B, L) of the rows `rows` (B,) bool (default: all)."""
        ones = torch.ones_like(tokens, dtype=torch.float32)
        if rows is not None:
            ones *= rows[:, None].float()
        self.output.scatter_add_(1, tokens, ones)


def penalize(logits: Tensor, config: GenerationConfig, seen: Seen, canvas: Tensor, carried: Tensor) -> None:
    """The penalties and the bias on one step's logits (B, L, V), in place, as vLLM orders them: repetition, then
    presence and frequency, then logit_bias. What they count is the output committed so far (`seen`) plus the tokens
    the step's input canvas (B, L) carries over (`carried` (B, L) bool), each position's own token excepted: a
    token a canvas has settled on is not pushed off its own position. `repetition_penalty` also counts the prompt:
    a logit > 0 is divided by it, one < 0 multiplied (CTRL's rule, as transformers and vLLM)."""
    own = carried.float()
    counts = seen.output.scatter_add(1, canvas, own)  # (B, V)
    c_own = counts.gather(1, canvas)  # (B, L): how often each position's own token occurs
    index = canvas[..., None]
    if config.repetition_penalty != 1:
        r = config.repetition_penalty
        before = logits.gather(2, index)
        hit = (seen.prompt | (counts > 0))[:, None, :]
        logits.copy_(torch.where(hit, torch.where(logits > 0, logits / r, logits * r), logits))
        only_itself = carried & ~seen.prompt.gather(1, canvas) & (c_own - own == 0)
        logits.scatter_(2, index, torch.where(only_itself[..., None], before, logits.gather(2, index)))
    if config.presence_penalty or config.frequency_penalty:
        p, f = config.presence_penalty, config.frequency_penalty
        logits.sub_((p * (counts > 0).float() + f * counts)[:, None, :])
        back = f * own + p * ((c_own > 0).float() - (c_own - own > 0).float())  # the position's own occurrence
        logits.scatter_add_(2, index, back[..., None])
    if config.logit_bias:
        ids = torch.tensor([i for i, _ in config.logit_bias], device=logits.device)
        bias = torch.tensor([b for _, b in config.logit_bias], dtype=logits.dtype, device=logits.device)
        logits[..., ids] += bias


def filter_tokens(z: Tensor, config: GenerationConfig) -> None:
    """top_k, top_p and min_p on one step's tempered logits (B, L, V), in place: the cut tokens become -inf, so the
    draw, the argmax, the entropy and the next step's self-conditioning all read the filtered distribution (the
    most probable token always stays). Ties at the k-th logit are kept, as transformers does."""
    V = z.shape[-1]
    if 0 < config.top_k < V:
        z.masked_fill_(z < z.topk(config.top_k, dim=-1).values[..., -1:], -torch.inf)
    if config.top_p < 1:
        sorted_z, order = z.sort(dim=-1, descending=True)
        p = torch.softmax(sorted_z, dim=-1)
        beyond = p.cumsum(-1) - p >= config.top_p  # the mass before a token already reaches top_p
        beyond[..., 0] = False  # the most probable token stays, whatever top_p is (1e-300 is 0 in float32)
        z.masked_fill_(torch.zeros_like(beyond).scatter_(-1, order, beyond), -torch.inf)
        del sorted_z, order, p, beyond
    if config.min_p > 0:
        p = torch.softmax(z, dim=-1)
        z.masked_fill_(p < config.min_p * p.amax(-1, keepdim=True), -torch.inf)


LOGPROB_FLOOR = -9999.0  # the least log-probability reported (vLLM's floor in its OpenAI server): never -inf


def token_logprobs(z: Tensor, tokens: Tensor, top: int = 0
                   ) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
    """What committed tokens' log-probabilities are (the server's `logprobs`), per row: log softmax of the
    distribution the last denoising step read, `z` (B, L, V) (tempered, after the sampling controls; under a
    grammar, dgemma/sampling/constraint.py `ConstraintState.masked_logits`), at `tokens` (B, L), floored at
    LOGPROB_FLOOR (a token the filter cut: finite by construction, as JSON has no -inf); and the `top` most probable
    tokens there as (id, log-probability), leaving out those the distribution cannot draw (cut by top_k/top_p/min_p, or
    forbidden by a grammar), so a position may list fewer than `top`."""
    logp = torch.log_softmax(z.float(), dim=-1)
    chosen = logp.gather(-1, tokens[..., None])[..., 0].nan_to_num(nan=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
    if not top:
        return chosen.tolist(), [[[] for _ in row] for row in tokens.tolist()]
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    alternatives = [[[(i, v) for i, v in zip(pi, pv, strict=True) if v > LOGPROB_FLOOR] for pi, pv in zip(ri, rv,
                     strict=True)] for ri, rv in zip(ids.tolist(), values.tolist(), strict=True)]
    return chosen.tolist(), alternatives
