"""The held-out likelihoods and their Monte Carlo error (dgemma/eval/likelihoods.py): an exact model scored through the
same code, the importance-weighted bound, independent draws per model, the same scored tokens on both sides."""

import math

import numpy as np
import pytest
import torch

from dgemma.data.shards import unigram_log_probs
from dgemma.diffusion.likelihood import iw_bound, window_log_weights, window_nelbo
from dgemma.eval.likelihoods import (
    heldout_ar_ce,
    heldout_iw,
    heldout_nelbo,
    mc_error,
    mc_seed,
    model_posterior,
    scored_digest,
    scored_windows,
    unigram_posterior,
    unigram_reference,
)
from tests.eval.test_evaluate import _corpus


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dgemma.data.prepare import prepare
    from dgemma.data.shards import TokenDataset

    root = tmp_path_factory.mktemp("lik")
    prepare(root / "data", [str(_corpus(root / "corpus.jsonl", n_docs=120))], tokenizer="bpe:300", val_fraction=0.15,
            quiet=True)
    return root / "data", TokenDataset(root / "data", "val")


def _exact(data_dir, val, seq_len, windows):
    """The unigram's exact NLL per token on the scored tokens, and its posterior."""
    log_p = unigram_log_probs(data_dir)
    ref = unigram_reference(log_p, val, seq_len=seq_len, max_windows=windows)
    return ref, torch.tensor(log_p)


@pytest.mark.parametrize("num_steps", [2, 8, 64, None])
def test_an_exact_model_has_a_flat_bound_across_T_within_its_monte_carlo_se(data, num_steps):
    """The unigram model's NELBO is its exact NLL in expectation at every T (and in continuous time): scored by the
    same code as a trained model, each T lands within a few Monte Carlo SEs of it, and the SE is not zero."""
    data_dir, val = data
    L, seq_len, windows = 8, 32, 12
    ref, log_p = _exact(data_dir, val, seq_len, windows)
    r = heldout_nelbo(lambda ctx: unigram_posterior(log_p, L), val, canvas_length=L, vocab_size=log_p.shape[0],
                      seq_len=seq_len, num_steps=num_steps, num_t_samples=2, replicates=4, model_sha="unigram",
                      max_windows=windows, progress=False)
    assert r["estimate"].windows == windows and r["replicates"] == 4
    assert r["mc_se"] > 0
    assert abs(r["estimate"].mean - ref.mean) < 4 * r["mc_se"], (r["estimate"].mean, ref.mean, r["mc_se"])
    assert len(set(r["seeds"])) == 4


def test_each_trajectorys_importance_weight_of_the_exact_model_is_its_likelihood(data):
    """For the exact model the forward process run backwards is its own reverse chain: every trajectory's log weight
    is log p(x0), so every K gives the exact NLL (the IW maths of window_log_weights, checked exactly)."""
    data_dir, val = data
    L, seq_len = 8, 16
    _, log_p = _exact(data_dir, val, seq_len, 4)
    x = next(scored_windows(val, seq_len, 4, 4)[0])[:, 1:]
    lw = window_log_weights(unigram_posterior(log_p, L), x, canvas_length=L, vocab_size=log_p.shape[0], num_steps=6,
                            num_samples=4, generator=torch.Generator().manual_seed(0))
    exact = log_p[x].double().view(x.shape[0], -1, L).sum(-1)  # (B, C)
    torch.testing.assert_close(lw, exact.expand_as(lw), atol=1e-6, rtol=0)  # the level reaches a posterior in float32
    torch.testing.assert_close(iw_bound(lw, 4), -exact, atol=1e-6, rtol=0)


def _miscalibrated(log_p, L):
    """A posterior that half-ignores its observation: the exact reverse chain of no data, so its bound has a gap."""
    exact = unigram_posterior(log_p, L)

    def posterior(x0, xt, level):
        return 0.5 * exact(x0, xt, level) + 0.5 * log_p.double()

    return posterior


def test_the_importance_weighted_bound_has_the_nelbos_mean_at_K1_and_tightens(data):
    """A model that is not exact: K = 1 trajectories average to the NELBO (the same expectation, the KLs taken in
    closed form), and the bound falls as K grows (Burda et al.), staying above the exact model's NLL."""
    data_dir, val = data
    L, seq_len, T = 8, 16, 4
    _, log_p = _exact(data_dir, val, seq_len, 4)
    x = next(scored_windows(val, seq_len, 4, 4)[0])[:, 1:]
    post = _miscalibrated(log_p, L)
    g = torch.Generator().manual_seed(1)
    V = log_p.shape[0]
    lw = window_log_weights(post, x, canvas_length=L, vocab_size=V, num_steps=T, num_samples=64, generator=g)
    nelbos = torch.stack([window_nelbo(post, x, canvas_length=L, vocab_size=V, num_steps=T, num_t_samples=T,
                                       generator=g).nelbo for _ in range(32)])  # (32, B, C): K = T visits every t
    k1, nelbo = iw_bound(lw, 1).sum(), nelbos.mean(0).sum()
    se = math.sqrt(float(lw.sum((1, 2)).var() / lw.shape[0] + nelbos.sum((1, 2)).var() / nelbos.shape[0]))
    assert abs(float(k1 - nelbo)) < 4 * se, (k1, nelbo, se)
    b1, b4, b16 = (iw_bound(lw, k).sum() for k in (1, 4, 16))
    assert b16 < b4 < b1
    assert b1 - b16 > 4 * se  # a gap the IW bound sizes, well above its noise


def test_monte_carlo_seeds_differ_by_model_estimator_T_and_replicate():
    seeds = {mc_seed(m, e, t, r) for m in ("a", "b") for e in ("nelbo", "iw") for t in (8, 16) for r in (0, 1)}
    assert len(seeds) == 16
    assert mc_seed("a", "nelbo", 8, 0) == mc_seed("a", "nelbo", 8, 0)
    assert mc_seed("a", "nelbo", 8, 0, seed=1) != mc_seed("a", "nelbo", 8, 0)


def test_monte_carlo_se_is_the_replicate_spread_per_window():
    rng = np.random.default_rng(0)
    windows = rng.normal(5, 1, size=200)  # between-window spread
    reps = windows + rng.normal(0, 0.1, size=(3, 200))  # Monte Carlo spread 0.1 per window
    se = mc_error(reps)
    assert se == pytest.approx(0.1 / math.sqrt(3 * 200), rel=0.15)
    assert mc_error(reps[:1]) is None


def test_ar_and_diffusion_score_the_same_tokens_and_the_unigram_is_scored_there(data, tmp_path):
    """Both sides score tokens 1..seq_len of the same windows (token 0 is context), which the digest fingerprints;
    the unigram reference is the mean of -log p over exactly those tokens."""
    from dgemma.model.config import preset
    from dgemma.model.diffusiongemma import DiffusionGemma

    data_dir, val = data
    seq_len, windows = 16, 5
    digest = scored_digest(val, seq_len, windows)
    assert digest["windows"] == windows and digest["tokens"] == windows * seq_len
    toks = torch.cat([x[:, 1:] for x in scored_windows(val, seq_len, 2, windows)[0]])
    log_p = unigram_log_probs(data_dir)
    ref = unigram_reference(log_p, val, seq_len=seq_len, max_windows=windows)
    assert ref.mean == pytest.approx(float(-log_p[toks.numpy()].mean()))
    cfg = preset("tiny").replace(vocab_size=int(val.meta["vocab_size"]))
    torch.manual_seed(0)
    model = DiffusionGemma(cfg).eval()
    ar = heldout_ar_ce(model, val, seq_len=seq_len, max_windows=windows, progress=False)
    assert ar["estimate"].tokens == digest["tokens"] and len(ar["per_window"]) == windows
    nelbo = heldout_nelbo(model_posterior(model), val, canvas_length=cfg.canvas_length, vocab_size=cfg.vocab_size,
                          seq_len=seq_len, num_steps=4, num_t_samples=2, replicates=2, model_sha="m",
                          max_windows=windows, progress=False)
    assert nelbo["estimate"].tokens == digest["tokens"]
    assert nelbo["replicate_means"][0] != nelbo["replicate_means"][1]  # independent draws
    iw = heldout_iw(model_posterior(model), val, canvas_length=cfg.canvas_length, vocab_size=cfg.vocab_size,
                    seq_len=seq_len, num_steps=4, windows=2, model_sha="m", ks=(1, 2), progress=False)
    assert iw["windows"] == 2 and set(iw["by_k"]) == {"1", "2"}
    assert iw["by_k"]["2"]["mean"] <= iw["by_k"]["1"]["mean"] + 1e-9
