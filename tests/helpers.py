"""Small helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch


def random_ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    """Token ids uniform in [0, vocab), of `shape`, reproducible from `seed`."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def model_config(name: str):
    """The dgemma-only test geometries of the fast-vs-readable tests: "tiny", and "k8-of-16" (like
    dgemma/testing/hf.py's: 16 experts top-8, six layers in the default 5:1 pattern, other RoPE)."""
    from dgemma.config import RopeConfig, preset

    if name == "tiny":
        return preset("tiny")
    if name == "k8-of-16":
        return preset("tiny").replace(num_experts=16, top_k_experts=8, num_hidden_layers=6, layer_types=(),
                                      sliding_rope=RopeConfig("default", 5_000.0),
                                      full_rope=RopeConfig("proportional", 200_000.0, 0.5))
    raise KeyError(f"no test geometry {name!r}")


GEOMETRY_NAMES = ("tiny", "k8-of-16")


def random_model(name: str, seed: int = 0):
    """A dgemma model of `model_config(name)` with every tensor randomised (dgemma.testing.hf.randomize_), eval."""
    from dgemma.model import DiffusionGemma
    from dgemma.testing.hf import randomize_

    return randomize_(DiffusionGemma(model_config(name)), seed).eval()
