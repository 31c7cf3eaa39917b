"""The sampler's rules on hand-built logits and canvases: no model involved (dgemma.sampling.rules)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dgemma import GenerationConfig
from dgemma.sampling import rules as S

# --- acceptance by entropy ---------------------------------------------------------------------------------------


def _accepted(entropy: list[float], bound: float) -> set[int]:
    mask = S.accept_by_entropy(torch.tensor([entropy]), bound)
    assert mask.dtype == torch.bool and mask.shape == (1, len(entropy))
    return set(mask[0].nonzero().flatten().tolist())


def test_acceptance_set_matches_the_hand_computed_rule():
    # sorted: 0.01 (pos 1), 0.02 (pos 2), 0.5 (pos 0), 3.0 (pos 3); sum(first k) - k-th = 0, 0.01, 0.03, 0.53.
    # The largest accepted entropy does not count against the bound, so 0.5 gets in at bound 0.05 ...
    assert _accepted([0.5, 0.01, 0.02, 3.0], 0.05) == {0, 1, 2}
    # ... but not at 0.02, where 0.01 + 0.02 = 0.03 already exceeds it,
    assert _accepted([0.5, 0.01, 0.02, 3.0], 0.02) == {1, 2}
    # and a bound large enough for 0.01 + 0.02 + 0.5 takes everything.
    assert _accepted([0.5, 0.01, 0.02, 3.0], 0.6) == {0, 1, 2, 3}


def test_bound_is_inclusive():
    # sum - max = 0.05 exactly in fp32 (0.05 + 0.05 - 0.05): "<= entropy_bound" accepts it.
    assert _accepted([0.0, 0.05, 0.05, 1.0], 0.05) == {0, 1, 2}


def test_at_least_one_position_is_accepted_whatever_the_bound():
    # The lowest-entropy position always has sum - max = 0 <= bound > 0: progress is guaranteed every step.
    assert _accepted([100.0, 200.0, 50.0, 75.0], 1e-9) == {2}
    assert len(_accepted([5.0, 5.0, 5.0], 1e-9)) == 1


def test_ties_accept_as_many_as_the_bound_allows():
    # Four equal entropies of 0.1: sum - max = 0, 0.1, 0.2, 0.3, so a bound of 0.25 takes exactly three of them
    # (which three is the sort's business, as in transformers).
    assert len(_accepted([0.1, 0.1, 0.1, 0.1], 0.25)) == 3
    assert len(_accepted([0.1, 0.1, 0.1, 0.1], 0.05)) == 1


def test_acceptance_is_decided_per_row():
    rows = torch.tensor([[0.5, 0.01, 0.02, 3.0], [3.0, 2.0, 1.0, 0.001], [0.0, 0.0, 0.0, 0.0]])
    batched = S.accept_by_entropy(rows, 0.05)
    for b in range(rows.shape[0]):
        assert torch.equal(batched[b], S.accept_by_entropy(rows[b:b + 1], 0.05)[0])
    # row 1: 0.001 then 1.0 (sum - max = 0.001), 2.0 would add 1.0; row 2: all zero, all in.
    assert batched.sum(-1).tolist() == [3, 2, 4]


# --- entropy -----------------------------------------------------------------------------------------------------


def _awkward_logits(V: int, seed: int = 0) -> torch.Tensor:
    """(3, 5, V) logits with the rows that break naive entropy code: -inf entries, a single finite entry, finfo.min,
    huge logits, an all-equal row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, V, generator=g) * 4
    x[0, 0, : V // 2] = -float("inf")  # half the vocabulary impossible
    x[0, 1, 1:] = -1e30  # one finite token: entropy ~0
    x[1, 2, ::3] = torch.finfo(torch.float32).min
    x[2, 3] = 0.0  # uniform: entropy log V
    x[2, 4] *= 100  # very peaked
    return x


@pytest.mark.parametrize("chunk_rows", [1, 2, 4, 15, 4096])
def test_entropy_is_categoricals_bit_for_bit_whatever_the_chunking(chunk_rows):
    # Bit equality with torch.distributions.Categorical is what keeps the acceptance set (a sort of entropies) and
    # the stop rule identical to transformers'. V below torch's CPU reduction grain (32768) keeps every row a
    # serial reduction, so no chunking can change the bits (larger vocabularies: the two tests below).
    x = _awkward_logits(512)
    ref = torch.distributions.Categorical(logits=x).entropy()
    got = S.token_entropy(x, chunk_rows=chunk_rows)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    assert torch.equal(got, ref)
    assert got[0, 1] == 0.0 and torch.isclose(got[2, 3], torch.tensor(np.log(512), dtype=torch.float32))
    assert bool((got >= 0).all())


@pytest.mark.parametrize("chunk_rows", [2, 4, 6])
def test_entropy_chunks_of_two_rows_or_more_are_bit_exact_at_large_vocab(chunk_rows):
    # Above torch's CPU reduction grain (32768 elements) reductions run in parallel. Over two or more rows torch
    # splits the rows between threads and each row is summed serially, the same as over the whole tensor. These
    # chunkings of 6 rows never leave a one-row chunk.
    x = _awkward_logits(40_000, seed=1)[:2, :3]
    ref = torch.distributions.Categorical(logits=x).entropy()
    assert torch.equal(S.token_entropy(x, chunk_rows=chunk_rows), ref)


def test_entropy_one_row_chunks_at_large_vocab_are_only_equal_to_rounding():
    # A single row is summed by a two-pass parallel reduction when torch has more than one thread, which reorders
    # the additions: within rounding of Categorical, not bit for bit. (The default 4096-row chunk never leaves a
    # one-row chunk on a 256-token canvas; a 1-token canvas is a single row either way.)
    x = _awkward_logits(40_000, seed=1)[:1, :2]
    ref = torch.distributions.Categorical(logits=x).entropy()
    torch.testing.assert_close(S.token_entropy(x, chunk_rows=1), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(S.token_entropy(x), ref)  # one chunk: the very reduction Categorical does


# --- temperature -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 2, 7, 48])
def test_temperature_runs_from_t_max_to_just_above_t_min(N):
    t_min, t_max = 0.4, 0.8  # the released defaults: both endpoints exact in fp32
    first = S.temperature(N, N, t_min, t_max)
    assert first.shape == () and first.dtype == torch.float32
    assert first == torch.tensor(t_max, dtype=torch.float32)
    last = S.temperature(1, N, t_min, t_max)
    assert last == torch.tensor(t_min + (t_max - t_min) / N, dtype=torch.float32)
    assert last > t_min  # the schedule never reaches t_min (as in the reference)
    temps = [float(S.temperature(n, N, t_min, t_max)) for n in range(N, 0, -1)]
    assert temps == sorted(temps, reverse=True) and len(set(temps)) == N  # strictly decreasing


@pytest.mark.parametrize(("N", "t_min", "t_max"), [(1, 0.4, 0.8), (5, 0.4, 0.8), (48, 0.4, 0.8), (13, 0.1, 1.7),
                                                    (3, 0.0, 1.0)])
def test_temperature_scales_logits_exactly_like_transformers(N, t_min, t_max):
    hf = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    proc = hf.LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=N)
    scores = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(N)) * 10
    for n in range(N, 0, -1):
        # transformers passes the remaining steps as an int32 tensor (see DiffusionGemmaGenerationMixin._denoising_step)
        expected = proc(None, scores, cur_step=torch.tensor(n, dtype=torch.int32))
        assert torch.equal(scores / S.temperature(n, N, t_min, t_max), expected)


# --- stability and the stop rule ---------------------------------------------------------------------------------


def test_is_stable_needs_threshold_consecutive_equal_argmaxes():
    a, b = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])
    history = None
    seen = []
    for argmax in (a, a, a, b, b, b):
        stable, history = S.is_stable(history, argmax, threshold=2)
        seen.append(bool(stable[0]))
    # step 1: empty history; step 2: only one earlier a; step 3: two earlier a's; then b restarts the count.
    assert seen == [False, False, True, False, False, True]


def test_first_call_is_never_stable_and_threshold_zero_always_is():
    canvas = torch.zeros(2, 3, dtype=torch.long)  # even a canvas of zeros is not mistaken for the -1 history
    stable, history = S.is_stable(None, canvas, threshold=1)
    assert not bool(stable.any()) and history.shape == (1, 2, 3)
    stable, history = S.is_stable(None, canvas, threshold=0)
    assert bool(stable.all()) and history is None


def test_is_stable_is_decided_per_row():
    history = None
    for step in range(3):
        argmax = torch.tensor([[7, 7], [step, step]])  # row 0 constant, row 1 changes every step
        stable, history = S.is_stable(history, argmax, threshold=1)
    assert stable.tolist() == [True, False]


def _stop_sequence(config: GenerationConfig, steps: list[tuple[list[int], float]]) -> list[bool]:
    state = S.StopState()
    out = []
    for argmax, mean_entropy in steps:
        am = torch.tensor([argmax])
        out.append(bool(S.stop_rows(config, state, am, am * 0 - 1, torch.tensor([mean_entropy]))[0]))
    return out


def test_hf_stop_needs_both_stability_and_confidence():
    config = GenerationConfig(stability_threshold=1, confidence_threshold=0.5)
    confident, unsure = 0.1, 1.0
    assert _stop_sequence(config, [([1, 2], confident), ([1, 2], unsure)]) == [False, False]  # stable, not confident
    assert _stop_sequence(config, [([1, 2], confident), ([3, 2], confident)]) == [False, False]  # confident, unstable
    assert _stop_sequence(config, [([1, 2], unsure), ([1, 2], confident)]) == [False, True]  # both
    # The confidence test is strict (transformers: mean < threshold).
    assert _stop_sequence(config, [([1, 2], 0.5), ([1, 2], 0.5)]) == [False, False]


def test_hf_stop_with_stability_threshold_zero_is_confidence_only():
    config = GenerationConfig(stability_threshold=0, confidence_threshold=0.5)
    assert _stop_sequence(config, [([1, 2], 0.1)]) == [True]
    assert _stop_sequence(config, [([1, 2], 0.9)]) == [False]


def test_jax_stop_compares_the_argmax_with_the_input_canvas():
    config = GenerationConfig(stop_rule="jax", confidence_threshold=0.5)
    state = S.StopState()
    argmax = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    canvas = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 0, 3]])
    mean_entropy = torch.tensor([0.5, 0.9, 0.1])  # inclusive bound in JAX (EntropyEarlyStop: <=)
    # row 0: reproduces its input and is confident -> stop at the very first step (no history needed);
    # row 1: reproduces its input but is not confident; row 2: confident but changed a token.
    assert S.stop_rows(config, state, argmax, canvas, mean_entropy).tolist() == [True, False, False]


def test_lite_adaptive_stop_counts_consecutive_calm_steps():
    config = GenerationConfig(sampler="lite", confidence_threshold=0.5, stability_steps=2)
    state = S.StopState()
    seen = [bool(S.stop_rows(config, state, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                       torch.tensor([h]))[0]) for h in (0.1, 0.9, 0.1, 0.1, 0.1)]
    assert seen == [False, False, False, True, True]  # the calm streak restarts after the 0.9 step
    fixed = GenerationConfig(sampler="lite", adaptive=False, confidence_threshold=0.5, stability_steps=1)
    assert _stop_sequence(fixed, [([1, 2], 0.0)] * 3) == [False] * 3  # adaptive=False never consults entropy


# --- renoising ---------------------------------------------------------------------------------------------------


def test_renoise_is_uniform_and_leaves_kept_positions_alone():
    V, n = 16, 200_000
    g = torch.Generator().manual_seed(1234)
    canvas = torch.randint(0, 3, (2, n // 2), generator=g)  # a canvas concentrated on tokens 0..2
    keep = torch.rand(2, n // 2, generator=g) < 0.3
    out = S.renoise(canvas, keep, V, generator=g)
    assert out.shape == canvas.shape and out.dtype == canvas.dtype
    assert torch.equal(out[keep], canvas[keep])
    redrawn = out[~keep].numpy()
    counts = np.bincount(redrawn, minlength=V)
    assert counts.shape == (V,) and redrawn.min() >= 0
    expected = redrawn.size / V
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # chi-square with 15 degrees of freedom: P(chi2 > 37.7) = 0.001; a non-uniform redraw (e.g. one token
    # 2 % too frequent) scores in the hundreds at this sample size.
    assert chi2 < 37.7, (chi2, counts)
    # Memoryless: the redraw does not depend on what was there (matches the old token 1/V of the time).
    same = float((out[~keep] == canvas[~keep]).float().mean())
    assert abs(same - 1 / V) < 0.005


# --- the Lite commit rule ----------------------------------------------------------------------------------------


def test_lite_commit_rule_on_a_hand_built_step():
    argmax = torch.tensor([[1, 2, 3, 4, 5]])
    prev_argmax = torch.tensor([[1, 0, 3, 0, 0]])
    confidence = torch.tensor([[0.5, 0.9, 0.1, 0.2, 0.4]])
    prev_confidence = torch.tensor([[0.9, 0.8, 0.2, 0.3, 0.4]])
    committed = torch.tensor([[False, False, True, False, False]])
    new = S.lite_candidates(argmax, confidence, prev_argmax, prev_confidence, committed)
    # 0: mode unchanged (weaker is fine); 1: stronger; 2: already frozen, never re-committed;
    # 3: changed and weaker -> no; 4: changed, confidence equal ("did not drop") -> yes.
    assert new.tolist() == [[True, True, False, False, True]]
    seed = S.lite_commit(GenerationConfig(lite_commit="seed", max_denoising_steps=5), 2, argmax, confidence,
                         prev_argmax, prev_confidence, committed)
    assert torch.equal(seed, new)  # the seed's rule commits every candidate
    # scheduled, step 2 of 5: ceil(5 * 2 / 5) = 2 committed, one is already, so one more: the most confident (1)
    scheduled = S.lite_commit(GenerationConfig(max_denoising_steps=5), 2, argmax, confidence, prev_argmax,
                              prev_confidence, committed)
    assert scheduled.tolist() == [[False, True, False, False, False]]


@pytest.mark.parametrize("rule", ["seed", "scheduled"])
def test_lite_commit_rule_is_monotone_over_random_steps(rule):
    """Both rules commit only the seed's candidates and never shrink the committed set; the seed's commits all of
    them, the scheduled one the most confident up to ceil(L * k / N) committed after step k of N."""
    g = torch.Generator().manual_seed(7)
    B, L, V, N = 3, 64, 5, 12  # a small vocabulary so that modes repeat often
    config = GenerationConfig(max_denoising_steps=N, sampler="lite", lite_commit=rule)
    committed = torch.zeros(B, L, dtype=torch.bool)
    prev_argmax = torch.full((B, L), -1)
    prev_confidence = torch.full((B, L), float("inf"))  # what denoise_canvas starts from: nothing commits at step 1
    sizes = []
    for step in range(1, N + 1):
        argmax = torch.randint(0, V, (B, L), generator=g)
        confidence = torch.rand(B, L, generator=g)
        new = S.lite_commit(config, step, argmax, confidence, prev_argmax, prev_confidence, committed)
        assert not bool((new & committed).any())  # a frozen position never commits twice
        candidates = (argmax == prev_argmax) | (confidence >= prev_confidence)
        candidates &= ~committed
        if rule == "seed":
            assert torch.equal(new, candidates)  # every position satisfying the rule commits now
        else:
            assert not bool((new & ~candidates).any())
            room = math.ceil(L * step / N) - committed.sum(-1)
            assert torch.equal(new.sum(-1), torch.minimum(room, candidates.sum(-1)))  # fills its quota if it can
            weakest = torch.where(new, confidence, math.inf).amin(-1)
            strongest_left = torch.where(candidates & ~new, confidence, -math.inf).amax(-1)
            assert bool((weakest >= strongest_left).all())  # the most confident candidates go first
        if step == 1:
            assert not bool(new.any())
        grown = committed | new
        assert bool((grown >= committed).all())  # the committed set never shrinks
        committed, prev_argmax, prev_confidence = grown, argmax, confidence
        sizes.append(int(committed.sum()))
    assert sizes == sorted(sizes) and 0 < sizes[-1] <= B * L
    if rule == "scheduled":
        assert sizes[1] <= B * math.ceil(L * 2 / N)  # step 2 commits at most its share, not nearly everything
