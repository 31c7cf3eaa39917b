"""A deterministic probe of memory: which vocabulary-sized tensors are alive, op by op (tests only)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveVocabTensors(TorchDispatchMode):
    """Tracks, op by op, the bytes of live vocabulary-sized tensors (last dimension `vocab_size`) created inside
    the mode, counting each storage once and ignoring `exclude` (storages that existed before: weights, the
    cache). Deterministic (CPython frees a tensor when its last reference goes), unlike allocator statistics; it
    sees what Python holds, not the temporaries inside a single aten op."""

    def __init__(self, vocab_size: int, exclude: set[int]):
        super().__init__()
        self.vocab_size, self.exclude, self.refs, self.peak = vocab_size, exclude, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == self.vocab_size \
                    and t.untyped_storage().data_ptr() not in self.exclude:
                self.refs.append(weakref.ref(t))
        self.refs = [r for r in self.refs if r() is not None]
        live = {r().untyped_storage().data_ptr(): r().untyped_storage().nbytes() for r in self.refs}
        self.peak = max(self.peak, sum(live.values()))
        return out
