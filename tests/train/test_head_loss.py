"""The fused head loss (dgemma/train/head_loss.py) against its readable twin, `x0_cross_entropy`'s chunk loss with
the reference kernels: the loss and the gradients of the hidden states and of the tied embedding agree to rounding,
with and without the softcap, the observation boost and chunking; and `training_loss` takes the fused path with the
fast kernels only."""

from __future__ import annotations

import pytest
import torch

from dgemma.train.diffusion import fusable, x0_cross_entropy
from tests.helpers import random_model


def loss_and_grads(model, final, targets, chunk_rows, observed):
    model.zero_grad(set_to_none=True)
    h = final.clone().requires_grad_(True)
    loss = x0_cross_entropy(model, h, targets, chunk_rows, observed)
    loss.backward()
    return loss.detach(), h.grad, model.embed_tokens.weight.grad.clone()


@pytest.mark.parametrize("chunk_rows", [None, 7, 1024])
@pytest.mark.parametrize("observed_likelihood", [False, True])
@pytest.mark.parametrize("softcap", [30.0, None])
def test_the_fused_head_loss_matches_the_readable_chunk_loss(chunk_rows, observed_likelihood, softcap):
    model = random_model("tiny")
    model.config = model.config.replace(observed_likelihood=observed_likelihood, final_logit_softcapping=softcap)
    model.train()
    N, D, V = 40, model.config.hidden_size, model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    final = torch.randn(N, D, generator=g) * 3
    targets = torch.randint(0, V, (N,), generator=g)
    observed = (torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g)) if observed_likelihood else None
    model.impl = "reference"
    assert not fusable(model, final)
    ref = loss_and_grads(model, final, targets, chunk_rows, observed)
    model.impl = "fast"
    assert fusable(model, final)
    fused = loss_and_grads(model, final, targets, chunk_rows, observed)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fused[2], ref[2], rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        assert not fusable(model, final)  # evaluation: the readable loss (no gradient to compute)
        torch.testing.assert_close(x0_cross_entropy(model, final, targets, chunk_rows, observed), ref[0],
                                   rtol=1e-5, atol=1e-5)
