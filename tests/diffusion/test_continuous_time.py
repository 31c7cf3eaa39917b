"""Continuous time: the continuous-time NELBO (`likelihood.continuous_kl`, `likelihood.window_nelbo_continuous`) against
exact enumeration on the solvable toy of tests/eval/test_evaluate.py (V = 3 tokens, canvases of 2), and training on
continuous levels."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import dgemma
from dgemma.diffusion.likelihood import clean_context_posterior, continuous_kl, reverse_kl, window_nelbo_continuous
from dgemma.diffusion.noise import alpha, alpha_rate
from dgemma.train.diffusion import sample_levels, training_loss
from tests.eval import test_evaluate
from tests.eval.test_evaluate import (
    STATES,
    V,
    code,
    data_distribution,
    exact_nelbo,
    marginal_posteriors,
    q_joint,
)
from tests.helpers import random_ids

pair = test_evaluate.pair  # the fixture: prepared toy data and a tiny diffusion / AR pair

L = 2


def exact_integrand(p_model_x0: np.ndarray, s: float) -> np.ndarray:
    """E over x_s ~ q(x_s | x0) of the per-canvas `continuous_kl` at level s, for every canvas x0 (V^L,), with the
    model's posterior the exact one of `p_model_x0` (level s is step s of a one-step grid: alpha_bar(s, 1))."""
    x0 = torch.tensor(np.stack([a for a in STATES for _ in STATES]))
    xt = torch.tensor(np.stack([b for _ in STATES for b in STATES]))
    marg = marginal_posteriors(p_model_x0, s, 1)
    logits = torch.tensor(np.log(marg[[code(b) for _ in STATES for b in STATES]]))
    kl = continuous_kl(logits.reshape(-1, V), x0.reshape(-1), xt.reshape(-1),
                       torch.full((x0.numel(),), s, dtype=torch.float64)).view(V**L, V**L, L).sum(-1).numpy()
    return (q_joint(s, 1) * kl).sum(1)


def exact_continuous_nelbo(p_model_x0: np.ndarray, points: int = 400) -> np.ndarray:
    """The continuous-time NELBO of every canvas: Gauss-Legendre quadrature over s in (0, 1) (the prior term is 0)."""
    nodes, weights = np.polynomial.legendre.leggauss(points)
    s, w = (nodes + 1) / 2, weights / 2
    return sum(wk * exact_integrand(p_model_x0, float(sk)) for sk, wk in zip(s, w, strict=True))


def test_continuous_kl_is_the_limit_of_T_reverse_kls():
    """T * reverse_kl at step t = s T tends to continuous_kl at s (the error is O(1/T)), for arbitrary posteriors."""
    g = torch.Generator().manual_seed(0)
    N, W = 64, 5
    logits = torch.randn(N, W, generator=g, dtype=torch.float64)
    x0, xt = torch.randint(0, W, (N,), generator=g), torch.randint(0, W, (N,), generator=g)
    for s in (0.05, 0.3, 0.7, 0.95):
        got = continuous_kl(logits, x0, xt, torch.full((N,), s, dtype=torch.float64))
        errors = []
        for T in (2_000, 20_000):
            t = torch.full((N,), round(s * T))
            errors.append(float((T * reverse_kl(logits, x0, xt, t, T) - got).abs().max()))
        assert errors[1] < errors[0] / 5 and errors[1] < 1e-3 * max(1.0, float(got.abs().max())), (s, errors)
    assert torch.all(got >= 0)  # a generalized KL between rates


def test_continuous_bound_is_the_limit_of_the_discrete_bounds_and_bounds_the_nll():
    """With the exact posterior of a known distribution at every level (an ideal model trained in continuous time):
    the discrete bound decreases as T grows, at O(1/T), towards the continuous one, which is tight: the
    continuous-time chain of the exact denoiser reproduces the data, so its bound is -log p(x0) for every canvas
    (never below it) and the entropy in expectation. A worse model's continuous bound is larger."""
    p = data_distribution()
    entropy = float(-(p * np.log(p)).sum())
    continuous = exact_continuous_nelbo(p)
    expected = float(p @ continuous)
    discrete = {T: float(p @ exact_nelbo(p, T)) for T in (4, 16, 64)}
    assert discrete[4] > discrete[16] > discrete[64] > expected
    assert discrete[64] - expected < 0.3 * (discrete[16] - expected)  # the O(1/T) excess: 4x T, 4x smaller
    assert np.all(continuous >= -np.log(p) - 1e-8)  # never below the true NLL, canvas by canvas
    assert abs(expected - entropy) < 1e-8
    worse = float(p @ exact_continuous_nelbo(data_distribution(seed=7)))
    assert worse > expected + 1.0


def test_window_nelbo_continuous_is_an_unbiased_estimate():
    """The stratified Monte Carlo estimator over levels and x_s, with the exact posterior as the model, averages to
    the quadrature value (one canvas per window)."""
    p = data_distribution()
    exact = float(p @ exact_continuous_nelbo(p))
    rng = np.random.default_rng(0)
    x0 = torch.tensor(np.stack([STATES[i] for i in rng.choice(len(STATES), size=6000, p=p)]))

    def posterior(x0, xt, level):  # the exact p(x0 | x_s) of each window's one canvas
        levels = level[:, 0].double().tolist()
        marg = np.stack([marginal_posteriors(p, s, 1)[code(x)] for x, s in zip(xt.numpy(), levels, strict=True)])
        return torch.from_numpy(np.log(marg))

    terms = window_nelbo_continuous(posterior, x0, canvas_length=L, vocab_size=V, num_t_samples=4,
                                    generator=torch.Generator().manual_seed(1))
    per_canvas = terms.nelbo[:, 0].numpy()
    se = per_canvas.std(ddof=1) / math.sqrt(len(per_canvas))
    assert abs(per_canvas.mean() - exact) < 4 * se, (per_canvas.mean(), exact, se)
    assert terms.t_counts.sum() == 4 * L * len(x0)


def test_levels_are_uniform_on_the_open_clean_end_and_the_rate_is_the_schedules():
    g = torch.Generator().manual_seed(0)
    for stratified in (False, True):
        s = torch.cat([sample_levels(4, 8, g, stratified=stratified).flatten() for _ in range(2000)])
        assert s.dtype == torch.float64 and bool((s > 0).all() and (s <= 1).all())
        assert abs(float(s.mean()) - 0.5) < 0.01 and abs(float((s < 0.25).double().mean()) - 0.25) < 0.01
    one = sample_levels(4, 8, g, stratified=True).flatten().sort().values  # 32 levels: one in each 1/32 stratum
    assert torch.equal((one * 32).ceil().long(), torch.arange(1, 33))
    s = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    h = 1e-6
    derivative = (alpha(s + h, torch.float64) - alpha(s - h, torch.float64)) / (2 * h)
    torch.testing.assert_close(alpha_rate(s), -derivative / alpha(s, torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("weighting", ["x0", "elbo"])
def test_continuous_training_loss_runs_and_tells_the_model_its_level(weighting):
    """A continuous-time step: finite loss and gradients; the time embedding reads the canvas's level (so a
    time-embedding model's loss depends on it), and the draws are reproducible from the generator."""
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny").replace(time_embedding=True)), seed=0)
    x0 = random_ids(model.config.vocab_size, 2, 2 * model.config.canvas_length, seed=3)
    out = [training_loss(model, x0, time="continuous", loss_weighting=weighting, self_conditioning_prob=0.0,
                         generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.isfinite(out[0].loss) and float(out[0].loss.detach()) == float(out[1].loss.detach())
    out[0].loss.backward()
    assert model.time_proj.weight.grad is not None and float(model.time_proj.weight.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="time must be one of"):
        training_loss(model, x0, time="continuos")


def test_the_clean_context_posterior_takes_continuous_levels():
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("lite-tiny")), seed=2).eval()
    L2 = model.config.canvas_length
    x0 = random_ids(500, 1, 2 * L2, seed=0)
    with torch.no_grad():
        a = clean_context_posterior(model)(x0, x0, torch.tensor([[0.3, 0.7]]))
        b = clean_context_posterior(model)(x0, x0, torch.tensor([[0.3, 0.71]]))
    assert torch.equal(a[:, :L2], b[:, :L2]) and not torch.equal(a[:, L2:], b[:, L2:])


# --- a continuous-time run end to end: its learning curve, `dgemma eval`'s headline bound ---------------------------

@pytest.fixture(scope="module")
def continuous_run(pair):
    """A time-conditioned tiny run trained for a few steps in continuous time on `pair`'s data."""
    import io

    from dgemma.train.config import TrainConfig
    from dgemma.train.loop import train

    root, _ = pair
    cfg = TrainConfig(preset="tiny", time_embedding=True, diffusion_time="continuous", seq_len=32, batch_size=4,
                      max_steps=8, warmup_steps=2, eval_every=8, eval_batches=1, save_every=8, chunk_rows=256,
                      device="cpu")
    train(cfg, root / "data", root / "continuous", stream=io.StringIO())
    return root / "continuous"


def test_a_continuous_time_run_logs_both_bounds_and_eval_reads_the_tighter(pair, continuous_run,
                                                                                         tmp_path):
    from dgemma.cli import main
    from dgemma.eval.curves import learning_curves

    root, runs = pair
    evals = [json.loads(line) for line in (continuous_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 8]
    for r in evals:  # the continuous bound beside the one at the training T
        assert math.isfinite(r["val_nelbo_continuous"]) and r["val_nelbo_continuous"] > 0 and r["val_nelbo"] > 0
    curves = learning_curves(continuous_run, runs["ar"], root / "data")
    assert curves["diffusion"]["metric"] == "val_nelbo"
    r = curves["ratio"][-1]
    assert r["share_of_ar_gain"] == pytest.approx((curves["unigram_ce"] - r["nelbo"]) /
                                                  (curves["unigram_ce"] - r["ar_ce"]))
    out = tmp_path / "report"
    assert main(["eval", "--model", str(continuous_run), "--baseline", str(runs["ar"]), "--data", str(root / "data"),
                 "--out", str(out), "--prompts", "2", "--max-denoising-steps-grid", "2", "--entropy-bounds", "0.5",
                 "--max-windows", "4", "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    lk, v = report["likelihood"], report["verdict"]
    tighter = min(("nelbo", "nelbo_continuous"), key=lambda k: lk[k]["estimate"]["mean"])
    assert report["headline_bound"] == v["bound"] == tighter
    assert lk["nelbo_continuous"]["num_steps"] is None and lk["x0_ce"]["time"] == "continuous"
    assert v["nelbo_over_ar"] == pytest.approx(lk[tighter]["estimate"]["mean"] / lk["ar_ce"]["estimate"]["mean"])
    assert "NELBO, continuous time" in (out / "report.md").read_text()


def test_tokens_to_reach_interpolates_in_log_tokens():
    from dgemma.eval.curves import token_multiplier, tokens_to_reach

    ar = [{"tokens": 0, "value": 9.0}, {"tokens": 1000, "value": 6.0}, {"tokens": 4000, "value": 5.0}]
    assert tokens_to_reach(ar, 7.0) == 1000.0  # below the first positive count: the first point that reaches it
    assert tokens_to_reach(ar, 5.5) == pytest.approx(2000.0)  # halfway in log tokens between 1000 and 4000
    assert tokens_to_reach(ar, 4.0) is None
    m = token_multiplier([{"tokens": 8000, "value": 5.5}], ar)
    assert m["multiplier"] == pytest.approx(4.0) and m["ar_tokens_for_same_loss"] == pytest.approx(2000.0)
