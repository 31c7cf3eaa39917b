"""The HTTP layer of `dgemma serve`: a FastAPI app over a running `Engine` (docs/serving.md).

`create_app(engine, tokenizer, model_name)` serves OpenAI's `/v1/models`, `/v1/completions` and
`/v1/chat/completions` (JSON, or server-sent events with one chunk per committed canvas and, on request, one per
denoising step), `/health`, `/metrics` (Prometheus) and the live page at `/`. A request passes `guards` (Host
name, key, content type, its body read under a size cap and a time limit), is parsed by `api` (pure rules, on a
worker thread), turned into engine submissions (one per choice), and answered from the engine's events, which the engine
thread hands to the event loop with `call_soon_threadsafe`. A client that goes away cancels its engine requests at
once. Every error is OpenAI's error object; nothing sends a traceback. `serve(app, host, port)` runs it on uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma.data.templates import (
    GEMMA_QUOTE,
    GEMMA_TOOL_CALL,
    ChatTemplate,
    OutputParser,
    ParsedOutput,
)
from dgemma.data.tokenizer import Tokenizer
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.adapter_routes import add_adapter_routes
from dgemma.serving.api import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    GenerationRequest,
    Limits,
    parse_chat_request,
    parse_completion_request,
    parse_json,
)
from dgemma.serving.choice import Choice
from dgemma.serving.engine import CanvasEvent, DoneEvent, EngineError, QueueFullError, StepEvent
from dgemma.serving.errors import APIError, error_body, model_not_found, rate_limited
from dgemma.serving.guards import (
    HostCheck,
    check_api_key,
    header_timeout_protocol,
    read_body,
    require_json,
)
from dgemma.serving.metrics import CountRequests, Metrics
from dgemma.serving.scoring import ScoringRun
from dgemma.serving.tokenizer_routes import add_tokenizer_routes

log = logging.getLogger("dgemma.serve")
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MAX_CONCURRENCY = 256
POLL_S = 0.1  # how often a waiting request checks whether its client is still there
PLACEHOLDER_PAGE = ("<!doctype html><title>dgemma serve</title><p>dgemma serve is running. The OpenAI API is at "
                    "<code>/v1</code>; <code>/health</code> and <code>/metrics</code> describe it.</p>")


class ClientGone(Exception):
    """The client disconnected while its request was being generated."""


def create_app(engine: Any, tokenizer: Tokenizer, model_name: str, *, template: ChatTemplate | None = None,
               generation_config: GenerationConfig | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
               limits: Limits | None = None, body_timeout: float = DEFAULT_BODY_TIMEOUT,
               allowed_hosts: Sequence[str] | None = None, allow_runtime_lora: bool = False,
               autoregressive: bool = False) -> FastAPI:
    """The app over a started `engine`. `generation_config` holds the defaults a request overrides (the checkpoint's:
    `dgemma.load_generation_config`; default GenerationConfig's, transformers' defaults); `template` the chat
    template (default: dgemma's Gemma template); `api_key`, when given, is required as `Authorization: Bearer KEY` on
    /v1/*; `limits` caps the work of one request (default: `Limits()`), `body_timeout` the seconds its body may take to
    arrive; `allowed_hosts` (`guards.allowed_hosts`), when given, are the only Host names answered. The engine's LoRA
    adapters (`Engine(adapters=)`) are each served as a model of their own (a request names one in `model`);
    `allow_runtime_lora` adds the routes that load and unload them while serving (dgemma/serving/adapter_routes.py).
    `autoregressive`: the model is an AR run (objective 'ar'), served for scoring (echo) and the tokenizer routes only.
    Raises ValueError for a setting that cannot work (an empty key, a default config over `limits`)."""
    check_api_key(api_key)
    if not body_timeout > 0:
        raise ValueError(f"--body-timeout: must be > 0 seconds, got {body_timeout!r}")
    limits = limits or Limits()
    config = generation_config or GenerationConfig()
    try:
        limits.check_steps(config)
    except APIError as e:
        raise ValueError(f"the default sampler settings exceed the server's limits: {e}") from None
    state = _State(engine, tokenizer, model_name, template or ChatTemplate(None), config, api_key,
                   max_request_bytes, max_concurrency, limits, body_timeout, autoregressive)
    app = FastAPI(title="dgemma serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dgemma = state
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)
    app.add_middleware(CountRequests, counter=state.metrics.requests)  # added last: outermost, counts refusals too

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"{param or 'request'}: {first.get('msg', 'invalid')}", param=param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(message, code="not_found" if e.status_code == 404 else None), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error answering %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"), 500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = engine.stats()
        return {"status": "ok", "model": model_name, "active": s.active, "queue_length": s.queue_length,
                "max_batch": s.max_batch, "in_flight": state.in_flight}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def page() -> HTMLResponse:
        resource = resources.files("dgemma.serving") / "page.html"
        return HTMLResponse(resource.read_text(encoding="utf-8") if resource.is_file() else PLACEHOLDER_PAGE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state.authorize(request)
        return {"object": "list", "data": [state.model_card(m) for m in (model_name, *state.adapters)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        state.authorize(request)
        if model_id != model_name and model_id not in state.adapters:
            raise model_not_found(model_id, state.served())
        return state.model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state.respond(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state.respond(request, "chat")

    add_tokenizer_routes(app, state)
    if allow_runtime_lora:
        add_adapter_routes(app, state)
    return app


class _State:
    """What the routes share: the engine, tokenizer, template, limits and metrics."""

    def __init__(self, engine: Any, tokenizer: Tokenizer, model_name: str, template: ChatTemplate,
                 config: GenerationConfig, api_key: str | None, max_request_bytes: int, max_concurrency: int,
                 limits: Limits, body_timeout: float, autoregressive: bool = False):
        self.autoregressive = autoregressive  # an AR run: scoring only (dgemma/serving/scoring.py)
        self.engine, self.tokenizer, self.model_name, self.template = engine, tokenizer, model_name, template
        self.config, self.api_key, self.limits, self.body_timeout = config, api_key, limits, body_timeout
        self.max_request_bytes, self.max_concurrency = max_request_bytes, max_concurrency
        self.in_flight, self.created = 0, int(time.time())
        self.stopping = False  # set on Ctrl-C / SIGTERM (`serve`): open requests end at once with an error
        self.metrics = Metrics(engine, lambda: self.in_flight, model_name)
        self._pieces: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._special = tokenizer.special_tokens()

    # --- requests ---

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError("missing or wrong API key: send `Authorization: Bearer KEY`", status=401,
                           code="invalid_api_key")

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters served beside the model, by name (the engine's)."""
        return () if self.engine.adapters is None else self.engine.adapters.names

    def model_card(self, name: str) -> dict[str, Any]:
        """/v1/models' entry of the model or of an adapter, whose `parent` is the model (as vLLM lists them)."""
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "dgemma"}
        return card if name == self.model_name else card | {"parent": self.model_name}

    def served(self) -> tuple[str, ...]:
        """The models this server serves, by name: the model itself, then its adapters."""
        return (self.model_name, *self.adapters)

    def adapter_of(self, body: dict[str, Any]) -> str | None:
        """The adapter a request names in `model` (None: the model itself); 404 naming what is served for an
        unknown name (a non-string `model` is the request parser's to refuse)."""
        model = body.get("model")
        if model in self.adapters:
            return model
        if self.adapters and isinstance(model, str) and model != self.model_name:
            raise model_not_found(model, self.served())
        return None

    async def respond(self, request: Request, kind: str) -> Response:
        """Answer a generation request. It counts against --max-concurrency only once its body has arrived and
        parses (a slow client holds no place); parsing, template rendering and tokenizing run on a worker thread,
        so a large prompt does not stall the event loop (and /health) while it is tokenized."""
        self.authorize(request)
        require_json(request)
        body = await run_in_threadpool(parse_json, await read_body(request, self.max_request_bytes,
                                                                   self.body_timeout))
        if self.in_flight >= self.max_concurrency:
            raise rate_limited(f"too many requests in flight ({self.max_concurrency}, --max-concurrency); retry later")
        self.in_flight += 1
        try:
            req = await run_in_threadpool(self._parse, kind, body)
            if req.ignored:
                log.warning("ignored request field(s) with no effect here: %s", ", ".join(req.ignored))
            adapter = self.adapter_of(body)
            if self.autoregressive and req.scoring is None:
                raise APIError(f"model: {self.model_name!r} is an autoregressive run (objective 'ar'), served here "
                               "for scoring only (echo: true with max_tokens 0 or 1); the engine generates with the "
                               "diffusion sampler, which does not decode it (docs/serving.md)", param="model")
            run = (_Run if req.scoring is None else ScoringRun)(self, req, request, adapter)
            run.submit()
            self.metrics.admitted(adapter)
        except BaseException:
            self.in_flight -= 1
            raise
        if req.stream:
            return _EventStream(run.stream(), on_close=partial(self._release, run))
        try:
            return JSONResponse(await run.complete())
        except ClientGone:  # nobody reads it; the metrics count it as nginx's "client closed request", not 200
            return Response(status_code=499)
        finally:
            self._release(run)

    def _parse(self, kind: str, body: dict[str, Any]) -> GenerationRequest:
        common = {"tokenizer": self.tokenizer, "base_config": self.config,
                  "model_name": self.adapter_of(body) or self.model_name,
                  "limits": self.limits, "canvas_length": self.engine.model.config.canvas_length}
        if kind == "chat":
            return parse_chat_request(body, template=self.template, **common)
        return parse_completion_request(body, **common)

    def _release(self, run: _Run) -> None:
        run.cancel()
        self.in_flight -= 1

    # --- text ---

    def decoder(self, keep: tuple[str, ...]) -> Callable[[list[int]], str]:
        """Decodes committed ids to response text: special tokens removed, except those the output parser needs
        (the markers of `keep`)."""
        drop = {i for i, t in self._special.items() if not any(t and t in m for m in keep)}
        return lambda ids: self.tokenizer.decode([i for i in ids if i not in drop])

    def token_bytes(self, token_id: int) -> bytes:
        """One id's own bytes (`Tokenizer.token_bytes`: a token that is part of a UTF-8 character has those bytes, so
        that a choice's logprobs `bytes` join into its text's)."""
        kept = self._bytes.get(token_id)
        if kept is None:
            kept = self._bytes[token_id] = self.tokenizer.token_bytes(token_id)
        return kept

    def piece(self, token_id: int) -> str:
        """One id decoded alone, special tokens shown (the denoising stream's `tokens`)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return text


class _EventStream(StreamingResponse):
    """Server-sent events that always run `on_close` when the response ends, however it ends (done, the client
    gone before the first byte or in the middle, the server stopping), so engine requests never outlive it."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _Run:
    """One HTTP generation request: its engine submissions, their events (bridged from the engine thread to this
    event loop), and the response built from them, whole or as server-sent events."""

    def __init__(self, state: _State, req: GenerationRequest, request: Request, adapter: str | None = None):
        self.state, self.req, self.request = state, req, request
        self.adapter = adapter  # the LoRA adapter the request names (None: the model itself)
        self.model = adapter or state.model_name  # what the response says served it
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{secrets.token_hex(12)}", int(time.time())
        self.object = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        keep = tuple(m for c in req.conventions for m in (c.open, c.close))
        keep += (GEMMA_QUOTE,) if GEMMA_TOOL_CALL in req.conventions else ()
        decode = state.decoder(keep)
        self.choices = [Choice(s.index, decode, req.stop,
                                OutputParser(req.conventions, start=req.opened) if req.conventions else None,
                                calls_only=req.calls_only)
                        for s in req.submissions]
        self.prompt_tokens = sum(len(p) for p in req.prompts)
        self.started = time.perf_counter()
        self.counted = False  # usage and latency go to the metrics once, however the run ends

    def submit(self) -> None:
        engine = self.state.engine
        most = engine.max_batch + engine.max_queue
        if len(self.req.submissions) > most:  # a 429 could never succeed: what the server can hold at once
            raise APIError(f"n: this request makes {len(self.req.submissions)} choices (n x prompts); this server "
                           f"holds at most {most} at once (--max-batch {engine.max_batch} + --max-queue "
                           f"{engine.max_queue})", param="n")
        for sub, choice in zip(self.req.submissions, self.choices, strict=True):
            prompt, config = self.req.prompts[sub.prompt], sub.config
            room = engine.room(len(prompt))
            if self.req.max_tokens_field is None and 0 < room < config.max_new_tokens:
                config = config.replace(max_new_tokens=room)  # the server's default, clamped to what fits
            choice.submitted_at = time.perf_counter()
            try:
                choice.handle = engine.submit(
                    prompt, config, seed=sub.seed,
                    on_event=partial(self._on_event, sub.index), stream_steps=self.req.include_denoising,
                    constraint=self.req.constraint, logprobs=self.req.logprobs,
                    **({"adapter": self.adapter} if self.adapter is not None else {}))
            except QueueFullError as e:
                self.cancel()
                raise rate_limited(f"the engine queue is full ({e}); retry later") from None
            except EngineError as e:
                self.cancel()
                prompt_field = "messages" if self.req.kind == "chat" else "prompt"
                too_many = room > 0 and config.max_new_tokens > room and self.req.max_tokens_field is not None
                raise APIError(str(e), param=self.req.max_tokens_field if too_many else prompt_field) from None

    def _on_event(self, index: int, event: Any) -> None:
        """Called on the engine thread: hand the event to the event loop (never raises)."""
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is stopping, nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    def cancel(self) -> None:
        for c in self.choices:
            if c.handle is not None and not c.done:
                c.handle.cancel()

    async def _next(self) -> tuple[int, Any]:
        while True:
            if self.state.stopping:  # a stream ends with this error event and [DONE], not a broken chunked read
                raise APIError("the server is shutting down; the request was cancelled", status=503,
                               type="server_error", code="server_shutting_down")
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=POLL_S)
            except TimeoutError:
                if await self.request.is_disconnected():
                    raise ClientGone from None

    async def events(self) -> AsyncIterator[tuple[Choice, Any, list[tuple[str, Any]]]]:
        """(choice, event, new pieces of text) until every choice is done; cancels what is left on the way out
        (a disconnect, a stop string, an error)."""
        try:
            while not all(c.done for c in self.choices):
                index, event = await self._next()
                choice = self.choices[index]
                if choice.done:
                    continue
                pieces: list[tuple[str, Any]] = []
                metrics = self.state.metrics
                if isinstance(event, CanvasEvent):
                    metrics.canvas_steps.observe(event.steps)
                    metrics.canvas_seconds.observe(event.seconds)
                    if choice.canvases == 0:
                        metrics.ttfc.observe(time.perf_counter() - choice.submitted_at)
                    choice.canvases, choice.steps = choice.canvases + 1, choice.steps + event.steps
                    pieces = choice.on_canvas(list(event.tokens), event.logprobs, event.top_logprobs)
                    if choice.stopped:  # a stop string: this choice is finished, its row leaves the batch
                        choice.handle.cancel()
                        pieces += choice.close()
                        choice.done, choice.finish_reason = True, "stop"
                        choice.completion_tokens = choice.returned_tokens()
                elif isinstance(event, DoneEvent):
                    if event.seconds_in_queue is not None:
                        metrics.queue_time.observe(event.seconds_in_queue)
                    if event.finish_reason not in ("stop", "length"):
                        raise APIError(f"generation failed: {event.error or event.finish_reason}", status=500,
                                       type="server_error")
                    pieces = choice.finish()
                    choice.done, choice.finish_reason = True, event.finish_reason
                    choice.completion_tokens = event.completion_tokens
                if choice.done and choice.parsed.tool_calls and choice.finish_reason == "stop":
                    choice.finish_reason = "tool_calls"
                if choice.done and choice.steps:
                    metrics.tokens_per_step.observe(choice.completion_tokens / choice.steps)
                yield choice, event, pieces
        finally:
            self.cancel()
            for c in self.choices:
                c.done = True
            self._count()

    def _count(self) -> None:
        """Usage and end-to-end latency into the metrics, once, for every request (streamed or not, with or without
        include_usage, ended by a stop string, an EOS, the budget or the client leaving)."""
        if not self.counted:
            self.counted = True
            self.state.metrics.usage(self.prompt_tokens, sum(c.completion_tokens for c in self.choices))
            self.state.metrics.e2e.observe(time.perf_counter() - self.started)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix cache served (a
        prompt's n choices count it once, with the fewest any of them reused)."""
        completion = sum(c.completion_tokens for c in self.choices)
        cached: dict[int, int] = {}
        for sub, c in zip(self.req.submissions, self.choices, strict=True):
            reused = c.handle.cached if c.handle is not None else 0  # set by the engine before its first event
            cached[sub.prompt] = min(cached.get(sub.prompt, reused), reused)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    async def complete(self) -> dict[str, Any]:
        """The whole response (non-streaming)."""
        async for _ in self.events():  # ClientGone: the caller answers 499
            pass
        choices = []
        for c in self.choices:
            if self.req.kind == "completion":
                choices.append({"index": c.index, "text": c.parsed.content if c.parser else c.text[:c.sent],
                                "logprobs": self._logprobs(c.logprobs[:c.returned_tokens()]),
                                "finish_reason": c.finish_reason})
                continue
            p = c.parsed if c.parser is not None else ParsedOutput(content=c.text[:c.sent])
            message: dict[str, Any] = {"role": "assistant", "content": p.content or (None if p.tool_calls else "")}
            if p.reasoning:
                message["reasoning_content"] = p.reasoning
            if p.tool_calls:
                message["tool_calls"] = p.tool_calls
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c.logprobs[:c.returned_tokens()]),
                            "finish_reason": c.finish_reason})
        return {"id": self.id, "object": self.object.removesuffix(".chunk"), "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: role chunks (chat), text per canvas, denoising steps (on request), finish chunks,
        usage (on request), [DONE]. An error after the stream began is sent as an error event."""
        try:
            if self.req.kind == "chat":
                for c in self.choices:
                    yield self._chunk([self._delta(c, {"role": "assistant", "content": ""})])
            async for choice, event, pieces in self.events():
                if isinstance(event, StepEvent):
                    yield self._chunk([], denoising=self._denoising(choice, event))
                    continue
                deltas = [self._delta(choice, d) for d in self._piece_deltas(choice, pieces)]
                if self.req.logprobs is not None and isinstance(event, CanvasEvent):  # this canvas's tokens, once
                    got = choice.logprobs[choice.logprobs_sent:choice.returned_tokens()]
                    choice.logprobs_sent += len(got)
                    deltas = deltas or [self._delta(choice, {} if self.req.kind == "chat" else "")]
                    deltas[0]["logprobs"] = self._logprobs(got)
                if deltas:
                    yield self._chunk(deltas)
                if choice.done:
                    yield self._chunk([self._delta(choice, {} if self.req.kind == "chat" else "",
                                                   choice.finish_reason)])
            if self.req.include_usage:
                yield self._chunk([], usage=self.usage())
        except ClientGone:
            return
        except APIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    def _logprobs(self, tokens: list[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any] | None:
        """OpenAI's logprobs object of `tokens` (id, log-probability, alternatives): chat's `content` entries, or the
        completions endpoint's parallel lists; None where the request asked for none."""
        if self.req.logprobs is None:
            return None
        piece = self.state.piece
        if self.req.kind == "chat":
            entry = lambda t, lp: {"token": piece(t), "logprob": lp, "bytes": list(self.state.token_bytes(t))}
            return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top]}
                                for t, lp, top in tokens], "refusal": None}
        offsets, at = [], 0
        for t, _, _ in tokens:
            offsets.append(at)
            at += len(piece(t))
        return {"tokens": [piece(t) for t, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens],
                "top_logprobs": [{piece(a): alp for a, alp in top} for _, _, top in tokens] if self.req.logprobs
                else None, "text_offset": offsets}

    def _piece_deltas(self, choice: Choice, pieces: list[tuple[str, Any]]) -> list[Any]:
        if self.req.kind == "completion":
            return ["".join(text for _, text in pieces)] if pieces else []
        out: list[Any] = []
        for kind, value in pieces:
            if kind == "tool_call":
                out.append({"tool_calls": [{"index": choice.calls_sent, **value}]})
                choice.calls_sent += 1
            else:
                out.append({"reasoning_content" if kind == "reasoning" else "content": value})
        return out

    def _delta(self, choice: Choice, delta: Any, finish_reason: str | None = None) -> dict[str, Any]:
        if self.req.kind == "completion":
            return {"index": choice.index, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _denoising(self, choice: Choice, e: StepEvent) -> dict[str, Any]:
        return {"choice": choice.index, "canvas": e.canvas, "step": e.step, "num_steps": e.num_steps,
                "token_ids": list(e.argmax), "tokens": [self.state.piece(t) for t in e.argmax],
                "accepted": [bool(a) for a in e.accepted],
                "entropy": [round(float(h), 4) if math.isfinite(h) else None for h in e.entropy],
                "text": choice.text} | ({} if e.grammar is None else {"grammar": list(e.grammar)})

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created,
                                 "model": self.model, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        chunk.update(extra)
        return _sse(chunk)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "warning",
          announce: Callable[[str], None] = print, header_timeout: float = DEFAULT_HEADER_TIMEOUT) -> None:
    """Run `app` on uvicorn at host:port until Ctrl-C (or SIGTERM); `announce` gets the URL once the port listens
    (port 0: a free one), so a client may connect the moment it reads the URL: connections made before uvicorn's
    loop runs wait in the listen backlog instead of being refused. At the signal, open requests end within a poll
    (POLL_S) with a 503 error, a stream with an error event and [DONE]. A request's line and headers must arrive
    within `header_timeout` seconds, else 408 and the connection closes (guards.header_timeout_protocol)."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(2048)  # uvicorn's own backlog; a bound socket that does not listen refuses connections
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        announce(f"http://{shown}:{bound}/")
        state = app.state.dgemma

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:  # tell the app at the first Ctrl-C or SIGTERM
                state.stopping = True
                super().handle_exit(sig, frame)

        Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                              http=header_timeout_protocol(header_timeout))).run(sockets=[sock])
    finally:
        sock.close()
