"""Continuous batching: one loop owns the model and serves many requests at once, each in its own row of one
preallocated KV cache.

    submit(prompt) -> waiting queue
    loop, between denoising steps:
        drop cancelled rows                               their slots are free at once
        admit waiting requests into free rows             prefill: commit(prompt) into the row
        one batched denoising pass over every active row  each row at its own committed length (`denoise(x, rows)`)
        each row's own sampler step                       with B = 1 and its own generator, through the sampler
                                                          protocol (dgemma/sampling/sampler.py; the rows that can,
                                                          stepped together)
        rows whose canvas finished: emit its tokens, then end (EOS, max_new_tokens) or commit it and start the next
                                                          (the outer loop: dgemma/sampling/sequence.py)

Requests join and leave between denoising steps, so N concurrent requests cost about one batched pass per step, not
N. Each request draws from its own generator (seeded by its `seed`) with the same draws, in the same order, as
`dgemma.generate(prompt, seed=seed)` of that request alone: with the reference kernels the readable sampler runs per
row on that row's logits; with the fast kernels a request the fast sampler implements runs its step
(`sampler.choose_loop`, as `generate` chooses).
The batched pass computes each row exactly as a batch of its own (attention per row over its own cache view; the
routed experts per row, or in whole row blocks with the fast kernels), so a request's tokens never depend on who else
is served; with the reference kernels they equal `generate(..., impl="reference")`'s (tests/serving/test_engine.py).

The canvases that finish at the same step are committed in one batched pass over their rows' views of the pool
(`KVCache.rows`); a prompt is prefilled on its own when its request is admitted, so a long prompt holds the other rows
for one prefill.

With `prefix_cache` (a number of tokens; dgemma/serving/prefix_cache.py) the K/V of prompt blocks outlive their
request: a prompt whose leading blocks were prefilled before gets them copied into its row and prefills only the rest.
Prompts are then prefilled in block-aligned chunks, which is what makes a request's tokens the same whether its prefix
came from the cache or not (without it, a prompt is prefilled whole, exactly as `generate` does).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dgemma.model.attention import Impl, check_impl
from dgemma.model.costs import check_memory
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.model.kv_cache import KVCache, RowCaches
from dgemma.sampling.canvas import StagedCanvas, StepInfo
from dgemma.sampling.constraint import Constraint, ConstraintState
from dgemma.sampling.generation_config import SEED_MAX, GenerationConfig, GenerationError
from dgemma.sampling.kernels import Workspace
from dgemma.sampling.request_rules import (
    canvas_count,
    check_logit_bias,
    check_prompt,
    check_seed,
    new_token_budget,
    new_token_room,
    sliding_prefix,
)
from dgemma.sampling.rules import Seen
from dgemma.sampling.sampler import Sampler, choose_loop, new_sampler, new_workspace
from dgemma.sampling.sequence import Sequences
from dgemma.serving.grammar_steps import GRAMMAR_STEP_SECONDS, GrammarSteps
from dgemma.serving.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCache
from dgemma.weights.adapters import AdapterRows, AdapterSet

log = logging.getLogger(__name__)


class EngineError(ValueError):
    """A request the engine refuses; the message names the field and value."""


class QueueFullError(EngineError):
    """`max_queue` requests are already waiting for a row (an HTTP server answers 429)."""


@dataclass(frozen=True)
class StepEvent:
    """One denoising step of a request's current canvas (only for requests submitted with `stream_steps`)."""

    canvas: int  # 0-based canvas index within the request
    step: int  # 1-based
    num_steps: int  # config.max_denoising_steps
    argmax: list[int]  # (L,) the model's current prediction for the canvas
    accepted: list[bool]  # (L,) positions the sampler kept this step
    entropy: list[float]  # (L,) nats
    grammar: list[int] | None = None  # (L,) with a constraint: 0 free, 1 pinned, 2 closed (sampling/constraint.py)


@dataclass(frozen=True)
class CanvasEvent:
    """A finished canvas: its tokens are final."""

    canvas: int
    tokens: list[int]  # new output tokens: cut before the first EOS and at max_new_tokens (EOS excluded)
    steps: int  # denoising steps this canvas took
    seconds: float = 0.0  # from the canvas's first denoising step to its end (the engine's time, batched)
    # with `logprobs`: each token's log-probability under the posterior the canvas's last step read, and the most
    # probable tokens there as (id, log-probability) (sampling.token_logprobs)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class DoneEvent:
    """The last event of every request."""

    finish_reason: str  # "stop" (an EOS token), "length" (max_new_tokens), "cancelled", "error"
    prompt_tokens: int
    completion_tokens: int  # tokens of all CanvasEvents, plus 1 for an EOS drawn within max_new_tokens (never more)
    denoising_steps: int  # denoising passes spent on this request
    seconds_to_first_canvas: float | None
    error: str | None = None
    seconds_in_queue: float | None = None  # from submission to a row (None: never admitted)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


Event = StepEvent | CanvasEvent | DoneEvent


@dataclass(frozen=True)
class EngineStats:
    """Cumulative counters since start, and gauges."""

    requests_submitted: int
    requests_finished: int
    requests_cancelled: int
    requests_failed: int
    queue_length: int  # waiting for a row
    active: int  # holding a row
    max_batch: int
    denoise_forwards: int  # batched denoising passes run
    denoise_rows: int  # sum over those passes of the rows in the batch (occupancy = rows / forwards)
    commits: int  # commit passes (prefills and finished canvases)
    generated_tokens: int  # output tokens delivered
    busy_seconds: float  # time the loop spent computing
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (0 without one)
    prefix_hits: int = 0  # of those, served from it
    prefix_blocks: int = 0  # blocks it holds now
    prefix_capacity: int = 0  # blocks it can hold
    prefix_evictions: int = 0


@dataclass(eq=False)
class Request:
    """A submitted request; `cancel()` (any thread) makes it leave before the next denoising step."""

    id: int
    prompt: list[int]
    config: GenerationConfig
    seed: int
    on_event: Callable[[Event], None]
    stream_steps: bool
    max_new: int
    submitted_at: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    # The engine thread's state.
    slot: int = -1
    length: int = 0  # committed tokens in the row
    cached: int = 0  # prompt tokens copied from the prefix cache
    loop: str = "readable"  # its sampler (`sampler.choose_loop`)
    out: Sequences | None = None  # its output canvas after canvas: the outer loop's state (grammar, penalties)
    sampler: Sampler | None = None
    generator: torch.Generator | None = None
    constraint: ConstraintState | None = None  # the request's grammar state, at the end of what it committed
    logprobs: int | None = None  # None: no log-probabilities; k: each token's and its k most probable alternatives
    adapter: str | None = None  # the LoRA adapter it runs on (None: the model itself)
    emitted: int = 0
    passes: int = 0
    first_canvas_s: float | None = None
    queue_s: float | None = None  # submission to admission
    canvas_started_at: float = 0.0
    done: bool = False
    engine: Engine | None = field(default=None, repr=False)

    def cancel(self) -> None:
        self._cancelled.set()
        if self.engine is not None:
            self.engine._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Engine:
    """Serves requests on `model` from one background thread (`start()`; `close()` stops it). `max_batch` rows of
    `max_context` committed tokens each are preallocated (the memory pre-flight refuses a pool larger than free memory
    unless `force`); `max_queue` requests may wait for a row. `impl`: the kernels (default: the model's).
    `prefix_cache`: tokens of prompt K/V kept across requests (0: none; rounded down to whole blocks of
    `prefix_block` tokens). `adapters` (dgemma/weights/adapters.py:AdapterSet): LoRA adapters of `model` a request may
    name (`submit(adapter=)`); rows with different adapters, and none, share each batched pass."""

    def __init__(self, model: DiffusionGemma, *, max_batch: int = 16, max_context: int = 4096, max_queue: int = 256,
                 impl: Impl | None = None, force: bool = False, prefix_cache: int = 0,
                 prefix_block: int = DEFAULT_BLOCK_SIZE, adapters: AdapterSet | None = None,
                 grammar_step_seconds: float = GRAMMAR_STEP_SECONDS):
        for name, value in (("max_batch", max_batch), ("max_context", max_context), ("max_queue", max_queue),
                            ("prefix_block", prefix_block)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"{name} must be a positive int, got {value!r}")
        if isinstance(prefix_cache, bool) or not isinstance(prefix_cache, int) or prefix_cache < 0:
            raise EngineError(f"prefix_cache must be an int >= 0 (tokens; 0: none), got {prefix_cache!r}")
        if 0 < prefix_cache < prefix_block:
            raise EngineError(f"prefix_cache={prefix_cache} tokens hold no block of prefix_block={prefix_block}; "
                              "give at least one block, or 0 for none")
        self.model, self.impl = model, model.impl if impl is None else impl
        check_impl(self.impl)
        cfg = model.config
        self.canvas_length = cfg.canvas_length
        self.max_context = min(max_context, cfg.max_position_embeddings)
        self.max_batch, self.max_queue = max_batch, max_queue
        if adapters is not None and adapters.model is not model:
            raise EngineError("adapters: an AdapterSet of another model; build it on the engine's model")
        self.adapters = adapters
        check_memory(cfg, model.dtype, model.device, batch_size=max_batch, cache_length=self.max_context,
                     prefix_tokens=prefix_cache // prefix_block * prefix_block, force=force)
        self.pool = model.new_cache(max_batch, self.max_context)
        self.prefix = None if prefix_cache == 0 else PrefixCache(
            cfg, prefix_cache // prefix_block, block_size=prefix_block, dtype=model.dtype, device=model.device)
        self._views = [self.pool.rows(i, i + 1) for i in range(max_batch)]  # one-row caches, made once
        self._lock = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._active: dict[int, Request] = {}  # slot -> request
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counts = dict.fromkeys(("requests_submitted", "requests_finished", "requests_cancelled",
                                      "requests_failed", "denoise_forwards", "denoise_rows", "commits",
                                      "generated_tokens"), 0)
        self._busy = 0.0
        self._buffers: Workspace | None = None
        self.grammar = GrammarSteps(self._wake, grammar_step_seconds)  # grammar steps, on their own threads

    # --- the public side (any thread) ---------------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dgemma-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop; requests still waiting or running get DoneEvent("cancelled")."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.grammar.close()
        for r in [*self._waiting, *self._active.values()]:
            self._finish(r, "cancelled")
        self._waiting.clear()
        self._active.clear()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def room(self, prompt_length: int) -> int:
        """The most new tokens a request of `prompt_length` may ask for (whole canvases; 0: the prompt does not
        fit): what it commits fits a row of `max_context` tokens (`request_rules.new_token_room`)."""
        return new_token_room(prompt_length, self.max_context, self.model.config.max_position_embeddings,
                              self.canvas_length)

    def submit(self, prompt_ids: Sequence[int], config: GenerationConfig, *, seed: int | None = None,
               on_event: Callable[[Event], None], stream_steps: bool = False,
               constraint: Constraint | None = None, logprobs: int | None = None,
               adapter: str | None = None) -> Request:
        """Queue a request for whole canvases after `prompt_ids`; its events go to `on_event`, called from the engine
        thread, in order: StepEvents (with `stream_steps`) and CanvasEvents, then one DoneEvent. `constraint`
        (dgemma/sampling/constraint.py): a grammar every committed canvas keeps the output a valid prefix of.
        `logprobs`: the CanvasEvents carry each token's log-probability and this many alternatives
        (CanvasEvent.logprobs).
        `adapter`: the name of one of the engine's LoRA `adapters` to run the request on (None: the model itself).
        Raises EngineError for a request that cannot run, QueueFullError when the queue is full."""
        if not isinstance(config, GenerationConfig):
            raise EngineError(f"config must be a GenerationConfig, got {type(config).__name__}")
        try:
            prompt = check_prompt(prompt_ids, self.model.config.vocab_size)
            seed = secrets.randbelow(SEED_MAX + 1) if seed is None else check_seed(seed)
            max_new = new_token_budget(config, len(prompt))
            check_logit_bias(config, self.model.config.vocab_size)
        except GenerationError as e:
            raise EngineError(str(e)) from None
        room = self.room(len(prompt))
        if max_new > room:
            L = self.canvas_length
            raise EngineError(f"{len(prompt)} prompt tokens + max_new_tokens={max_new} ({canvas_count(max_new, L)} "
                              f"canvases of {L}) exceed the context of {self.max_context} tokens per request"
                              + (f"; at most {room} new tokens fit" if room > 0 else ""))
        with self._lock:
            if self._stopping:
                raise EngineError("the engine is closed")
            if adapter is not None:  # under the lock: an unload cannot slip in before the request is queued
                self._check_adapter(adapter, "adapter")
            free = self.max_batch - len(self._active)  # rows the waiting requests take at the next step
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting (max_queue={self.max_queue}, "
                                     f"{max(free, 0)} free rows)")
            request = Request(self._next_id, prompt, config, seed, on_event, stream_steps, max_new, engine=self,
                              constraint=None if constraint is None else constraint.start(1, max_new),
                              logprobs=logprobs, adapter=adapter,
                              loop=choose_loop(config, self.impl, constraint=constraint))
            self._next_id += 1
            self._waiting.append(request)
            self._counts["requests_submitted"] += 1
            self._lock.notify_all()
        return request

    def complete(self, prompt_ids: Sequence[int], config: GenerationConfig, *, seed: int | None = None,
                 timeout: float | None = None) -> tuple[list[int], DoneEvent]:
        """Submit and wait: the output tokens (EOS excluded) and the DoneEvent."""
        tokens: list[int] = []
        done: list[DoneEvent] = []
        finished = threading.Event()

        def on_event(event: Event) -> None:
            if isinstance(event, CanvasEvent):
                tokens.extend(event.tokens)
            elif isinstance(event, DoneEvent):
                done.append(event)
                finished.set()

        request = self.submit(prompt_ids, config, seed=seed, on_event=on_event)
        if not finished.wait(timeout):
            request.cancel()
            raise TimeoutError(f"request {request.id} did not finish within {timeout} s")
        return tokens, done[0]

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter in directory `path` as `name` from the next pass on (any thread; its file is read
        before the engine is held). AdapterError naming the file, key or value for an adapter that does not fit."""
        with self._lock:
            if self.adapters is None:
                self.adapters = AdapterSet(self.model)
            adapters = self.adapters
        adapters.add(name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` and forget its prefix-cache blocks. Refused (EngineError) while a request
        waiting or running uses it: those end first."""
        with self._lock:
            self._check_adapter(name, "lora_name")
            users = sum(r.adapter == name for r in (*self._waiting, *self._active.values()))
            if users:
                raise EngineError(f"lora_name: adapter {name!r} is in use by {users} request(s); unload it once they "
                                  "end")
            self.adapters.remove(name)
            if self.prefix is not None:
                self.prefix.drop(name)

    def _check_adapter(self, name: str, field: str) -> None:
        """EngineError naming `field` unless `name` is one of the adapters served now."""
        if self.adapters is None or name not in self.adapters:
            have = ", ".join(repr(n) for n in self.adapters.names) if self.adapters else "none"
            raise EngineError(f"{field}: no adapter named {name!r} (loaded: {have})")

    def stats(self) -> EngineStats:
        with self._lock:
            prefix = {} if self.prefix is None else {f"prefix_{k}": v for k, v in vars(self.prefix.stats()).items()}
            return EngineStats(queue_length=len(self._waiting), active=len(self._active), max_batch=self.max_batch,
                               busy_seconds=self._busy, **self._counts, **prefix)

    # --- the loop (the engine thread) ---------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._waiting and not self.grammar.ready() and \
                        all(self.grammar.busy(r) and not r.cancelled for r in self._active.values()):
                    self._lock.wait()  # no row can step: none, or all wait for their grammar step
                if self._stopping:
                    return
                admitted = []
                while self._waiting and len(self._active) + len(admitted) < self.max_batch:
                    admitted.append(self._waiting.popleft())
            started = time.perf_counter()
            try:
                self._iteration(admitted)
            except Exception as e:  # a bug or a device error: fail what is in flight, keep serving
                log.exception("engine iteration failed")
                for r in {id(r): r for r in [*admitted, *self._active.values()]}.values():
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
            with self._lock:
                self._busy += time.perf_counter() - started

    @torch.no_grad()
    def _iteration(self, admitted: list[Request]) -> None:
        going_on = []
        for r, ended, error in self.grammar.done():  # grammar steps that ended (dgemma/serving/grammar_steps.py)
            if error is not None:
                self._finish(r, "error", error=error)
            elif ended is not None and (tokens := self._end_canvas(r, *ended)) is not None:
                going_on.append((r, tokens))
        self._commit_canvases(going_on)
        for r in list(self._active.values()):
            if r.cancelled:
                self._finish(r, "cancelled")
        free = sorted(set(range(self.max_batch)) - set(self._active))
        for r in admitted:
            if r.cancelled:
                self._finish(r, "cancelled")
                continue
            r.slot = free.pop(0)
            r.queue_s = time.perf_counter() - r.submitted_at
            self._active[r.slot] = r
            r.generator = torch.Generator(device=self.model.device).manual_seed(r.seed)
            seen = Seen.of(torch.tensor([r.prompt], device=self.model.device), self.model.config.vocab_size) \
                if r.config.penalizes else None
            r.out = Sequences(r.config, 1, r.max_new, self.canvas_length, self.model.device, grammar=r.constraint,
                              seen=seen)
            self._prefill(r)
            self._start_canvas(r)
        rows = [r for r in self._active.values() if r.sampler is not None and not self.grammar.busy(r)]
        by_prefix: dict[str, list[Request]] = {}
        for r in rows:
            by_prefix.setdefault(r.config.sliding_prefix, []).append(r)
        for group in by_prefix.values():
            self._denoise_step(group)

    def _prefill(self, r: Request) -> None:
        """Commit the prompt into the request's row: whole, or with a prefix cache, its cached leading blocks copied
        and the rest committed block by block (dgemma/serving/prefix_cache.py), then its new blocks stored."""
        if self.prefix is None:
            self._commit(r, r.prompt)
            return
        namespace = r.adapter or ""  # K/V an adapter computed are its own
        with self._lock:  # stats() reads the prefix cache's counters
            r.cached = r.length = self.prefix.load(r.prompt, self._view(r), namespace)
        for a, b in self.prefix.chunks(r.length, len(r.prompt)):
            self._commit(r, r.prompt[a:b])
        with self._lock:
            self.prefix.save(r.prompt, self._view(r), namespace)

    def _adapters(self, rows: list[Request]) -> AdapterRows | None:
        """Which adapter each of `rows` runs (None: no row runs one)."""
        return None if self.adapters is None else self.adapters.rows([r.adapter for r in rows])

    def _commit(self, r: Request, tokens: list[int]) -> None:
        view = self._view(r)
        self.model.commit(torch.tensor([tokens], device=self.model.device), view, impl=self.impl,
                          adapters=self._adapters([r]))
        r.length = view.length
        self._count("commits")

    def _view(self, r: Request) -> KVCache:
        """The request's row of the pool as a one-row cache at its committed length."""
        view = self._views[r.slot]
        view.length = r.length
        return view

    def _start_canvas(self, r: Request) -> None:
        r.canvas_started_at = time.perf_counter()
        on_step = (lambda info, r=r: self._on_step(r, info)) if r.stream_steps else None
        r.sampler = new_sampler(self.model, r.config, 1, loop=r.loop, generator=r.generator, on_step=on_step,
                                workspace=self._workspace(), keep_final=r.logprobs is not None,
                                **r.out.sampler_options())  # type: ignore[union-attr]

    def _workspace(self) -> Workspace:
        """The samplers' (rows, V) buffers, one pair for the engine, reused by every step: a row's own step and,
        where samplers are stepped together, those passes over several rows (as many canvases as fit, up to
        `max_batch`) run one at a time."""
        if self._buffers is None:
            self._buffers = new_workspace(self.model, self.max_batch)
        return self._buffers

    def _denoise_step(self, rows: list[Request]) -> None:
        """One batched pass over `rows` (one sliding-prefix rule), each at its own length, then each row's sampler
        step on its own row of the pass: the head and the self-conditioning input of a row are what the request
        alone computes (per row, or for the fast rows in one row-wise call), so no row's numbers depend on the
        others'."""
        model, device = self.model, self.model.device
        samplers = [r.sampler for r in rows if r.sampler is not None]  # all of them: the rows stepping
        inputs = [s.inputs() for s in samplers]
        x = torch.cat([canvas for canvas, _, _ in inputs])
        softs = [s.soft_embedding(sc) for s, (_, sc, _) in zip(samplers, inputs, strict=True)]
        soft = level = None
        if any(s is not None for s in softs):
            D = model.config.hidden_size
            zero = torch.zeros(1, self.canvas_length, D, dtype=model.dtype, device=device)  # = no signal, exactly
            soft = torch.cat([zero if s is None else s for s in softs])
        if model.config.time_embedding:
            level = torch.cat([t for _, _, t in inputs])  # each row's own level (B,)
        del inputs, softs
        caches = RowCaches([self._view(r) for r in rows])
        prefix = sliding_prefix(model.config, rows[0].config)
        final = model.denoise_hidden(x, caches, soft=soft, sliding_prefix=prefix, t=level, impl=self.impl,
                                     adapters=self._adapters(rows))
        del soft
        self._count("denoise_forwards")
        self._count("denoise_rows", len(rows))
        together: dict[type, list[int]] = {}  # the rows whose samplers step together, by kind (one head pass each)
        for i, s in enumerate(samplers):
            if s.batchable(self.canvas_length):
                together.setdefault(type(s), []).append(i)
        for kind, group in together.items():
            kind.step_together([samplers[i] for i in group], final[group])
        stepped = {i for group in together.values() for i in group}
        going_on: list[tuple[Request, list[int]]] = []
        for i, (r, s) in enumerate(zip(rows, samplers, strict=True)):
            r.passes += 1
            try:
                if i in stepped:
                    finished = s.finished()
                elif r.constraint is not None:  # its grammar's work runs on a worker meanwhile
                    self.grammar.submit(r, s.read(final[i:i + 1]))
                    continue
                else:
                    finished = s.step(s.read(final[i:i + 1]))
            except ValueError as e:  # GenerationError: non-finite logits in this row
                self._finish(r, "error", error=str(e))
                continue
            if finished:
                tokens = self._end_canvas(r, s.staged())
                if tokens is not None:
                    going_on.append((r, tokens))
        self._commit_canvases(going_on)

    def _commit_canvases(self, going_on: list[tuple[Request, list[int]]]) -> None:
        """One batched commit of the canvases that finished at this step, each at its row's end; then their next."""
        if going_on:
            views = RowCaches([self._view(r) for r, _ in going_on])
            ids = torch.tensor([tokens for _, tokens in going_on], device=self.model.device)
            self.model.commit(ids, views, impl=self.impl, adapters=self._adapters([r for r, _ in going_on]))
            self._count("commits")
            for (r, _), view in zip(going_on, views.rows, strict=True):
                r.length = view.length
                self._start_canvas(r)

    def _end_canvas(self, r: Request, staged: StagedCanvas, scores: tuple[list, list] | None = None
                    ) -> list[int] | None:
        """Emit a finished canvas (`scores`: its log-probabilities if a grammar step took them), taken into the
        request's output by the outer loop (`Sequences.end_canvas`: cut at EOS and the budget); end the request or
        return the tokens to commit before its next canvas."""
        if scores is None and r.logprobs is not None:
            scores = r.sampler.logprobs(staged.tokens, r.logprobs)  # type: ignore[union-attr]
        r.sampler = None
        index = r.out.canvas  # type: ignore[union-attr]
        end = r.out.end_canvas(staged)  # type: ignore[union-attr]
        out, eos = end.output[0], end.eos[0]  # eos: an EOS drawn within the budget (it counts as generated)
        r.emitted += len(out)
        if r.first_canvas_s is None:
            r.first_canvas_s = time.perf_counter() - r.submitted_at
        self._count("generated_tokens", len(out))
        logprobs, top = (None, None) if scores is None else (scores[0][0][:len(out)], scores[1][0][:len(out)])
        self._emit(r, CanvasEvent(index, out, int(staged.steps[0]), time.perf_counter() - r.canvas_started_at,
                                  logprobs, top))
        if r.constraint is not None and r.constraint.failed[0] is not None:  # the grammar gave up or ran out of
            self._finish(r, "length", error=r.constraint.failed[0])  # time: an honest incomplete answer
        elif eos or (r.constraint is not None and r.constraint.complete()[0]):  # or the grammar's sentence is complete
            self._finish(r, "stop", eos=eos)
        elif bool(end.ended[0]):  # its budget is spent
            self._finish(r, "length")
        elif not r.cancelled:
            return end.tokens[0].tolist()
        return None

    def _on_step(self, r: Request, info: StepInfo) -> None:
        self._emit(r, StepEvent(info.canvas, info.step, info.num_steps, info.argmax[0].tolist(),
                                info.accepted[0].tolist(), info.entropy[0].tolist(),
                                None if info.grammar is None else info.grammar[0].tolist()))

    def _finish(self, r: Request, reason: str, error: str | None = None, eos: bool = False) -> None:
        if r.done:
            return
        r.done = True
        if r.slot >= 0 and self._active.get(r.slot) is r:
            del self._active[r.slot]
        r.sampler = None
        completion = r.emitted + eos
        key = {"cancelled": "requests_cancelled", "error": "requests_failed"}.get(reason, "requests_finished")
        self._count(key)
        self._emit(r, DoneEvent(reason, len(r.prompt), completion, r.passes, r.first_canvas_s, error, r.queue_s,
                                r.cached))

    def _emit(self, r: Request, event: Event) -> None:
        try:
            r.on_event(event)
        except Exception:  # a consumer's bug must not stop the loop; that request goes
            log.exception("on_event of request %d raised; cancelling it", r.id)
            r._cancelled.set()

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n
