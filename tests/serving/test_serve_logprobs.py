"""What the server reports beside the text: log-probabilities finite by construction (floored at
sampling.LOGPROB_FLOOR, cut tokens left out of top_logprobs), those of the masked distribution under a grammar, the
same text with and without them, each token's own bytes, and usage that counts the returned tokens."""

from __future__ import annotations

import json
import math
import queue

import httpx
import numpy as np
import pytest

import dgemma
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.sampling.rules import LOGPROB_FLOOR
from dgemma.serving.app import create_app
from dgemma.serving.engine import CanvasEvent, DoneEvent, Engine
from tests.helpers import random_init_model, running_server

USER = [{"role": "user", "content": "Hello there"}]
CUTS = [dict(top_p=0.01), dict(extra_body={"top_k": 3}), dict(extra_body={"min_p": 0.99}),
        dict(temperature=0, top_p=0.9), dict(temperature=0)]
CUT_IDS = ["top_p", "top_k", "min_p", "temperature 0 + top_p", "temperature 0"]


@pytest.fixture(scope="module")
def model():
    return random_init_model()


@pytest.fixture(scope="module")
def base(model) -> GenerationConfig:
    return GenerationConfig.for_model(model.config).replace(max_denoising_steps=3, eos_token_id=(1,),
                                                           max_new_tokens=32)


@pytest.fixture(scope="module", params=["reference", "fast"])
def served(request, model, tok, base):
    with Engine(model, max_batch=4, max_context=512, impl=request.param) as engine, \
            running_server(create_app(engine, tok, "tiny", generation_config=base)) as url:
        yield url, engine


def _strict(text: str) -> dict:
    """JSON as openai-node reads it: -Infinity, Infinity and NaN are a SyntaxError."""
    def refuse(name: str) -> None:
        raise ValueError(f"non-JSON number {name}")
    return json.loads(text, parse_constant=refuse)


def _finite_entries(content: list[dict], top: int) -> None:
    for e in content:
        assert math.isfinite(e["logprob"]) and LOGPROB_FLOOR <= e["logprob"] <= 0
        assert len(e["top_logprobs"]) <= top
        assert all(math.isfinite(a["logprob"]) and a["logprob"] > LOGPROB_FLOOR for a in e["top_logprobs"])


@pytest.mark.parametrize("kw", CUTS, ids=CUT_IDS)
def test_logprobs_of_truncated_or_greedy_sampling_are_finite_json(served, kw):
    """top_k/top_p/min_p (or temperature 0 with top_p) cut tokens to -inf: a 500 ("Out of range float values are
    not JSON compliant") and, streamed, `"logprob": -Infinity` in the SSE chunk."""
    url, _ = served
    body = {"model": "tiny", "messages": USER, "max_tokens": 24, "seed": 3, "logprobs": True, "top_logprobs": 5,
            **{k: v for k, v in kw.items() if k != "extra_body"}, **kw.get("extra_body", {})}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = _strict(r.text)["choices"][0]["logprobs"]["content"]
    _finite_entries(content, 3 if "top_k" in body else 5)
    streamed = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = _strict(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    streamed += (c.get("logprobs") or {}).get("content") or []
    assert streamed == content
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 16, "seed": 1,
                                                  "logprobs": 5, **{k: v for k, v in body.items() if k not in (
                                                      "model", "messages", "max_tokens", "seed", "logprobs",
                                                      "top_logprobs")}}, timeout=120)
    assert r.status_code == 200, r.text
    lp = _strict(r.text)["choices"][0]["logprobs"]
    assert all(LOGPROB_FLOOR <= v <= 0 for v in lp["token_logprobs"])


def _run(engine: Engine, prompt: list[int], config: GenerationConfig, **kw) -> tuple[list[CanvasEvent], DoneEvent]:
    events: queue.Queue = queue.Queue()
    engine.submit(prompt, config, on_event=events.put, **kw)
    canvases = []
    while True:
        e = events.get(timeout=120)
        if isinstance(e, DoneEvent):
            return canvases, e
        if isinstance(e, CanvasEvent):
            canvases.append(e)


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "observed-likelihood"])
@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_logprobs_do_not_change_the_text(model, base, impl, observed):
    """The engine ran a request with logprobs on the readable sampler loop and one without on the fast one, whose
    random draws differ: `logprobs: true` changed the text for the same seed. (An observed-likelihood model's
    posterior adds each position's observation, which the fast sampler's logprobs add too.)"""
    if observed:
        model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny").replace(
            observed_likelihood=True, time_embedding=True)), seed=1).eval()
    config = base.replace(eos_token_id=(), max_new_tokens=64)
    with Engine(model, max_batch=2, max_context=256, impl=impl) as engine:
        for seed in (0, 1, 2):
            plain, _ = _run(engine, [5, 6, 7], config, seed=seed)
            scored, _ = _run(engine, [5, 6, 7], config, seed=seed, logprobs=2)
            assert [c.tokens for c in scored] == [c.tokens for c in plain]
            for c in scored:
                assert len(c.logprobs) == len(c.tokens) and all(LOGPROB_FLOOR <= v <= 0 for v in c.logprobs)
                # the entropy-bound sampler commits the argmax of the posterior the logprobs read
                assert all(top[0] == (t, v) for t, v, top in zip(c.tokens, c.logprobs, c.top_logprobs, strict=True))


def test_logprobs_under_a_grammar_are_those_of_the_masked_distribution(model, tok, base):
    """A forced `{` was reported at -4.61 with forbidden alternatives in top_logprobs: the log-probabilities ignored
    the grammar's mask. Each token's is now that of the masked distribution it was drawn from: every alternative is
    one the grammar allows there, a position with one allowed token has log-probability 0, and the alternatives'
    probabilities sum to at most 1."""
    llguidance = pytest.importorskip("llguidance")
    from dgemma.sampling.constraint import Constraint

    c = Constraint.json_object(tok, eos_token_id=1)
    for impl, kw in (("reference", {}), ("reference", {"top_k": 2}), ("fast", {"t_min": 0.0, "t_max": 1e-6})):
        with Engine(model, max_batch=1, max_context=256, impl=impl) as engine:
            canvases, done = _run(engine, [5, 6, 7], base.replace(**kw), seed=0, constraint=c, logprobs=8)
        assert done.finish_reason == "stop"
        m = llguidance.LLMatcher(c.tokenizer, c.grammar)
        bits = llguidance.numpy.allocate_token_bitmask(1, c.tokenizer.vocab_size)
        pinned = 0
        for canvas in canvases:
            for t, lp, top in zip(canvas.tokens, canvas.logprobs, canvas.top_logprobs, strict=True):
                llguidance.numpy.fill_next_token_bitmask(m, bits, 0)
                allowed = set(np.unpackbits(bits.view(np.uint8), bitorder="little").nonzero()[0].tolist())
                assert {a for a, _ in top} <= allowed and t in allowed
                assert sum(math.exp(v) for _, v in top) <= 1 + 1e-5 and LOGPROB_FLOOR <= lp <= 0
                if len(allowed) == 1:
                    assert lp == 0.0 and top == [(t, 0.0)]
                    pinned += 1
                assert m.consume_token(t)
        assert pinned >= 1  # the opening brace at least


def test_scoring_a_model_with_infinite_weights_is_an_error_not_an_invalid_number(tok):
    """Echo scoring (echo: true, max_tokens: 0) on infinite weights answered 500 "Out of range float values are not
    JSON compliant"; it is one clear error naming the cause."""
    import torch

    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    with torch.no_grad():
        model.embed_tokens.weight[7:9] = math.inf
    with Engine(model, max_batch=1, max_context=256, impl="reference") as engine, \
            running_server(create_app(engine, tok, "tiny", generation_config=GenerationConfig.for_model(model.config))
                           ) as url:
        answers = [httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 7, 8, 9, 10],
                                                             "echo": True, "max_tokens": m, "logprobs": m},
                              timeout=120) for m in (0, 1)]  # max_tokens 1, logprobs 1: lm-eval's request
    for r in answers:
        error = _strict(r.text)["error"]
        assert "non-finite scores" in error["message"] and "NaN or inf" in error["message"], error


def test_usage_counts_the_returned_tokens_when_a_grammar_closes_at_the_budget(tok_path, tok):
    """A grammar closed exactly at max_tokens (the budget's closer) finished "stop" with no EOS drawn, and usage
    added one for it: n=3, max_tokens 48 gave 147 completion tokens. A choice counts its returned tokens, plus the
    EOS where one was drawn within max_tokens."""
    pytest.importorskip("llguidance")
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    base = GenerationConfig.for_model(model.config).replace(max_denoising_steps=3, eos_token_id=(1,),
                                                            max_new_tokens=48)
    at_budget = 0
    with Engine(model, max_batch=4, max_context=512, impl="reference") as engine, \
            running_server(create_app(engine, tok, "tiny", generation_config=base)) as url:
        for seed in (0, 3):
            r = httpx.post(url + "/v1/chat/completions", json={
                "model": "tiny", "messages": USER, "max_tokens": 48, "n": 3, "seed": seed, "logprobs": True,
                "response_format": {"type": "json_object"}}, timeout=120).json()
            returned = [len(c["logprobs"]["content"]) for c in r["choices"]]
            assert all(c["finish_reason"] == "stop" for c in r["choices"])
            assert r["usage"]["completion_tokens"] == sum(n + (n < 48) for n in returned) <= 3 * 48, returned
            at_budget += returned.count(48)
    assert at_budget >= 2  # the case the audit hit


def test_chat_logprobs_bytes_are_each_tokens_own_and_join_into_the_content(model, tok, base):
    """A token holding part of a UTF-8 character reported U+FFFD's bytes (its text alone), so the joined bytes were
    not the content. The grammar makes the output "€€ é日", whose characters the test tokenizer splits into byte
    tokens."""
    pytest.importorskip("llguidance")
    text = "€€ é日"
    assert any(tok.decode([t]) == "\ufffd" for t in tok.encode(text, add_special_tokens=False))
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": [text]}}}
    with Engine(model, max_batch=1, max_context=256, impl="reference") as engine, \
            running_server(create_app(engine, tok, "tiny", generation_config=base)) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 32,
                                                           "seed": 0, "logprobs": True, "top_logprobs": 2,
                                                           "response_format": fmt}, timeout=120).json()
    message, content = r["choices"][0]["message"]["content"], r["choices"][0]["logprobs"]["content"]
    assert json.loads(message) == text
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8") == message
    assert any(e["token"] == "\ufffd" and bytes(e["bytes"]) != "\ufffd".encode() for e in content)


def test_token_bytes_of_a_byte_fallback_metaspace_tokenizer():
    """Gemma's kind of tokenizer (SentencePiece's `▁` for a space, <0xHH> byte-fallback tokens): each token's own
    bytes join into the decoded text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from dgemma.data.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "▁a": 1, "b": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    t = Tokenizer(backend)
    ids = [1, 2, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 1]
    assert t.decode(ids) == " ab€ a"
    assert b"".join(t.token_bytes(i) for i in ids) == " ab€ a".encode()
    assert t.token_bytes(3 + 0x82) == b"\x82"
