"""No hidden modes (issue 22, item 3): the sampler loop is an explicit argument of `generate` (a setting the
sync-free loop does not implement is an error naming it, not a silent switch to other random draws), and the
bench times commits through generate's `around_commit`, not by patching the model."""

from __future__ import annotations

import pytest
import torch

from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationError
from tests.helpers import random_ids, random_model

FAST = {"max_new_tokens": 32, "max_denoising_steps": 2}


@pytest.fixture(scope="module")
def model():
    return random_model("tiny")


def test_the_sync_free_loop_refuses_what_it_does_not_implement(model):
    prompt = random_ids(500, 1, 5)
    with pytest.raises(GenerationError, match=r"sync-free sampler loop .* does not implement sampler='lite'.*"
                                              r"pass loop='readable'"):
        generate(model, prompt, seed=0, impl="fast", loop="sync-free", sampler="lite", **FAST)
    with pytest.raises(GenerationError, match=r"does not implement initial_self_conditioning='uniform'"):
        generate(model, prompt, seed=0, impl="fast", loop="sync-free", initial_self_conditioning="uniform", **FAST)
    with pytest.raises(GenerationError, match=r"loop must be one of readable, sync-free, got 'fastest'"):
        generate(model, prompt, seed=0, loop="fastest", **FAST)
    with pytest.raises(GenerationError, match=r"loop='sync-free' runs the fast kernels: pass impl='fast'"):
        generate(model, prompt, seed=0, impl="reference", loop="sync-free", **FAST)


def test_the_default_loop_on_fast_kernels_is_the_one_that_implements_the_settings(model):
    """impl="fast" is the default of every command: without a loop, settings the sync-free loop does not implement
    (Lite, a sampling control) run on the readable loop (its random stream), never an error."""
    prompt = random_ids(500, 1, 5)
    for settings in ({"sampler": "lite"}, {"top_p": 0.5}):
        fast = generate(model, prompt, seed=3, impl="fast", **settings, **FAST)
        readable = generate(model, prompt, seed=3, impl="fast", loop="readable", **settings, **FAST)
        assert torch.equal(fast.sequences, readable.sequences)


def test_the_readable_loop_on_fast_kernels_is_asked_for(model):
    """loop='readable' with impl='fast' draws as the readable loop does: the same random stream as the reference."""
    prompt = random_ids(500, 1, 5)
    ref = generate(model, prompt, seed=3, sampler="lite", **FAST)
    fast = generate(model, prompt, seed=3, sampler="lite", impl="fast", loop="readable", **FAST)
    assert ref.steps_per_canvas == fast.steps_per_canvas and ref.sequences.shape == fast.sequences.shape


def test_generate_calls_around_commit_for_each_cache_write(model):
    calls: list[int] = []

    def around(run):
        before = len(calls)
        run()
        calls.append(before)

    out = generate(model, random_ids(500, 1, 5), seed=0, around_commit=around, **FAST)
    assert len(out.steps_per_canvas) == 2 and calls == [0, 1]  # the prefill, then the first canvas
    assert out.cache.length == 5 + 16
    assert "commit" not in vars(model)  # nothing patched on the instance


def test_the_bench_does_not_patch_the_model():
    from dgemma.eval.bench import BenchSettings, run_dgemma

    model = random_model("tiny")
    rt = run_dgemma(model, random_ids(500, 1, 5), "reference", BenchSettings(steps=2, canvases=2), seed=0)
    assert len(rt.commits) == 1 and rt.prefill > 0 and all(c > 0 for c in rt.commits)
    assert "commit" not in vars(model) and torch.is_tensor(model.embed_tokens.weight)


def test_the_process_group_timeout_is_read_when_asked(monkeypatch):
    """DGEMMA_DIST_TIMEOUT_MIN is read when a process group starts, not once at import."""
    import datetime

    from dgemma.train.distributed import process_group_timeout

    monkeypatch.setenv("DGEMMA_DIST_TIMEOUT_MIN", "2.5")
    assert process_group_timeout() == datetime.timedelta(minutes=2.5)
    monkeypatch.delenv("DGEMMA_DIST_TIMEOUT_MIN")
    assert process_group_timeout() == datetime.timedelta(minutes=30)
    for bad in ("soon", "0", "inf"):
        monkeypatch.setenv("DGEMMA_DIST_TIMEOUT_MIN", bad)
        with pytest.raises(ValueError, match=rf"DGEMMA_DIST_TIMEOUT_MIN must be a number of minutes > 0, got '{bad}'"):
            process_group_timeout()


def test_the_nelbo_is_an_evaluation_function_not_a_training_objective(model):
    from dgemma.diffusion.likelihood import clean_context_posterior, nelbo_per_window, window_nelbo
    from dgemma.train.distributed import LossModule
    from dgemma.train.loop import batch_loss

    x0 = random_ids(500, 2, 32, seed=4)
    with pytest.raises(ValueError, match=r"unknown objective 'nelbo'"):
        batch_loss(model, x0, objective="nelbo", num_steps=4, generator=torch.Generator().manual_seed(0))
    net = LossModule(model, batch_loss)
    with torch.no_grad():
        got, out = net(x0, measure=nelbo_per_window, objective="clean-context", num_steps=4, num_t_samples=2,
                       generator=torch.Generator().manual_seed(1))
        want = window_nelbo(clean_context_posterior(model), x0, canvas_length=16, vocab_size=512, num_steps=4,
                            num_t_samples=2, generator=torch.Generator().manual_seed(1)).nelbo.sum(1)
    assert out is None and torch.equal(got, want)
