"""The bookkeeping of one canvas's denoising, shared by the readable sampler (dgemma/sampling/readable.py) and the
fast one (dgemma/sampling/fast_sampler.py): per-row step and pass counts, the stop rule and its reasons, per-step
records for callbacks and traces, and the staged result. The samplers differ only in how a step computes its numbers.

    state = CanvasState.start((B, L), V, device, config, ...)
    for n in N..1:
        was_done, active = state.begin_step()         state.level: the noise level a time-embedding model is told
        ... denoise, draw, accept / commit, renoise; freeze the rows in `was_done` ...
        state.end_step(was_done, active, new_x, new_argmax, accepted, entropy, temperature)
        if state.all_done(): break
    staged = state.staged(sample)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dgemma.sampling import rules
from dgemma.sampling.generation_config import COMMITTING, GenerationConfig


@dataclass
class StepInfo:
    """What one denoising step did, for `on_step` callbacks and traces. Tensors are (B, L) or (B,)."""

    canvas: int
    step: int  # 1-based
    num_steps: int
    temperature: float
    input_canvas: Tensor
    argmax: Tensor
    accepted: Tensor
    entropy: Tensor  # (B, L) nats, of the posterior the sampler reads (`posterior`: tempered, or raw for Lite)
    mean_entropy: Tensor
    done: Tensor  # rows whose canvas has stopped (after this step)
    active: Tensor  # rows that spent this step (not stopped before it, not finished)
    level: Tensor  # (B,) the noise level of the step's input canvas (`time_level`): what a time-embedding model is told
    seconds: float
    # with a constraint: what the grammar did at each position of `argmax` (B, L) int8 (dgemma/sampling/constraint.py:
    # FREE, PINNED: the only token it allows, CLOSED: the budget's closer chose it); None without one
    grammar: Tensor | None = None


@dataclass
class StagedCanvas:
    """A denoised canvas that has not touched the cache: `tokens` is what `commit` would write."""

    tokens: Tensor  # (B, L)
    argmax: Tensor  # (B, L) argmax of the last step's logits
    sample: Tensor  # (B, L) the last step's accepted/renoised canvas
    steps: Tensor  # (B,) denoising passes spent by each row
    passes: Tensor  # (B,) passes counted like transformers (rows already finished excluded)
    stop_reasons: list[str]
    mean_entropy: Tensor  # (B,) at the last step
    trace: list[StepInfo] = field(default_factory=list)
    # with a constraint: what the grammar did at each position of `tokens` (dgemma/sampling/constraint.py: FREE, PINNED,
    # CLOSED)
    grammar: Tensor | None = None


class CanvasState:
    """The state of one canvas across its denoising steps. `x` is the current input canvas, `argmax` the last
    step's prediction; `done` marks rows that stopped (they ride along, frozen), `finished` rows whose sequence
    already ended (they run but are not counted)."""

    def __init__(self, x: Tensor, finished: Tensor, config: GenerationConfig, *, canvas_index: int = 0,
                 on_step: Callable[[StepInfo], None] | None = None, trace: bool = False):
        B, device = x.shape[0], x.device
        self.x, self.argmax, self.finished, self.config = x, x, finished, config
        self.done = torch.zeros(B, dtype=torch.bool, device=device)
        self.steps = torch.zeros(B, dtype=torch.long, device=device)
        self.passes = torch.zeros(B, dtype=torch.long, device=device)
        self.stopped_at = torch.zeros(B, dtype=torch.long, device=device)  # the step a row stopped at, 0 = never
        self.mean_entropy = torch.zeros(B, device=device)
        self.clean = torch.zeros(B, device=device)  # share of `x` carried over clean (accepted/committed): 0 = noise
        self.carried = torch.zeros(B, x.shape[1], dtype=torch.bool, device=device)  # which positions of `x` those are
        self.level = torch.ones(B, device=device)  # the current step's noise level (`begin_step` sets it)
        self.step, self.canvas_index, self.on_step, self.trace = 0, canvas_index, on_step, trace
        self.records: list[StepInfo] = []
        self._stop = rules.StopState()
        self._started = 0.0

    @classmethod
    def start(cls, shape: tuple[int, int], vocab_size: int, device: torch.device, config: GenerationConfig, *,
              generator: torch.Generator | None = None, canvas: Tensor | None = None, finished: Tensor | None = None,
              canvas_index: int = 0, on_step: Callable[[StepInfo], None] | None = None, trace: bool = False
              ) -> CanvasState:
        """A canvas of `shape` (B, L) starting from uniform noise, which is drawn even when `canvas` replaces it (the
        random stream stays aligned with transformers'); `finished` (B,) defaults to no row finished."""
        noise = rules.uniform_tokens(shape, vocab_size, device, generator)
        x = noise if canvas is None else canvas.to(device)
        finished = torch.zeros(shape[0], dtype=torch.bool, device=device) if finished is None else finished
        return cls(x, finished, config, canvas_index=canvas_index, on_step=on_step, trace=trace)

    def begin_step(self) -> tuple[Tensor, Tensor]:
        """Count the step and set its noise level `level` (B,) (`rules.time_level`: the loops pass it to a
        time-embedding model); returns `was_done` (rows stopped before it) and `active` (rows it is spent on)."""
        self.step += 1
        N = self.config.max_denoising_steps
        self.level = rules.time_level(self.config, self.clean, N - self.step + 1, N)
        self._started = time.perf_counter()
        was_done = self.done
        active = ~(was_done | self.finished)
        self.passes += active
        self.steps += ~was_done
        return was_done, active

    def end_step(self, was_done: Tensor, active: Tensor, new_x: Tensor, new_argmax: Tensor, accepted: Tensor,
                 entropy: Tensor, temperature: Tensor, grammar: Tensor | None = None) -> None:
        """Apply the stop rule to the step's (already frozen) results and move on to the next input canvas;
        `grammar`: what a constraint did at each position of `new_argmax` (StepInfo.grammar)."""
        self.mean_entropy = entropy.mean(-1)
        stopped = rules.stop_rows(self.config, self._stop, new_argmax, self.x, self.mean_entropy, accepted)
        self.stopped_at = torch.where(stopped & ~was_done, self.step, self.stopped_at)
        self.done = was_done | stopped
        self.clean = torch.where(was_done, self.clean, accepted.float().mean(-1))  # what `new_x` carries over
        self.carried = torch.where(was_done[:, None], self.carried, accepted)
        if self.trace or self.on_step is not None:
            info = StepInfo(self.canvas_index, self.step, self.config.max_passes, float(temperature), self.x,
                            new_argmax, accepted, entropy, self.mean_entropy, self.done, active, self.level,
                            time.perf_counter() - self._started, grammar)
            if self.trace:
                self.records.append(info)
            if self.on_step is not None:
                self.on_step(info)
        self.x, self.argmax = new_x, new_argmax

    def all_done(self) -> bool:
        """Whether every row has stopped (a host read of a device flag)."""
        return bool(self.done.all())

    def stop_reasons(self) -> list[str]:
        reason = "adaptive" if self.config.sampler == "lite" else "committed" if self.config.sampler in COMMITTING \
            else "stable+confident"
        return [reason if s else "max_steps" for s in (self.stopped_at > 0).tolist()]

    def staged(self, sample: Tensor) -> StagedCanvas:
        """The result: `sample` is the sampler's final canvas; `tokens` what the `commit` rule takes."""
        tokens = self.argmax if self.config.commit_rule == "argmax" else sample
        return StagedCanvas(tokens, self.argmax, sample, self.steps, self.passes, self.stop_reasons(),
                            self.mean_entropy, self.records)
