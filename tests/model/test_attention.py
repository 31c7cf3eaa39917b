"""dgemma/model/attention.py: SDPA attention against the explicit reference, and the fast masks against the reference
masks (the reference masks against brute-forced visibility rules: tests/model/test_kv_cache.py)."""

from __future__ import annotations

import pytest
import torch

from dgemma.model.attention import (
    Mask,
    commit_masks,
    denoise_masks,
    reference_attention,
    reference_mask,
    sdpa_attention,
)
from dgemma.model.config import FULL, SLIDING, preset
from dgemma.model.diffusiongemma import DiffusionGemma
from tests.helpers import random_ids


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive-with-empty-row"])
def test_sdpa_attention_matches_reference_attention(kind):
    g = torch.Generator().manual_seed(0)
    B, H, K, S, Dh = 2, 4, 2, 5, 8
    T = S if kind == "causal" else 9
    q, k, v = (torch.randn(B, n, t, Dh, generator=g) for n, t in ((H, S), (K, T), (K, T)))
    allowed = torch.rand(B, 1, S, T, generator=g) > 0.3
    allowed[..., -1] = True
    if kind == "none":
        mask, dense = None, None
    elif kind == "causal":
        mask, dense = "causal", torch.ones(S, T, dtype=torch.bool).tril()[None, None]
    elif kind == "bool":
        mask, dense = allowed, allowed
    else:
        allowed[0, 0, 1] = False  # a padding query that sees nothing: the reference averages every value
        mask, dense = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min), allowed
    torch.testing.assert_close(sdpa_attention(q, k, v, mask), reference_attention(q, k, v, dense),
                               atol=1e-5, rtol=0)


def _dense(mask: Mask, shape: tuple[int, int, int]) -> torch.Tensor:
    B, S, T = shape
    if mask is None:
        return torch.ones(B, 1, S, T, dtype=torch.bool)
    if isinstance(mask, str):
        return torch.ones(S, T, dtype=torch.bool).tril().expand(B, 1, S, T)
    if mask.dtype != torch.bool:
        mask = mask == 0
    return mask.expand(B, 1, S, T)


@pytest.mark.parametrize("padding", [False, True])
def test_fast_masks_equal_reference_masks(padding):
    config = preset("tiny")
    model = DiffusionGemma(config)
    cache = model.new_cache(2, 64)
    W, L = config.sliding_window, config.canvas_length
    prompt = random_ids(config.vocab_size, 2, 11, seed=0)
    attention_mask = torch.ones_like(prompt)
    if padding:
        attention_mask[0, :4] = 0
    for start, S, keep in ((0, 11, attention_mask), (11, L, None), (0, 5, None)):  # prefill, a canvas, a short one
        if start == 0:
            cache = model.new_cache(2, 64)
        cache.prepare_write(random_ids(config.vocab_size, 2, S, seed=1), start, keep if padding else None)
        new_keep = cache.is_token[:, start:start + S]
        fast = commit_masks(cache, start, S, new_keep, "fast", torch.float32)
        slow = commit_masks(cache, start, S, new_keep, "reference", torch.float32)
        for kind, prefix, window in ((FULL, None, None), (SLIDING, W - 1, W)):
            ref = reference_mask(cache, start, S, prefix=prefix, causal=True, window=window, new_is_token=new_keep)
            assert (slow[kind] is None and ref is None) or torch.equal(slow[kind], ref)
            T = S + start - cache.visible_start(start, prefix)
            assert torch.equal(_dense(fast[kind], (2, S, T)), _dense(ref, (2, S, T))), (start, kind)
            if not padding:
                assert fast[kind] is None or isinstance(fast[kind], str) or fast[kind].shape[0] == 1
        cache.finish_write(start + S)
        prefixes = {FULL: None, SLIDING: W - 1}
        fast = denoise_masks(cache, start + S, L, prefixes, "fast")
        slow = denoise_masks(cache, start + S, L, prefixes, "reference")
        for kind, prefix in prefixes.items():
            ref = reference_mask(cache, start + S, L, prefix=prefix, causal=False)
            assert (slow[kind] is None and ref is None) or torch.equal(slow[kind], ref)
            T = L + start + S - cache.visible_start(start + S, prefix)
            assert torch.equal(_dense(fast[kind], (2, L, T)), _dense(ref, (2, L, T)))
            assert (fast[kind] is None) == (not cache.has_padding)  # no mask tensor at all without padding
