"""The sampler families as small strategies: what each does with one step's posterior, given the readable sampler's
shared work (dgemma/sampling/readable.py: the posterior, its draw, argmax, entropy and confidence).

    family                        `update(step)` -> (next input canvas, the step's draw, accepted / committed)
    EntropyBound                  accept the lowest-entropy positions under the bound, renoise the rest (transformers)
    Lite                          commit a position once its mode is stable or its confidence did not drop (seed 003)
    Committing                    commit the drawn tokens above `commit_threshold` (block refinement: at least a
                                  schedule's share; confidence: one a step), edit committed ones (`edit_threshold`)
    Ancestral                     x_{s'} drawn from the model's reverse step, s = n / N -> (n - 1) / N
    PredictorCorrector            the ancestral chain, each step followed by corrector passes

Which likelihood, if any, describes what a setting samples is `chain_likelihood`'s to say: only the ancestral chain
run as dgemma/diffusion/likelihood.py's NELBO assumes it (temperature 1, no self-conditioning, nothing else on the
draw) is described by a bound.

The rules themselves are pure functions in dgemma/sampling/rules.py. A new family is one class here: its `update`,
and the few flags below that say what the shared step should compute for it; `family_for` maps a
`GenerationConfig.sampler` name to it (and the name joins `generation_config.SAMPLERS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.sampling import rules
from dgemma.sampling.canvas import CanvasState
from dgemma.sampling.generation_config import CHAINS, GenerationConfig


@dataclass
class Step:
    """What the readable sampler's shared work hands a family for one step of B rows and L positions."""

    config: GenerationConfig
    generator: torch.Generator | None
    vocab_size: int
    n: int  # the chain's index: the pass's level is n / N (steps remaining, for the non-chain families)
    num_steps: int  # N
    z: Tensor  # (B, L, V) the posterior's logits (tempered, or raw), after the draw
    x: Tensor  # (B, L) the step's input canvas
    draw: Tensor | None  # (B, L) one draw per position from the tempered posterior (None for a chain family)
    argmax: Tensor  # (B, L)
    entropy: Tensor  # (B, L)
    confidence: Tensor | None  # (B, L) what `Family.confidence` read from the probabilities
    committed: Tensor  # (B, L) bool: the committed set so far (families that keep commits)


class Family:
    """The default flags: a family that draws a proposal per position from the tempered posterior, keeps no
    committed set and lets a grammar's own argmax and entropy stand in for the posterior's (entropy-bound)."""

    chain = False  # runs the reverse chain: draws its canvas itself, and an observed likelihood reads level n / N
    keeps_commits = False  # has a committed set: the canvas ends on its committed tokens, else the last draw
    grammar_decides = False  # under a grammar, its argmax and the entropy of what it allows replace the posterior's

    def confidence(self, probs: Tensor, draw: Tensor | None) -> Tensor | None:
        """What the family reads from the tempered probabilities (B, L, V) before they are freed (None: nothing)."""
        return None

    def update(self, step: Step) -> tuple[Tensor, Tensor, Tensor]:
        """The next input canvas, the step's draw and which positions it accepted (or holds committed)."""
        raise NotImplementedError

    def index(self, remaining: int) -> int:
        """n of the pass's level n / N, given the steps remaining (a corrector pass is one level up)."""
        return remaining

    def begin(self, state: CanvasState, remaining: int, num_steps: int, vocab_size: int,
              generator: torch.Generator | None) -> None:
        """Before a pass reads the canvas (a corrector noises it up a level)."""

    def advance(self) -> bool:
        """After a pass: whether it was a step down the schedule (it counts against the steps remaining)."""
        return True

    def settled(self) -> bool:
        """Whether no pass of the current step is still to come (a corrector's)."""
        return True


class EntropyBound(Family):
    grammar_decides = True

    def update(self, step: Step) -> tuple[Tensor, Tensor, Tensor]:
        accepted = rules.accept_by_entropy(step.entropy, step.config.entropy_bound)
        return rules.renoise(step.draw, accepted, step.vocab_size, step.generator), step.draw, accepted


class Lite(Family):
    """The committed set grows by `rules.lite_commit`, which compares this step's mode and confidence with the
    previous step's (+inf at the start: nothing commits at step 1)."""

    keeps_commits = True

    def __init__(self, shape: tuple[int, int], device: torch.device, raw: bool):
        self.raw = raw  # confidence reads the raw posterior (read after the draw) rather than the tempered one
        self.prev_argmax = torch.full(shape, -1, dtype=torch.long, device=device)
        self.prev_confidence = torch.full(shape, math.inf, device=device)

    def confidence(self, probs: Tensor, draw: Tensor | None) -> Tensor | None:
        return None if self.raw else probs.amax(-1)

    def update(self, step: Step) -> tuple[Tensor, Tensor, Tensor]:
        confidence = rules.max_probability(step.z) if self.raw else step.confidence
        new = rules.lite_commit(step.config, step.num_steps - step.n + 1, step.argmax, confidence,
                                self.prev_argmax, self.prev_confidence, step.committed)
        x = torch.where(new, step.draw, rules.renoise(step.x, step.committed, step.vocab_size, step.generator))
        self.prev_argmax, self.prev_confidence = step.argmax, confidence
        return x, step.draw, step.committed | new


class Committing(Family):
    """Block refinement (`quota`: at least ceil(L * k / N) committed after step k) and confidence-threshold decoding
    (one a step); confidence is the tempered probability of each drawn token (diffusers')."""

    keeps_commits = True

    def __init__(self, scheduled: bool):
        self.scheduled = scheduled

    def confidence(self, probs: Tensor, draw: Tensor | None) -> Tensor | None:
        return probs.gather(-1, draw[..., None])[..., 0]

    def update(self, step: Step) -> tuple[Tensor, Tensor, Tensor]:
        committed, config, N = step.committed, step.config, step.num_steps
        quota = rules.commit_quota(committed, N - step.n + 1, N) if self.scheduled else \
            torch.ones(committed.shape[0], dtype=torch.long, device=committed.device)
        new = rules.threshold_commits(step.confidence, committed, config.commit_threshold, quota)
        edited = rules.edits(step.draw, step.x, committed, step.confidence, config.edit_threshold)
        kept = rules.renoise(torch.where(edited, step.draw, step.x), committed, step.vocab_size, step.generator)
        return torch.where(new, step.draw, kept), step.draw, committed | new


class Ancestral(Family):
    """x_{s'} from the reverse step ("accepted": unchanged)."""

    chain = True

    def update(self, step: Step) -> tuple[Tensor, Tensor, Tensor]:
        N = step.num_steps
        x = rules.draw_tokens(rules.ancestral_step(step.z, step.x, step.n / N, (step.n - 1) / N), step.generator)
        return x, x, x == step.x


class PredictorCorrector(Ancestral):
    """Each ancestral step (the predictor pass) followed by `correctors` (>= 1) passes that noise the canvas back up
    one level and step down again."""

    def __init__(self, correctors: int):
        self.correctors = correctors
        self.corrector_pass = 0  # 0: the step's predictor pass; 1..correctors: its corrector passes

    def index(self, remaining: int) -> int:
        return remaining + (1 if self.corrector_pass else 0)

    def begin(self, state: CanvasState, remaining: int, num_steps: int, vocab_size: int,
              generator: torch.Generator | None) -> None:
        s, N = self.index(remaining), num_steps  # the pass's level is the chain's, s / N
        if self.corrector_pass:  # noise x_{s'} forward to s: the corrector's first half
            state.x = rules.forward_noise(state.x, (s - 1) / N, s / N, vocab_size, generator)
        state.level = torch.full_like(state.level, s / N)

    def advance(self) -> bool:
        if self.corrector_pass:
            self.corrector_pass = (self.corrector_pass + 1) % (self.correctors + 1)
            return False
        self.corrector_pass = 1
        return True

    def settled(self) -> bool:
        return not self.corrector_pass


def chain_departures(config: GenerationConfig, *, constrained: bool = False) -> list[str]:
    """What makes `config`'s samples other than draws of the reverse chain whose NELBO dgemma/diffusion/likelihood.py
    computes at T = max_denoising_steps (empty: none; `constrained`: a grammar masks the draw). That chain is the
    ancestral family (`Ancestral`: predictor-corrector without a corrector pass is the same chain) with

        temperature 1 at every step      t_min = t_max = 1 (the bound's reverse step is the untempered mixture)
        no self-conditioning             self_conditioning off (the bound's posterior is the first step's, without
                                         the signal: `clean_context_posterior`)
        the draw itself                  no top_k / top_p / min_p, penalty, logit_bias or grammar
        clean context                    each canvas commits its last draw (commit "sample": the next canvas's clean
                                         prefix is the chain's x0) and sees sliding_window - 1 committed tokens in
                                         sliding layers (sliding_prefix "hf", as `clean_context_masks`)

    What else the bound assumes the chain does by construction: at step n of N the canvas is a draw at level n / N
    and a time-embedding model is told n / N (`rules.time_level`), an observed-likelihood posterior reads the canvas
    at n / N (readable.py `_posterior`), every canvas runs its N steps (`rules.stop_rows`). The posterior switch
    and time_level do not act at temperature 1 on the chain; an output cut at EOS keeps the draws before it."""
    out = []
    if config.sampler not in CHAINS or config.corrector_passes:
        out.append(f"sampler={config.sampler!r}" + (f" with corrector_steps={config.corrector_steps}"
                                                    if config.corrector_passes else ""))
    if not config.t_min == config.t_max == 1:
        out.append(f"temperature {config.t_max:g} -> {config.t_min:g}" if config.t_min != config.t_max
                   else f"temperature {config.t_max:g}")
    if config.self_conditioning != "off":
        out.append("self_conditioning='on'")
    out += config.active_controls
    if constrained:
        out.append("a grammar")
    if config.commit_rule != "sample":
        out.append(f"commit={config.commit_rule!r}")
    if config.sliding_prefix != "hf":
        out.append(f"sliding_prefix={config.sliding_prefix!r}")
    return out


def chain_likelihood(config: GenerationConfig, *, constrained: bool = False) -> str | None:
    """Which likelihood describes the samples of `config`: "NELBO at T=N" (N = max_denoising_steps; an upper bound on
    their NLL, `likelihood.window_nelbo` with the clean-context posterior) for the bounded chain (`chain_departures`
    empty), else None: no likelihood describes a tempered, self-conditioned or filtered sampler, nor the
    accept / renoise and committing samplers. The one rule every label of a sampler's likelihood reads."""
    return None if chain_departures(config, constrained=constrained) else f"NELBO at T={config.max_denoising_steps}"


def family_for(config: GenerationConfig, shape: tuple[int, int], device: torch.device) -> Family:
    """The family that `config.sampler` names, for a canvas of `shape` (B, L)."""
    if config.sampler == "lite":
        return Lite(shape, device, raw=config.posterior_rule == "raw")
    if config.sampler in ("block-refinement", "confidence"):
        return Committing(scheduled=config.sampler == "block-refinement")
    if config.sampler in ("ancestral", "predictor-corrector"):  # no corrector pass: the ancestral chain
        return PredictorCorrector(config.corrector_passes) if config.corrector_passes else Ancestral()
    return EntropyBound()
