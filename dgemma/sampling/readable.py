"""The readable sampler: one canvas of B rows stepped on the pass's full (B, L, V) logits, every rule a plain tensor
expression, with every setting of `GenerationConfig` (every family, the sampling controls, a grammar, an observed
likelihood). It implements dgemma/sampling/sampler.py:Sampler; the fast sampler (dgemma/sampling/fast_sampler.py)
takes the same decisions for the settings it implements. A step:

    logits -> posterior z            observe, penalties, temperature, filter (`_posterior`)
    z -> draw, argmax, entropy       under a grammar, its masked draw (`_propose`)
    family.update -> next canvas     dgemma/sampling/families.py: accept / commit, renoise
    freeze the stopped rows, stop rule, bookkeeping (dgemma/sampling/canvas.py:CanvasState)

("readable", not "reference": it runs on either kernels, `impl="reference"` or `"fast"`, which pick the model's.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dgemma.diffusion.noise import observation_levels, observe
from dgemma.model.attention import Impl
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.model.kv_cache import KVCache
from dgemma.sampling import rules
from dgemma.sampling.canvas import CanvasState, StagedCanvas, StepInfo
from dgemma.sampling.constraint import ConstraintState
from dgemma.sampling.families import Family, Step, family_for
from dgemma.sampling.generation_config import GenerationConfig, non_finite_logits
from dgemma.sampling.kernels import Workspace


class ReadableSampler:
    """The readable sampler's state and step for one canvas of B rows (dgemma/sampling/sampler.py:Sampler): its
    self-conditioning input is the previous step's posterior logits (B, L, V), and `step` reads a pass's logits."""

    def __init__(self, model: DiffusionGemma, config: GenerationConfig, batch_size: int, *,
                 generator: torch.Generator | None = None, canvas: Tensor | None = None,
                 finished: Tensor | None = None, canvas_index: int = 0,
                 on_step: Callable[[StepInfo], None] | None = None, trace: bool = False,
                 constraint: ConstraintState | None = None, seen: rules.Seen | None = None,
                 workspace: Workspace | None = None, keep_final: bool = False,
                 self_conditioning_logits: Tensor | None = None, family: Family | None = None):
        """`seen`: the prompt and output so far that the penalties count (`rules.Seen`; without it, with a penalty
        set, only the canvas itself is counted). `workspace` and `keep_final` are the fast sampler's: this one
        allocates per step and always keeps the posterior `logprobs` reads. `family` replaces the one
        `config.sampler` names (dgemma/sampling/families.py)."""
        B, L, V = batch_size, model.config.canvas_length, model.config.vocab_size
        device = model.device
        if config.penalizes and seen is None:
            seen = rules.Seen(torch.zeros(B, V, dtype=torch.bool, device=device), torch.zeros(B, V, device=device))
        self.model, self.config, self.generator, self.vocab_size, self.dtype = model, config, generator, V, model.dtype
        self.constraint, self.seen = constraint, seen
        self.marks: Tensor | None = None  # with a constraint: what the grammar did at each committed position
        self.unfiltered: Tensor | None = None  # with a constraint and a filter: the last step's logits before it
        self.time_embedding = model.config.time_embedding
        self.observed = model.config.observed_likelihood
        self.state = CanvasState.start((B, L), V, device, config, generator=generator, canvas=canvas,
                                       finished=finished, canvas_index=canvas_index, on_step=on_step, trace=trace)
        self.family = family or family_for(config, (B, L), device)
        self.raw = config.posterior_rule == "raw"
        self.num_steps = self.remaining = config.max_denoising_steps
        sc = self_conditioning_logits
        self.use_self_conditioning = config.self_conditioning == "on"  # off: no pass reads one
        if sc is not None and not self.use_self_conditioning:
            raise ValueError("self_conditioning_logits were given, and self_conditioning='off' feeds none to any step")
        if sc is None and config.initial_self_conditioning == "uniform":  # seed 000: a uniform first posterior
            sc = torch.zeros(B, L, V, dtype=model.dtype, device=device)
        # the last posterior's logits (None before the first step): the next pass's self-conditioning input when
        # `use_self_conditioning` (None: the first step's zero signal), what `logprobs` reads and stopped rows keep
        self.sc = sc
        self.draw = self.state.x
        self.committed = torch.zeros(B, L, dtype=torch.bool, device=device)  # the families that keep commits
        self._finished = False

    # --- the protocol -----------------------------------------------------------------------------------------------

    def inputs(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Begin a step: the pass's canvas (B, L), self-conditioning logits (B, L, V) or None (always None with
        self_conditioning off), and the noise level (B,) for a time-embedding model (`rules.time_level`; None without
        a time embedding)."""
        self._begun = self.state.begin_step()
        self.family.begin(self.state, self.remaining, self.num_steps, self.vocab_size, self.generator)
        sc = self.sc if self.use_self_conditioning else None
        return self.state.x, sc, self.state.level if self.time_embedding else None

    def denoiser(self, cache: KVCache, *, impl: Impl | None = None, sliding_prefix: int | None = None,
                 compile: bool = False) -> Callable[[Tensor, Tensor | None, Tensor | None], Tensor]:
        """A lone pass, (canvas, self-conditioning logits, level) -> fp32 logits: `DiffusionGemma.denoise`."""
        if compile:
            raise ValueError("compile=True needs impl='fast' and the sync-free loop (the static denoise step lives in "
                             "dgemma/sampling/fast_sampler.py)")
        return lambda x, sc, t: self.model.denoise(x, cache, self_conditioning_logits=sc,
                                                   sliding_prefix=sliding_prefix, t=t, impl=impl)

    def soft_embedding(self, self_conditioning: Tensor | None) -> Tensor | None:
        """The self-conditioning logits as the soft embedding a batched pass reads (`model.soft_embedding`)."""
        return None if self_conditioning is None else self.model.soft_embedding(self_conditioning)

    def read(self, final: Tensor) -> Tensor:
        """What `step` reads from a pass's final hidden state: the fp32 logits (the tied head)."""
        return self.model.logits(final)

    def batchable(self, rows: int) -> bool:
        """Never: each readable sampler steps alone."""
        return False

    @classmethod
    def step_together(cls, samplers: list[ReadableSampler], final: Tensor) -> None:
        raise NotImplementedError("the readable sampler steps alone (`batchable` is False)")

    def step(self, logits: Tensor, *, sync: bool = True) -> bool:
        """The sampler on the pass's fp32 logits (B, L, V), consumed in place. Returns whether the canvas is
        finished (every row stopped, or no step left); it reads the host at every step, whatever `sync`."""
        state, n, N = self.state, self.family.index(self.remaining), self.num_steps
        was_done, active = self._begun
        check_finite_logits(logits, state.canvas_index, N - n + 1)
        # Keep only the stopped rows of the previous logits (they ride along on them); `_posterior` frees the rest.
        sc_done = self.sc[was_done] if self.sc is not None and bool(was_done.any()) else None
        z, temp = self._posterior(logits, n)
        proposal, marks = self._propose(z, temp, n, was_done, active)
        new_x, draw, accepted = self.family.update(proposal)
        new_argmax, entropy, z = proposal.argmax, proposal.entropy, proposal.z
        if sc_done is not None:  # rows that already stopped keep everything; they only ride along in the batch
            keep = was_done[:, None]
            new_argmax = torch.where(keep, state.argmax, new_argmax)
            new_x = torch.where(keep, state.x, new_x)
            draw = torch.where(keep, self.draw, draw)
            accepted = torch.where(keep, self.committed if self.family.keeps_commits else accepted, accepted)
            z[was_done] = sc_done.to(z.dtype)
            entropy[was_done] = rules.token_entropy(z[was_done])
        if self.family.keeps_commits:
            self.committed = accepted
        state.end_step(was_done, active, new_x, new_argmax, accepted, entropy, temp, grammar=marks)
        self.draw = draw
        self.sc = z.to(self.dtype)  # self-conditioning reads the posterior's logits, in the embedding dtype
        if self.family.advance():
            self.remaining -= 1
        self._finished = (self.remaining == 0 and self.family.settled()) or state.all_done()
        return self._finished

    def finished(self) -> bool:
        """Whether the canvas is finished, as the last `step` returned."""
        return self._finished

    def logprobs(self, tokens: Tensor, top: int = 0) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
        """`rules.token_logprobs` of `tokens` (B, L) under the posterior the last step read (after `step`); with a
        grammar, the masked distribution each token was drawn from (the masks along `tokens`, from the parser's
        committed state; where the filter cut every allowed token, the unfiltered logits', as the draw)."""
        z = self.sc if self.constraint is None else \
            self.constraint.masked_logits(tokens, self.sc, self.unfiltered)
        return rules.token_logprobs(z, tokens, top)

    def staged(self) -> StagedCanvas:
        """The finished canvas. The families that keep commits end every position on its best guess: the committed
        token, else the last draw (seed 003, 4.2 rule 5). With a constraint, a canvas other than entropy-bound's
        grammar argmax is projected onto the grammar (`ConstraintState.project`): its tokens where they are valid,
        the grammar's argmax of the last posterior elsewhere."""
        staged = self.state.staged(torch.where(self.committed, self.state.x, self.draw) if self.family.keeps_commits
                                   else self.state.x)
        if self.constraint is not None:
            if not self.family.grammar_decides or self.config.commit_rule == "sample":
                rows = (~self.state.finished).nonzero().flatten().tolist()
                staged.tokens, self.marks = self.constraint.project(staged.tokens, self.sc.float(), rows,
                                                                    self.unfiltered)
            staged.grammar = self.marks
        return staged

    # --- the step's shared work -------------------------------------------------------------------------------------

    def _posterior(self, logits: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """The tempered posterior z (in place on `logits`) and its temperature: the observation an observed-likelihood
        model takes in, the penalties, the temperature, the filter. Frees the previous step's logits."""
        state, config, N = self.state, self.config, self.num_steps
        if self.observed:  # the posterior takes each position's observation in (diffusion/noise.py): a chain's canvas
            # is a forward-process draw at n / N; the others' carried positions are at the canvas level and their
            # fresh noise tells nothing
            levels = torch.tensor(n / N) if self.family.chain else \
                observation_levels(rules.canvas_level(state.clean), state.carried)
            observe(logits, state.x, levels, inplace=True)
        if config.penalizes:  # the sampling controls (rules.penalize, filter_tokens): none at their neutral values
            rules.penalize(logits, config, self.seen, state.x, state.carried)
        self.sc = None
        temp = rules.temperature(n, N, config.t_min, config.t_max, logits.device)
        z = logits.div_(temp)  # the tempered logits; in place, so only `probs` is a second (B, L, V) fp32 tensor
        # under a grammar, the tempered logits before the filter: where it cut every token the grammar allows
        self.unfiltered = z.clone() if config.filters_tokens and self.constraint is not None else None
        if config.filters_tokens:
            rules.filter_tokens(z, config)
        return z, temp

    def _propose(self, z: Tensor, temp: Tensor, n: int, was_done: Tensor, active: Tensor
                 ) -> tuple[Step, Tensor | None]:
        """The draw (the grammar's, or one from softmax(z) unless the family runs a chain), what the family reads
        from the probabilities, then argmax and entropy of the posterior (z, or the raw logits again for
        posterior_rule="raw"); and what the grammar did at each position where its argmax decides, else None."""
        family, generator = self.family, self.generator
        decided = draw = confidence = marks = None
        if self.constraint is not None and not family.chain:  # left to right under the grammar's masks
            # (dgemma/sampling/constraint.py): the draw, the grammar's argmax, the entropy of what it allows and what
            # the grammar did at each position. Entropy-bound reads all four; the others draw their proposals so
            # and read the posterior as it is (their committed canvas is projected: `staged`)
            rows = (active & ~was_done).nonzero().flatten().tolist()
            draw, greedy, masked_entropy, step_marks = self.constraint.draw(z, generator, rows, self.unfiltered)
            self.marks = torch.where(was_done[:, None], self.marks, step_marks) if bool(was_done.any()) else \
                step_marks
            if family.grammar_decides:
                decided, marks = (greedy, masked_entropy), self.marks
        if decided is None:
            probs = torch.softmax(z, dim=-1, dtype=torch.float32)
            if draw is None and not family.chain:
                draw = rules.draw_tokens(probs, generator)
            confidence = family.confidence(probs, draw)
            del probs
        # What entropy, confidence and self-conditioning read: z, or the raw logits again (z * T, within a rounding).
        z = z.mul_(temp) if self.raw else z
        argmax, entropy = (torch.argmax(z, dim=-1), rules.token_entropy(z)) if decided is None else decided
        return Step(self.config, generator, self.vocab_size, n, self.num_steps, z, self.state.x, draw, argmax,
                    entropy, confidence, self.committed), marks


def check_finite_logits(logits: Tensor, canvas_index: int, step: int) -> None:
    """Refuse NaN or +-inf logits (non-finite weights or an overflow) before they reach the draw, where
    torch.multinomial would fail obscurely or a sampler would silently pick token 0."""
    finite = torch.isfinite(logits.sum(-1))  # (B, L): NaN or inf anywhere in a row of V makes its sum non-finite
    if not bool(finite.all()):
        rows = (~finite).any(-1).nonzero().flatten().tolist()
        raise non_finite_logits(canvas_index, step, rows)
