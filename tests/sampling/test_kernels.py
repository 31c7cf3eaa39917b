"""Each sampling kernel in dgemma/sampling/kernels.py against its readable twin (fp32, CPU): the fused sampler
statistics, the draws, the row-chunked head and sample, and the one pass over the vocabulary. The fast sampler loop:
tests/sampling/test_fast_sampler.py."""

from __future__ import annotations

import pytest
import torch

from dgemma.model.kernels import logits_into
from dgemma.sampling import kernels, rules
from tests.helpers import random_model


def _tempered(R: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(R, V, generator=g) * torch.linspace(0.1, 60, R)[:, None]  # flat rows ... near-one-hot rows
    z[0] = 0.0  # exactly uniform
    z[1, 3] = float("-inf")  # a token that cannot be drawn
    return z


def test_tempered_stats_match_reference():
    z = _tempered(64, 300, 0)
    probs, argmax, entropy = kernels.tempered_stats(z.clone())
    torch.testing.assert_close(probs, torch.softmax(z, -1), atol=1e-7, rtol=1e-5)
    assert torch.equal(argmax, z.argmax(-1))
    truth = rules.token_entropy(z.double())
    assert ((entropy.double() - truth).abs() <= 1e-6 + 1e-6 * truth).all()  # nearer fp64 than the fp32 reference
    assert (entropy - rules.token_entropy(z)).abs().max() < 1e-5  # which is within 6e-6 of it here


@pytest.mark.parametrize("draw", ["cdf", "race"])
def test_draws_follow_the_distribution(draw):
    V, R = 10, 40_000
    p = torch.tensor([0.3, 0.0, 0.05, 0.15, 0.0, 0.2, 0.1, 0.1, 0.1, 0.0])
    g = torch.Generator().manual_seed(15)
    probs = p.expand(R, V)
    if draw == "cdf":  # blocks of 4 over 10 tokens: both levels and a short last block
        ids = kernels.draw_cdf(probs, torch.rand(R, generator=g, dtype=torch.float64), block=4)
    else:
        ids = kernels.draw_race(probs, torch.empty(R, V).exponential_(generator=g))
    freq = torch.bincount(ids, minlength=V).float() / R
    assert (freq - p).abs().max() < 0.01  # ~5 standard errors
    assert freq[p == 0].sum() == 0


def test_head_and_sample_matches_reference_and_ignores_chunking():
    model = random_model("tiny")
    B, L, V, D = 2, 16, model.config.vocab_size, model.config.hidden_size
    final = torch.randn(B, L, D, generator=torch.Generator().manual_seed(16)) * 2
    temp = rules.temperature(5, 12, 0.4, 0.8)
    z = model.logits(final).div_(temp)
    results = []
    for chunk, ws in ((None, None), (5, None), (7, kernels.Workspace(7, V, torch.device("cpu")))):
        g = torch.Generator().manual_seed(17)
        head = lambda rows, o: logits_into(rows, model.embed_tokens.weight, 30.0, o)
        out = kernels.head_and_sample(final, head, temp, generator=g,
                                      embed=model.embed_tokens.weight, embed_scale=D**0.5, chunk_rows=chunk,
                                      workspace=ws)
        results.append(out)
        assert torch.equal(out.argmax, z.argmax(-1))
        torch.testing.assert_close(out.entropy, rules.token_entropy(z), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.soft, model.soft_embedding(z), atol=1e-4, rtol=1e-5)
    for other in results[1:]:  # the same uniforms whatever the chunking
        assert torch.equal(other.draw, results[0].draw)


@pytest.mark.parametrize("block", [64, 100, 1024])  # many blocks, a short last block, one block
def test_one_pass_over_the_vocabulary_matches_head_and_sample(block):
    """The online-softmax kernel against the row-chunked one it replaces on the fast path: the same argmax, the
    entropy and the soft embedding to rounding, and the same draw from the same uniform wherever both land inside
    the same token's interval (all of them here)."""
    model = random_model("tiny")
    B, L, V, D = 3, 16, model.config.vocab_size, model.config.hidden_size
    weight = model.embed_tokens.weight
    final = torch.randn(B, L, D, generator=torch.Generator().manual_seed(18)) * 2
    temp = rules.temperature(5, 12, 0.4, 0.8)
    z = model.logits(final).div_(temp)
    head = lambda rows, o: logits_into(rows, weight, 30.0, o)
    chunked = kernels.head_and_sample(final, head, temp, generator=torch.Generator().manual_seed(19), embed=weight,
                                      embed_scale=D**0.5)
    one = kernels.one_pass_head_and_sample(final, weight, 30.0, temp, generator=torch.Generator().manual_seed(19),
                                           embed_scale=D**0.5, block=block,
                                           workspace=kernels.Workspace(B * L, V, torch.device("cpu")))
    assert torch.equal(one.argmax, z.argmax(-1)) and torch.equal(one.argmax, chunked.argmax)
    torch.testing.assert_close(one.entropy, rules.token_entropy(z), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one.soft, model.soft_embedding(z), atol=1e-4, rtol=1e-5)
    assert torch.equal(one.draw, chunked.draw)
    last = kernels.one_pass_head_and_sample(final, weight, 30.0, temp, block=block)  # the last step: no soft input
    assert last.soft is None and torch.equal(last.argmax, one.argmax)


@pytest.mark.parametrize("block", [4, 5, 16])
def test_one_pass_argmax_is_the_first_maximal_index(block):
    """Tied maxima inside a block and across blocks: the one-pass kernel returns torch.argmax's first index."""
    V = 13
    weight = torch.eye(V)  # row i of the hidden state is the logit of token i
    rows = torch.zeros(4, V)
    rows[0, [3, 7, 11]] = 2.0  # ties in different blocks (block 4: blocks 0, 1, 2)
    rows[1, [8, 9]] = 1.5  # ties inside one block
    rows[2, 12] = 3.0  # the last, short block
    rows[3] = -1.0  # all equal: token 0
    out = kernels.one_pass_head_and_sample(rows[None], weight, None, torch.tensor(0.7), block=block,
                                           generator=torch.Generator().manual_seed(0))
    assert out.argmax.flatten().tolist() == rows.argmax(-1).tolist() == [3, 8, 12, 0]


def test_one_pass_draws_follow_the_distribution():
    """Both levels of the one-pass draw (a block by its mass, a token inside it) over many rows of one
    distribution, with zero-probability tokens in blocks of their own and beside likely ones."""
    V, D, R = 10, 10, 40_000
    p = torch.tensor([0.3, 0.0, 0.05, 0.15, 0.0, 0.2, 0.1, 0.1, 0.1, 0.0])
    weight = torch.eye(V, D)  # row i of the hidden state is the logit of token i
    logits = torch.where(p > 0, p.log(), torch.tensor(-1e4))
    final = logits.expand(R, V).reshape(1, R, V).contiguous()
    out = kernels.one_pass_head_and_sample(final, weight, None, torch.tensor(1.0), block=4,
                                           generator=torch.Generator().manual_seed(20))
    freq = torch.bincount(out.draw.flatten(), minlength=V).float() / R
    assert (freq - p).abs().max() < 0.01  # ~5 standard errors
    assert freq[p == 0].sum() == 0
