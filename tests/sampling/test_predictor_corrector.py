"""The predictor-corrector sampler (issue 24): the ancestral chain with forward-backward corrector passes. Its
forward-noise rule against the forward process's law, its identity with the ancestral chain when it has no corrector,
and its pass schedule on a real tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from dgemma import generate, preset
from dgemma.diffusion.noise import alpha
from dgemma.model.config import ConfigError
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling import rules as S
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.testing.hf import randomize_


def test_forward_noise_keeps_each_token_at_the_forward_processs_rate():
    """From s = 0.2 to 0.5 a token stays with probability alpha(0.5) / alpha(0.2), else it is drawn uniformly (and may
    land on itself, 1 / V)."""
    V, n = 50, 200_000
    x = torch.zeros(1, n, dtype=torch.long)
    out = S.forward_noise(x, 0.2, 0.5, V, torch.Generator().manual_seed(0))
    keep = float(alpha(torch.tensor(0.5), torch.float64) / alpha(torch.tensor(0.2), torch.float64))
    want = keep + (1 - keep) / V
    got = float((out == 0).double().mean())
    assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / n), (got, want)
    others = torch.bincount(out[out != 0], minlength=V)[1:].double()
    assert float(others.std() / others.mean()) < 0.05  # the redrawn tokens are uniform over the others
    assert torch.equal(S.forward_noise(x, 0.3, 0.3, V, torch.Generator().manual_seed(0)), x)  # no step: unchanged


def _model() -> DiffusionGemma:
    return randomize_(DiffusionGemma(preset("tiny").replace(time_embedding=True)), 0).eval()


def _prompt() -> torch.Tensor:
    return torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(1))


def test_without_a_corrector_it_is_the_ancestral_chain_token_for_token():
    model = _model()
    kw = dict(seed=0, max_new_tokens=32, max_denoising_steps=4)
    chain = generate(model, _prompt(), sampler="ancestral", **kw)
    pc = generate(model, _prompt(), sampler="predictor-corrector", corrector_steps=0, **kw)
    assert torch.equal(chain.sequences, pc.sequences)


def test_each_step_is_followed_by_its_corrector_passes_at_the_same_level():
    """N = 4, one corrector: 8 passes a canvas, the time input told 1, 1, 3/4, 3/4, ... (a corrector noises x_{s'}
    back up to the step's s and steps down again), no early stop, and the last draw committed."""
    model = _model()
    out = generate(model, _prompt(), seed=0, max_new_tokens=16, max_denoising_steps=4, sampler="predictor-corrector",
                   corrector_steps=1, trace=True)
    assert out.steps_per_canvas == [[8, 8]]
    assert [float(info.level[0]) for info in out.trace.steps] == [1.0, 1.0, 0.75, 0.75, 0.5, 0.5, 0.25, 0.25]
    assert out.stop_reasons == [["max_steps", "max_steps"]]
    assert {info.num_steps for info in out.trace.steps} == {8}  # what a progress display counts to
    assert GenerationConfig(sampler="predictor-corrector").commit_rule == "sample"
    two = generate(model, _prompt(), seed=0, max_new_tokens=16, max_denoising_steps=3, sampler="predictor-corrector",
                   corrector_steps=2)
    assert two.steps_per_canvas == [[9, 9]]


def test_a_bad_corrector_count_is_one_error_naming_it():
    with pytest.raises(ConfigError, match=r"corrector_steps: must be an int >= 0, got -1"):
        GenerationConfig(sampler="predictor-corrector", corrector_steps=-1)
