"""The fast sampler (the "sync-free" loop): the entropy-bound family with every decision taken on the device, an
implementation of dgemma/sampling/sampler.py:Sampler beside the readable one (dgemma/sampling/readable.py).

Per step: `DenoiseStep` (the model's denoise up to the final hidden state, optionally with fixed shapes for
torch.compile and CUDA graphs) -> `kernels.head_and_sample` (head, temperature, draw, argmax, entropy and the next
self-conditioning input, row-chunked, in reused buffers; dgemma/sampling/kernels.py) -> the readable sampler's own
rules on device tensors: `rules.accept_by_entropy`, `rules.renoise`, and the stop rule and step accounting of
`canvas.CanvasState`. Rows that stopped keep their state through `torch.where`, not a branch on a host value, and
`step(..., sync=False)` skips the host read of `done.all()` (`sampler.denoise_canvas` reads once every `sync_every`
steps).

Same decisions as the readable sampler given the same logits and noise (tests/sampling/test_fast_sampler.py); the
random draws differ (inverse-CDF or exponential race instead of torch.multinomial). `generate(..., loop="sync-free")`
(the default with impl="fast") runs it; settings it does not implement (`unsupported`) are an error naming them, and
`loop="readable"` runs those on the fast kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from dgemma.diffusion.noise import observation_boost, observation_levels
from dgemma.model import attention, kernels
from dgemma.model.attention import Impl
from dgemma.model.config import SLIDING
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.model.kv_cache import KVCache
from dgemma.sampling import rules
from dgemma.sampling.canvas import CanvasState, StagedCanvas, StepInfo
from dgemma.sampling.constraint import ConstraintState
from dgemma.sampling.generation_config import GenerationConfig, GenerationError, non_finite_logits
from dgemma.sampling.kernels import (
    Draw,
    StepDraws,
    Workspace,
    default_chunk_rows,
    head_and_sample,
    one_pass_head_and_sample,
)

# the sampling controls (generation_config.CONTROLS) are implemented by the readable loop only: at their neutral values
IMPLEMENTED = {"sampler": "entropy-bound", "posterior_rule": "tempered", "initial_self_conditioning": "zeros"}


def unsupported(config: GenerationConfig) -> list[str]:
    """The settings of `config` this loop does not implement, as "name=value" (empty: it implements `config`). It
    implements the entropy-bound sampler with transformers' posterior and first self-conditioning input, and no
    sampling control (top_k ... logit_bias)."""
    return [f"{k}={getattr(config, k)!r}" for k, v in IMPLEMENTED.items() if getattr(config, k) != v] + \
        config.active_controls


def check_supported(config: GenerationConfig) -> None:
    """GenerationError naming the settings of `config` this loop does not implement, and the way out."""
    bad = unsupported(config)
    if bad:
        raise GenerationError(f"the sync-free sampler loop (loop='sync-free') does not "
                              f"implement {', '.join(bad)} (it runs "
                              f"{', '.join(f'{k}={v!r}' for k, v in IMPLEMENTED.items())}); pass loop='readable' to "
                              "run these settings on the fast kernels")


class DenoiseStep:
    """`DiffusionGemma.denoise_hidden` with the fast kernels, taking the self-conditioning signal as the soft
    embedding (B, L, D), which the fast sampler computes from the probabilities it already holds instead of a second
    softmax over (B, L, V) logits.

    static=False reads the visible slice of the cache, as `denoise` does (shapes follow the context length).
    static=True keeps every shape fixed for the life of the cache, so the step can be captured whole: full layers
    read all preallocated slots and mask those at or past the committed length, which enters as a device scalar (no
    recompilation per canvas); sliding layers gather a fixed window of `sliding_prefix` slots. compile=True wraps the
    static step in torch.compile(fullgraph=True), with CUDA graphs ("reduce-overhead") on CUDA; a string names the
    torch.compile backend instead of inductor."""

    def __init__(self, model: DiffusionGemma, cache: KVCache, *, sliding_prefix: int | None = None,
                 static: bool = False, compile: bool | str = False):
        self.model, self.cache, self.sliding_prefix = model, cache, sliding_prefix
        self.static = static or bool(compile)
        self._fn: Callable[..., Tensor] = _static_hidden
        if compile:
            self._fn = compiled_static_hidden(model.device, cache, compile if isinstance(compile, str) else "inductor")
        self._end = torch.zeros((), dtype=torch.long, device=model.device)

    @torch.no_grad()
    def __call__(self, canvas: Tensor, soft: Tensor | None = None, t: Tensor | float | None = None) -> Tensor:
        if not self.static:
            return self.model.denoise_hidden(canvas, self.cache, soft=soft, sliding_prefix=self.sliding_prefix, t=t,
                                             impl="fast")
        self.cache.check_batch(canvas, "canvas")
        if t is not None:
            t = torch.as_tensor(t, dtype=torch.float32, device=canvas.device).reshape(-1, 1)
        self._end.fill_(self.cache.length)  # a host-to-device write, never a read
        prefix = attention.visible_prefixes(self.model.config.sliding_window, "decoder", self.sliding_prefix)[SLIDING]
        c = self.cache
        return self._fn(self.model, c.keys, c.values, c.is_token, canvas, soft, t, self._end, prefix)


def compiled_static_hidden(device: torch.device, cache: KVCache | None = None, backend: str = "inductor"
                           ) -> Callable[..., Tensor]:
    """torch.compile(fullgraph=True) of the static denoise step, made on first use. On CUDA: CUDA graphs, with the
    cache marked as living at a fixed address so that replays read it in place instead of copying it in.
    `backend="aot_eager"` traces the same whole graph without generating code (what the tests use: seconds, not
    minutes)."""
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    if device.type == "cuda" and cache is not None:
        for t in (*cache.keys, *cache.values, cache.is_token):
            torch._dynamo.mark_static_address(t)
    kernels.register_expert_loop_op()
    return _compiled(backend, mode)


@functools.cache
def _compiled(backend: str, mode: str | None) -> Callable[..., Tensor]:
    """torch.compile of `_static_hidden` for one backend and mode, made once (compiling is what costs)."""
    return torch.compile(_static_hidden, fullgraph=True, dynamic=False, backend=backend, mode=mode)


def _static_hidden(model: DiffusionGemma, keys: list[Tensor], values: list[Tensor], is_token: Tensor,
                   canvas: Tensor, soft: Tensor | None, t: Tensor | None, end: Tensor, prefix: int) -> Tensor:
    """`denoise_hidden` with shapes that do not depend on `end` (a 0-d device tensor): no host reads, no
    data-dependent shapes, so torch.compile(fullgraph=True) and CUDA graphs can take it whole."""
    L = canvas.shape[1]
    device = canvas.device
    x = model.self_conditioning(model.embed(canvas, t), soft)
    T = is_token.shape[1]
    window = end - prefix + torch.arange(prefix, device=device)  # the sliding layers' slots, some maybe < 0
    slots = window.clamp(0, T - 1)
    masks = attention.static_denoise_masks(is_token, end, L, slots, window)
    kinds = model.config.layer_types

    def past(i: int) -> attention.Past:
        if kinds[i] == SLIDING:
            return attention.Past((keys[i].index_select(2, slots), values[i].index_select(2, slots)), masks[SLIDING])
        return attention.Past((keys[i], values[i]), masks[kinds[i]])

    hidden = model.run_layers(x, (end + torch.arange(L, device=device))[None], "decoder", past, "fast")
    return model.final_hidden(hidden, soft)


class FastSampler:
    """The sync-free loop's state and step for one canvas of B rows (dgemma/sampling/sampler.py:Sampler), the twin
    of dgemma/sampling/readable.py:ReadableSampler: its self-conditioning input is the soft embedding (B, L, D) it
    computes from the probabilities it already holds, and `step` reads a pass's final hidden state (B, L, D).
    `sampler.denoise_canvas` drives one over a batch; the serving engine drives one per request (B = 1), each with
    its own generator, sharing one `workspace` (dgemma/serving/engine.py), the rows that fit stepped together.
    `head`: rows -> fp32 logits (default the model's tied head); `draw`: "cdf" (default on CPU) or "race" (default
    on CUDA); `chunk_rows`: rows of (rows, V) logits per chunk; `keep_final`: keep what `logprobs` reads."""

    def __init__(self, model: DiffusionGemma, config: GenerationConfig, batch_size: int, *,
                 generator: torch.Generator | None = None, canvas: Tensor | None = None,
                 finished: Tensor | None = None, canvas_index: int = 0,
                 on_step: Callable[[StepInfo], None] | None = None, trace: bool = False,
                 constraint: ConstraintState | None = None, seen: rules.Seen | None = None,
                 workspace: Workspace | None = None, keep_final: bool = False,
                 head: Callable[[Tensor, Tensor | None], Tensor] | None = None, draw: Draw | None = None,
                 chunk_rows: int | None = None):
        check_supported(config)
        if constraint is not None or seen is not None:
            raise GenerationError("the sync-free sampler runs no grammar and no penalties: pass loop='readable'")
        B, L, V = batch_size, model.config.canvas_length, model.config.vocab_size
        device = model.device
        self.model, self.config, self.generator, self.vocab_size = model, config, generator, V
        self.state = CanvasState.start((B, L), V, device, config, generator=generator, canvas=canvas,
                                       finished=finished, canvas_index=canvas_index, on_step=on_step, trace=trace)
        self.weight = model.embed_tokens.weight
        # the one pass over the vocabulary (kernels.one_pass_head_and_sample) where it applies: the model's own fp32
        # tied head, inverse-CDF draws, every row in one chunk; else the row-chunked passes (head_and_sample)
        self.one_pass = head is None and (draw or "cdf") == "cdf" and one_pass_applies(model)
        if head is None:
            self.softcap = model.config.final_logit_softcapping
            head = lambda rows, out: kernels.logits_into(rows, self.weight, self.softcap, out)
        self.head = head
        self.draw = draw or ("race" if device.type == "cuda" else "cdf")
        self.chunk_rows = min(B * L, chunk_rows or default_chunk_rows(V, device))
        self.workspace = workspace or Workspace(self.chunk_rows, V, device)
        self.scale = model.config.hidden_size**0.5
        self.soft: Tensor | None = None  # the next pass's self-conditioning input (never, with self_conditioning off)
        self.use_self_conditioning = config.self_conditioning == "on"
        self.entropy = torch.zeros(B, L, device=device)
        N = config.max_denoising_steps
        # whether every entropy so far was finite (NaN or inf logits make it NaN), and the first step whose was not
        self.finite = torch.ones((), dtype=torch.bool, device=device)
        self.first_bad = torch.full((), N + 1, dtype=torch.long, device=device)
        self.remaining = N
        # with `keep_final` (the server's logprobs): the last step's final hidden state and temperature (`logprobs`)
        self.keep_final, self.final = keep_final, None

    def inputs(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Begin a step: the pass's canvas (B, L), soft embedding (B, L, D) or None, and noise level (B,) for a
        time-embedding model (None without one)."""
        self._begun = self.state.begin_step()
        return self.state.x, self.soft, self.state.level if self.model.config.time_embedding else None

    def denoiser(self, cache: KVCache, *, impl: Impl | None = None, sliding_prefix: int | None = None,
                 compile: bool = False) -> Callable[[Tensor, Tensor | None, Tensor | None], Tensor]:
        """A lone pass, (canvas, soft embedding, level) -> final hidden state: `DenoiseStep` (always the fast
        kernels, whatever `impl`)."""
        return DenoiseStep(self.model, cache, sliding_prefix=sliding_prefix, compile=compile)

    def soft_embedding(self, self_conditioning: Tensor | None) -> Tensor | None:
        """The soft embedding, as `inputs` hands it over."""
        return self_conditioning

    def read(self, final: Tensor) -> Tensor:
        """The final hidden state itself (the head is part of `step`)."""
        return final

    def temperature(self) -> Tensor:
        """This step's temperature (0-d, on the device)."""
        N = self.config.max_denoising_steps
        return rules.temperature(self.remaining, N, self.config.t_min, self.config.t_max, self.model.device)

    def batchable(self, rows: int) -> bool:
        """Whether a step of `rows` canvas rows runs the one pass over the vocabulary (`step_together` takes such
        samplers' rows in one call)."""
        return self.one_pass and not self.model.config.observed_likelihood and rows <= self.chunk_rows

    def step(self, final: Tensor, *, sync: bool = True) -> bool:
        """The sampler on the pass's final hidden state (B, L, D): head, draw, accept, renoise, stop rule; then, with
        `sync` or at the last step, the host read `finished()` (else False, without reading)."""
        state, V, n = self.state, self.vocab_size, self.remaining
        temp = self.temperature()
        observed = None
        if self.model.config.observed_likelihood:  # the readable loop's `observe`, inside the chunked head
            levels = observation_levels(rules.canvas_level(state.clean), state.carried)
            observed = (state.x, observation_boost(levels, V))
        self.keep(final, temp, observed)
        feeds_back = n > 1 and self.use_self_conditioning  # a next pass that reads a self-conditioning input
        if self.batchable(final.shape[0] * final.shape[1]):
            out = one_pass_head_and_sample(final, self.weight, self.softcap, temp, generator=self.generator,
                                           embed_scale=self.scale if feeds_back else None, workspace=self.workspace)
        else:
            out = head_and_sample(final, self.head, temp, generator=self.generator, draw=self.draw,
                                  embed=self.weight if feeds_back else None, embed_scale=self.scale,
                                  chunk_rows=self.chunk_rows, workspace=self.workspace, observed=observed)
        self.apply(out, temp)
        return self.finished() if sync or self.remaining == 0 else False

    def apply(self, out: StepDraws, temp: Tensor) -> None:
        """The rest of a step given its draws: accept by entropy, renoise, freeze the rows that stopped, stop rule."""
        state, config, V, N = self.state, self.config, self.vocab_size, self.config.max_denoising_steps
        was_done, active = self._begun
        ok = torch.isfinite(out.entropy).all()  # a device tensor: no host read here
        self.first_bad = torch.where(self.finite & ~ok, N - self.remaining + 1, self.first_bad)
        self.finite = self.finite & ok
        accepted = rules.accept_by_entropy(out.entropy, config.entropy_bound)
        new_x = rules.renoise(out.draw, accepted, V, self.generator)
        keep = was_done[:, None]  # rows that already stopped keep everything (the readable loop's freeze)
        new_argmax = torch.where(keep, state.argmax, out.argmax)
        new_x = torch.where(keep, state.x, new_x)
        self.entropy = torch.where(keep, self.entropy, out.entropy)
        if out.soft is not None and self.remaining > 1 and self.use_self_conditioning:
            self.soft = out.soft if self.soft is None else torch.where(keep[..., None], self.soft, out.soft)
        state.end_step(was_done, active, new_x, new_argmax, accepted, self.entropy, temp)
        self.remaining -= 1

    def keep(self, final: Tensor, temp: Tensor, observed: tuple[Tensor, Tensor] | None = None) -> None:
        """Keep a step's final hidden state (B, L, D), temperature and observation (tokens, boost) for `logprobs`
        (with `keep_final`)."""
        if self.keep_final:
            self.final = (final.clone(), temp, None if observed is None else tuple(t.clone() for t in observed))

    def logprobs(self, tokens: Tensor, top: int = 0) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
        """`rules.token_logprobs` of `tokens` (B, L) under the distribution the last step read: its logits (this
        sampler's head on the kept final hidden state) over its temperature, as `ReadableSampler.logprobs`
        reads for these settings. Computed once the canvas is finished, from no random number, so a request's
        tokens are the same with and without log-probabilities. Needs `keep_final`."""
        assert self.final is not None, "FastSampler.logprobs needs keep_final=True and a step"
        final, temp, observed = self.final
        B, L, D = final.shape
        logits = self.head(final.reshape(B * L, D), None).view(B, L, -1)
        if observed is not None:  # what the step's head added (an observed-likelihood model's posterior)
            logits.scatter_add_(-1, observed[0][..., None], observed[1][..., None].to(logits.dtype))
        return rules.token_logprobs(logits / temp, tokens, top)

    def finished(self) -> bool:
        """The host read: GenerationError if a step so far had non-finite logits; whether the canvas is finished
        (every row stopped, or no step left)."""
        if not bool(self.finite):
            raise non_finite_logits(self.state.canvas_index, int(self.first_bad))
        return self.remaining == 0 or self.state.all_done()

    def staged(self) -> StagedCanvas:
        return self.state.staged(self.state.x)

    @classmethod
    @torch.no_grad()
    def step_together(cls, samplers: list[FastSampler], final: Tensor) -> None:
        """`sampler.step(final[i:i + 1], sync=False)` for each of `samplers` (one-row samplers of one model, all
        `batchable`), with one head pass over all their rows: each row keeps its own temperature and its own generator
        (its uniforms are drawn from it first, its renoising after, as in `step`), and the one pass computes every row
        as it would alone, so a row's draws do not depend on the others (the serving engine's batch invariance,
        tests/serving/test_engine.py). The rows go through in groups that fit the first sampler's workspace (the engine
        gives all its samplers one), so no step allocates (rows, V) buffers; the self-conditioning product is left out
        when no row of a group needs it (every row at its last step or with self_conditioning off). No host read:
        `finished()` is each one's."""
        first, L = samplers[0], final.shape[1]
        per_pass = max(1, first.workspace.logits.shape[0] // L)
        for lo in range(0, len(samplers), per_pass):
            group, rows = samplers[lo:lo + per_pass], final[lo:lo + per_pass]
            temps = [s.temperature() for s in group]
            uniforms = torch.cat([torch.rand(L, generator=s.generator, device=final.device, dtype=torch.float64)
                                  for s in group])
            temperature = torch.stack(temps).repeat_interleave(L)[:, None]  # (rows, 1)
            soft = any(s.remaining > 1 and s.use_self_conditioning for s in group)
            fits = first.workspace.logits.shape[0] >= L * len(group)
            out = one_pass_head_and_sample(rows, first.weight, first.softcap, temperature, uniforms=uniforms,
                                           embed_scale=first.scale if soft else None,
                                           workspace=first.workspace if fits else None)
            for i, (s, temp) in enumerate(zip(group, temps, strict=True)):
                s.keep(rows[i:i + 1], temp)
                s.apply(StepDraws(out.draw[i:i + 1], out.argmax[i:i + 1], out.entropy[i:i + 1],
                                  None if out.soft is None else out.soft[i:i + 1]), temp)


def one_pass_applies(model: DiffusionGemma) -> bool:
    """Whether the fast sampler's head runs the one pass over the vocabulary (`one_pass_head_and_sample`)
    for `model` with its own head and inverse-CDF draws: an fp32 tied head on a CPU. Only such samplers can be
    stepped together (`step_together`)."""
    return model.embed_tokens.weight.dtype == torch.float32 and model.device.type == "cpu"
