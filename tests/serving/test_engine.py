"""The continuous-batching engine (dgemma/serving/engine.py) against `dgemma.generate`: the same tokens per request
whatever else is in the batch, requests joining and leaving mid-canvas, cancellation, errors, bad input, and the
ragged denoising pass it rests on (`model.denoise(lengths=)`, `KVCache.rows` / `gather`)."""

from __future__ import annotations

import threading

import pytest
import torch

import dgemma
from dgemma.model.kv_cache import RowCaches
from dgemma.serving.engine import CanvasEvent, DoneEvent, Engine, EngineError, QueueFullError, StepEvent
from dgemma.testing.hf import randomize_
from tests.helpers import random_ids, random_model


def lite_model():
    return randomize_(dgemma.DiffusionGemma(dgemma.preset("lite-tiny")), 3).eval()


def reference_tokens(model, prompt, config, seed):
    """What `generate` gives for this request alone: the new tokens, EOS excluded, cut at max_new_tokens."""
    result = dgemma.generate(model, torch.tensor([prompt]), generation_config=config, seed=seed, truncate=True,
                             impl="reference")
    tokens = result.sequences[0, len(prompt):].tolist()  # not new_tokens(): it drops the pad id everywhere
    cut = next((i for i, t in enumerate(tokens) if t in config.eos_token_id), None)
    return (tokens, "length") if cut is None else (tokens[:cut], "stop")


def run_concurrently(engine, jobs):
    """Submit every (prompt, config, seed) from its own thread at once; returns [(tokens, done)]."""
    out = [None] * len(jobs)

    def go(i):
        prompt, config, seed = jobs[i]
        out[i] = engine.complete(prompt, config, seed=seed, timeout=120)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("kind", ["dg", "lite"])
def test_each_request_gets_the_tokens_generate_gives_it_alone(kind):
    model = random_model("tiny") if kind == "dg" else lite_model()
    V = model.config.vocab_size
    base = dgemma.GenerationConfig.for_model(model.config).replace(
        max_denoising_steps=5, eos_token_id=(), **({"sampler": "lite"} if kind == "lite" else {}))
    jobs = []
    for i in range(7):  # different prompt lengths (some past the sliding window), budgets and settings
        prompt = random_ids(V, 1 + 5 * i, seed=i).tolist()
        config = base.replace(max_new_tokens=[5, 16, 40, 23, 8, 33, 17][i], max_denoising_steps=3 + i % 4,
                              entropy_bound=[0.1, 0.5, 2.0][i % 3])
        jobs.append((prompt, config, 1000 + i))
    with Engine(model, max_batch=4, max_context=128) as engine:  # 7 requests, 4 rows: some wait, join mid-canvas
        results = run_concurrently(engine, jobs)
        stats = engine.stats()
    for (prompt, config, seed), (tokens, done) in zip(jobs, results, strict=True):
        expected, reason = reference_tokens(model, prompt, config, seed)
        assert tokens == expected
        assert done.finish_reason == reason == "length"
        assert done.completion_tokens == len(tokens) == config.max_new_tokens
        assert done.prompt_tokens == len(prompt)
    assert stats.denoise_rows > stats.denoise_forwards  # rows were batched
    assert stats.active == stats.queue_length == 0 and stats.requests_finished == 7


def test_with_the_fast_kernels_a_requests_tokens_do_not_depend_on_the_batch():
    """impl="fast": generate's own fast loop draws differently, so the promise is batch invariance: a request
    served alone and in a crowd of others gives the same tokens."""
    model = random_model("k8-of-16")  # 16 experts top-8: every expert's block of rows changes with the batch
    V = model.config.vocab_size
    base = dgemma.GenerationConfig.for_model(model.config).replace(max_denoising_steps=4, eos_token_id=())
    jobs = [(random_ids(V, 3 + 7 * i, seed=i).tolist(), base.replace(max_new_tokens=12 + 9 * i), 50 + i)
            for i in range(6)]
    with Engine(model, max_batch=1, max_context=128, impl="fast") as engine:
        alone = [engine.complete(p, c, seed=s) for p, c, s in jobs]
    with Engine(model, max_batch=6, max_context=128, impl="fast") as engine:
        crowd = run_concurrently(engine, jobs)
        assert engine.stats().denoise_rows > engine.stats().denoise_forwards
    assert [t for t, _ in crowd] == [t for t, _ in alone]


def test_eos_ends_a_request_with_finish_reason_stop():
    model = random_model("tiny")
    config = dgemma.GenerationConfig.for_model(model.config).replace(max_new_tokens=48, max_denoising_steps=4,
                                                                     eos_token_id=())
    prompt = [3, 1, 4, 1, 5]
    free, _ = reference_tokens(model, prompt, config, 7)
    eos = free[20]  # a token the request produces in its second canvas: it must stop there
    config = config.replace(eos_token_id=(eos,))
    expected, reason = reference_tokens(model, prompt, config, 7)
    assert reason == "stop" and len(expected) == free.index(eos)
    with Engine(model, max_batch=2, max_context=128) as engine:
        tokens, done = engine.complete(prompt, config, seed=7)
    assert tokens == expected and done.finish_reason == "stop"
    assert done.completion_tokens == len(expected) + 1  # the EOS counts as generated


def test_events_arrive_in_order_with_every_step_when_asked():
    model = random_model("tiny")
    config = dgemma.GenerationConfig.for_model(model.config).replace(max_new_tokens=20, max_denoising_steps=3,
                                                                     eos_token_id=())
    events, finished = [], threading.Event()

    def on_event(e):
        events.append(e)
        if isinstance(e, DoneEvent):
            finished.set()

    with Engine(model, max_batch=2, max_context=64) as engine:
        engine.submit([1, 2, 3], config, seed=0, on_event=on_event, stream_steps=True)
        assert finished.wait(60)
    steps = [e for e in events if isinstance(e, StepEvent)]
    canvases = [e for e in events if isinstance(e, CanvasEvent)]
    assert isinstance(events[-1], DoneEvent) and sum(isinstance(e, DoneEvent) for e in events) == 1
    assert [c.canvas for c in canvases] == [0, 1] and [len(c.tokens) for c in canvases] == [16, 4]
    assert len(steps) == sum(c.steps for c in canvases) == events[-1].denoising_steps
    L = model.config.canvas_length
    for s in steps:
        assert 1 <= s.step <= s.num_steps == 3 and len(s.argmax) == len(s.accepted) == len(s.entropy) == L
    canvas_of_step = [s.canvas for s in steps]
    assert canvas_of_step == sorted(canvas_of_step)


def test_a_cancelled_request_leaves_and_the_others_are_untouched():
    model = random_model("tiny")
    config = dgemma.GenerationConfig.for_model(model.config).replace(max_new_tokens=64, max_denoising_steps=8,
                                                                     eos_token_id=(), entropy_bound=1e-6)
    got, done = [], threading.Event()
    request_box = []

    def on_event(e):
        got.append(e)
        if isinstance(e, StepEvent) and e.step == 2:
            request_box[0].cancel()
        if isinstance(e, DoneEvent):
            done.set()

    with Engine(model, max_batch=2, max_context=128) as engine:
        request_box.append(engine.submit([5, 6, 7], config, seed=1, on_event=on_event, stream_steps=True))
        other = engine.complete([9, 9, 9, 9], config, seed=2, timeout=120)
        assert done.wait(60)
        stats = engine.stats()
    assert got[-1].finish_reason == "cancelled" and not any(isinstance(e, CanvasEvent) for e in got)
    assert other[0] == reference_tokens(model, [9, 9, 9, 9], config, 2)[0]
    assert stats.requests_cancelled == 1 and stats.active == 0


def test_non_finite_logits_fail_only_that_request():
    model = random_model("tiny")
    config = dgemma.GenerationConfig.for_model(model.config).replace(max_new_tokens=32, max_denoising_steps=3,
                                                                     eos_token_id=(), entropy_bound=1e-6)
    events, done, box = [], threading.Event(), []

    def poison(e):  # after its first step, NaN in this request's own rows of the cache
        events.append(e)
        if isinstance(e, StepEvent) and e.step == 1 and e.canvas == 0:
            for keys in engine.pool.keys:
                keys[box[0].slot] = float("nan")
        if isinstance(e, DoneEvent):
            done.set()

    with Engine(model, max_batch=4, max_context=64) as engine:
        box.append(engine.submit([1, 2], config, seed=0, on_event=poison, stream_steps=True))
        good = engine.complete([1, 2, 3], config, seed=1)
        assert done.wait(60)
        after = engine.complete([4, 5], config, seed=2)  # the slot is reused: the prefill overwrites what it reads
    bad = events[-1]
    assert bad.finish_reason == "error" and "non-finite logits at canvas 0, step 2" in bad.error
    assert good == (reference_tokens(model, [1, 2, 3], config, 1)[0], good[1]) and good[1].finish_reason == "length"
    assert after[0] == reference_tokens(model, [4, 5], config, 2)[0]


def test_bad_requests_are_refused_with_the_field_named():
    model = random_model("tiny")
    config = dgemma.GenerationConfig.for_model(model.config).replace(max_new_tokens=16)
    engine = Engine(model, max_batch=1, max_context=40, max_queue=1)  # not started: submissions queue up
    noop = lambda e: None
    with pytest.raises(EngineError, match="empty"):
        engine.submit([], config, on_event=noop)
    with pytest.raises(EngineError, match=r"vocab_size=512"):
        engine.submit([1, 512], config, on_event=noop)
    with pytest.raises(EngineError, match="integer token ids"):
        engine.submit("hello", config, on_event=noop)
    with pytest.raises(EngineError, match="context of 40 tokens"):
        engine.submit(list(range(30)), config.replace(max_new_tokens=17), on_event=noop)
    with pytest.raises(EngineError, match="seed"):
        engine.submit([1], config, seed=1.5, on_event=noop)
    with pytest.raises(EngineError, match="max_batch"):
        Engine(model, max_batch=0)
    engine.submit([1], config, on_event=noop)  # takes the free row at the next step
    engine.submit([1], config, on_event=noop)  # waits: max_queue=1 beyond the free row
    with pytest.raises(QueueFullError, match="max_queue=1, 1 free rows"):
        engine.submit([2], config, on_event=noop)
    events = []
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.submit([1], config, on_event=events.append)


def test_a_batched_pass_over_rows_of_different_lengths_equals_each_rows_own_bit_for_bit():
    """model.denoise(canvas, RowCaches([one-row caches])): each row reads its own committed prefix (sliding layers
    their own window) and computes exactly what it would alone, which is what makes a request's tokens
    batch-independent."""
    V, L = 512, 16
    for name in ("tiny", "lite"):
        model = random_model("tiny") if name == "tiny" else lite_model()
        lengths = [3, 20, 11]  # below and above the sliding window (8)
        pool = model.new_cache(3, 32)
        for r, n in enumerate(lengths):
            model.commit(random_ids(V, 1, n, seed=r), pool.rows(r, r + 1, length=0))
        rows = [pool.rows(r, r + 1, length=n) for r, n in enumerate(lengths)]
        canvas = random_ids(V, 3, L, seed=9)
        sc = torch.randn(3, L, V, generator=torch.Generator().manual_seed(0))
        for impl in ("reference", "fast"):
            batched = model.denoise(canvas, RowCaches(rows), self_conditioning_logits=sc,
                                    t=torch.tensor([0.2, 0.5, 1.0]),
                                    self_conditioning_mask=torch.tensor([True, False, True]), impl=impl)
            for r in range(3):
                # reference: what generate computes for that row alone; fast: the same row alone through the
                # batch-invariant kernels (its experts in whole blocks of rows)
                alone = model.denoise(canvas[r:r + 1], rows[r] if impl == "reference" else RowCaches([rows[r]]),
                                      self_conditioning_logits=sc[r:r + 1] if r != 1 else None,
                                      t=[0.2, 0.5, 1.0][r], impl=impl)
                assert torch.equal(batched[r:r + 1], alone), (name, impl, r)
            if impl == "fast":
                plain = model.denoise(canvas[:1], rows[0], self_conditioning_logits=sc[:1], t=0.2, impl="fast")
                torch.testing.assert_close(batched[:1], plain, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match=r"canvas must have shape \(rows=2, length\), one row per cache"):
        model.denoise(canvas, RowCaches(rows[:2]))
    with pytest.raises(ValueError, match="RowCaches takes one-row KVCaches"):
        RowCaches([pool])


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_a_batched_commit_over_rows_of_different_lengths_writes_what_each_row_would_alone(impl):
    model = random_model("tiny")
    V, lengths = 512, [2, 19, 9]
    pools = [model.new_cache(3, 48) for _ in range(2)]
    for pool in pools:
        for r, n in enumerate(lengths):
            model.commit(random_ids(V, 1, n, seed=r), pool.rows(r, r + 1, length=0))
    canvas = random_ids(V, 3, 16, seed=5)
    batched = [pools[0].rows(r, r + 1, length=n) for r, n in enumerate(lengths)]
    model.commit(canvas, RowCaches(batched), impl=impl)
    for r, n in enumerate(lengths):  # reference: generate's own lone commit; fast: the same row alone
        view = pools[1].rows(r, r + 1, length=n)
        model.commit(canvas[r:r + 1], view if impl == "reference" else RowCaches([view]), impl=impl)
        assert batched[r].length == view.length == n + 16
    for a, b in zip(pools[0].keys + pools[0].values, pools[1].keys + pools[1].values, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no start or attention_mask"):
        model.commit(canvas, RowCaches(batched), start=0)


def test_row_views_share_the_pool():
    model = random_model("tiny")
    pool = model.new_cache(3, 16)
    view = pool.rows(1, 2, length=0)
    model.commit(torch.tensor([[1, 2, 3]]), view)
    assert view.length == 3 and pool.length == 0
    assert pool.keys[0][1, :, :3].abs().sum() > 0 and pool.keys[0][0].abs().sum() == 0
    with pytest.raises(ValueError, match="outside a cache of batch size 3"):
        pool.rows(2, 4)


def test_with_the_fast_kernels_fast_and_readable_rows_batch_together_and_stay_batch_invariant():
    """impl="fast": an entropy-bound request without a grammar (with or without logprobs) runs on the fast sampler
    (fast_sampler.FastSampler: the fused head and inverse-CDF draw, on its own row), the others on the readable one;
    in one batch each gives what it gives alone."""
    model = random_model("tiny")
    V = model.config.vocab_size
    base = dgemma.GenerationConfig.for_model(model.config).replace(max_denoising_steps=4, eos_token_id=())
    configs = [base, base.replace(sampler="lite"), base.replace(top_k=20), base, base.replace(entropy_bound=2.0)]
    jobs = [(random_ids(V, 4 + 5 * i, seed=i).tolist(), c.replace(max_new_tokens=16 + 8 * i), 70 + i)
            for i, c in enumerate(configs)]
    with Engine(model, max_batch=1, max_context=128, impl="fast") as engine:
        alone = [engine.complete(p, c, seed=s) for p, c, s in jobs]
        kinds = [engine.submit(p, c, seed=s, on_event=lambda e: None).loop == "sync-free" for p, c, s in jobs]
    assert kinds == [True, False, False, True, True]
    with Engine(model, max_batch=5, max_context=128, impl="fast") as engine:
        crowd = run_concurrently(engine, jobs)
        assert engine.stats().denoise_rows > engine.stats().denoise_forwards
    assert [t for t, _ in crowd] == [t for t, _ in alone]
    with Engine(model, max_batch=5, max_context=128, impl="fast") as engine:  # logprobs: the fast sampler too
        request = engine.submit(*jobs[0][:2], seed=1, logprobs=2, on_event=lambda e: None)
        assert request.loop == "sync-free"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fast_samplers_workspace_holds_the_rows_that_are_stepped_together(dtype):
    """The engine's one (rows, V) workspace: room for every row of a batch where the fast rows' heads run together
    (the one pass over the vocabulary: an fp32 head on a CPU), one canvas where each row's head runs alone."""
    model = random_model("tiny").to(dtype)
    L = model.config.canvas_length
    with Engine(model, max_batch=3, max_context=128, impl="fast") as engine:
        rows = engine._workspace().logits.shape[0]
    assert rows == (3 * L if dtype == torch.float32 else L)
