"""Invariants of the readable model that hold for any weights."""

from __future__ import annotations

import pytest
import torch

from dgemma import DiffusionGemma, init_weights, preset
from dgemma.model.config import FULL
from dgemma.model.layers import rope_cos_sin, rope_inv_freq
from tests.helpers import random_ids


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    return init_weights(DiffusionGemma(preset("tiny")), seed=1, std=0.2)


def test_shapes_and_dtypes(model):
    logits = model(random_ids(512, 3, 7), random_ids(512, 3, 16, seed=1))
    assert logits.shape == (3, 16, 512) and logits.dtype == torch.float32
    bf16 = DiffusionGemma(preset("tiny")).to(torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    out = bf16(random_ids(512, 3, 7), random_ids(512, 3, 16, seed=1))
    assert out.dtype == torch.float32  # logits are fp32 whatever the weights
    cos = torch.nn.functional.cosine_similarity(out.flatten(), logits.flatten(), dim=0)
    assert cos > 0.95  # bf16 tracks fp32 (a random model amplifies rounding, so no elementwise bound)


def test_softcap_bounds_the_logits(model):
    big = DiffusionGemma(preset("tiny"))
    big.load_state_dict(model.state_dict())
    with torch.no_grad():
        big.embed_tokens.weight.mul_(50)
    logits = big(random_ids(512, 1, 5), random_ids(512, 1, 16, seed=2))
    assert logits.abs().max() <= 30.0 and logits.abs().max() > 25.0


def test_zero_self_conditioning_mask_equals_no_self_conditioning(model):
    prompt, canvas = random_ids(512, 2, 9), random_ids(512, 2, 16, seed=3)
    sc = torch.randn(2, 16, 512) * 3
    plain = model(prompt, canvas)
    masked = model(prompt, canvas, self_conditioning_logits=sc, self_conditioning_mask=torch.tensor([False, True]))
    # Equal up to rounding: row 1's tokens change how many rows each expert's matmul gets.
    torch.testing.assert_close(masked[0], plain[0], atol=1e-5, rtol=0)
    assert not torch.allclose(masked[1], plain[1])


def test_partial_rope_leaves_the_unrotated_dims_alone():
    cfg = preset("tiny")
    full = cfg.layer_types.index(FULL)
    hd, rotated = cfg.layer_head_dim(full), cfg.rotary_dims(full)
    assert (hd, rotated) == (48, 12)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg.full_rope, hd), torch.arange(100)[None], torch.float32)
    half = hd // 2
    for lo, hi in [(0, rotated // 2), (half, half + rotated // 2)]:  # rotate-half: pair i with i + hd/2
        assert not torch.allclose(cos[0, 1:, lo:hi], torch.ones(99, hi - lo))
    for lo, hi in [(rotated // 2, half), (half + rotated // 2, hd)]:
        assert torch.equal(cos[0, :, lo:hi], torch.ones(100, hi - lo))
        assert torch.equal(sin[0, :, lo:hi], torch.zeros(100, hi - lo))


def test_full_layers_share_keys_and_values():
    m = DiffusionGemma(preset("tiny"))
    for i, block in enumerate(m.layers):
        assert (block.self_attn.v_proj is None) == (m.config.layer_types[i] == FULL)


def test_encoder_and_decoder_layer_scalars_are_separate(model):
    m = DiffusionGemma(preset("tiny"))
    m.load_state_dict(model.state_dict())
    prompt, canvas = random_ids(512, 1, 9), random_ids(512, 1, 16, seed=4)
    base = m(prompt, canvas)
    with torch.no_grad():
        m.layers[1].layer_scalar.fill_(0.5)  # decoder only
    dec = m(prompt, canvas)
    assert not torch.allclose(dec, base)
    cache = m.new_cache(1, 9)
    m.commit(prompt, cache)
    keys = [k.clone() for k in cache.keys]
    with torch.no_grad():
        m.layers[1].encoder_layer_scalar.fill_(0.5)  # encoder only: changes what later layers cache
    m.commit(prompt, cache, start=0)
    assert torch.equal(keys[1], cache.keys[1]) and not torch.equal(keys[2], cache.keys[2])


def test_dense_model_without_experts_runs():
    m = init_weights(DiffusionGemma(preset("tiny").replace(num_experts=0)))
    assert not any("experts" in n or "router" in n for n, _ in m.named_parameters())
    assert torch.isfinite(m(random_ids(512, 2, 5), random_ids(512, 2, 16, seed=5))).all()


def test_empty_prompt_denoises_against_nothing(model):
    assert model(torch.zeros(2, 0, dtype=torch.long), random_ids(512, 2, 16)).shape == (2, 16, 512)


def test_gradients_flow_through_the_training_forward(model):
    """The training path (no_grad only wraps the public inference methods) is differentiable."""
    from dgemma.train.diffusion import training_loss

    m = DiffusionGemma(preset("tiny"))
    m.load_state_dict(model.state_dict())
    training_loss(m, random_ids(512, 1, 32), self_conditioning_prob=0.0).loss.backward()
    assert m.embed_tokens.weight.grad is not None and m.layers[0].experts.gate_up_proj.grad.abs().sum() > 0
