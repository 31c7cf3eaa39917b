"""Prefix caching across requests (dgemma/serving/prefix_cache.py, the engine's `prefix_cache`): a request's tokens are
the same whether its prefix came from the cache or not, the K/V copied in is bit for bit what the request would have
committed, eviction is least-recently-used and bounded, namespaces stay apart, and the counters say what happened."""

from __future__ import annotations

import pytest
import torch

import dgemma
from dgemma.serving.engine import Engine, EngineError
from dgemma.serving.prefix_cache import PrefixCache
from tests.helpers import random_ids, random_model
from tests.serving.test_engine import lite_model, run_concurrently

BLOCK = 8


def committed_in_chunks(model, cache, tokens, impl):
    """What the engine commits for a prompt with a prefix cache: block by block from slot 0."""
    row = cache.rows(0, 1, length=0)
    for a in range(0, len(tokens), BLOCK):
        model.commit(torch.tensor([tokens[a:a + BLOCK]]), row, impl=impl)
    return row


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_a_loaded_prefix_is_what_the_request_would_have_committed_bit_for_bit(impl):
    model = random_model("k8-of-16")
    V = model.config.vocab_size
    shared = random_ids(V, 29, seed=1).tolist()  # 3 whole blocks and 5 tokens
    first, second = shared + random_ids(V, 6, seed=2).tolist(), shared[:24] + random_ids(V, 11, seed=3).tolist()
    prefix = PrefixCache(model.config, 16, block_size=BLOCK, dtype=model.dtype)
    assert prefix.save(first, committed_in_chunks(model, model.new_cache(1, 64), first, impl)) == 4
    row = model.new_cache(1, 64).rows(0, 1, length=0)
    assert prefix.load(second, row) == 24  # blocks 0-2 are shared; block 3 differs
    for a in range(24, len(second), BLOCK):
        model.commit(torch.tensor([second[a:a + BLOCK]]), row, impl=impl)
    alone = committed_in_chunks(model, model.new_cache(1, 64), second, impl)
    assert row.length == alone.length == len(second)
    for a, b in zip(row.keys + row.values, alone.keys + alone.values, strict=True):
        assert torch.equal(a[:, :, :len(second)], b[:, :, :len(second)])


@pytest.mark.parametrize("kind", ["dg", "lite"])
def test_a_requests_tokens_are_the_same_whether_its_prefix_was_cached_or_not(kind):
    model = random_model("tiny") if kind == "dg" else lite_model()
    V = model.config.vocab_size
    config = dgemma.GenerationConfig.for_model(model.config).replace(max_new_tokens=24, max_denoising_steps=4,
                                                                    eos_token_id=())
    system = random_ids(V, 37, seed=5).tolist()  # a shared "system prompt" past the sliding window (8)
    prompts = [system + random_ids(V, 3 + 4 * i, seed=10 + i).tolist() for i in range(4)]
    engine = lambda: Engine(model, max_batch=2, max_context=128, prefix_cache=256, prefix_block=BLOCK)
    with engine() as warm:
        first = warm.complete(prompts[0], config, seed=7)  # fills the cache with the system prompt's blocks
        rest = run_concurrently(warm, [(p, config, 7 + i) for i, p in enumerate(prompts) if i])
        stats = warm.stats()
    assert first[1].cached_tokens == 0
    for i, (tokens, done) in enumerate(rest, 1):
        with engine() as cold:  # the same request on an empty cache
            expected, alone = cold.complete(prompts[i], config, seed=7 + i)
        assert tokens == expected
        assert done.cached_tokens == 32 and alone.cached_tokens == 0  # the system prompt's four whole blocks
    assert stats.prefix_hits == 3 * 32
    assert stats.prefix_queries == sum(map(len, prompts))
    assert 0 < stats.prefix_blocks <= stats.prefix_capacity == 256 // BLOCK


def test_each_cold_request_matches_the_same_request_on_an_engine_without_a_cache_for_a_one_block_prompt():
    """A prompt of at most one block is prefilled in one commit either way: with or without a prefix cache, the
    engine gives what `generate` gives alone."""
    model = random_model("tiny")
    config = dgemma.GenerationConfig.for_model(model.config).replace(max_new_tokens=16, max_denoising_steps=3,
                                                                    eos_token_id=())
    prompt = random_ids(512, BLOCK, seed=1).tolist()
    with Engine(model, max_context=64, prefix_cache=64, prefix_block=BLOCK) as cached, \
            Engine(model, max_context=64) as plain:
        a, b = cached.complete(prompt, config, seed=3), plain.complete(prompt, config, seed=3)
        again = cached.complete(prompt, config, seed=3)  # now a hit: the whole prompt from the cache
    assert a[0] == b[0] == again[0]
    assert again[1].cached_tokens == BLOCK


def test_eviction_is_least_recently_used_and_bounded():
    model = random_model("tiny")
    prefix = PrefixCache(model.config, 4, block_size=BLOCK, dtype=model.dtype)
    prompts = [random_ids(512, 2 * BLOCK, seed=s).tolist() for s in range(3)]

    def save(p):
        return prefix.save(p, committed_in_chunks(model, model.new_cache(1, 64), p, "reference"))

    def hit(p):
        return prefix.load(p, model.new_cache(1, 64).rows(0, 1, length=0))

    assert save(prompts[0]) == save(prompts[1]) == 2
    assert hit(prompts[0]) == 2 * BLOCK  # prompt 0 is now the most recently used
    assert save(prompts[2]) == 2  # evicts prompt 1, not prompt 0
    assert (hit(prompts[0]), hit(prompts[1]), hit(prompts[2])) == (2 * BLOCK, 0, 2 * BLOCK)
    stats = prefix.stats()
    assert (stats.blocks, stats.capacity, stats.evictions) == (4, 4, 2)
    long = random_ids(512, 6 * BLOCK, seed=9).tolist()  # longer than the whole store: its first 4 blocks fit
    assert save(long) == 4 and hit(long) == 4 * BLOCK


def test_namespaces_stay_apart_and_drop_forgets_one():
    model = random_model("tiny")
    prefix = PrefixCache(model.config, 8, block_size=BLOCK, dtype=model.dtype)
    p = random_ids(512, 2 * BLOCK, seed=0).tolist()
    row = committed_in_chunks(model, model.new_cache(1, 32), p, "reference")
    assert prefix.save(p, row, namespace="a") == 2
    empty = model.new_cache(1, 32).rows(0, 1, length=0)
    assert prefix.load(p, empty, namespace="b") == 0 and prefix.load(p, empty) == 0
    assert prefix.save(p, row, namespace="b") == 2
    assert prefix.drop("a") == 2
    assert prefix.load(p, empty, namespace="a") == 0 and prefix.load(p, empty, namespace="b") == 2 * BLOCK


def test_bad_prefix_cache_settings_are_refused_with_the_field_named():
    model = random_model("tiny")
    for kwargs, message in (({"prefix_cache": -1}, "prefix_cache must be an int >= 0"),
                            ({"prefix_cache": True}, "prefix_cache must be an int >= 0"),
                            ({"prefix_cache": 10, "prefix_block": 16}, "hold no block of prefix_block=16"),
                            ({"prefix_cache": 64, "prefix_block": 0}, "prefix_block must be a positive int")):
        with pytest.raises(EngineError, match=message):
            Engine(model, max_context=64, **kwargs)


def test_through_the_openai_client_a_shared_system_prompt_is_reused_and_counted(tok_path):
    """A chat whose long system prompt was served before: `usage.prompt_tokens_details.cached_tokens` says how much
    came from the cache, the reply is the same as on a cold server, and /metrics counts queries and hits."""
    import re

    import httpx
    from openai import OpenAI

    from dgemma.data.tokenizer import load_tokenizer
    from dgemma.serving.app import create_app
    from tests.helpers import running_server

    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()
    tok = load_tokenizer(tok_path)
    base = dgemma.GenerationConfig.for_model(model.config).replace(max_new_tokens=16, max_denoising_steps=3,
                                                                  eos_token_id=())
    system = {"role": "system", "content": "You answer questions about the sea, briefly and kindly. " * 8}
    turns = [[system, {"role": "user", "content": q}] for q in ("Why is it blue?", "How deep is it?")]

    def serve(prefix_cache):
        engine = Engine(model, max_batch=2, max_context=512, impl="reference", prefix_cache=prefix_cache,
                        prefix_block=16)
        return engine, running_server(create_app(engine.start(), tok, "tiny", generation_config=base))

    def ask(url, messages, seed):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        return client.chat.completions.create(model="tiny", messages=messages, seed=seed)

    engine, server = serve(1024)
    with engine, server as url:
        first, second = ask(url, turns[0], 1), ask(url, turns[1], 2)
        metrics = httpx.get(url + "/metrics").text
    cold_engine, cold_server = serve(1024)
    with cold_engine, cold_server as url:
        cold = ask(url, turns[1], 2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 == cold.usage.prompt_tokens_details.cached_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached <= second.usage.prompt_tokens - 4  # the system prompt's blocks
    assert second.choices[0].message.content == cold.choices[0].message.content
    value = lambda name: float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))
    assert value("dgemma_prefix_cache_hits_total") == cached
    assert value("dgemma_prefix_cache_queries_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert 0 < value("dgemma_prefix_cache_blocks") <= value("dgemma_prefix_cache_capacity") == 1024 // 16


@pytest.mark.parametrize(("flags", "error"), [
    (["--prefix-cache", "100"], "--prefix-cache must be 0 (off) or at least one block of --prefix-block 256 tokens, "
                                "got 100"),
    (["--prefix-cache", "-5"], "--prefix-cache must be 0 (off) or at least one block"),
    (["--prefix-block", "0"], "--prefix-block must be >= 1, got 0"),
])
def test_serve_refuses_bad_prefix_cache_flags_in_one_line(flags, error, capsys):
    pytest.importorskip("fastapi")
    from dgemma import cli

    assert cli.main(["serve", "--preset", "tiny", "--random-init", *flags]) == 2
    err = capsys.readouterr().err
    assert error in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
