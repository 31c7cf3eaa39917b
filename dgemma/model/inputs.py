"""The checks of what `commit`, `denoise` and `generate` take: token ids that lie in the vocabulary, caches that match
the batch. One home, so the model and the sampler loops refuse a bad input with the same message."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dgemma.model.kv_cache import KVCache


def check_token_ids(ids: Tensor, vocab_size: int, name: str = "input_ids") -> None:
    """Refuse ids outside [0, vocab_size) with a message naming the range found (an embedding lookup would fail
    with a bare index error, or silently on some devices)."""
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be an integer tensor of token ids, got {got}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")


def one_row_caches(cache: KVCache | Sequence[KVCache], ids: Tensor, name: str) -> list[KVCache] | None:
    """None for one cache (checked against the batch of `ids`); the list for one-row caches, one per row of `ids`."""
    if isinstance(cache, KVCache):
        cache.check_batch(ids, name)
        return None
    rows = list(cache)
    if len(rows) != ids.shape[0] or any(not isinstance(c, KVCache) or c.batch_size != 1 for c in rows):
        raise ValueError(f"cache must be a KVCache or a list of one-row KVCaches, one per {name} row "
                         f"({ids.shape[0]}), got {len(rows)} entries")
    return rows
