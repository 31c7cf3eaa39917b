"""The distillation objective (`objective="distill"`, `dgemma distill`): a student learns to take in one reverse step
what a frozen teacher takes in two, so that it samples a canvas in N steps as the teacher does in 2N. SDTT
(self-distillation through time, Deschenaux & Gulcehre 2024, arXiv 2410.21035) for masked diffusion, here on the
uniform-state canvas with a committed clean context. One micro-batch:

    x0                                   clean token windows (B, S), S a whole number of canvases of L
    s = t / N, t ~ U{1..N}               one level per canvas on the student's grid (`--t-sampling` as in train)
    x_s ~ q(x_s | x0)                    the forward process (dgemma/diffusion/noise.py)
    p_T(x0 | x_s)                        teacher pass 1 (no grad, eval mode)
    x_s' ~ sum_k p_T(k | x_s) q(x_s' | x_s, x0 = k),   s' = s - 1/(2N)
                                         the ancestral step of the sampler (dgemma/sampling/rules.py:ancestral_step)
    p_T(x0 | x_s')                       teacher pass 2: the target, a full distribution per position
    loss = mean over tokens of KL(p_T(x0 | x_s') || p_S(x0 | x_s))     the student at its own level s

Every pass is the clean-context training forward (each noisy canvas sees the clean canvases before it and itself,
what `denoise` sees after `commit`), and the posterior is `posterior_logits` (the head, plus the observed likelihood
of each position's observation at its level for a model with one): a chain sampler's step reads exactly these at
n / N (dgemma/sampling/readable.py), and a time-embedding model is told its level as there. The student may get a
self-conditioning input as in training (`self_conditioning_prob`: a no-grad pre-pass of its own at x_s); the teacher
never does (the first denoising step's situation, as the NELBO's posterior).

Soft targets: the KL against the teacher's whole distribution carries more than a sampled token (SDTT's finding that
KL targets beat hard ones), and it is zero exactly when the student reproduces the two-step teacher. Progressive
rounds are repeated runs: teacher 2N -> student N, that student as the next teacher -> N/2 (docs/training.md).

Lower-variance targets (`teacher_draws` K): the expected loss over the teacher's draw is
E_k KL(p_k || p_S) = E_k KL(p_k || m) + KL(m || p_S), m = E_k p_k the mean target: a floor no student removes (the
spread of the teacher's two-step outcomes) plus the part a student can learn, minimised by p_S = m. With K draws per
x_s and their mean as the target, the minimiser is the same m and the target's draw noise K times smaller, for K - 1
more teacher forwards (runs/distill_floor.py measures the floor and the learnable part of a student).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dgemma.diffusion.likelihood import posterior_logits
from dgemma.diffusion.noise import draw_rows, q_sample
from dgemma.io import fsio
from dgemma.model.attention import clean_context_masks
from dgemma.model.config import ModelConfig
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.rules import ancestral_step
from dgemma.train.diffusion import LossOutput, sample_canvas_t, self_conditioned_hidden
from dgemma.weights.checkpoint import read_model_config, resolve_model_dir
from dgemma.weights.loading import load_generation_config


def soft_kl(target_logits: Tensor, logits: Tensor) -> Tensor:
    """KL(softmax(target_logits) || softmax(logits)) per row, (...) float32: >= 0, and 0 exactly where the two
    distributions agree (then its gradient in `logits` is 0 too)."""
    target = torch.log_softmax(target_logits.float(), dim=-1)
    return (target.exp() * (target - torch.log_softmax(logits.float(), dim=-1))).sum(-1)


def inverse_cdf_draw(probs: Tensor, u: Tensor) -> Tensor:
    """Categorical draws per row of `probs` (M, V) from uniforms `u` (M,) or (M, K) in [0, 1), shaped as `u`: the
    first index whose cumulative probability exceeds u. The uniforms are drawn beforehand with `draw_rows`, so the
    draw of a row does not depend on how the batch is split across ranks (torch.multinomial's would)."""
    cdf = probs.double().cumsum(-1)
    values = u.double().reshape(u.shape[0], -1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, values.contiguous(), right=True)
    return idx.clamp_(max=probs.shape[-1] - 1).view(u.shape)


def teacher_step(teacher: DiffusionGemma, hidden: Tensor, xs: Tensor, level: Tensor, num_steps: int, u: Tensor,
                 chunk_rows: int) -> Tensor:
    """x_{s'} drawn from the teacher's ancestral step s -> s' = s - 1/(2N), from its final hidden states (M, D) at
    the canvases x_s (M,) of levels `level` (M,) (each a multiple of 1/N), with uniforms `u` (M,) or (M, K): one draw
    per uniform, shaped as `u`, all K from the one step's probabilities. Row chunks; the sampler's `ancestral_step`
    takes one level at a time, so the rows of a chunk go level by level (at most N)."""
    out = torch.empty(u.shape, dtype=xs.dtype, device=xs.device)
    half = 1.0 / (2 * num_steps)
    for lo in range(0, xs.shape[0], chunk_rows):
        sl = slice(lo, lo + chunk_rows)
        z = posterior_logits(teacher, hidden[sl], xs[sl], level[sl]).float()  # (m, V)
        probs = torch.empty_like(z)
        for s in level[sl].unique().tolist():
            rows = level[sl] == s
            probs[rows] = ancestral_step(z[rows][None], xs[sl][rows][None], s, s - half)[0]
        out[sl] = inverse_cdf_draw(probs, u[sl])
    return out


def mean_posterior(teacher: DiffusionGemma, hidden: Tensor, xs: Tensor, level: Tensor) -> Tensor:
    """The log of the mean of K teacher posteriors per row, (M, V) float32, from the teacher's hidden states (M, K, D)
    at K canvases xs (M, K) of one level (M,): the target of `teacher_draws` K (for K = 1, the one posterior's
    logits, as they are)."""
    K = xs.shape[1]
    logits = [posterior_logits(teacher, hidden[:, k], xs[:, k], level) for k in range(K)]
    if K == 1:
        return logits[0]
    logp = torch.stack([torch.log_softmax(z.float(), -1) for z in logits])
    return torch.logsumexp(logp, 0) - math.log(K)


def distill_loss(student: DiffusionGemma, x0: Tensor, *, teacher: DiffusionGemma, num_steps: int,
                 self_conditioning_prob: float = 0.5, chunk_rows: int | None = 1024, t_sampling: str = "uniform",
                 generator: torch.Generator | None = None, batch_rows: tuple[int, int] | None = None,
                 teacher_draws: int = 1) -> LossOutput:
    """The distillation loss on clean windows x0 (B, S) with the student's N = `num_steps` (module docstring).
    `loss`: the mean per-token KL(target || student); `cross_entropy`: the student's x0 cross-entropy on the same
    pass (detached, for the log). Random draws in order (levels, corruption, the self-conditioning coin, the
    teacher's steps), each made for the whole micro-batch with `batch_rows` as `training_loss` makes them.
    `teacher_draws` K > 1: K independent teacher half-steps from the same x_s, the target the mean of their K
    posteriors (module docstring, "Lower-variance targets"); K = 1 is the single-draw loss, draw for draw."""
    cfg = student.config
    L, W, V = cfg.canvas_length, cfg.sliding_window, cfg.vocab_size
    B, S = x0.shape
    device, N = x0.device, num_steps
    if S % L:
        raise ValueError(f"training windows of {S} tokens are not a whole number of canvases of {L}")
    t = draw_rows(lambda shape, **k: sample_canvas_t(shape[0], shape[1], N, stratified=t_sampling == "stratified",
                                                     **k), (B, S // L), batch_rows, generator, device)
    xs = q_sample(x0, t, N, L, V, generator, batch_rows)
    use_sc = bool(torch.rand((), generator=generator, device=device) < self_conditioning_prob)
    u = torch.stack([draw_rows(torch.rand, (B, S), batch_rows, generator, device) for _ in range(teacher_draws)], -1)
    level = (t.double() / N).repeat_interleave(L, dim=1)  # (B, S): each token's canvas level, a multiple of 1/N
    half = level - 1.0 / (2 * N)
    pos = torch.arange(S, device=device)
    positions, masks = torch.cat([pos, pos])[None], clean_context_masks(S, L, W, device)
    clean = torch.zeros_like(level, dtype=torch.float32)

    def hidden(model: DiffusionGemma, noisy: Tensor, lv: Tensor, self_conditioned: bool) -> Tensor:
        out = self_conditioned_hidden(model, torch.cat([x0, noisy], 1), positions, masks, num_clean=S,
                                      level=torch.cat([clean, lv.float()], 1), self_conditioned=self_conditioned,
                                      chunk_rows=chunk_rows)
        return out[:, S:].reshape(B * S, -1)

    rows = chunk_rows or B * S
    with torch.no_grad():
        h1 = hidden(teacher, xs, level, False)
        xs2 = teacher_step(teacher, h1, xs.reshape(-1), level.reshape(-1), N, u.reshape(B * S, -1), rows)  # (B S, K)
        del h1
        h2 = torch.stack([hidden(teacher, x2.view(B, S), half, False) for x2 in xs2.unbind(-1)], 1)  # (B S, K, D)
    final = hidden(student, xs, level, use_sc)
    flat = (xs.reshape(-1), level.reshape(-1).float(), xs2, half.reshape(-1).float(), x0.reshape(-1))

    def chunk(h: Tensor, ht: Tensor, x: Tensor, lv: Tensor, x2: Tensor, lv2: Tensor, y: Tensor
              ) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            target = mean_posterior(teacher, ht, x2, lv2)
        logits = posterior_logits(student, h, x, lv)
        ce = torch.nn.functional.cross_entropy(logits.detach().float(), y, reduction="sum")
        return soft_kl(target, logits).sum(), ce

    kl_total = final.new_zeros((), dtype=torch.float32)
    ce_total = torch.zeros((), dtype=torch.float32, device=device)
    for lo in range(0, B * S, rows):
        sl = slice(lo, lo + rows)
        args = (final[sl], h2[sl], *(f[sl] for f in flat))
        kl, ce = checkpoint(chunk, *args, use_reentrant=False) if chunk_rows is not None else chunk(*args)
        kl_total, ce_total = kl_total + kl, ce_total + ce
    return LossOutput(kl_total / (B * S), (ce_total / (B * S)).detach(), None, B * S, use_sc)


# --- what a distillation run checks of its teacher ---------------------------------------------------------------

def teacher_problem(teacher: str, student_steps: int, student: ModelConfig) -> tuple[str, str] | None:
    """(field, what is wrong) when `teacher` cannot teach this student, else None: the path is missing or not a
    checkpoint, the teacher is an AR run (objective 'ar': it has no reverse step), its architecture differs from the
    student's (the first differing config field), or `student_steps` is not fewer than the teacher's own steps
    (its generation_config.json's max_denoising_steps)."""
    if not Path(teacher).exists():
        return "teacher", "no such checkpoint or run directory"
    ckpt = resolve_model_dir(teacher)
    if teacher_recipe(teacher).get("objective") == "ar":  # the rule of cli/loading.py:autoregressive
        return "teacher", "is an AR run (objective 'ar'): it has no reverse diffusion step to distil"
    config = read_model_config(ckpt)
    if config != student:
        diff = next(f for f in config.__dataclass_fields__ if getattr(config, f) != getattr(student, f))
        return "teacher", (f"its architecture differs from the student's in {diff}: teacher "
                           f"{getattr(config, diff)!r}, student {getattr(student, diff)!r} (the student starts from "
                           "init_from, by default the teacher)")
    steps = load_generation_config(ckpt).max_denoising_steps
    if student_steps >= steps:
        return "student_steps", f"must be fewer than the teacher's max_denoising_steps={steps}"
    return None


def teacher_recipe(teacher: str) -> dict[str, Any]:
    """The teacher's own training recipe (its checkpoint's train_config.json as a dict; {} without a readable one: a
    checkpoint no training run wrote)."""
    try:
        recipe = json.loads(fsio.read_text(resolve_model_dir(teacher) / "train_config.json"))
    except (OSError, ValueError, fsio.UnsafeFileError):
        return {}
    return recipe if isinstance(recipe, dict) else {}
