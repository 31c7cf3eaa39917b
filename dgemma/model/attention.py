"""Attention and its masks: who may attend to whom, for each layer type and each role, in one place.

    role      layer type   keys a query sees
    encoder   full         every committed token, then the new tokens causally (k <= q)
    (commit)  sliding      a causal window of `sliding_window` keys including itself (q - k < window)
    decoder   full         every committed token, then the whole canvas (bidirectional)
    (denoise) sliding      the last `sliding_window - 1` committed tokens (transformers' DynamicSlidingWindowLayer
                           keeps that many; the JAX reference `sliding_window`), then the whole canvas
    both      any          never a left-padding token (`KVCache.is_token`)

`Masks` builds them once per pass from the cache. The readable form (`impl="reference"`) is a boolean tensor
(B, 1, S, T), True = may attend, for `reference_attention`; the fast form (`impl="fast"`) is what
`sdpa_attention` needs and no more: "causal", a broadcast rule, or None when nothing is masked, so an unpadded
canvas never materialises a mask. tests/model/test_attention.py pins the two forms to each other.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dgemma.model.config import FULL, SLIDING
from dgemma.model.kv_cache import KVCache

Impl = Literal["reference", "fast"]
IMPLS: tuple[Impl, ...] = ("reference", "fast")
Mask = Tensor | Literal["causal"] | None  # boolean (True = may attend), additive float, "causal", or None (all)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")


# --- attention ---------------------------------------------------------------------------------------------------

def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
    """Explicit softmax(q k^T) v with grouped-query heads. q: (B, H, S, Dh); k, v: (B, K, T, Dh); mask: bool
    (B or 1, 1, S or 1, T), True = may attend, or None. Returns (B, S, H, Dh)."""
    assert not isinstance(mask, str), "the reference path takes boolean masks"
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # each kv head serves `groups` consecutive query heads
        B, K, T, Dh = k.shape
        k = k[:, :, None].expand(B, K, groups, T, Dh).reshape(B, K * groups, T, Dh)
        v = v[:, :, None].expand(B, K, groups, T, Dh).reshape(B, K * groups, T, Dh)
    scores = torch.matmul(q, k.transpose(2, 3))  # Gemma: scale 1.0, no 1/sqrt(Dh); q_norm/k_norm set the temperature
    if mask is not None:  # finfo.min rather than -inf: a fully masked row (a padding query) stays finite
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
    """Twin of `reference_attention` on torch's fused kernel, within fp32 rounding. `mask`: None (every key),
    "causal" (query i sees keys <= i: only valid when the queries start at key 0), a boolean mask with no fully
    masked row, or an additive float mask where rows may be fully masked (padding queries): SDPA gives such a row
    under a boolean mask zeros or NaN depending on the backend, the reference a uniform average, and the additive
    form reproduces the latter."""
    gqa = q.shape[1] != k.shape[1]  # SDPA repeats kv heads itself; no (B, H, T, Dh) copy
    if isinstance(mask, str):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, enable_gqa=gqa)
    else:  # Gemma: scale 1.0 (q_norm/k_norm set the temperature)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


ATTENTION = {"reference": reference_attention, "fast": sdpa_attention}


class Past:
    """What one layer reads in one pass besides its own new keys and values: the visible cached keys and values
    `kv` (B, K, T, Dh each; None without a cache: a first commit, training) and the mask over [those keys ; the
    pass's own]. The layers call only `attend` and `rows_apart`, which `RowPasts` implements too."""

    rows_apart = False  # the rows are one batch: a kernel may round them together

    def __init__(self, kv: tuple[Tensor, Tensor] | None, mask: Mask):
        self.kv, self.mask = kv, mask

    def attend(self, q: Tensor, k: Tensor, v: Tensor, impl: Impl) -> Tensor:
        """This pass's queries q (B, H, S, Dh) over the visible cached keys and values, then the pass's own k, v
        (B, K, S, Dh); returns (B, S, H, Dh)."""
        keys, values = (k, v) if self.kv is None else (torch.cat([self.kv[0], k], -2), torch.cat([self.kv[1], v], -2))
        return ATTENTION[impl](q, keys, values, self.mask)


class RowPasts:
    """One `Past` per row, for rows at different committed lengths (continuous batching: `kv_cache.RowCaches`). Each
    row attends on its own, and `rows_apart` tells the layer to run each row's experts on their own too, so that a
    row computes exactly what it would in a batch of its own."""

    rows_apart = True

    def __init__(self, rows: list[Past]):
        self.rows = rows

    def attend(self, q: Tensor, k: Tensor, v: Tensor, impl: Impl) -> Tensor:
        assert len(self.rows) == q.shape[0]
        return torch.cat([p.attend(q[r:r + 1], k[r:r + 1], v[r:r + 1], impl) for r, p in enumerate(self.rows)])


LayerPast = Past | RowPasts  # what a layer reads of the cache in one pass


# --- masks -------------------------------------------------------------------------------------------------------

def visible_prefixes(sliding_window: int, role: Literal["encoder", "decoder"], sliding_prefix: int | None = None
                     ) -> dict[str, int | None]:
    """How many committed tokens before a pass each layer type sees (None: all of them)."""
    if role == "encoder":  # Gemma: encoder sliding layers see a causal window of `sliding_window` keys incl. self
        return {FULL: None, SLIDING: sliding_window - 1}
    # Gemma: decoder sliding layers see the last `sliding_window - 1` committed tokens plus the whole canvas,
    # whatever the query's offset in the canvas (transformers' DynamicSlidingWindowLayer keeps that many)
    return {FULL: None, SLIDING: sliding_window - 1 if sliding_prefix is None else sliding_prefix}


def causal_rule(start: int, num_new: int, lo: int, window: int | None, device: torch.device) -> Tensor:
    """(S, T) boolean: query p in [start, start + S) sees key k in [lo, start + S) iff k <= p, and p - k < window."""
    q = torch.arange(start, start + num_new, device=device)[:, None]
    k = torch.arange(lo, start + num_new, device=device)[None, :]
    rule = k <= q
    return rule & (q - k < window) if window is not None else rule


def reference_mask(cache: KVCache, start: int, num_new: int, *, prefix: int | None, causal: bool,
                   window: int | None = None, new_is_token: Tensor | None = None) -> Tensor | None:
    """Boolean mask (B, 1, S, T), True = may attend, for `num_new` queries at positions start..start+S-1 over the
    keys a layer sees: its last `prefix` committed tokens before `start` (None: all), then the S new tokens
    (`new_is_token` (B, S): which are real; None = all). With `causal`, `causal_rule`. None when nothing is masked."""
    lo = cache.visible_start(start, prefix)
    device = cache.is_token.device
    if new_is_token is None:
        new_is_token = torch.ones(cache.batch_size, num_new, dtype=torch.bool, device=device)
    keep = torch.cat([cache.is_token[:, lo:start], new_is_token.to(device=device, dtype=torch.bool)], dim=1)
    allowed = keep[:, None, None, :].expand(-1, -1, num_new, -1)  # (B, 1, S, T)
    if causal:
        allowed = allowed & causal_rule(start, num_new, lo, window, device)
    return None if bool(allowed.all()) else allowed


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def commit_masks(cache: KVCache, start: int, num_new: int, new_is_token: Tensor, impl: Impl,
                 dtype: torch.dtype) -> dict[str, Mask]:
    """The encoder's masks for a commit of `num_new` tokens at `start`, per layer type.

    Fast form, when no padding was ever committed: "causal" when the queries start at key 0 and no window cuts in
    (a prefill), else a (1, 1, S, T) boolean rule; nothing is read back from the device. With padding in the cache:
    the reference masks, made additive only when this span itself holds padding, since a padded query is the only
    one that can see no key at all (a real token always sees itself)."""
    window = cache.sliding_window
    seen = visible_prefixes(window, "encoder")
    if impl == "fast" and not cache.has_padding:
        device = cache.is_token.device
        full: Mask = "causal" if start == 0 else causal_rule(start, num_new, 0, None, device)[None, None]
        sliding: Mask = "causal" if start == 0 and num_new <= window else causal_rule(
            start, num_new, cache.visible_start(start, seen[SLIDING]), window, device)[None, None]
        return {FULL: full, SLIDING: sliding}
    masks = {FULL: reference_mask(cache, start, num_new, prefix=seen[FULL], causal=True, new_is_token=new_is_token),
             SLIDING: reference_mask(cache, start, num_new, prefix=seen[SLIDING], causal=True, window=window,
                                     new_is_token=new_is_token)}
    if impl == "reference" or bool(new_is_token.all()):
        return dict(masks)
    return {kind: _additive(m, dtype) for kind, m in masks.items()}


def denoise_masks(cache: KVCache, end: int, num_new: int, seen: dict[str, int | None], impl: Impl
                  ) -> dict[str, Mask]:
    """The decoder's masks for a canvas of `num_new` tokens after the committed prefix [0, end), per layer type.
    Fast form: None unless the cache ever held padding, then (B, 1, 1, T) boolean over [visible prefix ; canvas],
    broadcast over the queries (a canvas query always sees the canvas, so no row is empty)."""
    if impl == "reference":
        return {kind: reference_mask(cache, end, num_new, prefix=p, causal=False) for kind, p in seen.items()}
    if not cache.has_padding:
        return dict.fromkeys(seen)
    canvas = cache.is_token.new_ones(cache.batch_size, num_new)
    return {kind: torch.cat([cache.is_token[:, cache.visible_start(end, p):end], canvas], 1)[:, None, None]
            for kind, p in seen.items()}


def static_denoise_masks(is_token: Tensor, end: Tensor, num_new: int, slots: Tensor, window: Tensor
                         ) -> dict[str, Tensor]:
    """The decoder's masks with shapes that do not depend on the committed length `end` (a 0-d device tensor), for
    a step captured whole (torch.compile, CUDA graphs): full layers read every preallocated slot and mask those at or
    past `end`; sliding layers read the fixed `slots` (clamped `window`, some of which may lie before slot 0)."""
    B, T = is_token.shape
    canvas = is_token.new_ones(B, num_new)
    full = torch.cat([is_token & (torch.arange(T, device=is_token.device) < end), canvas], 1)[:, None, None]
    sliding = torch.cat([is_token[:, slots] & (window >= 0), canvas], 1)[:, None, None]
    return {FULL: full, SLIDING: sliding}


# --- training masks: whole sequences, no cache (dgemma/train/diffusion.py's objectives) -------------------------------
# The same rules over one sequence that holds several canvases: a canvas sees the clean canvases before it (its
# sliding layers the last `window - 1` of their tokens) and itself bidirectionally; clean tokens attend causally.

def clean_context_masks(length: int, canvas_length: int, window: int, device: torch.device | None = None, *,
                        context: int = 0) -> dict[str, Tensor]:
    """Masks (1, 1, P + 2T, P + 2T) over [clean ; noisy] for both layer types (True = may attend): the clean stream
    is P = `context` committed tokens then the T canvas tokens, the noisy stream the T canvas tokens again; canvases
    start right after the context (the last one may be shorter), as they do when a prompt is committed first."""
    P, T = context, length
    idx = torch.arange(P + 2 * T, device=device)
    noisy = idx >= P + T
    pos = torch.where(noisy, idx - T, idx)
    block = (pos - P).clamp(min=0) // canvas_length
    q_pos, k_pos = pos[:, None], pos[None, :]
    q_noisy, k_noisy = noisy[:, None], noisy[None, :]
    start = P + block[:, None] * canvas_length
    causal = ~q_noisy & ~k_noisy & (k_pos <= q_pos)  # the encoder role: clean attends causally to clean
    prefix = q_noisy & ~k_noisy & (k_pos < start)  # a canvas sees the context and the clean canvases before it
    own = q_noisy & k_noisy & (block[:, None] == block[None, :])  # ...and itself, bidirectionally
    full = causal | prefix | own
    sliding = (causal & (q_pos - k_pos < window)) | (prefix & (k_pos >= start - (window - 1))) | own
    return {FULL: full[None, None], SLIDING: sliding[None, None]}


def noisy_context_masks(length: int, canvas_length: int, window: int, device: torch.device | None = None
                        ) -> dict[str, Tensor]:
    """Block-causal masks (1, 1, T, T): canvas b sees canvases < b and itself."""
    pos = torch.arange(length, device=device)
    block = pos // canvas_length
    start = (block * canvas_length)[:, None]
    earlier, own = pos[None, :] < start, block[:, None] == block[None, :]
    return {FULL: (earlier | own)[None, None],
            SLIDING: ((earlier & (pos[None, :] >= start - (window - 1))) | own)[None, None]}


def causal_masks(length: int, window: int, device: torch.device | None = None) -> dict[str, Tensor]:
    """Causal masks (1, 1, T, T), sliding layers with a window of `window` keys including self."""
    pos = torch.arange(length, device=device)
    causal = pos[None, :] <= pos[:, None]
    return {FULL: causal[None, None], SLIDING: (causal & (pos[:, None] - pos[None, :] < window))[None, None]}
