"""The frontier's statistics: paired per-prompt comparisons (dgemma/eval/paired.py), the matched-quality rule
(dgemma/eval/matched.py), the real-text share and its floors (dgemma/eval/realtext.py), per-prompt figures over
sampling seeds (dgemma/eval/judging.py:prompt_figures)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dgemma.eval.paired import Z95, mean_se, paired_difference, ratio_of_rates, seed_means


def test_paired_difference_is_the_mean_and_se_of_per_prompt_differences():
    a, b = [1.0, 2.0, 3.0, 4.0], [0.5, 2.5, 2.0, 3.0]
    # d = 0.5, -0.5, 1, 1: mean 0.5; deviations 0, -1, 0.5, 0.5 -> variance 1.5 / 3 = 0.5; SE sqrt(0.5) / 2
    d = paired_difference(a, b)
    assert d["mean"] == pytest.approx(0.5) and d["se"] == pytest.approx(math.sqrt(0.5) / 2) and d["n"] == 4
    odd = paired_difference(a, b, [1, 3])  # d = -0.5, 1: mean 0.25, SE = std 1.0607 / sqrt 2 = 0.75
    assert odd["mean"] == pytest.approx(0.25) and odd["se"] == pytest.approx(0.75) and odd["n"] == 2
    # pairing removes what the prompts share: a constant shift has no spread, whatever the prompts' own spread
    assert paired_difference([1.0, 5.0, 9.0], [0.0, 4.0, 8.0]) == {"mean": 1.0, "se": 0.0, "n": 3}
    assert mean_se([1.0, 5.0, 9.0])["se"] == pytest.approx(4 / math.sqrt(3))
    nan = paired_difference([1.0, math.nan, 3.0], [0.0, 0.0, 0.0])  # a prompt without a figure is left out
    assert nan["n"] == 2 and nan["mean"] == 2.0
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([1.0], [1.0, 2.0])


def test_ratio_of_rates_is_paired_by_prompt():
    # diffusion 10 and 30 tokens in 1 s each (20 tok/s), AR 5 in 1 s (5 tok/s): ratio 4; the log ratio's SE is the
    # diffusion rate's relative SE, sqrt((100 + 100) / 2) / 20 = 0.5
    r = ratio_of_rates([10, 30], [1, 1], [5, 5], [1, 1])
    assert r["ratio"] == pytest.approx(4.0) and r["log_se"] == pytest.approx(0.5)
    assert r["ci95"] == pytest.approx([4 * math.exp(-Z95 * 0.5), 4 * math.exp(Z95 * 0.5)])
    # a prompt that is slow for both sides (a burst of load) moves neither the ratio's interval
    shared = ratio_of_rates([10, 10, 10], [1, 3, 2], [5, 5, 5], [1, 3, 2])
    assert shared["ratio"] == pytest.approx(2.0) and shared["log_se"] == pytest.approx(0.0, abs=1e-12)
    # tokens per forward against AR's exactly 1 per pass: the ratio is diffusion's own
    tpf = ratio_of_rates([32, 32], [8, 16], [32, 32], [32, 32])
    assert tpf["ratio"] == pytest.approx(64 / 24)
    sub = ratio_of_rates([10, 30, 99], [1, 1, 1], [5, 5, 1], [1, 1, 1], idx=[0, 1])
    assert sub["ratio"] == pytest.approx(4.0) and sub["n"] == 2
    assert math.isnan(ratio_of_rates([0], [1], [1], [1])["ratio"])


def test_seed_means_average_each_prompt_over_its_seeds():
    assert seed_means([[1.0, math.nan, 2.0], [3.0, 4.0, math.nan]]) == [2.0, 4.0, 2.0]
    assert math.isnan(seed_means([[math.nan], [math.nan]])[0])


# --- the matched-quality rule ---------------------------------------------------------------------------------------

NOISE = [0.01, -0.02, 0.015, -0.005, 0.02, -0.01, 0.005, -0.015]  # 8 prompts: select 0, 2, 4, 6; report 1, 3, 5, 7


def _row(nll, distinct, seconds, passes, report_shift=0.0, **extra):
    """A frontier (or AR) row over 8 prompts: per-prompt judge NLL (`nll` + noise, + `report_shift` on the report
    prompts), per-sample distinct-2, 32 useful tokens each, `seconds` and `passes` per prompt."""
    per = {"nll_per_token": [nll + e + (report_shift if i % 2 else 0.0) for i, e in enumerate(NOISE)],
           "distinct_2_per_sample": [distinct] * 8, "tokens": [32] * 8, "seconds": list(seconds),
           "generated": [32] * 8, "passes": list(passes)}
    return {"per_prompt": per, **extra}


def _diffusion(nll, distinct, seconds, passes, label, report_shift=0.0):
    return _row(nll, distinct, seconds, passes, report_shift, label=label, sampler="entropy-bound",
                max_denoising_steps=8, entropy_bound=0.1)


def test_matched_means_nll_within_one_paired_se_and_distinct_2_at_least_095():
    from dgemma.eval.matched import compare

    ar = _row(6.0, 0.9, [1.0] * 8, [32] * 8, temperature=1.0)
    idx = [0, 2, 4, 6]
    same = compare(_diffusion(6.0, 0.9, [1.0] * 8, [8] * 8, "same"), ar, idx)
    assert same["matched"] and same["nll_difference"]["mean"] == pytest.approx(0.0)
    worse = _diffusion(6.0, 0.9, [1.0] * 8, [8] * 8, "worse")
    worse["per_prompt"]["nll_per_token"] = [x + 0.1 for x in ar["per_prompt"]["nll_per_token"]]
    worse = compare(worse, ar, idx)
    assert not worse["nll_within_se"] and not worse["matched"]  # 0.1 above, far beyond its paired SE
    better = compare(_diffusion(5.0, 0.9, [1.0] * 8, [8] * 8, "better"), ar, idx)
    assert better["matched"]  # a lower NLL is within the rule
    repetitive = compare(_diffusion(5.0, 0.85, [1.0] * 8, [8] * 8, "loops"), ar, idx)
    assert repetitive["nll_within_se"] and repetitive["distinct_2_ratio"] == pytest.approx(0.85 / 0.9)
    assert not repetitive["matched"]  # 0.944x the AR point's distinct-2: below 0.95
    assert compare(_diffusion(5.0, 0.855, [1.0] * 8, [8] * 8, "x"), ar, idx)["matched"]  # 0.95x exactly


def test_verdict_picks_the_fastest_matched_setting_against_its_best_ar_point_and_reports_the_other_half():
    from dgemma.eval.evaluate import verdict

    est = {"mean": 2.0, "se": 0.01}
    lk = {"ar_ce": {"estimate": est}, "nelbo": {"estimate": est}, "x0_ce": {"estimate": est}}
    cold = _row(5.0, 0.5, [1.0, 2.0] * 4, [32] * 8, temperature=0.7)  # best NLL, repetitive
    warm = _row(5.5, 0.9, [1.0, 2.0] * 4, [32] * 8, temperature=0.85)
    hot = _row(6.0, 0.9, [1.0, 2.0] * 4, [32] * 8, temperature=1.0)
    # fast: warm's quality on the selection prompts (so it matches warm and hot, not cold), 1 nat worse on the report
    # prompts; slow: cold's quality, and its repetition (it matches cold only)
    fast = _diffusion(5.5, 0.9, [0.5, 0.5, 0.5, 0.25] * 2, [8, 10] * 4, "fast", report_shift=1.0)
    slow = _diffusion(5.0, 0.5, [4.0] * 8, [33] * 8, "slow")
    v = verdict({"likelihood": lk, "frontier": [fast, slow], "ar_frontier": [hot, cold, warm]})
    # the fastest setting that matches an AR point, against the best-quality AR point it matches
    assert v["speedup_setting"]["label"] == "fast" and v["ar_temperature"] == 0.85 and v["ar_index"] == 2
    assert v["quality_matched"] and v["selection"]["nll_difference"]["mean"] == pytest.approx(0.0)
    report = [1, 3, 5, 7]  # the numbers are the report half's
    seconds = [fast["per_prompt"]["seconds"][i] for i in report]
    want = (32 * 4 / sum(seconds)) / (32 * 4 / (2.0 * 4))
    assert v["speedup"] == pytest.approx(want) and v["speedup_ci95"][0] < want < v["speedup_ci95"][1]
    assert v["tokens_per_forward_ratio"] == pytest.approx(32 * 4 / (10 * 4))  # AR: 1 per pass
    assert v["nll_difference"]["mean"] == pytest.approx(1.0) and v["nll_difference"]["n"] == 4
    assert not v["quality_matched_on_report"] and v["distinct_2_ratio"] == pytest.approx(1.0)
    assert v["prompts_select"] == v["prompts_report"] == 4 and "0.95x" in v["match_rule"]
    # every setting's matched AR point on all prompts (the table): fast is 0.5 worse than warm on average there
    by_label = {m["label"]: m for m in v["matches"]}
    assert by_label["fast"]["ar_temperature"] == 1.0 and by_label["fast"]["matched"]
    assert by_label["slow"]["ar_temperature"] == 0.7 and by_label["slow"]["matched"]
    v = verdict({"likelihood": lk, "frontier": [fast, slow], "ar_frontier": [cold]})
    assert v["speedup_setting"]["label"] == "slow" and v["ar_temperature"] == 0.7 and v["quality_matched"]
    # nothing matches an AR point far better than every setting: said so, and the closest pair reported
    sharp = _row(3.0, 0.9, [1.0] * 8, [32] * 8, temperature=0.5)
    v = verdict({"likelihood": lk, "frontier": [fast, slow], "ar_frontier": [sharp]})
    assert not v["quality_matched"] and v["speedup_setting"]["label"] == "fast"  # slow fails the diversity check
    assert not any(m["matched"] for m in v["matches"])


# --- the real-text share and its floors -----------------------------------------------------------------------------

def test_real_text_counts_characters_so_degenerate_text_fails():
    from dgemma.eval.realtext import real_text_share

    vocab = {"the", "old", "king"}
    assert real_text_share("the old king", vocab) == pytest.approx(10 / 12)
    assert real_text_share("\n\n\n...!!\n", vocab) == 0.0  # line breaks and punctuation: no word at all
    assert real_text_share("the\n\n\n\n\n\n\n\n\n\n", vocab) == pytest.approx(3 / 13)
    assert real_text_share("thx oldd king", vocab) == pytest.approx(4 / 13)
    assert math.isnan(real_text_share("", vocab))


def test_real_text_floors_order_heldout_over_unigram_over_uniform(tiny_data):
    from dgemma.data.shards import TokenDataset
    from dgemma.eval.realtext import floors, vocabulary

    tok = TokenDataset(tiny_data, "val").tokenizer()
    vocab = vocabulary(tiny_data)
    f = floors(tiny_data, tok, vocab, count=16, length=32, seed=0)
    real, unigram, uniform = (f[k]["mean"] for k in ("heldout_text", "unigram_floor", "uniform_floor"))
    assert real > unigram > uniform >= 0 and f["unigram_floor"]["n"] == f["uniform_floor"]["n"] == 16
    assert f["heldout_text"]["n"] == 16 and real > 0.6
    assert floors(tiny_data, tok, vocab, count=16, length=32, seed=0) == f  # seeded


# --- per-prompt figures over seeds ----------------------------------------------------------------------------------

def _run(samples, seconds=None):
    from dgemma.eval.decoding import DecodeRun

    run = DecodeRun("x", [list(s) for s in samples], list(seconds or [1.0] * len(samples)))
    run.prompt_passes, run.prompt_generated = [4] * len(samples), [len(s) for s in samples]
    return run


def test_prompt_figures_average_seeds_first_and_equal_seeds_change_nothing():
    from dgemma.eval.judging import point_stats, prompt_figures, prompt_nlls

    timed = _run([[1, 2, 3, 4]] * 4)
    a = _run([[1, 2, 1, 2], [1, 2, 3, 4], [5, 5, 5, 5], [1, 2, 3, 1]])
    b = _run([[1, 2, 3, 4], [1, 1, 1, 1], [5, 6, 5, 6], [1, 2, 3, 1]])
    nll_a = [(4.0, 4), (8.0, 4), (2.0, 2), (0.0, 0)]
    nll_b = [(8.0, 4), (4.0, 4), (6.0, 2), (3.0, 3)]
    one = prompt_figures(timed, [a], [nll_a], [[0.5, 0.5, 0.5, 0.5]])
    # distinct-2 of each sample alone: [1,2,1,2] has bigrams 12 21 12 -> 2/3
    assert one["distinct_2_per_sample"] == pytest.approx([2 / 3, 1.0, 1 / 3, 1.0])
    assert one["nll_per_token"][:3] == [1.0, 2.0, 1.0] and math.isnan(one["nll_per_token"][3])
    twice = prompt_figures(timed, [a, a], [nll_a, nll_a], [[0.5] * 4] * 2)
    assert twice.keys() == one.keys()
    for key in one:  # the same draw twice: nothing changes
        np.testing.assert_allclose(twice[key], one[key], err_msg=key)
    stats = point_stats(timed, [a], one, prompt_nlls([nll_a]), seed=0, resamples=50)
    again = point_stats(timed, [a, a], twice, prompt_nlls([nll_a, nll_a]), seed=0, resamples=50)
    for half in ("all", "select", "report"):
        for key in ("nll_per_token", "nll_per_token_se", "distinct_2_per_sample", "distinct_2_per_sample_se",
                    "gen_ppl", "gen_ppl_ci95", "tokens_per_second"):
            assert again[half][key] == pytest.approx(stats[half][key], nan_ok=True), (half, key)
    # unlike the pooled figure, which counts a repeated draw as repetition
    assert again["all"]["distinct_2_pooled"] == pytest.approx(stats["all"]["distinct_2_pooled"] / 2)
    two = prompt_figures(timed, [a, b], [nll_a, nll_b], None)
    assert two["nll_per_token"] == pytest.approx([1.5, 1.5, 2.0, 1.0])  # per prompt: the mean of its seeds
    assert two["distinct_2_per_sample"] == pytest.approx([(2 / 3 + 1) / 2, (1 + 1 / 3) / 2, (1 / 3 + 2 / 3) / 2, 1])
    assert "real_text" not in two
    s = point_stats(timed, [a, b], two, prompt_nlls([nll_a, nll_b]), seed=0, resamples=50)["all"]
    assert s["nll_per_token"] == pytest.approx(np.mean([1.5, 1.5, 2.0, 1.0]))
    assert s["nll_per_token_se"] == pytest.approx(np.std([1.5, 1.5, 2.0, 1.0], ddof=1) / 2)  # prompts the unit
    assert s["prompts_scored"] == 4 and s["tokens"] == 4 + 4 + 2 + 0 + 4 + 4 + 2 + 3
