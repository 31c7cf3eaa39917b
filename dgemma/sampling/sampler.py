"""The sampler protocol, and the one inner loop that drives any sampler over one canvas.

A sampler holds one canvas of B rows while it is denoised. A step is one denoising pass between `inputs` and `step`:

    x, sc, level = sampler.inputs()                   begin the step: the canvas, self-conditioning, noise level
    out = sampler.denoiser(cache)(x, sc, level)       a lone pass (`denoise_canvas`); or a pass batched with other
                                                      samplers (the serving engine) reads soft_embedding(sc), and
                                                      out = sampler.read(final), of its final hidden state
    done = sampler.step(out)                          the sampler's rules on what it reads; whether the canvas ended
    staged = sampler.staged()                         the finished canvas (StagedCanvas), never written to the cache

Two implementations: the readable sampler (dgemma/sampling/readable.py: every setting, on the pass's logits) and the
fast one (dgemma/sampling/fast_sampler.py: the entropy-bound family on the device, on the final hidden state).
`choose_loop` picks one from the settings and kernels, `new_sampler` makes it: `generate`, the serving engine and
eval drive either through this protocol alone. The sampler families (entropy-bound, Lite, ...) are strategies of the
readable sampler (dgemma/sampling/families.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from dgemma.model.attention import Impl
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.model.kv_cache import KVCache
from dgemma.sampling import fast_sampler
from dgemma.sampling.canvas import CanvasState, StagedCanvas
from dgemma.sampling.constraint import Constraint
from dgemma.sampling.fast_sampler import FastSampler
from dgemma.sampling.generation_config import GenerationConfig, GenerationError
from dgemma.sampling.kernels import Workspace, default_chunk_rows
from dgemma.sampling.readable import ReadableSampler
from dgemma.sampling.request_rules import sliding_prefix

LOOPS = {"readable": ReadableSampler, "sync-free": FastSampler}  # the sampler loops, by name


class Sampler(Protocol):
    """One canvas of B rows being denoised (module docstring). Every implementation's constructor takes
    (model, config, batch_size, *, generator, canvas, finished, canvas_index, on_step, trace, constraint, seen,
    workspace, keep_final); an option one has no use for it ignores (the readable sampler's own buffers), one it
    cannot honour it refuses (a grammar on the fast sampler)."""

    state: CanvasState

    def inputs(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Begin a step: the pass's canvas (B, L), self-conditioning in this sampler's form or None, the noise level
        (B,) for a time-embedding model (None without one)."""
        ...

    def denoiser(self, cache: KVCache, *, impl: Impl | None = None, sliding_prefix: int | None = None,
                 compile: bool = False) -> Callable[[Tensor, Tensor | None, Tensor | None], Tensor]:
        """A lone pass over `cache`: (canvas, self-conditioning, level) -> what `step` reads."""
        ...

    def soft_embedding(self, self_conditioning: Tensor | None) -> Tensor | None:
        """The self-conditioning of `inputs` as the soft embedding (B, L, D) that a pass batched with other
        samplers reads."""
        ...

    def read(self, final: Tensor) -> Tensor:
        """What `step` reads, from such a pass's final hidden state (B, L, D)."""
        ...

    def step(self, out: Tensor, *, sync: bool = True) -> bool:
        """The sampler's rules on the pass's output. Returns whether the canvas is finished; with sync=False a
        sampler may skip that host read and return False (the fast one does, until its last step)."""
        ...

    def finished(self) -> bool:
        """The host read: whether the canvas is finished (GenerationError: a step had non-finite logits)."""
        ...

    def batchable(self, rows: int) -> bool:
        """Whether a step of `rows` canvas rows can run in `step_together` with others of its kind."""
        ...

    @classmethod
    def step_together(cls, samplers: list[Any], final: Tensor) -> None:
        """`step(read(final[i:i + 1]), sync=False)` for each of `samplers` (one-row, all `batchable`), in one pass;
        each row draws what it would alone."""
        ...

    def staged(self) -> StagedCanvas:
        """The finished canvas."""
        ...

    def logprobs(self, tokens: Tensor, top: int = 0) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
        """`rules.token_logprobs` of `tokens` (B, L) under the distribution the last step read."""
        ...


def choose_loop(config: GenerationConfig, impl: Impl, *, constraint: Constraint | None = None,
                loop: str | None = None, compile: bool = False) -> str:
    """The sampler loop for `config` on `impl`'s kernels: `loop`, checked, or by default "sync-free" where the fast
    sampler implements the settings (impl="fast", no grammar, `fast_sampler.unsupported`), else "readable". An
    explicit loop="sync-free" it cannot run is a GenerationError naming why, never a silent switch of loop."""
    if loop is None:  # the sync-free loop where it implements the settings: impl="fast" is fast on every sampler
        loop = "sync-free" if impl == "fast" and constraint is None and not fast_sampler.unsupported(config) \
            else "readable"
    if loop not in LOOPS:
        raise GenerationError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    if loop == "sync-free" and impl != "fast":
        raise GenerationError("loop='sync-free' runs the fast kernels: pass impl='fast' (or loop='readable')")
    if compile and loop != "sync-free":
        raise ValueError("compile=True needs impl='fast' and the sync-free loop (the static denoise step lives in "
                         "dgemma/sampling/fast_sampler.py)")
    if loop == "sync-free":
        if constraint is not None:
            raise GenerationError("a constraint runs on the readable loop: pass loop='readable' (the sync-free loop "
                                  "draws every position at once)")
        fast_sampler.check_supported(config)  # before anything is allocated
    return loop


def new_sampler(model: DiffusionGemma, config: GenerationConfig, batch_size: int, *, loop: str = "readable",
                **options: Any) -> Sampler:
    """The sampler of `loop` (`choose_loop`) for one canvas of `batch_size` rows; `options` go to its constructor."""
    return LOOPS[loop](model, config, batch_size, **options)


def new_workspace(model: DiffusionGemma, canvases: int) -> Workspace:
    """(rows, V) buffers for samplers that share them (the serving engine's): room for `canvases` canvas rows where
    samplers step together (`fast_sampler.one_pass_applies`), else one, within the default chunk."""
    V, L, device = model.config.vocab_size, model.config.canvas_length, model.device
    canvases = canvases if fast_sampler.one_pass_applies(model) else 1
    return Workspace(min(canvases * L, default_chunk_rows(V, device)), V, device)


@torch.no_grad()
def denoise_canvas(model: DiffusionGemma, cache: KVCache, config: GenerationConfig, *, loop: str = "readable",
                   impl: Impl | None = None, compile: bool = False, step: Callable[..., Tensor] | None = None,
                   sync_every: int | None = None, **options: Any) -> StagedCanvas:
    """Denoise one canvas against what the cache holds, without writing it (stage; `model.commit` writes): the
    inner loop, for the sampler of `loop` ("readable" or "sync-free"; `options` go to its constructor: generator,
    canvas, finished, canvas_index, on_step, trace, constraint, seen, ...).

    `canvas` (B, L) replaces the initial noise (which is still drawn, keeping the random stream aligned);
    `finished` (B,) marks rows whose sequence already ended (they run along but are not counted). `impl` selects
    the model's kernels for the readable loop (default: the model's; the sync-free loop runs the fast ones);
    `compile=True` compiles the sync-free loop's denoise step; `step` replaces the sampler's lone pass (`denoiser`);
    `sync_every`: steps between the host reads of whether the canvas ended (default: every step on CPU, where a read
    costs nothing; every 4 on CUDA; the readable sampler reads at every step whatever it is told, and steps run after
    the whole batch stopped change nothing, so the per-row step counts are the same)."""
    sampler = new_sampler(model, config, cache.batch_size, loop=loop, **options)
    forward = step or sampler.denoiser(cache, impl=impl, sliding_prefix=sliding_prefix(model.config, config),
                                       compile=compile)
    sync_every = sync_every or (1 if model.device.type == "cpu" else 4)
    n = 0
    while True:
        n += 1
        if sampler.step(forward(*sampler.inputs()), sync=n % sync_every == 0):
            return sampler.staged()
