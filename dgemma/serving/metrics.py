"""The Prometheus side of `dgemma serve`: the app's registry (HTTP counters, per-request histograms fed from the
engine's events, the engine's own counters and gauges read at each scrape) and the middleware counting answered
requests by endpoint and status (docs/serving.md, Metrics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/")


LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """The app's Prometheus registry: HTTP counters, per-request series labelled with the served `model_name` (as
    vLLM's, so dashboards built for it carry over), fed as each request's canvases and end arrive, and the engine's
    own counters and gauges, read from `engine.stats()` at each scrape."""

    def __init__(self, engine: Any, in_flight: Callable[[], int], model_name: str):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dgemma_http_requests", "HTTP requests answered (499: the client left first)",
                                ["endpoint", "status"], registry=r)
        Gauge("dgemma_http_requests_in_flight", "generation requests being answered", registry=r
              ).set_function(in_flight)
        per_request = lambda kind, name, doc, **kw: kind(name, doc, ["model_name"], registry=r, **kw).labels(
            model_name)
        self.canvas_steps = per_request(Histogram, "dgemma_canvas_denoising_steps",
                                        "denoising steps per finished canvas",
                                        buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128))
        self.canvas_seconds = per_request(Histogram, "dgemma_canvas_seconds",
                                          "a canvas's first denoising step to its end, in the engine",
                                          buckets=LATENCY_BUCKETS)
        self.tokens_per_step = per_request(Histogram, "dgemma_request_tokens_per_step",
                                           "a choice's completion tokens / its denoising steps",
                                           buckets=(0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128))
        self.ttfc = per_request(Histogram, "dgemma_time_to_first_canvas_seconds",
                                "submission to the first finished canvas", buckets=LATENCY_BUCKETS)
        self.queue_time = per_request(Histogram, "dgemma_request_queue_time_seconds",
                                      "submission to a row of the engine", buckets=LATENCY_BUCKETS)
        self.e2e = per_request(Histogram, "dgemma_e2e_request_latency_seconds",
                               "a generation request's body parsed to its last choice done", buckets=LATENCY_BUCKETS)
        self.prompt_tokens = per_request(Counter, "dgemma_prompt_tokens", "prompt tokens of answered requests")
        self.completion_tokens = per_request(Counter, "dgemma_completion_tokens",
                                             "completion tokens of answered requests (the tokens returned)")
        self.adapter_requests = Counter("dgemma_lora_requests", "generation requests admitted, by the LoRA adapter "
                                        "they run on (adapter=\"\": the model itself)", ["model_name", "adapter"],
                                        registry=r)
        self.model_name = model_name
        r.register(_EngineCollector(engine))

    def admitted(self, adapter: str | None) -> None:
        self.adapter_requests.labels(self.model_name, adapter or "").inc()

    def usage(self, prompt: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)


class _EngineCollector:
    """engine.stats() as Prometheus metrics, read at scrape time."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Any:
        s = self.engine.stats()
        for name, doc, value in (("queue_length", "engine requests waiting for a slot", s.queue_length),
                                 ("active_requests", "engine slots in use", s.active),
                                 ("max_batch", "engine slots", s.max_batch),
                                 ("batch_occupancy", "mean rows per batched denoising forward since start",
                                  s.denoise_rows / s.denoise_forwards if s.denoise_forwards else 0.0),
                                 ("tokens_per_busy_second", "generated tokens / engine busy seconds since start",
                                  s.generated_tokens / s.busy_seconds if s.busy_seconds else 0.0)):
            yield GaugeMetricFamily(f"dgemma_engine_{name}", doc, value=value)
        for name, doc, value in (("engine_denoise_forwards", "batched denoising forwards", s.denoise_forwards),
                                 ("engine_denoise_rows", "rows over all batched denoising forwards", s.denoise_rows),
                                 ("engine_commits", "commit passes (prefills and canvases)", s.commits),
                                 ("generated_tokens", "output tokens delivered", s.generated_tokens),
                                 ("engine_busy_seconds", "time the engine loop spent computing", s.busy_seconds)):
            yield CounterMetricFamily(f"dgemma_{name}", doc, value=value)
        for name, doc, value in (("prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  s.prefix_queries),
                                 ("prefix_cache_hits", "prompt tokens served from the prefix cache", s.prefix_hits),
                                 ("prefix_cache_evictions", "prefix-cache blocks evicted", s.prefix_evictions)):
            yield CounterMetricFamily(f"dgemma_{name}", doc, value=value)
        adapters = self.engine.adapters
        yield GaugeMetricFamily("dgemma_lora_adapters_loaded", "LoRA adapters served beside the model",
                                value=0 if adapters is None else len(adapters))
        for name, doc, value in (("prefix_cache_blocks", "prefix-cache blocks held", s.prefix_blocks),
                                 ("prefix_cache_capacity", "prefix-cache blocks it can hold", s.prefix_capacity)):
            yield GaugeMetricFamily(f"dgemma_{name}", doc, value=value)
        requests = CounterMetricFamily("dgemma_engine_requests", "engine requests by state", labels=["state"])
        for label, value in (("submitted", s.requests_submitted), ("finished", s.requests_finished),
                             ("cancelled", s.requests_cancelled), ("failed", s.requests_failed)):
            requests.add_metric([label], value)
        yield requests


class CountRequests:
    """ASGI middleware: counts answered requests by endpoint (the known routes, else "other") and status. An
    exception that leaves the app before a response began is counted as the 500 it becomes: Starlette's
    ServerErrorMiddleware, outside every user middleware, answers it (the app's `Exception` handler), so no status
    passes through here."""

    def __init__(self, app: Any, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = next((e for e in ENDPOINTS if path == e or (e == "/v1/models" and path.startswith(e + "/"))),
                        "other")

        started = False

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.counter.labels(endpoint, "500").inc()
            raise
