"""dgemma.eval.evaluate: the NELBO against exact enumeration, token-forward counting, sample metrics, `dgemma eval`."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dgemma
from dgemma.data.shards import TokenDataset
from dgemma.diffusion.likelihood import clean_context_posterior, prior_kl, reverse_kl, stratified_t, window_nelbo
from dgemma.eval.decoding import (
    DecodeJob,
    DecodeRun,
    ar_job,
    distinct_n,
    fixed_schedule,
    machine_load,
    run_ar,
    run_interleaved,
    run_sampler,
    sampler_job,
    unigram_entropy,
    useful,
)
from dgemma.eval.evaluate import run_info
from dgemma.eval.judging import prompt_dependence, retokenize
from dgemma.eval.viz import renoise_counts
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.sampling.trace import TRACE_FORMAT
from dgemma.train.heldout import EvalError, estimate

# --- an exactly solvable case: V = 3 tokens, canvases of 2, a known correlated data distribution --------------------

V, L = 3, 2


def alpha_bar(t: int, T: int) -> float:
    return math.cos(math.pi / 2 * t / T) ** 2


def forward_matrix(keep: float) -> np.ndarray:
    """One token's q(x_t = k | x_s = i) = keep * [i == k] + (1 - keep) / V, as a (V, V) matrix [i, k]."""
    return keep * np.eye(V) + (1 - keep) / V


STATES = [np.array(s) for s in itertools.product(range(V), repeat=L)]  # every canvas, in code order


def code(s: np.ndarray) -> int:
    return int(np.ravel_multi_index(tuple(s), (V,) * L))


def data_distribution(seed: int = 0) -> np.ndarray:
    """p(x0) over the V^L canvases, strongly correlated (so a per-token reverse is not exact) and with full support."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(V**L, 0.3)) + 1e-3
    return p / p.sum()


def q_joint(t: int, T: int) -> np.ndarray:
    """q(x_t | x0) for whole canvases: (V^L, V^L) [x0 code, x_t code]."""
    m = forward_matrix(alpha_bar(t, T))
    return np.array([[np.prod([m[a[i], b[i]] for i in range(L)]) for b in STATES] for a in STATES])


def marginal_posteriors(p_x0: np.ndarray, t: int, T: int) -> np.ndarray:
    """The exact per-position posterior p(x0^l | x_t) under p_x0: (V^L x_t codes, L, V)."""
    joint = p_x0[:, None] * q_joint(t, T)  # (x0, x_t)
    post = joint / joint.sum(0, keepdims=True)
    out = np.zeros((V**L, L, V))
    for a, s in enumerate(STATES):
        for i in range(L):
            out[:, i, s[i]] += post[a]
    return out


def reverse_step(marg: np.ndarray, xt: np.ndarray, t: int, T: int) -> np.ndarray:
    """From the definition: p(x_{t-1}^l = j | x_t) = sum_i q(x_{t-1} = j | x_t^l, x0 = i) m_l(i), with the posterior
    q(j | k, i) = q(k | j) q(j | i) / q(k | i) by Bayes. (L, V)."""
    step, before, now = forward_matrix(alpha_bar(t, T) / alpha_bar(t - 1, T)), forward_matrix(alpha_bar(t - 1, T)), \
        forward_matrix(alpha_bar(t, T))
    out = np.zeros((L, V))
    for pos in range(L):
        k = xt[pos]
        post = before * step[:, k][None, :] / now[:, k][:, None]  # [i, j]: q(x_{t-1} = j | x_t = k, x0 = i)
        out[pos] = marg[pos] @ post
    return out


def exact_model_nll(p_model_x0: np.ndarray, T: int) -> np.ndarray:
    """-log p_theta(x0) of the factorised x0-parameterised reverse chain, run exactly over all V^L canvases from the
    uniform prior: (V^L,)."""
    p = np.full(V**L, 1.0 / V**L)  # p(x_T)
    for t in range(T, 0, -1):
        marg = marginal_posteriors(p_model_x0, t, T)
        nxt = np.zeros(V**L)
        for b, xt in enumerate(STATES):
            probs = marg[b] if t == 1 else reverse_step(marg[b], xt, t, T)
            for a, x in enumerate(STATES):
                nxt[a] += p[b] * np.prod([probs[i, x[i]] for i in range(L)])
        p = nxt
    return -np.log(p)


def exact_nelbo(p_model_x0: np.ndarray, T: int) -> np.ndarray:
    """The NELBO of every canvas with the library's `reverse_kl`, its expectation over x_t taken exactly."""
    x0 = torch.tensor(np.stack([a for a in STATES for _ in STATES]))  # (V^L * V^L, L): every (x0, x_t) pair
    xt = torch.tensor(np.stack([b for _ in STATES for b in STATES]))
    out = np.full(V**L, prior_kl(T, V) * L)
    for t in range(1, T + 1):
        marg = marginal_posteriors(p_model_x0, t, T)
        logits = torch.tensor(np.log(marg[[code(b) for _ in STATES for b in STATES]]))  # (pairs, L, V)
        kl = reverse_kl(logits.reshape(-1, V), x0.reshape(-1), xt.reshape(-1),
                        torch.full((x0.numel(),), t), T).view(V**L, V**L, L).sum(-1).numpy()
        out += (q_joint(t, T) * kl).sum(1)  # E over x_t ~ q(x_t | x0)
    return out


def test_reverse_kl_matches_the_definition():
    """The closed form equals KL(q(x_{t-1} | x_t, x0) || sum_x0' q(x_{t-1} | x_t, x0') p(x0')) built by Bayes."""
    T = 8
    rng = np.random.default_rng(1)
    for t in (1, 2, 5, 8):
        for _ in range(5):
            marg = rng.dirichlet(np.ones(V), size=L)
            x0, xt = rng.integers(0, V, L), rng.integers(0, V, L)
            p = reverse_step(marg, xt, t, T) if t > 1 else marg
            ref = []
            for pos in range(L):
                onehot = np.eye(V)[x0[pos]][None]
                q = reverse_step(onehot.repeat(L, 0), xt, t, T)[pos] if t > 1 else np.eye(V)[x0[pos]]
                ref.append(sum(qj * math.log(qj / pj) for qj, pj in zip(q, p[pos], strict=True) if qj > 0))
            got = reverse_kl(torch.tensor(np.log(marg)), torch.tensor(x0), torch.tensor(xt), torch.full((L,), t), T)
            np.testing.assert_allclose(got.numpy(), ref, rtol=1e-9, atol=1e-12)


def test_nelbo_bounds_the_exact_likelihood_and_tightens_with_T():
    """With the exact posterior of a known distribution: NELBO(x0) >= -log p_theta(x0) for every canvas, its
    expectation >= the data entropy, and the gap (the per-token factorisation of the reverse step) shrinks as T
    grows; a worse model's bound is larger."""
    p = data_distribution()
    entropy = float(-(p * np.log(p)).sum())
    gaps = {}
    for T in (2, 8, 32):
        nelbo = exact_nelbo(p, T)
        model_nll = exact_model_nll(p, T)
        assert np.all(nelbo >= model_nll - 1e-9), (T, nelbo - model_nll)
        expected = float(p @ nelbo)
        assert expected >= float(p @ model_nll) - 1e-9 >= entropy - 1e-9
        gaps[T] = expected - entropy
    assert gaps[2] > gaps[8] > gaps[32] >= 0
    assert gaps[32] < 0.015 * entropy  # close to the true NLL: 1.1% above it at T = 32 (docs/evaluation.md)
    # A worse model: the exact posterior of another distribution. Its bound on *this* data is larger.
    worse = float(p @ exact_nelbo(data_distribution(seed=7), 32))
    assert worse > float(p @ exact_nelbo(p, 32)) + 1.0


def test_prior_kl_is_zero_at_the_end_of_the_cosine_schedule():
    assert 0 <= prior_kl(16, 50_257) < 1e-20
    assert prior_kl(16, 3) >= 0


def test_stratified_t_weights_sum_to_T_and_each_stratum_is_covered():
    t, weights = stratified_t(4, 16, (200, 3), torch.Generator().manual_seed(0))
    assert weights.tolist() == [1, 5, 5, 5]  # t = 1 exactly, then {2..6}, {7..11}, {12..16}
    assert set(t[0].unique().tolist()) == {1}
    for k, (lo, hi) in enumerate([(2, 6), (7, 11), (12, 16)], start=1):
        assert set(t[k].unique().tolist()) == set(range(lo, hi + 1))
    t, weights = stratified_t(1, 16, (500,), torch.Generator().manual_seed(0))
    assert weights.tolist() == [16] and set(t[0].unique().tolist()) == set(range(1, 17))
    t, weights = stratified_t(16, 16, (2, 2))
    assert weights.tolist() == [1] * 16 and torch.equal(t[:, 0, 0], torch.arange(1, 17))
    with pytest.raises(ValueError, match="t samples"):
        stratified_t(17, 16, (1,))


# --- the Monte Carlo estimator over whole windows, with a clean prefix ------------------------------------------------

C = 2  # canvases per window


def window_distribution() -> np.ndarray:
    """p over windows of C canvases (V^(L*C) of them), correlated within and across canvases."""
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(V ** (L * C), 0.5)) + 1e-3
    return p / p.sum()


def prefix_tables(p: np.ndarray, T: int) -> list[np.ndarray]:
    """For canvas c: log p(x0_c^l | x0_<c, x_t of canvas c) as (T + 1, V^(L*c), V^L, L, V)."""
    full = p.reshape((V**L,) * C)
    tables = []
    for c in range(C):
        joint = full.sum(axis=tuple(range(c + 1, C))).reshape(-1, V**L)  # (prefix, x0_c)
        cond = joint / joint.sum(1, keepdims=True)
        tab = np.zeros((T + 1, joint.shape[0], V**L, L, V))
        for t in range(1, T + 1):
            for pre in range(joint.shape[0]):
                tab[t, pre] = np.log(marginal_posteriors(cond[pre], t, T))
        tables.append(tab)
    return tables


def test_window_nelbo_is_an_unbiased_estimate_of_the_block_autoregressive_bound():
    T = 4
    p = window_distribution()
    tables = prefix_tables(p, T)
    full = p.reshape((V**L,) * C)
    powers = V ** np.arange(L - 1, -1, -1)

    def posterior(x0, xt, level):  # the stub: exact p(x0 | x_t canvas, clean prefix), same interface as the model's
        t = (level * T).round().long()  # the level of step t is t / T
        out = torch.empty(*x0.shape, V, dtype=torch.float64)
        for c in range(C):
            pre = x0[:, : c * L].numpy() @ (V ** np.arange(c * L - 1, -1, -1)) if c else np.zeros(len(x0), int)
            cur = xt[:, c * L:(c + 1) * L].numpy() @ powers
            out[:, c * L:(c + 1) * L] = torch.from_numpy(tables[c][t[:, c].numpy(), pre, cur])
        return out

    # Exact expectation of sum_c NELBO(canvas c | prefix) over the data, by enumeration per canvas.
    exact = 0.0
    for c in range(C):
        joint = full.sum(axis=tuple(range(c + 1, C))).reshape(-1, V**L)
        for pre in range(joint.shape[0]):
            if joint[pre].sum() > 0:
                exact += joint[pre].sum() * float((joint[pre] / joint[pre].sum()) @
                                                   exact_nelbo(joint[pre] / joint[pre].sum(), T))
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    windows = rng.choice(len(p), size=6000, p=p)
    x0 = torch.tensor(np.stack(np.unravel_index(windows, (V,) * (L * C)), 1))
    terms = window_nelbo(posterior, x0, canvas_length=L, vocab_size=V, num_steps=T, num_t_samples=2, generator=g)
    per_window = terms.nelbo.sum(-1).numpy()
    mean, se = per_window.mean(), per_window.std(ddof=1) / math.sqrt(len(per_window))
    assert abs(mean - exact) < 4 * se, (mean, exact, se)
    entropy = float(-(p * np.log(p)).sum())
    assert exact >= entropy


def test_estimate_reports_per_token_mean_se_and_windows_needed():
    est = estimate([10.0, 12.0, 14.0], [5, 5, 5], num_bytes=30)
    assert est.mean == pytest.approx(2.4) and est.windows == 3 and est.tokens == 15
    assert est.se == pytest.approx(0.4 / math.sqrt(3))
    assert est.bits_per_byte == pytest.approx(36 / (math.log(2) * 30))
    assert est.windows_for_se(0.1) == 16
    with pytest.raises(EvalError, match="no held-out window"):
        estimate([], [])


# --- counting forwards --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=0).eval()


@pytest.mark.parametrize("sampler", ["entropy-bound", "lite"])
def test_fixed_schedules_cost_L_over_T_plus_1_and_adaptive_never_more(tiny, sampler):
    L = tiny.config.canvas_length
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7)]
    for T in (2, 5):
        # confidence_threshold high and no stability history: the adaptive rules fire as early as they can
        cfg = GenerationConfig(max_new_tokens=3 * L, max_denoising_steps=T, sampler=sampler, confidence_threshold=50.0,
                               stability_threshold=0)
        fixed = run_sampler(tiny, prompts, fixed_schedule(cfg), progress=False)
        assert fixed.denoise_passes == 2 * 3 * T and fixed.commit_passes == 2 * 3
        assert fixed.tokens_per_forward == pytest.approx(L / (T + 1))
        assert fixed.token_forwards == 2 * 3 * (T + 1) * L
        adaptive = run_sampler(tiny, prompts, cfg, progress=False)
        assert adaptive.passes <= fixed.passes and adaptive.token_forwards <= fixed.token_forwards
        assert adaptive.denoise_passes == sum(adaptive.steps_per_canvas)
        if T == 5:
            assert adaptive.passes < fixed.passes  # the stop rule does fire here


class CountingGemma(DiffusionGemma):
    """Records every pass into the layers (kind, batch x tokens), as an independent check of the decoders' counts."""

    def __init__(self, config):
        super().__init__(config)
        self.events = []

    def commit(self, input_ids, *args, **kwargs):
        if input_ids.numel():  # committing nothing runs no layer
            self.events.append(("commit", input_ids.numel()))
        return super().commit(input_ids, *args, **kwargs)

    def next_token_logits(self, input_ids, *args, **kwargs):  # a commit that also returns the encoder's logits
        if input_ids.numel():
            self.events.append(("commit", input_ids.numel()))
        return super().next_token_logits(input_ids, *args, **kwargs)

    def denoise(self, canvas, *args, **kwargs):
        self.events.append(("denoise", canvas.numel()))
        return super().denoise(canvas, *args, **kwargs)


def test_decode_counts_match_the_passes_the_model_ran(tiny):
    counting = CountingGemma(tiny.config).eval()
    counting.load_state_dict(tiny.state_dict())
    L = tiny.config.canvas_length
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7)]
    cfg = GenerationConfig(max_new_tokens=3 * L, max_denoising_steps=5, confidence_threshold=50.0,
                           stability_threshold=0)  # the stop rule fires: canvases spend different step counts
    for decode in (lambda m: run_sampler(m, prompts, cfg, progress=False),
                   lambda m: run_ar(m, prompts, max_new_tokens=5, eos=(), progress=False)):
        counting.events = []
        run = decode(counting)
        # an untimed warm-up first, then per prompt its prefill (the only commits of 3 or 7 tokens) and its passes
        prefills = [i for i, (kind, n) in enumerate(counting.events) if kind == "commit" and
                    n in [p.numel() for p in prompts]][-len(prompts):]
        after = [e for i, e in enumerate(counting.events) if i not in prefills and i >= prefills[0]]
        assert run.passes == len(after) and run.token_forwards == sum(n for _, n in after)
        assert run.denoise_passes == sum(1 for k, _ in after if k == "denoise")
        assert run.commit_passes == sum(1 for k, _ in after if k == "commit")
        untimed = {"seconds": 0, "tokens_per_second": 0, "seconds_per_prompt": 0}
        assert decode(tiny).summary() | untimed == run.summary() | untimed  # same counts, samples without the subclass


# --- sample metrics -------------------------------------------------------------------------------------------------

def test_sample_metrics_on_hand_made_samples():
    assert useful([5, 6, 1, 7, 8], eos=(1,), max_new=10) == [5, 6, 1]
    assert useful([5, 6, 7, 8], eos=(1,), max_new=3) == [5, 6, 7]
    assert distinct_n([[1, 2, 1, 2]], 1) == 0.5 and distinct_n([[1, 2, 1, 2]], 2) == pytest.approx(2 / 3)
    assert unigram_entropy([[4, 4, 4]]) == 0.0 and unigram_entropy([[1, 2]]) == pytest.approx(math.log(2))
    arrays = {"canvas": np.array([0, 0, 0, 1]), "active": np.ones((4, 1), bool),
              "accepted": np.array([[[1, 0, 0]], [[1, 1, 0]], [[0, 1, 1]], [[1, 1, 1]]], bool)}
    # steps 0->1: kept 1, accepted 1, noise 1; 1->2: kept 1, renoised 1, accepted 1; 2->3 crosses canvases
    assert renoise_counts(arrays) == {"kept": 2, "renoised": 1, "accepted": 2, "stayed_noise": 1}
    json.dumps(renoise_counts(arrays))


def test_timed_decoders_take_turns_prompt_by_prompt(tiny):
    """`run_interleaved`: every job warms up before anything is timed, then prompt by prompt every job decodes in
    rotation (prompt i starts with job i mod k), so a change of load falls on all of them alike; taking turns
    changes no sample."""
    events = []

    def recording(name):
        return DecodeJob(DecodeRun(name, [], []), lambda p: events.append((name, "warm-up")),
                         lambda i, p: events.append((name, i)))

    run_interleaved([recording("a"), recording("b"), recording("c")], [torch.tensor([5])] * 4, progress=False)
    assert events == [("a", "warm-up"), ("b", "warm-up"), ("c", "warm-up"), ("a", 0), ("b", 0), ("c", 0),
                      ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2), ("a", 3), ("b", 3), ("c", 3)]
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 4)]
    cfg = GenerationConfig(max_new_tokens=tiny.config.canvas_length, max_denoising_steps=3)
    together = run_interleaved([sampler_job(tiny, cfg, seed=2), ar_job(tiny, max_new_tokens=5, eos=(), seed=2)],
                               prompts, progress=False)
    alone = [run_sampler(tiny, prompts, cfg, seed=2, progress=False),
             run_ar(tiny, prompts, max_new_tokens=5, eos=(), seed=2, progress=False)]
    assert [r.samples for r in together] == [r.samples for r in alone]
    assert all(len(r.seconds) == 3 for r in together)
    load = machine_load()
    assert load["cpu_count"] == os.cpu_count() and load["torch_threads"] == torch.get_num_threads()
    assert load["loadavg_1_5_15"] is None or (len(load["loadavg_1_5_15"]) == 3 and min(load["loadavg_1_5_15"]) >= 0)


def test_the_judge_scores_samples_as_their_text_tokenizes(tiny_data):
    """A diffusion model may spell a word in pieces the tokenizer never produces; the judge scores the text encoded
    again, each EOS kept where it was: a length-matched sample runs on past an end, and what follows is judged too."""
    tok = TokenDataset(tiny_data, "val").tokenizer()
    text = " the old king"
    canonical = tok.encode(text, add_special_tokens=False)
    pieces = [i for c in text for i in tok.encode(c, add_special_tokens=False)]  # one character at a time
    assert pieces != canonical and tok.decode(pieces) == text
    after = tok.encode(tok.decode([7, 8], skip_special_tokens=True), add_special_tokens=False)
    assert retokenize(tok, [pieces, [*pieces, 1], [*pieces, 1, 7, 8], [*pieces, 1, 1, *pieces], []], eos=(1,)) == \
        [canonical, [*canonical, 1], [*canonical, 1, *after], [*canonical, 1, 1, *canonical], []]


def _nll_by_hand(model, prompt, continuation):
    x = torch.cat([prompt, torch.tensor(continuation)])[None]
    with torch.no_grad():
        logits = model.next_token_logits(x, model.new_cache(1, x.shape[1])).double()[0]
    logp = torch.log_softmax(logits[prompt.numel() - 1:-1], dim=-1)
    return float(-logp.gather(1, torch.tensor(continuation)[:, None]).mean())


def test_prompt_dependence_is_the_nll_gap_to_other_prompts(tiny):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (n,), generator=g) for n in (4, 6, 5)]
    samples = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 5, 6)]
    d = prompt_dependence(tiny, prompts, samples)
    m = [[_nll_by_hand(tiny, p, c) for p in prompts] for c in samples]
    np.testing.assert_allclose(d["nll"], m, rtol=1e-5)
    gaps = [np.mean([m[i][j] - m[i][i] for j in range(3) if j != i]) for i in range(3)]
    assert d["prompt_dependence"] == pytest.approx(np.mean(gaps), rel=1e-5)
    assert d["prompt_dependence_se"] == pytest.approx(np.std(gaps, ddof=1) / math.sqrt(3), rel=1e-4)
    # the same prompt everywhere: the prompt cannot matter
    assert prompt_dependence(tiny, [prompts[0]] * 3, samples)["prompt_dependence"] == 0.0
    # an empty continuation has nothing to score: left out (its row NaN); fewer than two prompts: undefined
    partial = prompt_dependence(tiny, prompts, [samples[0], [], samples[2]])
    assert partial["continuations"] == 2 and all(math.isnan(x) for x in partial["nll"][1])
    assert math.isnan(prompt_dependence(tiny, prompts[:1], samples[:1])["prompt_dependence"])
    # with fewer others than prompts, each continuation is scored after the next `others` prompts, cyclically
    one = prompt_dependence(tiny, prompts, samples, others=1)
    assert one["others"] == 1
    assert one["prompt_dependence"] == pytest.approx(np.mean([m[i][(i + 1) % 3] - m[i][i] for i in range(3)]),
                                                     rel=1e-5)
    assert [math.isnan(x) for x in one["nll"][0]] == [False, False, True]


# --- the model's posterior, held-out likelihoods and `dgemma eval` on a tiny trained pair ---------------------------

@pytest.mark.parametrize("name", ["tiny", "lite-tiny"])
def test_clean_context_posterior_is_what_denoise_sees_after_committing_the_prefix(name):
    """The NELBO's p(x0 | x_t, clean prefix) from the one-pass training forward equals commit(prefix) then
    denoise(canvas) (with t for time-embedding models), canvas by canvas."""
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset(name)), seed=2).eval()
    L, T = model.config.canvas_length, 8
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, 500, (2, 3 * L), generator=g)
    t = torch.tensor([[1, 4, 8], [8, 2, 5]])
    xt = torch.randint(0, 500, x0.shape, generator=g)
    with torch.no_grad():
        one_pass = clean_context_posterior(model)(x0, xt, t.float() / T)
    for c in range(3):
        cache = model.new_cache(2, 3 * L)
        model.commit(x0[:, : c * L], cache)
        logits = model.denoise(xt[:, c * L:(c + 1) * L], cache, t=t[:, c].float() / T)
        torch.testing.assert_close(one_pass[:, c * L:(c + 1) * L], logits, atol=2e-4, rtol=1e-4)


def _corpus(path, n_docs=160, seed=0):
    import random

    from dgemma.data.tokenizer import toy_corpus

    rng = random.Random(seed)
    sentences = toy_corpus(400)
    docs = [" ".join(rng.choice(sentences) for _ in range(rng.randint(3, 8))) for _ in range(n_docs)]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Prepared data (a BPE of 512 on toy sentences, 10% validation) and two runs trained on it for a few steps:
    clean-context diffusion and the AR baseline, both on the tiny preset."""
    import io

    from dgemma.data.prepare import prepare
    from dgemma.train.config import TrainConfig
    from dgemma.train.loop import train

    root = tmp_path_factory.mktemp("pair")
    prepare(root / "data", [str(_corpus(root / "corpus.jsonl"))], tokenizer="bpe:512", val_fraction=0.1, quiet=True)
    runs = {}
    for objective in ("clean-context", "ar"):
        cfg = TrainConfig(preset="tiny", objective=objective, seq_len=32, batch_size=4, max_steps=8, warmup_steps=2,
                          eval_every=8, eval_batches=1, save_every=8, chunk_rows=256, device="cpu")
        train(cfg, root / "data", root / objective, stream=io.StringIO())
        runs[objective] = root / objective
    return root, runs


def test_heldout_losses_match_training_loss_without_self_conditioning(pair):
    from dgemma.data.shards import TokenDataset
    from dgemma.eval.likelihoods import heldout_ar_ce, heldout_x0_ce
    from dgemma.train.diffusion import training_loss
    from dgemma.weights.loading import load_model

    root, runs = pair
    val = TokenDataset(root / "data", "val")
    diffusion = load_model(run_info(runs["clean-context"]).model_dir).eval()
    ours = heldout_x0_ce(diffusion, val, seq_len=32, num_steps=16, batch_size=4, max_windows=4, seed=5, progress=False)
    x0 = next(val.heldout_batches(4, 32, shift=1))[:, 1:]  # the scored tokens: 1..32 of windows of 33
    with torch.no_grad():
        ref = training_loss(diffusion, x0, num_steps=16, self_conditioning_prob=0.0,
                            generator=torch.Generator().manual_seed(5))
    assert ours["estimate"].mean == pytest.approx(float(ref.cross_entropy), rel=1e-5)
    ar = load_model(run_info(runs["ar"]).model_dir).eval()
    ours = heldout_ar_ce(ar, val, seq_len=32, batch_size=4, max_windows=4, progress=False, tokenizer=val.tokenizer())
    with torch.no_grad():
        ref = training_loss(ar, next(val.heldout_batches(4, 32, shift=1)), objective="ar")
    assert ours["estimate"].mean == pytest.approx(float(ref.cross_entropy), rel=1e-5)
    assert ours["estimate"].bits_per_byte > 0


def test_dgemma_eval_writes_a_complete_report(pair, tmp_path):
    from dgemma.cli import main
    from dgemma.sampling.trace import load_trace

    pytest.importorskip("matplotlib")
    from PIL import Image

    root, runs = pair
    out = tmp_path / "report"
    rc = main(["eval", "--model", str(runs["clean-context"]), "--baseline", str(runs["ar"]), "--data",
               str(root / "data"), "--out", str(out), "--prompts", "2", "--max-denoising-steps-grid", "2,4",
               "--entropy-bounds", "0.5",
               "--max-windows", "4", "--quiet"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    lk = report["likelihood"]
    for key in ("nelbo", "x0_ce", "ar_ce"):
        e = lk[key]["estimate"]
        assert e["mean"] > 0 and e["se"] >= 0 and e["bits_per_byte"] > 0 and e["windows"] == 4
    # Every likelihood scores the same tokens; the Monte Carlo ones carry their Monte Carlo SE from independent
    # replicates; the exact reference, the unigram and the importance-weighted bound are beside them.
    assert {lk[k]["estimate"]["tokens"] for k in ("nelbo", "x0_ce", "ar_ce", "reference_nelbo")} == \
        {lk["scored"]["tokens"]} and lk["unigram"]["tokens"] == lk["scored"]["tokens"]
    assert lk["nelbo"]["replicates"] == 2 and lk["nelbo"]["mc_se"] > 0
    assert lk["nelbo"]["replicate_means"][0] != lk["nelbo"]["replicate_means"][1]
    assert lk["reference_nelbo"]["mc_se"] > 0 and lk["ar_ce"].get("mc_se") is None
    iw = lk["iw"]
    assert iw["windows"] == 4 and set(iw["by_k"]) == {"1", "4", "16"}
    assert iw["by_k"]["16"]["mean"] <= iw["by_k"]["1"]["mean"] + 1e-9
    assert report["verdict"]["unigram_ce"] == lk["unigram"]["mean"]
    assert report["baseline"]["annealed"] is True and report["baseline"]["step"] == 8  # the end of its schedule
    assert len(report["frontier"]) == 2 and report["ar_decode"]["useful_tokens"] > 0
    timing = report["timing"]  # all timed decoders in rotation, the load they shared recorded
    assert timing["order"].startswith("interleaved: prompt by prompt")
    assert timing["before"]["cpu_count"] == timing["after"]["cpu_count"] == os.cpu_count()
    for point in report["frontier"]:
        n = point["max_denoising_steps"]
        assert point["fixed"]["tokens_per_forward"] == pytest.approx(16 / (n + 1))
        assert point["adaptive"]["passes"] <= point["fixed"]["passes"]
        q = point["quality"]
        assert q["gen_ppl"] > 1 and 0 <= q["distinct_2_per_sample"] <= 1 and 0 <= q["distinct_2_pooled"] <= 1
        assert q["scored_samples"] == 2 and q["sample_seeds"] == 1 and 0 <= q["real_text"] <= 1
    v = report["verdict"]
    assert v["available"] and v["nelbo_over_ar"] > 0 and v["speedup"] > 0
    md = (out / "report.md").read_text()
    for heading in ("## Verdict (seed 003)", "## Likelihood", "## Speed / quality frontier", "## Traces"):
        assert heading in md
    assert "± MC SE" in md and "importance-weighted bound at T=" in md and lk["scored"]["sha256"][:12] in md
    assert f"Machine: {os.cpu_count()} cores" in md and "load average (1 / 5 / 15 min)" in md
    assert report["command"].startswith("dgemma eval --model") and report["command"] in md
    for png in ("frontier.png", "likelihood.png"):
        with Image.open(out / png) as im:
            assert im.size == (1200, 800)
    traces = sorted(p.stem for p in (out / "traces").glob("*.json"))
    assert traces == ["N2_eb0p5", "N4_eb0p5"]
    assert load_trace(out / "traces" / "N2_eb0p5").summary["format"] == TRACE_FORMAT


def test_dgemma_eval_bad_inputs_are_clear_errors(pair, tmp_path, capsys):
    from dgemma.cli import main
    from dgemma.data.prepare import prepare
    from dgemma.data.tokenizer import build_test_tokenizer

    root, runs = pair
    base = ["--data", str(root / "data"), "--out", str(tmp_path / "r"), "--quiet"]
    # a baseline with another tokenizer
    other = tmp_path / "other-ar"
    shutil.copytree(runs["ar"], other)
    for tok in other.rglob("tokenizer.json"):
        build_test_tokenizer(300, tok)
    assert main(["eval", "--model", str(runs["clean-context"]), "--baseline", str(other), *base]) == 2
    assert "uses another tokenizer" in capsys.readouterr().err
    # the runs swapped
    assert main(["eval", "--model", str(runs["ar"]), "--baseline", str(runs["clean-context"]), *base]) == 2
    assert "objective 'ar'" in capsys.readouterr().err
    # an empty validation split
    empty = tmp_path / "empty"
    prepare(empty, [str(_corpus(tmp_path / "c.jsonl", n_docs=20))], tokenizer="bpe:512", val_fraction=0.0, quiet=True)
    assert main(["eval", "--model", str(runs["clean-context"]), "--data", str(empty), "--out", str(tmp_path / "r"),
                 "--quiet"]) == 2
    assert "validation split is empty" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "nope"), *base]) == 2
    assert "no such model or run directory" in capsys.readouterr().err
    assert main(["eval", "--model", str(runs["clean-context"]), "--max-denoising-steps-grid", "0", *base]) == 2
    assert "--max-denoising-steps-grid must be positive" in capsys.readouterr().err


# --- the judge, learning curves, intervals and the two prompt halves ------------------------------------------------

def test_bootstrap_interval_holds_the_estimate_and_is_seeded():
    from dgemma.eval.judging import bootstrap_ppl

    rng = np.random.default_rng(0)
    nlls = [(float(rng.uniform(20, 60)), int(rng.integers(10, 20))) for _ in range(12)] + [(0.0, 0)]  # one empty
    a = bootstrap_ppl(nlls, resamples=1000, seed=3)
    total, count = sum(s for s, _ in nlls), sum(n for _, n in nlls)
    assert a["gen_ppl"] == pytest.approx(math.exp(total / count)) and a["tokens"] == count and a["samples"] == 12
    lo, hi = a["gen_ppl_ci95"]
    assert lo < a["gen_ppl"] < hi
    assert bootstrap_ppl(nlls, resamples=1000, seed=3) == a  # deterministic given the seed
    assert bootstrap_ppl(nlls, resamples=1000, seed=4)["gen_ppl_ci95"] != a["gen_ppl_ci95"]
    one = bootstrap_ppl(nlls[:1], seed=0)  # one sample: nothing to resample, the interval is the point
    assert one["gen_ppl_ci95"] == [pytest.approx(one["gen_ppl"])] * 2
    assert math.isnan(bootstrap_ppl([(0.0, 0)])["gen_ppl"])


def test_tokens_per_second_interval_across_prompts():
    from dgemma.eval.judging import Z95, rate_interval

    r = rate_interval([10, 20], [1.0, 1.0])
    # R = 30 / 2 = 15; residuals -5, 5: SE = sqrt(50 / (2 * 1)) / mean seconds 1 = 5
    assert r["tokens_per_second"] == 15 and r["tokens_per_second_se"] == pytest.approx(5.0)
    assert r["tokens_per_second_ci95"] == pytest.approx([15 - Z95 * 5, 15 + Z95 * 5])
    assert rate_interval([10, 20], [1.0, 2.0])["tokens_per_second_se"] == pytest.approx(0.0)  # same rate each
    assert math.isnan(rate_interval([7], [1.0])["tokens_per_second_se"])


def test_selection_and_report_prompts_are_disjoint_halves():
    from dgemma.eval.judging import split_prompts

    for n in (2, 7, 8):
        select, report = split_prompts(n)
        assert not set(select) & set(report) and sorted(select + report) == list(range(n))
        assert abs(len(select) - len(report)) <= 1 and select[0] == 0 and report[0] == 1


def test_learning_curves_are_the_runs_metrics_records(pair):
    from dgemma.data.shards import unigram_cross_entropy
    from dgemma.eval.curves import eval_points, learning_curves

    root, runs = pair
    for objective, metric in (("clean-context", "val_nelbo"), ("ar", "val_loss")):
        records = [json.loads(line) for line in (runs[objective] / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in records if "val_loss" in r]
        assert [r["step"] for r in evals] == [0, 8]
        points = eval_points(runs[objective], metric)
        assert [(p["step"], p["tokens"], p["value"]) for p in points] == \
            [(r["step"], r["tokens"], r[metric]) for r in evals]
        for p, r in zip(points, evals, strict=True):  # one eval batch: an AR run's SE is NaN, kept as None
            assert p["se"] == r[f"{metric}_se"] if math.isfinite(r[f"{metric}_se"]) else p["se"] is None
        cpu = {r["step"]: r["cpu_s"] for r in records if "cpu_s" in r}
        assert points[0]["cpu_s"] is None and points[1]["cpu_s"] == cpu[8] > 0
    assert eval_points(runs["ar"], "val_nelbo") == [] and eval_points(root / "data", "val_loss") is None
    curves = learning_curves(runs["clean-context"], runs["ar"], root / "data")
    assert curves["unigram_ce"] == pytest.approx(unigram_cross_entropy(root / "data"))
    d, a = curves["diffusion"]["points"], curves["ar"]["points"]
    assert [r["tokens"] for r in curves["ratio"]] == [0, 8 * 4 * 32]
    for r, dp, ap in zip(curves["ratio"], d, a, strict=True):
        assert r["ratio"] == pytest.approx(dp["value"] / ap["value"])
        assert r["ratio_se"] is None if ap["se"] is None or dp["se"] is None else r["ratio_se"] > 0
    # a checkpoint of the run gives the run's curve; a checkpoint directory on its own has none
    ckpt = run_info(runs["clean-context"]).model_dir
    assert learning_curves(ckpt, None, root / "data")["diffusion"]["points"] == curves["diffusion"]["points"]
    alone = root / "alone"
    shutil.copytree(ckpt, alone)
    assert learning_curves(alone, None, root / "data") is None


@pytest.fixture(scope="module")
def judge_run(pair):
    """A third tiny run on the same data: an AR model neither side of the comparison is."""
    import io

    from dgemma.train.config import TrainConfig
    from dgemma.train.loop import train

    root, _ = pair
    cfg = TrainConfig(preset="tiny", objective="ar", seq_len=32, batch_size=4, max_steps=6, warmup_steps=2,
                      eval_every=6, eval_batches=1, save_every=6, chunk_rows=256, device="cpu", seed=7)
    train(cfg, root / "data", root / "judge", stream=io.StringIO())
    return root / "judge"


def test_dgemma_eval_with_a_judge_and_an_ar_temperature_grid(pair, judge_run, tmp_path):
    from dgemma.cli import main
    from dgemma.data.shards import TokenDataset
    from dgemma.eval.decoding import generative_perplexity
    from dgemma.eval.evaluate import pick_prompts
    from dgemma.eval.judging import SEPARATE_JUDGE, prompt_dependence, retokenize
    from dgemma.weights.loading import load_model

    pytest.importorskip("matplotlib")
    root, runs = pair
    out = tmp_path / "report"
    assert main(["eval", "--model", str(runs["clean-context"]), "--baseline", str(runs["ar"]), "--judge",
                 str(judge_run), "--data", str(root / "data"), "--out", str(out), "--prompts", "4",
                 "--max-denoising-steps-grid", "2",
                 "--entropy-bounds", "0.5", "--ar-temperatures", "0.7,1", "--max-windows", "2", "--t-samples", "1",
                 "--bootstrap", "200", "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    judge = report["judge"]
    assert judge["judge"] == SEPARATE_JUDGE and judge["path"] == str(judge_run) and judge["dtype"] == "float64"
    assert judge["seed"] == 7  # beside the relation, what makes it separate: its own seed (and data, steps, tokens)
    assert judge["objective"] == "ar" and judge["trained_step"] == 6 and judge["trained_tokens"] == 6 * 4 * 32
    assert [p["temperature"] for p in report["ar_frontier"]] == [0.7, 1.0]  # one AR point per temperature
    # every AR row says which likelihood describes its samples: the AR model's own at temperature 1, else none
    assert [p["likelihood"] for p in report["ar_frontier"]] == ["none", "AR NLL (exact)"]
    assert all(p["quality"]["dtype"] == "float64" for p in [*report["frontier"], *report["ar_frontier"]])
    # gen-PPL of both sides is the judge's (float64), on the very samples: not the baseline's
    val = TokenDataset(root / "data", "val")
    prompts = pick_prompts(val, 4, 32)
    # on the kernels `dgemma eval` ran (--impl's default: fast)
    judge_model = load_model(judge_run, dtype=torch.float32, impl="fast").to(torch.float64).eval()
    baseline = load_model(runs["ar"], dtype=torch.float32, impl="fast").eval()
    for point in [*report["frontier"], *report["ar_frontier"]]:
        # the judge scores the samples' text tokenized again, as a reader's text would be
        judged = retokenize(val.tokenizer(), point["samples"], (val.eot_id,))
        direct = generative_perplexity(judge_model, prompts, judged)["gen_ppl"]
        assert point["quality"]["gen_ppl"] == pytest.approx(direct, rel=1e-9)
        assert point["quality"]["gen_ppl"] != pytest.approx(
            generative_perplexity(baseline, prompts, judged)["gen_ppl"], rel=1e-3)
        dependence = prompt_dependence(judge_model, prompts, judged)
        assert point["quality"]["prompt_dependence"] == pytest.approx(dependence["prompt_dependence"], rel=1e-9)
        np.testing.assert_allclose(point["prompt_dependence_nll"], dependence["nll"], rtol=1e-9)  # NaN: empty
        lo, hi = point["quality"]["gen_ppl_ci95"]
        assert lo <= point["quality"]["gen_ppl"] <= hi
        select, rep = point["stats"]["select"]["prompts"], point["stats"]["report"]["prompts"]
        assert select == [0, 2] and rep == [1, 3]
        assert point["stats"]["all"]["tokens_per_second_se"] >= 0
    v = report["verdict"]
    assert v["available"] and v["ar_temperature"] in (0.7, 1.0) and v["prompts_select"] == v["prompts_report"] == 2
    assert report["ar_decode"]["temperature"] == v["ar_temperature"]
    adaptive = report["frontier"][0]["adaptive"]
    assert 0 <= adaptive["early_stop_share"] <= 1 and adaptive["mean_steps_per_canvas"] <= 2
    # learning curves of both runs, and the report's sections
    curves = report["curves"]
    assert len(curves["diffusion"]["points"]) == len(curves["ar"]["points"]) == len(curves["ratio"]) == 2
    md = (out / "report.md").read_text()
    for text in ("## Learning curves", "### Adaptive stopping", "AR T=0.7", "AR T=1", "a separately trained AR run",
                 "### Which likelihood describes each setting", "| AR T=0.7 | none |", "| AR T=1 | AR NLL (exact) |",
                 "selection prompts", "prompt dependence |", "Timing: interleaved: prompt by prompt"):
        assert text in md, text
    from PIL import Image

    with Image.open(out / "curves.png") as im:
        assert im.size == (1200, 800)


def test_eval_without_a_judge_names_the_baseline_and_checks_the_judge(pair, tmp_path, capsys):
    from dgemma.cli import main
    from dgemma.eval.judging import BASELINE_JUDGE, SAME_RUN_JUDGE

    pytest.importorskip("matplotlib")
    root, runs = pair
    base = ["--model", str(runs["clean-context"]), "--data", str(root / "data"), "--quiet", "--max-windows", "2",
            "--t-samples", "1", "--max-denoising-steps-grid", "2", "--entropy-bounds", "0.5", "--prompts", "2"]
    assert main(["eval", *base, "--baseline", str(runs["ar"]), "--out", str(tmp_path / "r")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["judge"]["judge"] == BASELINE_JUDGE and report["judge"]["path"] == str(runs["ar"])
    assert "the AR baseline (one of the compared models)" in (tmp_path / "r" / "report.md").read_text()
    # a judge from a compared run is named as what it is, never "independent" because --judge was passed
    assert main(["eval", *base, "--baseline", str(runs["ar"]), "--judge", str(runs["ar"]), "--out",
                 str(tmp_path / "same")]) == 0
    assert json.loads((tmp_path / "same" / "report.json").read_text())["judge"]["judge"] == SAME_RUN_JUDGE
    assert main(["eval", *base, "--judge", str(runs["clean-context"]), "--out", str(tmp_path / "j")]) == 2
    assert "the judge must be an autoregressive run" in capsys.readouterr().err
    assert main(["eval", *base, "--ar-temperatures", "0", "--out", str(tmp_path / "t")]) == 2
    assert "--ar-temperatures must be numbers > 0" in capsys.readouterr().err
    assert main(["eval", *base, "--prompts", "1", "--out", str(tmp_path / "p")]) == 2
    assert "--prompts must be >= 2" in capsys.readouterr().err
    assert main(["eval", *base, "--sample-seeds", "0", "--out", str(tmp_path / "s")]) == 2
    assert "--sample-seeds must be >= 1, got 0" in capsys.readouterr().err
    assert main(["eval", *base, "--mc-replicates", "0", "--out", str(tmp_path / "m")]) == 2
    assert "--mc-replicates must be >= 1, got 0" in capsys.readouterr().err
    assert main(["eval", *base, "--iw-windows", "-1", "--out", str(tmp_path / "i")]) == 2
    assert "--iw-windows must be >= 0 (0: no importance-weighted bound), got -1" in capsys.readouterr().err


def test_sample_seeds_draw_length_matched_samples_per_prompt(pair, tmp_path):
    """--sample-seeds S: S quality draws per prompt of every setting and AR temperature (draw 0 on the timed runs'
    seeds, so S = 1's samples are kept), each exactly --max-new-tokens long; timing stays one rotation."""
    from dgemma.cli import main

    pytest.importorskip("matplotlib")
    root, runs = pair
    base = ["--model", str(runs["clean-context"]), "--baseline", str(runs["ar"]), "--data", str(root / "data"),
            "--quiet", "--max-windows", "2", "--t-samples", "1", "--max-denoising-steps-grid", "2",
            "--entropy-bounds", "0.5", "--prompts", "4", "--max-new-tokens", "24", "--ar-temperatures", "0.8,1",
            "--bootstrap", "50"]
    reports = {}
    for seeds in (1, 2):
        assert main(["eval", *base, "--sample-seeds", str(seeds), "--out", str(tmp_path / str(seeds))]) == 0
        reports[seeds] = json.loads((tmp_path / str(seeds) / "report.json").read_text())
    one, two = reports[1], reports[2]
    assert two["settings"]["sample_seeds"] == 2 and "--sample-seeds 2" in two["command"]
    protocol = two["quality_protocol"]
    assert protocol["sample_seeds"] == 2 and protocol["new_tokens"] == 24 and "exactly max_new_tokens (24)" in \
        protocol["length_rule"]
    floors = protocol["real_text"]
    assert floors["count"] == 8 and floors["length"] == 24
    assert floors["heldout_text"]["mean"] > floors["unigram_floor"]["mean"] > floors["uniform_floor"]["mean"]
    for a, b in zip([*one["frontier"], *one["ar_frontier"]], [*two["frontier"], *two["ar_frontier"]], strict=True):
        assert a["quality"]["scored_samples"] == 4 and b["quality"]["scored_samples"] == 8  # doubled
        assert a["samples"] == b["samples"] and all(len(x) == 24 for x in b["samples"])  # draw 0, length-matched
        timed_a, timed_b = a.get("adaptive", a), b.get("adaptive", b)  # one timed rotation either way, same seeds
        assert timed_a["passes"] == timed_b["passes"] and timed_a["prompts"] == timed_b["prompts"] == 4
        for key in ("nll_per_token", "distinct_2_per_sample", "real_text", "tokens", "seconds", "passes"):
            assert len(b["per_prompt"][key]) == 4, key
        q = b["quality"]
        assert q["nll_per_token"] == pytest.approx(np.mean(b["per_prompt"]["nll_per_token"]))
        assert q["distinct_2_per_sample_se"] >= 0 and 0 <= q["real_text"] <= 1
    v = two["verdict"]
    assert v["available"] and v["ar_temperature"] in (0.8, 1.0) and v["nll_difference"]["n"] == 2
    assert v["tokens_per_forward_ratio"] > 0 and len(v["tokens_per_forward_ratio_ci95"]) == 2
    md = (tmp_path / "2" / "report.md").read_text()
    for text in ("Speed at matched quality", "paired Δ NLL vs its matched AR point ± SE", "distinct-2 per sample ± SE",
                 "real text ± SE", "Real text: share of the sample's characters", "2 seed(s) per prompt",
                 "(closest; not matched)" if not all(m["matched"] for m in v["matches"]) else " vs T="):
        assert text in md, text
    # runs/frontier_table.py reads the new rows (per-sample distinct-2, paired SEs) as it reads the committed report
    root = Path(__file__).resolve().parents[2]
    script, report_json = root / "runs" / "frontier_table.py", tmp_path / "2" / "report.json"
    table = subprocess.run([sys.executable, str(script), str(report_json)], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert "| distinct-2 per sample |" in table.stdout and "| AR, temperature 0.8 |" in table.stdout


def test_a_judge_is_named_by_its_relation_to_the_compared_runs(tmp_path):
    """`judge_relation` reads what a judge is from the runs: a checkpoint of a compared run, of the run the diffusion
    model started from, or of neither."""
    from dgemma.eval.judging import SAME_RUN_JUDGE, SEPARATE_JUDGE, START_RUN_JUDGE, judge_relation

    def ckpt(run: str, step: int):
        d = tmp_path / run / "checkpoints" / f"step-{step:07d}"
        d.mkdir(parents=True)
        return d

    baseline, later, model = ckpt("ar", 4800), ckpt("ar", 9600), ckpt("diffusion", 2400)
    start, judge, lone = ckpt("ar-start", 2400), ckpt("judge", 9600), tmp_path / "exported"
    lone.mkdir()
    assert judge_relation(later, [model, baseline], None) == SAME_RUN_JUDGE  # the baseline's own run, later
    assert judge_relation(model, [model, baseline], None) == SAME_RUN_JUDGE
    assert judge_relation(ckpt("ar-start", 4800), [model, baseline], str(start)) == START_RUN_JUDGE
    assert judge_relation(judge, [model, baseline], str(start)) == SEPARATE_JUDGE
    assert judge_relation(lone, [model, baseline], None) == SEPARATE_JUDGE  # an exported checkpoint: its own


def test_a_mid_schedule_baseline_is_named_not_annealed(pair):
    from dgemma.eval.judging import schedule_position
    from dgemma.eval.report import _baseline_line

    _, runs = pair
    mid = schedule_position(runs["ar"], runs["ar"] / "checkpoints" / "step-0000004", {"max_steps": 8})
    assert mid == {"step": 4, "schedule_steps": 8, "annealed": False}
    assert "**not annealed**" in _baseline_line({"checkpoint": "x", **mid})
    end = schedule_position(runs["ar"], runs["ar"] / "checkpoints" / "step-0000008", {"max_steps": 8})
    assert end["annealed"] is True and "not annealed" not in _baseline_line({"checkpoint": "x", **end})
