"""commit / denoise over the preallocated KV cache: pieces equal whole, denoise is read-only, overwriting a span
invalidates what follows, and the visibility rules of every layer type."""

from __future__ import annotations

import pytest
import torch

from dgemma import DiffusionGemma, init_weights, preset
from dgemma.model.attention import reference_mask
from dgemma.model.kv_cache import KVCache
from tests.helpers import random_ids

ATOL = 1e-5  # cached K/V
LOGITS_ATOL = 1e-4  # logits of order 10: different span shapes change fp32 rounding


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    torch.manual_seed(0)
    m = init_weights(DiffusionGemma(preset("tiny")), seed=0, std=0.2)
    with torch.no_grad():  # make the layer scalars matter and differ between encoder and decoder
        for i, block in enumerate(m.layers):
            block.layer_scalar.fill_(0.7 + 0.1 * i)
            block.encoder_layer_scalar.fill_(1.3 - 0.1 * i)
    return m


def _committed(cache: KVCache) -> list[torch.Tensor]:
    return [t[:, :, : cache.length].clone() for t in (*cache.keys, *cache.values)]


def test_committing_in_pieces_equals_committing_at_once(model):
    seq = random_ids(512, 2, 30)  # crosses the sliding window (8) several times
    whole = model.new_cache(2, 40)
    model.commit(seq, whole)
    pieces = model.new_cache(2, 40)
    for lo, hi in [(0, 5), (5, 6), (6, 19), (19, 30)]:
        model.commit(seq[:, lo:hi], pieces)
    assert whole.length == pieces.length == 30
    for a, b in zip(_committed(whole), _committed(pieces), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    canvas = random_ids(512, 2, 16, seed=1)
    torch.testing.assert_close(model.denoise(canvas, whole), model.denoise(canvas, pieces), atol=LOGITS_ATOL, rtol=0)


def test_denoise_never_writes_the_cache_so_canvases_can_be_compared(model):
    cache = model.new_cache(2, 40)
    model.commit(random_ids(512, 2, 12), cache)
    before = [t.clone() for t in (*cache.keys, *cache.values, cache.is_token)]
    a, b = random_ids(512, 2, 16, seed=2), random_ids(512, 2, 16, seed=3)
    first = model.denoise(a, cache)
    model.denoise(b, cache, self_conditioning_logits=torch.randn(2, 16, 512))
    assert cache.length == 12
    assert all(torch.equal(x, y) for x, y in zip(before, (*cache.keys, *cache.values, cache.is_token), strict=True))
    assert torch.equal(model.denoise(a, cache), first)  # best-of-k: re-scoring the first canvas is reproducible


def test_overwriting_a_span_invalidates_everything_after_it(model):
    prompt, old, new = random_ids(512, 1, 10), random_ids(512, 1, 16, seed=4), random_ids(512, 1, 6, seed=5)
    cache = model.new_cache(1, 40)
    model.commit(prompt, cache)
    model.commit(old, cache)
    model.commit(new, cache, start=13)  # keep prompt + old[:3], replace the rest with `new`
    assert cache.length == 19
    fresh = model.new_cache(1, 40)
    model.commit(torch.cat([prompt, old[:, :3], new], 1), fresh)
    canvas = random_ids(512, 1, 16, seed=6)
    torch.testing.assert_close(model.denoise(canvas, cache), model.denoise(canvas, fresh), atol=LOGITS_ATOL, rtol=0)
    # Stale slots past `length` are never read: scribbling on them changes nothing.
    for t in (*cache.keys, *cache.values):
        t[:, :, 19:] = 1e4
    torch.testing.assert_close(model.denoise(canvas, cache), model.denoise(canvas, fresh), atol=LOGITS_ATOL, rtol=0)


def test_truncate_then_recommit_equals_fresh(model):
    seq = random_ids(512, 1, 20, seed=7)
    cache = model.new_cache(1, 20)
    model.commit(seq, cache)
    cache.truncate(9)
    model.commit(seq[:, 9:], cache)
    fresh = model.new_cache(1, 20)
    model.commit(seq, fresh)
    for a, b in zip(_committed(cache), _committed(fresh), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _perturbed_slot_changes(model, slot: int, *, encoder: bool) -> bool:
    """Scribble on one cached slot of the sliding layers only; does the next pass notice?"""
    cache = model.new_cache(1, 40)
    model.commit(random_ids(512, 1, 20, seed=8), cache)
    nxt = random_ids(512, 1, 16, seed=9)

    def run() -> torch.Tensor:
        if encoder:
            probe = model.new_cache(1, 40)
            probe.keys, probe.values = [t.clone() for t in cache.keys], [t.clone() for t in cache.values]
            probe.length = 20
            model.commit(nxt[:, :1], probe)
            return torch.cat([k[:, :, 20].flatten() for k in probe.keys])  # what the encoder wrote at position 20
        return model.denoise(nxt, cache)

    before = run()
    for i, sliding in enumerate(cache.is_sliding):
        if sliding:
            cache.keys[i][:, :, slot] += 3.0
    return not torch.equal(before, run())


def test_sliding_layers_see_the_reference_window(model):
    """Decoder: the last `sliding_window - 1` committed tokens (slots 13..19 of 20 with window 8). Encoder: a causal
    window of `sliding_window` keys including itself (position 20 sees 13..20)."""
    sw = model.config.sliding_window
    for encoder in (False, True):
        assert _perturbed_slot_changes(model, 20 - (sw - 1), encoder=encoder)
        assert not _perturbed_slot_changes(model, 20 - sw, encoder=encoder)


def test_masks_follow_the_reference_rules(model):
    """Brute-force the visibility rules of every layer type and compare with attention.reference_mask."""
    cfg = model.config
    sw, start, S = cfg.sliding_window, 13, 5
    cache = model.new_cache(1, 30)
    model.commit(random_ids(512, 1, start), cache)
    for prefix, window, causal in [(None, None, True), (sw - 1, sw, True), (None, None, False), (sw - 1, None, False)]:
        mask = reference_mask(cache, start, S, prefix=prefix, causal=causal, window=window)
        lo = 0 if prefix is None else start - prefix
        keys = list(range(lo, start + S))
        want = torch.tensor([[(k <= q and (window is None or q - k < window)) if causal else True for k in keys]
                             for q in range(start, start + S)])
        if want.all():
            assert mask is None
        else:
            assert mask is not None and torch.equal(mask[0, 0], want)
    # The encoder's sliding queries see exactly `sliding_window` keys including themselves.
    enc = reference_mask(cache, start, S, prefix=sw - 1, causal=True, window=sw)
    assert enc is not None and (enc[0, 0].sum(-1) == sw).all()


@pytest.mark.parametrize("bad, message", [
    (lambda m, c: m.commit(random_ids(512, 1, 4), c, start=30),
     r"commit start=30 is outside the committed prefix \[0, 10\]"),
    (lambda m, c: m.commit(random_ids(512, 1, 15), c),
     r"cache overflow: committing 15 tokens at position 10 needs 25 slots"),
    (lambda m, c: m.commit(random_ids(512, 2, 4), c),
     r"input_ids must have shape \(batch_size=1, length\), got \(2, 4\)"),
    (lambda m, c: m.commit(random_ids(512, 1, 4), c, attention_mask=torch.ones(1, 5)),
     r"attention_mask has shape \(1, 5\)"),
    (lambda m, c: m.commit(random_ids(512, 1, 4), c, attention_mask=torch.full((1, 4), 2)), r"only 0/1"),
    (lambda m, c: m.commit(torch.tensor([[1, 512]]), c), r"input_ids must lie in \[0, vocab_size=512\)"),
    (lambda m, c: m.denoise(random_ids(512, 1, 16), c, self_conditioning_logits=torch.zeros(1, 16, 7)),
     r"self_conditioning_logits has shape \(1, 16, 7\), expected \(1, 16, 512\)"),
    (lambda m, c: m.denoise(random_ids(512, 16), c), r"canvas must have shape \(batch_size=1, length\)"),
    (lambda m, c: c.truncate(11), r"cannot truncate a cache of length 10 to 11"),
])
def test_bad_input_gets_a_clear_error(model, bad, message):
    cache = model.new_cache(1, 20)
    model.commit(random_ids(512, 1, 10), cache)
    with pytest.raises(ValueError, match=message):
        bad(model, cache)
    assert cache.length == 10  # a refused commit leaves the cache as it was
