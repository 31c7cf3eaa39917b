"""dgemma/sampling/sampler.py: both samplers driven through the `Sampler` protocol alone, as the serving engine
drives them (a pass batched by hand from `soft_embedding` and `read`), take the steps the inner loop `denoise_canvas`
takes with their own lone pass; and a new family (dgemma/sampling/families.py) plugs into the readable sampler as one
class."""

from __future__ import annotations

import itertools

import pytest
import torch

from dgemma.sampling.families import Family, Step
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.sampling.sampler import Sampler, choose_loop, denoise_canvas, new_sampler
from tests.helpers import random_ids, random_model


def _prefilled(model, B: int = 2):
    cache = model.new_cache(B, 64)
    model.commit(random_ids(model.config.vocab_size, B, 9, seed=3), cache, impl="fast")
    return cache


def _drive(sampler: Sampler, model, cache) -> tuple[object, int]:
    """The canvas to its end through the protocol's batched path only: inputs, soft_embedding, one
    `denoise_hidden`, read, step. No name of an implementation."""
    passes = 0
    while True:
        x, sc, level = sampler.inputs()
        final = model.denoise_hidden(x, cache, soft=sampler.soft_embedding(sc), t=level, impl="fast")
        passes += 1
        if sampler.step(sampler.read(final)):
            return sampler.staged(), passes


@pytest.mark.parametrize("settings", [{}, {"sampler": "lite"}, {"top_k": 5}])
def test_either_sampler_through_the_protocol_alone_takes_the_inner_loops_steps(settings):
    model = random_model("tiny")
    config = GenerationConfig(max_denoising_steps=5, **settings)
    loop = choose_loop(config, "fast")
    assert loop == ("sync-free" if not settings else "readable")
    cache = _prefilled(model)
    sampler = new_sampler(model, config, 2, loop=loop, generator=torch.Generator().manual_seed(7))
    got, passes = _drive(sampler, model, cache)
    want = denoise_canvas(model, cache, config, loop=loop, impl="fast", generator=torch.Generator().manual_seed(7))
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.steps, want.steps)
    assert passes == int(want.steps.max()) and got.stop_reasons == want.stop_reasons
    assert cache.length == 9  # staged, never committed


class _KeepTheArgmax(Family):
    """A family of one rule: every position takes the posterior's argmax, accepted."""

    def update(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return step.argmax, step.argmax, torch.ones_like(step.argmax, dtype=torch.bool)


def test_a_new_family_is_one_class():
    model = random_model("tiny")
    records = []
    staged = denoise_canvas(model, _prefilled(model), GenerationConfig(max_denoising_steps=4), family=_KeepTheArgmax(),
                            generator=torch.Generator().manual_seed(0), on_step=records.append)
    assert all(bool(r.accepted.all()) for r in records)
    for before, after in itertools.pairwise(records):  # each step's argmax is the next step's input
        assert torch.equal(after.input_canvas, before.argmax)
    assert torch.equal(staged.tokens, records[-1].argmax)
