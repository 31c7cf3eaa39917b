"""A preallocated KV cache for committed tokens.

Each layer owns a (B, K, max_length, Dh) key and value tensor; slot p holds the token at position p. `commit`
writes a span [start, start + S) and sets `length = start + S`, so re-committing an earlier span discards what
came after it. `denoise` only reads. Which slots a layer sees:

    full layers      every committed slot [0, end)
    sliding layers   the last `sliding_window - 1` slots [end - sliding_window + 1, end): what transformers'
                     DynamicSlidingWindowLayer retains, so a canvas sees that many prefix tokens, and an encoder
                     query (with itself) sees `sliding_window` keys.

Sliding layers store every position too (not a ring buffer): rewinding then costs nothing, at the price of
memory on long contexts (see `dgemma inspect` for bytes per token).

`is_token` (B, max_length) marks real tokens (True) against left padding (False); the attention masks
(dgemma/model/attention.py) exclude padding. The cache stores; it decides nothing about who attends to whom.

Continuous batching (dgemma/serving/engine.py) keeps one cache as a pool of rows, one request per row, each with its
own committed length: `rows(start, stop, length)` is a cache over some rows that shares the pool's storage (a commit
through it writes into the pool), and `model.denoise(canvas, RowCaches([one-row caches]))` runs one batched pass in
which each row reads its own (`attention.RowPasts` is what its layers see).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dgemma.model.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, batch_size: int, max_length: int, *, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        if batch_size <= 0 or max_length <= 0:
            raise ValueError(f"KVCache needs batch_size > 0 and max_length > 0, got {batch_size} and {max_length}")
        self.batch_size, self.max_length = batch_size, max_length
        self.sliding_window = config.sliding_window
        self.is_sliding = [config.is_sliding(i) for i in range(config.num_hidden_layers)]
        shapes = [(batch_size, config.layer_num_kv_heads(i), max_length, config.layer_head_dim(i))
                  for i in range(config.num_hidden_layers)]
        self.keys = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.values = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.is_token = torch.ones(batch_size, max_length, dtype=torch.bool, device=device)
        self.length = 0  # number of committed positions; slots >= length are stale
        # Whether any commit ever held padding (never reset): the fast path then needs masks
        # (dgemma/model/attention.py).
        self.has_padding = False

    def rows(self, start: int, stop: int, length: int | None = None) -> KVCache:
        """Rows [start, stop) as a cache of their own that shares this one's storage: commits through it write here.
        `length`: its committed length (default this cache's). Never grow it (`ensure_capacity` would copy)."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows [{start}, {stop}) are outside a cache of batch size {self.batch_size}")
        view = object.__new__(KVCache)  # the same fields, over slices of this cache's tensors
        view.batch_size, view.max_length = stop - start, self.max_length
        view.sliding_window, view.is_sliding = self.sliding_window, self.is_sliding
        view.keys, view.values = [k[start:stop] for k in self.keys], [v[start:stop] for v in self.values]
        view.is_token, view.has_padding = self.is_token[start:stop], self.has_padding
        view.length = self.length if length is None else length
        return view

    def __repr__(self) -> str:
        return f"KVCache(batch_size={self.batch_size}, length={self.length}, max_length={self.max_length})"

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def visible_start(self, end: int, prefix: int | None) -> int:
        """First visible slot when the committed prefix ends at `end` and a layer sees its last `prefix` tokens
        (None: all of them)."""
        return 0 if prefix is None else max(0, end - prefix)

    def visible(self, layer: int, end: int, prefix: int | None) -> tuple[Tensor, Tensor]:
        """Keys and values (B, K, T, Dh) of the last `prefix` committed tokens before `end` (None: all)."""
        lo = self.visible_start(end, prefix)
        return self.keys[layer][:, :, lo:end], self.values[layer][:, :, lo:end]

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        self.keys[layer][:, :, start:start + k.shape[2]] = k
        self.values[layer][:, :, start:start + v.shape[2]] = v

    def ensure_capacity(self, max_length: int) -> None:
        """Grow the preallocated storage to hold `max_length` positions, keeping what is committed."""
        if max_length <= self.max_length:
            return
        grow = max_length - self.max_length

        def extend(t: Tensor) -> Tensor:
            return torch.cat([t, t.new_zeros(*t.shape[:2], grow, *t.shape[3:])], dim=2)

        self.keys = [extend(t) for t in self.keys]
        self.values = [extend(t) for t in self.values]
        self.is_token = torch.cat([self.is_token, self.is_token.new_ones(self.batch_size, grow)], dim=1)
        self.max_length = max_length

    def truncate(self, length: int) -> None:
        """Forget everything from position `length` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def check_batch(self, ids: Tensor, name: str) -> None:
        if ids.ndim != 2 or ids.shape[0] != self.batch_size:
            raise ValueError(f"{name} must have shape (batch_size={self.batch_size}, length), got {tuple(ids.shape)}")

    def prepare_write(self, input_ids: Tensor, start: int | None, attention_mask: Tensor | None) -> int:
        """Validate a commit of `input_ids` (B, S) at `start`; drop everything from `start` on and record the
        span's padding. Returns the resolved start."""
        self.check_batch(input_ids, "input_ids")
        start = self.length if start is None else start
        S = input_ids.shape[1]
        if not 0 <= start <= self.length:
            raise ValueError(f"commit start={start} is outside the committed prefix [0, {self.length}]: commits "
                             "append at the end or overwrite an earlier span")
        if start + S > self.max_length:
            raise ValueError(f"cache overflow: committing {S} tokens at position {start} needs {start + S} slots but "
                             f"the cache holds {self.max_length}; allocate a larger one with "
                             f"model.new_cache(batch_size, max_length)")
        if attention_mask is None:
            padding = torch.ones(input_ids.shape, dtype=torch.bool, device=self.is_token.device)
        else:
            if tuple(attention_mask.shape) != tuple(input_ids.shape):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                                 f"{tuple(input_ids.shape)}")
            if not torch.isin(attention_mask, torch.tensor([0, 1], device=attention_mask.device)).all():
                raise ValueError("attention_mask must contain only 0/1 (or False/True)")
            padding = attention_mask.to(device=self.is_token.device, dtype=torch.bool)
            self.has_padding = self.has_padding or not bool(padding.all())
        self.length = start
        self.is_token[:, start:start + S] = padding
        return start

    def finish_write(self, end: int) -> None:
        self.length = end


class RowCaches:
    """B one-row caches (`KVCache.rows` views of a pool), each at its own committed length, batched for one pass:
    `model.commit(ids, rows)` appends each row at its own end and `model.denoise(canvas, rows)` reads each row's own
    prefix, each row computing what it would in a batch of its own (continuous batching: dgemma/serving/engine.py)."""

    def __init__(self, rows: Sequence[KVCache]):
        if not rows or any(not isinstance(c, KVCache) or c.batch_size != 1 for c in rows):
            raise ValueError(f"RowCaches takes one-row KVCaches, got {[getattr(c, 'batch_size', c) for c in rows]}")
        self.rows = list(rows)

    def __repr__(self) -> str:
        return f"RowCaches(lengths={[c.length for c in self.rows]})"

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def check_batch(self, ids: Tensor, name: str) -> None:
        if ids.ndim != 2 or ids.shape[0] != self.batch_size:
            raise ValueError(f"{name} must have shape (rows={self.batch_size}, length), one row per cache, got "
                             f"{tuple(ids.shape)}")
