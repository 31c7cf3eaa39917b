"""Small helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch


def random_ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    """Token ids uniform in [0, vocab), of `shape`, reproducible from `seed`."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
