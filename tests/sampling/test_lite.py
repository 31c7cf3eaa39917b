"""The Lite architecture (seed 003) on the one model class: dense GQA blocks with their own V, a per-canvas time
embedding and zero-initialised linear self-conditioning."""

from __future__ import annotations

import torch

from dgemma import DiffusionGemma, generate, init_weights, load_generation_config, load_model, preset, save_pretrained
from dgemma.model.attention import clean_context_masks
from dgemma.model.costs import parameter_counts
from dgemma.train.diffusion import chunked_soft_embedding, training_loss
from tests.helpers import random_ids

CFG = preset("lite-tiny")


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> DiffusionGemma:
    m = init_weights(DiffusionGemma(CFG), seed=seed, std=0.1)
    torch.nn.init.zeros_(m.self_conditioning.proj.weight)  # init_weights fills every matrix; Lite starts at zero
    return m.to(dtype)


def test_zero_init_self_conditioning_is_bit_identical_to_none_in_fp64():
    m = _model(dtype=torch.float64)
    cache = m.new_cache(2, 8)
    m.commit(random_ids(CFG.vocab_size, 2, 8), cache)
    canvas = random_ids(CFG.vocab_size, 2, 16, seed=1)
    sc = torch.randn(2, 16, CFG.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(m.denoise(canvas, cache, self_conditioning_logits=sc, t=0.5), m.denoise(canvas, cache, t=0.5))
    with torch.no_grad():
        m.self_conditioning.proj.weight.normal_(0, 0.1)
    assert not torch.equal(m.denoise(canvas, cache, self_conditioning_logits=sc, t=0.5),
                           m.denoise(canvas, cache, t=0.5))


def test_full_layers_have_their_own_values_and_the_count_matches():
    m = _model()
    assert all(block.self_attn.v_proj is not None for block in m.layers)
    assert sum(p.numel() for p in m.parameters()) == parameter_counts(CFG)["total"]
    assert parameter_counts(preset("lite-380m"))["total"] == 342_284_288  # the seed's own block: 343,516,160


def test_time_embedding_is_read_and_training_matches_sampling():
    """The noise level changes the prediction, and the clean-context training forward (clean copy at t=0, canvas
    at its level) equals commit + denoise(t) with self-conditioning."""
    m = _model(seed=3)
    with torch.no_grad():
        m.self_conditioning.proj.weight.normal_(0, 0.1)
    T, L = 2 * CFG.canvas_length, CFG.canvas_length
    x0, xt = random_ids(CFG.vocab_size, 1, T, seed=4), random_ids(CFG.vocab_size, 1, T, seed=5)
    cache = m.new_cache(1, T)
    m.commit(x0[:, :L], cache)
    assert not torch.allclose(m.denoise(xt[:, L:], cache, t=0.25), m.denoise(xt[:, L:], cache, t=0.75))
    pos = torch.arange(T)
    level = torch.cat([torch.zeros(T), torch.full((T,), 0.75)])[None]
    tokens, positions, masks = torch.cat([x0, xt], 1), torch.cat([pos, pos])[None], clean_context_masks(T, L, 256)
    with torch.no_grad():
        pre = m.sequence_hidden(tokens, positions, masks, num_clean=T, t=level)[:, T:]
        soft = chunked_soft_embedding(m, pre)
        final = m.sequence_hidden(tokens, positions, masks, num_clean=T, soft=soft, t=level)[:, T:]
    want = m.denoise(xt[:, L:], cache, self_conditioning_logits=m.logits(pre[:, L:]), t=0.75)
    torch.testing.assert_close(want, m.logits(final[:, L:]), atol=1e-4, rtol=0)


def test_lite_trains_saves_loads_and_generates(tmp_path):
    m = _model(seed=6)
    out = training_loss(m, random_ids(CFG.vocab_size, 2, 32, seed=7), self_conditioning_prob=1.0,
                        generator=torch.Generator().manual_seed(8))
    out.loss.backward()
    assert m.self_conditioning.proj.weight.grad.abs().sum() > 0 and m.time_proj.weight.grad.abs().sum() > 0
    save_pretrained(m, tmp_path)
    back = load_model(tmp_path)
    assert back.config == CFG
    for a, b in zip(m.state_dict().values(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for sampler in ("entropy-bound", "lite"):
        result = generate(back, random_ids(CFG.vocab_size, 1, 5, seed=9), generation_config=load_generation_config(
            tmp_path), seed=0, max_new_tokens=32, max_denoising_steps=4, sampler=sampler)
        assert result.sequences.shape == (1, 5 + 32)
