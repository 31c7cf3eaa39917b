"""`likelihood.first_step_log_probs`, the posterior the server ranks alternatives with and draws its greedy next token
from (docs/serving.md, "Scoring a prompt"): each position's row reads the context and the clean canvases before its
own canvas, never its own canvas's tokens or later ones, and is the clean-context forward at level 1."""

from __future__ import annotations

import pytest
import torch

from dgemma.diffusion.likelihood import clean_context_posterior, first_step_log_probs
from tests.helpers import random_init_model


@pytest.fixture(scope="module")
def model():
    return random_init_model()


def test_a_row_reads_the_canvases_before_its_own_only(model):
    L, V = model.config.canvas_length, model.config.vocab_size
    x = torch.randint(0, V, (2 * L + 3,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = first_step_log_probs(model, [], x, seed=4)
    assert rows.shape == (len(x), V) and torch.allclose(rows.exp().sum(-1), torch.ones(len(x)), atol=1e-4)
    own = [*x[:L + 2], (x[L + 2] + 1) % V, *x[L + 3:]]  # a token of canvas 1 changed: canvas 1's rows do not move
    assert torch.equal(first_step_log_probs(model, [], own, seed=4)[:2 * L], rows[:2 * L])
    earlier = [(x[0] + 1) % V, *x[1:]]  # a token of canvas 0 changed: canvas 1's rows move, canvas 0's do not
    moved = first_step_log_probs(model, [], earlier, seed=4)
    assert torch.equal(moved[:L], rows[:L]) and not torch.equal(moved[L:2 * L], rows[L:2 * L])
    assert not torch.equal(first_step_log_probs(model, [5, 6], x, seed=4)[:L], rows[:L])  # the context is read
    with torch.no_grad():  # the clean-context forward at level 1, on the same noise
        g = torch.Generator().manual_seed(4)
        S = 3 * L
        x0 = torch.zeros(1, S, dtype=torch.long)
        x0[0, :len(x)] = torch.tensor(x)
        xt = torch.randint(0, V, (1, S), generator=g)
        want = torch.log_softmax(clean_context_posterior(model)(x0, xt, torch.ones(1, 3))[0, :len(x)].float(), -1)
    assert torch.equal(rows, want)


def test_bad_input_is_refused_by_name(model):
    with pytest.raises(ValueError, match="tokens"):
        first_step_log_probs(model, [], [])
    with pytest.raises(ValueError, match="positions"):
        first_step_log_probs(model, [1] * model.config.max_position_embeddings, [1])
    with pytest.raises(ValueError, match="tokens"):
        first_step_log_probs(model, [], [model.config.vocab_size])
