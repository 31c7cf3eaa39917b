"""`dgemma serve` end to end: real uvicorn servers on free localhost ports over a real `Engine` and a tiny random
model, driven by the real `openai` client (and httpx for what that client cannot send): both endpoints, streaming
and not, usage, stop strings, n > 1, seeds, refusals (400, 401, 404, 413, 429), disconnects, the denoising stream,
32 concurrent streaming clients, and the `dgemma serve` command on a training run and on a checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from dgemma.data.templates import ChatTemplate
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.api import parse_completion_request
from dgemma.serving.app import create_app
from dgemma.serving.engine import Engine
from tests.helpers import random_init_model, running_server

KEY = "sk-test"
STEPS = 4
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model():
    return random_init_model()


@pytest.fixture(scope="module")
def base(model) -> GenerationConfig:
    """No EOS: every request runs to max_tokens (finish_reason "length", usage exact) unless a stop string cuts it."""
    return GenerationConfig.for_model(model.config).replace(max_denoising_steps=STEPS, eos_token_id=(),
                                                           max_new_tokens=32)


@pytest.fixture(scope="module")
def engine(model):
    # impl="reference" in fp32: the engine's tokens equal a lone request's (its docstring; tests/serving/test_engine.py)
    with Engine(model, max_batch=16, max_context=512, impl="reference") as e:
        yield e


@pytest.fixture(scope="module")
def server(engine, tok, base):
    app = create_app(engine, tok, "tiny", generation_config=base, api_key=KEY, max_request_bytes=64 * 1024)
    with running_server(app) as url:
        yield url


@pytest.fixture
def client(server) -> OpenAI:
    return OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- the endpoints ---------------------------------------------------------------------------------------------

def test_models_health_metrics_and_page(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = httpx.get(server + "/health").json()  # open: no key
    assert health["status"] == "ok" and health["model"] == "tiny" and health["max_batch"] == 16
    page = httpx.get(server + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    metrics = httpx.get(server + "/metrics").text
    for name in ("dgemma_http_requests_total", "dgemma_engine_queue_length", "dgemma_engine_batch_occupancy",
                 "dgemma_engine_denoise_forwards_total", "dgemma_generated_tokens_total",
                 "dgemma_time_to_first_canvas_seconds_bucket", "dgemma_canvas_denoising_steps_bucket",
                 "dgemma_request_tokens_per_step_bucket", "dgemma_engine_tokens_per_busy_second"):
        assert name in metrics, name


def test_chat_whole_and_streamed_agree_with_usage_and_seeds(client, tok):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, seed=3)
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny" and r.created > 0
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    prompt = len(ChatTemplate(None).encode(tok, USER))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt, 20, prompt + 20)
    text = choice.message.content
    assert text and client.chat.completions.create(messages=USER, model="tiny", max_tokens=20, seed=3
                                                   ).choices[0].message.content == text  # same seed, same text
    assert client.chat.completions.create(messages=USER, model="tiny", max_tokens=20, seed=4
                                          ).choices[0].message.content != text
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=20, seed=3,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_n_prompts_and_token_ids(client, tok):
    r = client.completions.create(model="tiny", prompt="The cat", max_tokens=24, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(tok.encode("The cat")) and r.usage.completion_tokens == 3 * 24
    for c in r.choices:  # choice i is the request with seed + i
        alone = client.completions.create(model="tiny", prompt="The cat", max_tokens=24, seed=5 + c.index)
        assert c.text == alone.choices[0].text and c.finish_reason == "length"
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model="tiny", prompt="The cat", max_tokens=24, seed=5, n=2,
                                           stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {0: r.choices[0].text, 1: r.choices[1].text}
    ids = tok.encode("The cat")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=24, seed=5)
    assert by_ids.choices[0].text == r.choices[0].text
    two = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=8, seed=5)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.prompt_tokens == len(ids) + 2


def test_stop_strings_cut_the_text_and_end_the_request(client, engine, tok, base):
    full = client.completions.create(model="tiny", prompt="Once", max_tokens=48, seed=11).choices[0].text
    k = next(k for k in range(len(full) // 2, len(full) - 3) if "\ufffd" not in full[k:k + 3])
    stop = full[k:k + 3]
    expected = full[:full.find(stop)]
    r = client.completions.create(model="tiny", prompt="Once", max_tokens=48, seed=11, stop=[stop, "never-there"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    # usage counts the tokens behind the text returned, not the rest of the canvas the stop string cut
    ids, _ = engine.complete(parse_completion_request({"prompt": "Once"}, tokenizer=tok, base_config=base,
                                                      model_name="tiny").prompts[0],
                             base.replace(max_new_tokens=48), seed=11)
    k = r.usage.completion_tokens
    assert tok.decode(ids[:k]).startswith(expected) and not tok.decode(ids[:k - 1]).startswith(expected)
    chunks = list(client.completions.create(model="tiny", prompt="Once", max_tokens=48, seed=11, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # lm-eval's gsm8k stops and its EOS make 5; up to 64 are taken, the one that occurs cuts the same text
    many = ["Question:", "</s>", "<|im_end|>", "\n\n\n", *(f"never-{i}" for i in range(59)), stop]
    for kwargs in ({}, {"stream": True}):
        out = client.completions.create(model="tiny", prompt="Once", max_tokens=48, seed=11, stop=many, **kwargs)
        text = out.choices[0].text if not kwargs else "".join(c.choices[0].text for c in out if c.choices)
        assert text == expected


def test_denoising_stream_extension(client, model):
    whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=32, seed=8).choices[0]
    steps, text = [], ""
    for chunk in client.chat.completions.create(model="tiny", messages=USER, max_tokens=32, seed=8, stream=True,
                                                stream_options={"include_denoising": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            continue
        d = chunk.model_extra["denoising"]
        assert set(d) == {"choice", "canvas", "step", "num_steps", "token_ids", "tokens", "accepted", "entropy",
                          "text"}
        L = model.config.canvas_length
        assert len(d["token_ids"]) == len(d["tokens"]) == len(d["accepted"]) == len(d["entropy"]) == L
        assert d["choice"] == 0 and d["num_steps"] == STEPS and 1 <= d["step"] <= STEPS
        assert all(0 <= t < model.config.vocab_size for t in d["token_ids"]) and all(h >= 0 for h in d["entropy"])
        assert whole.message.content.startswith(d["text"]) and d["text"].startswith(text.rstrip("\ufffd"))
        steps.append((d["canvas"], d["step"]))
    assert text == whole.message.content
    assert {c for c, _ in steps} == {0, 1} and steps[0] == (0, 1)  # two canvases of 16, each from step 1


# --- refusals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"extra_body": {"entropy_bound": -1}}, "entropy_bound"),
    ({"top_p": 0}, "top_p"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"temperature": 5}, "temperature"),
    ({"n": 50}, "n"),
    ({"max_tokens": 10_000}, "max_tokens"),  # does not fit --max-context beside the prompt (the engine's check)
])
def test_bad_fields_get_400_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, **kwargs)
    error = e.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_malformed_requests_get_openai_errors_never_tracebacks(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body, status in ((b"{not json", 400), (b"[1, 2]", 400), (b'{"prompt": [9999]}', 400),
                         (b'{"prompt": "x", "max_tokens": "many"}', 400), (b'{"model": "gpt-4", "prompt": "x"}', 404)):
        r = httpx.post(server + "/v1/completions", content=body, headers=auth)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert "vocab_size=512" in httpx.post(server + "/v1/completions", content=b'{"prompt": [9999]}',
                                          headers=auth).json()["error"]["message"]
    for method, path, status in (("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, server + path, headers=auth)
        assert r.status_code == status and "error" in r.json()


def test_api_key_and_body_size(server):
    with pytest.raises(openai.AuthenticationError) as e:
        OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(server + "/v1/completions", json={"prompt": "x"}).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = b'{"prompt": "' + b"a" * 70_000 + b'"}'
    r = httpx.post(server + "/v1/completions", content=big, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        yield big[:40_000]
        yield big[40_000:]

    assert httpx.post(server + "/v1/completions", content=chunked(), headers=auth).status_code == 413


def test_the_default_max_tokens_is_clamped_to_what_fits_and_an_asked_one_is_named(client):
    """max_context 512, canvases of 16: a 500-token prompt leaves room for one canvas. Without max_tokens the
    server's default (32) is clamped to it; asking for 32 is a 400 naming max_tokens (not the prompt)."""
    long = [5] * 500
    r = client.completions.create(model="tiny", prompt=long, seed=0)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (16, "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=long, max_tokens=32)
    error = e.value.response.json()["error"]
    assert error["param"] == "max_tokens" and "at most 16 new tokens fit" in error["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * 600)
    assert e.value.response.json()["error"]["param"] == "prompt"


def _metric(server: str, name: str) -> float:
    text = httpx.get(server + "/metrics").text
    m = re.search(r"^" + re.escape(name) + r'\{model_name="tiny"\} (\S+)$', text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_metrics_count_every_request_with_the_model_name(server, client):
    """Usage counts streams that did not ask for it; a request a stop string ends still feeds the time to first
    canvas and tokens-per-step histograms; the latency series (end to end, queue, per canvas) are there."""
    before = {n: _metric(server, n) for n in ("dgemma_completion_tokens_total", "dgemma_prompt_tokens_total",
                                              "dgemma_time_to_first_canvas_seconds_count",
                                              "dgemma_request_tokens_per_step_count",
                                              "dgemma_e2e_request_latency_seconds_count",
                                              "dgemma_request_queue_time_seconds_count",
                                              "dgemma_canvas_seconds_count")}
    chunks = list(client.completions.create(model="tiny", prompt="The sea", max_tokens=20, seed=2, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    full = client.completions.create(model="tiny", prompt="Once", max_tokens=32, seed=3).choices[0].text
    stop = next(full[k:k + 2] for k in range(2, len(full) - 2) if "\ufffd" not in full[k:k + 2])
    cut = client.completions.create(model="tiny", prompt="Once", max_tokens=32, seed=3, stop=stop)
    assert cut.choices[0].finish_reason == "stop"
    after = {n: _metric(server, n) for n in before}
    delta = {n: after[n] - before[n] for n in before}
    assert delta["dgemma_completion_tokens_total"] == 20 + 32 + cut.usage.completion_tokens
    assert delta["dgemma_time_to_first_canvas_seconds_count"] == 3
    assert delta["dgemma_request_tokens_per_step_count"] == 3
    assert delta["dgemma_e2e_request_latency_seconds_count"] == 3 and delta["dgemma_prompt_tokens_total"] > 0
    assert delta["dgemma_canvas_seconds_count"] >= 2 + 2 + 1 and delta["dgemma_request_queue_time_seconds_count"] >= 2


def test_logprobs_are_the_committed_tokens_under_their_last_posterior(client):
    """Each returned token's log-probability under the posterior its canvas's last step read, with the most probable
    alternatives: the entropy-bound sampler commits that posterior's argmax, so each token is its own top
    alternative; streamed, the same entries arrive with their canvases."""
    kw = dict(model="tiny", messages=USER, max_tokens=32, seed=4, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 32
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.completions.create(model="tiny", prompt="Once", max_tokens=16, seed=1, logprobs=2)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert "".join(lp.tokens) == plain.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) <= 2 and max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs,
                                                                           strict=True))
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, seed=4).choices[0].logprobs \
        is None


def test_eos_ends_with_stop(engine, tok, base):
    every_id_ends = base.replace(eos_token_id=tuple(range(512)))  # the first token of a canvas is an EOS
    with running_server(create_app(engine, tok, "tiny", generation_config=every_id_ends)) as url:
        r = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).chat.completions.create(
            model="tiny", messages=USER, max_tokens=32, seed=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)


# --- limits and disconnects ------------------------------------------------------------------------------------

def test_429_disconnects_cancel_and_the_queue(model, tok, base):
    """On an engine not yet started (so requests wait in its queue, deterministically): a second request over
    max_concurrency=1 gets 429; a client that goes away (mid-stream or mid-wait) frees its place at once and its
    engine request is cancelled (the engine drops it without running it once started); a full queue (max_queue
    waiting beyond the free rows) gets 429 with Retry-After; more choices than rows + queue can hold get 400."""
    engine = Engine(model, max_batch=1, max_context=64, max_queue=1, impl="reference")  # 2 may wait: + 1 free row
    try:
        with running_server(create_app(engine, tok, "tiny", generation_config=base, max_concurrency=1)) as url:
            c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
            in_flight = lambda: httpx.get(url + "/health").json()["in_flight"]
            with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
                httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8}, timeout=0.5)
            wait_for(lambda: in_flight() == 0, "the abandoned request to be released")
            stream = c.completions.create(model="tiny", prompt="Hi", max_tokens=8, stream=True)
            assert in_flight() == 1
            with pytest.raises(openai.RateLimitError):
                c.completions.create(model="tiny", prompt="Hi", max_tokens=8)
            stream.close()
            wait_for(lambda: in_flight() == 0, "the closed stream to be released")
            assert engine.stats().queue_length == 2  # both wait, cancelled, for a loop that has not started
            with pytest.raises(openai.RateLimitError) as e:
                c.completions.create(model="tiny", prompt="Hi", max_tokens=8)
            error = e.value.response.json()["error"]
            assert "queue is full" in error["message"] and error["type"] == "requests"
            assert e.value.response.headers["retry-after"] == "1"
            with pytest.raises(openai.BadRequestError) as e:  # more choices than the server can ever hold: 400
                c.completions.create(model="tiny", prompt="Hi", max_tokens=8, n=3)
            assert e.value.response.json()["error"]["param"] == "n"
            engine.start()
            wait_for(lambda: engine.stats().requests_cancelled == 2, "the engine to drop the cancelled requests")
            r = c.completions.create(model="tiny", prompt="Hi", max_tokens=8, seed=1)
            assert r.usage.completion_tokens == 8
            s = engine.stats()
            assert (s.requests_finished, s.requests_cancelled, s.generated_tokens) == (1, 2, 8)
    finally:
        engine.close()


def test_disconnect_mid_stream_cancels_and_the_server_goes_on(client, engine):
    before = engine.stats()
    stream = client.completions.create(model="tiny", prompt="A long story", max_tokens=480, seed=2, stream=True,
                                       stream_options={"include_denoising": True})
    first = next(iter(stream))
    assert first.model_extra["denoising"]["step"] == 1
    stream.close()  # 30 canvases were asked for; the row leaves the batch at once
    wait_for(lambda: engine.stats().requests_cancelled == before.requests_cancelled + 1, "the cancel")
    assert engine.stats().generated_tokens - before.generated_tokens < 480
    assert client.completions.create(model="tiny", prompt="Next", max_tokens=16).usage.completion_tokens == 16


# --- load ------------------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_32_concurrent_streams_batch_and_none_is_lost_or_mixed_up(server, client, engine):
    n, max_tokens = 32, 32

    async def one(c: AsyncOpenAI, i: int) -> tuple[str, str, int]:
        stream = await c.completions.create(model="tiny", prompt=f"Request {i}:", max_tokens=max_tokens, seed=100 + i,
                                            stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            for ch in chunk.choices:
                assert ch.index == 0
                text += ch.text
                finish = ch.finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage.completion_tokens

    async def all_of_them() -> list[tuple[str, str, int]]:
        async with AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    before = engine.stats()
    results = asyncio.run(all_of_them())
    after = engine.stats()
    occupancy = (after.denoise_rows - before.denoise_rows) / (after.denoise_forwards - before.denoise_forwards)
    assert occupancy > 4, f"mean rows per batched denoising forward {occupancy:.2f}: the requests did not batch"
    assert after.requests_finished - before.requests_finished == n
    for i, (text, finish, tokens) in enumerate(results):
        assert (finish, tokens) == ("length", max_tokens)
        alone = client.completions.create(model="tiny", prompt=f"Request {i}:", max_tokens=max_tokens, seed=100 + i)
        assert text == alone.choices[0].text, f"request {i} differs from the same request made alone"


# --- the command -----------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_serve_command_on_a_run_and_on_a_checkpoint(tiny_run):
    checkpoint = sorted((tiny_run / "checkpoints").glob("step-*"))[-1]
    assert (checkpoint / "config.json").is_file() and (checkpoint / "tokenizer.json").is_file()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "--model", str(path), "--port", "0",
                               "--max-denoising-steps", "2", "--max-batch", "2", "--max-context", "256",
                               "--api-key", KEY],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for path in (tiny_run, checkpoint)]
    try:
        for proc, name in zip(procs, ("run", checkpoint.name), strict=True):
            line = proc.stdout.readline()  # the URL, once the port listens
            assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
            url = line.split(" at ")[1].split()[0]
            c = OpenAI(base_url=url + "v1", api_key=KEY, max_retries=0, timeout=60)
            assert [m.id for m in c.models.list().data] == [name]
            r = c.chat.completions.create(model=name, messages=USER, max_tokens=8, seed=0)
            assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("stop", "length")
            proc.send_signal(signal.SIGINT)  # Ctrl-C
        for proc in procs:
            assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def test_the_announced_url_accepts_connections_at_once():
    """A client that connects the moment it reads the URL is queued, not refused: the port listens before it is
    announced (it used to be bound only, and `dgemma serve --port 0` raced the client that read its first line)."""
    import socket

    from fastapi import FastAPI

    from dgemma.serving.app import serve

    class Announced(Exception):
        pass

    seen: list[str] = []

    def connect_now(url: str) -> None:
        seen.append(url)
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # ConnectionRefusedError if not listening
        raise Announced  # stop before uvicorn starts: the connection above is all this test needs

    with pytest.raises(Announced):
        serve(FastAPI(), "127.0.0.1", 0, announce=connect_now)
    assert len(seen) == 1 and seen[0].startswith("http://127.0.0.1:")


def test_serve_command_errors_and_the_missing_extra(monkeypatch, capsys):
    from dgemma import cli

    with pytest.raises(SystemExit) as exit_:  # each request carries its own `seed`: serve has no --seed
        cli.main(["serve", "--preset", "tiny", "--random-init", "--seed", "1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "dgemma: error: unrecognized arguments: --seed 1"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--preset", "tiny", "--random-init", "--threads", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == ("dgemma serve: error: argument --threads: must be a positive integer "
                                               "(>= 1), got '0'")
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if the serve extra were not installed
    monkeypatch.delitem(sys.modules, "dgemma.serving.app", raising=False)
    assert cli.main(["serve", "--preset", "tiny", "--random-init"]) == 2
    assert capsys.readouterr().err.strip() == "dgemma serve needs the serve extra: pip install 'dgemma[serve]'"


def test_readme_openai_example_runs(server, engine, tok):
    """README's Python example, as written, against a server on its port."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = readme.split("```python\nfrom openai import OpenAI", 1)[1].split("```", 1)[0]
    code = "from openai import OpenAI" + code.replace("http://127.0.0.1:8000", server).replace(
        'api_key="none"', f'api_key="{KEY}"')
    out: list[str] = []
    exec(compile(code, "README.md", "exec"), {"print": lambda *a, **k: out.append(" ".join(map(str, a)))})
    assert out, "the README example printed nothing"


def test_json_of_a_whole_response_is_openai_shaped(server):
    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": USER, "max_tokens": 4, "seed": 0})
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert set(body["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    assert json.dumps(body)  # plain JSON all the way down


def test_metrics_count_every_status_5xx_included(engine, tok, base):
    """A route that raises is answered 500 by the app's exception handler, which Starlette runs outside every
    middleware: the request counter still counts it, beside a 2xx and a 4xx."""
    app = create_app(engine, tok, "tiny", generation_config=base)

    @app.get("/raises")
    async def raises() -> None:
        raise RuntimeError("an internal failure")

    with running_server(app) as url:
        assert httpx.get(url + "/raises").status_code == 500
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "bogus": 1}).status_code == 400
        text = httpx.get(url + "/metrics").text
    counted = dict(re.findall(r'^dgemma_http_requests_total\{endpoint="([^"]+)",status="(\d+)"\} \S+$', text, re.M))
    assert counted == {"other": "500", "/health": "200", "/v1/completions": "400"}
