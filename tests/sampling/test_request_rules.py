"""The rules of one request (dgemma/sampling/request_rules.py) hold wherever a request runs: `dgemma.generate`, the
serving engine and the OpenAI request parser accept the same seeds (0 .. 2**32 - 1) and refuse the same ones by name."""

from __future__ import annotations

import pytest
import torch

from dgemma.data.tokenizer import load_tokenizer
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import SEED_MAX, GenerationConfig, GenerationError
from dgemma.serving.api import APIError, parse_completion_request
from dgemma.serving.engine import Engine, EngineError
from tests.helpers import model_config

CONFIG = GenerationConfig(max_new_tokens=4, max_denoising_steps=2)


@pytest.fixture(scope="module")
def model():
    return DiffusionGemma(model_config("tiny")).eval()


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, 1.5, True])
def test_generate_refuses_a_seed_outside_the_one_range(model, seed):
    with pytest.raises(GenerationError, match=r"seed must be an int from 0 to 4294967295 \(2\*\*32 - 1\)"):
        generate(model, torch.tensor([[1, 2, 3]]), generation_config=CONFIG, seed=seed)


def test_generate_takes_the_largest_seed(model):
    out = generate(model, torch.tensor([[1, 2, 3]]), generation_config=CONFIG, seed=SEED_MAX)
    assert out.sequences.shape[1] > 3


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1])
def test_engine_refuses_the_seeds_generate_refuses(model, seed):
    engine = Engine(model, max_batch=1, max_context=64)
    with pytest.raises(EngineError, match=r"seed must be an int from 0 to 4294967295 \(2\*\*32 - 1\)"):
        engine.submit([1, 2, 3], CONFIG, seed=seed, on_event=lambda e: None)


def test_engine_max_length_rule_is_generates(model):
    engine = Engine(model, max_batch=1, max_context=64)
    with pytest.raises(EngineError, match=r"max_length=3 leaves no room after 3 context tokens"):
        engine.submit([1, 2, 3], CONFIG.replace(max_new_tokens=256, max_length=3), on_event=lambda e: None)
    with pytest.raises(GenerationError, match=r"max_length=3 leaves no room after 3 context tokens"):
        generate(model, torch.tensor([[1, 2, 3]]), generation_config=CONFIG.replace(max_new_tokens=256, max_length=3))


def test_api_seeds_of_choices_wrap_as_every_derived_seed(tok_path):
    """n choices draw with seed + i wrapped into 32 bits (generation_config.offset_seed), so the largest seed is
    accepted as it is by the CLI; a seed outside the range is refused naming the range."""
    tok = load_tokenizer(tok_path)
    request = parse_completion_request({"prompt": "Hello", "n": 3, "seed": SEED_MAX}, tokenizer=tok,
                                       base_config=CONFIG, model_name="tiny")
    assert [s.seed for s in request.submissions] == [SEED_MAX, 0, 1]
    with pytest.raises(APIError, match=r"seed: must be an int from 0 to 4294967295 \(2\*\*32 - 1\)"):
        parse_completion_request({"prompt": "Hello", "seed": SEED_MAX + 1}, tokenizer=tok, base_config=CONFIG,
                                 model_name="tiny")


def test_different_accepted_seeds_draw_different_streams(model):
    """torch's CPU generator keeps 32 bits of a seed: 0, 2**32, 2**62 and 2**63 drew one stream while the error said
    seeds went up to 2**64 - 1. The accepted range is that of distinct streams, and what lies beyond is refused."""
    outs = [generate(model, torch.tensor([[1, 2, 3]]), generation_config=CONFIG, seed=s).sequences[0].tolist()
            for s in (0, 2**31, SEED_MAX)]
    assert outs[0] != outs[1] and outs[0] != outs[2] and outs[1] != outs[2]
    for s in (2**32, 2**63):
        with pytest.raises(GenerationError, match=r"seed must be an int from 0 to 4294967295"):
            generate(model, torch.tensor([[1, 2, 3]]), generation_config=CONFIG, seed=s)
