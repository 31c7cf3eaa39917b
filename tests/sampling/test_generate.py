"""The generation loop on tiny random models: what gets committed, determinism, rows finishing independently, the
Lite sampler, stage-then-commit, traces, callbacks, EOS/padding, the switches, bad input and memory.

Parity with transformers lives in test_generate_parity.py; the pure sampler rules in test_sampling.py. The tiny
preset has a 16-token canvas, a 512-token vocabulary and a sliding window of 8, so every run here takes well under
a second. A random model is never confident (mean entropy of a few nats), so unless a test lowers the bar, every
canvas runs the full `max_denoising_steps`.
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dgemma import ConfigError, DiffusionGemma, GenerationConfig, init_weights, preset
from dgemma.model.kv_cache import KVCache
from dgemma.sampling import rules as S
from dgemma.sampling.canvas import StepInfo
from dgemma.sampling.generate import GenerationResult, generate
from dgemma.sampling.sampler import denoise_canvas
from dgemma.sampling.trace import Trace
from tests.helpers import random_ids
from tests.sampling.live_tensors import LiveVocabTensors

L, V = 16, 512  # the tiny preset's canvas and vocabulary
FAST = {"max_denoising_steps": 3}
LOGITS_ATOL = 1e-4  # committing in pieces vs at once changes fp32 rounding (see test_kv_cache.py)


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    return init_weights(DiffusionGemma(preset("tiny")), seed=3, std=0.2)


def _canvas(result: GenerationResult, c: int) -> torch.Tensor:
    lo = result.prompt_length + c * L
    return result.sequences[:, lo:lo + L]


def _last_step(trace: Trace, c: int) -> StepInfo:
    return [s for s in trace.steps if s.canvas == c][-1]


def _prefilled(model: DiffusionGemma, prompt: torch.Tensor, extra: int = L) -> KVCache:
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + extra)
    model.commit(prompt, cache)
    return cache


def _snapshot(cache: KVCache) -> list[torch.Tensor]:
    return [t.clone() for t in (*cache.keys, *cache.values, cache.is_token)]


@pytest.fixture(scope="module")
def two_rows(model) -> GenerationResult:
    """Batch 2, three canvases, traced: shared by the tests that only read a run."""
    return generate(model, random_ids(V, 2, 5), seed=0, max_new_tokens=3 * L, trace=True, **FAST)


# --- what a canvas commits ---------------------------------------------------------------------------------------


def test_default_commit_is_the_argmax_of_the_last_step(two_rows):
    assert two_rows.sequences.shape == (2, 5 + 3 * L)
    assert two_rows.steps_per_canvas == [[3, 3]] * 3  # a random model never stops early at the default threshold
    for c in range(3):
        assert torch.equal(_canvas(two_rows, c), _last_step(two_rows.trace, c).argmax)


def test_generate_commits_what_denoise_canvas_stages(model):
    # generate draws nothing before the first canvas, so a hand-driven denoise_canvas with the same seed stages the
    # same canvas; commit="sample" (the JAX reference) then commits the last accepted/renoised canvas instead.
    prompt = random_ids(V, 2, 5)
    for commit in ("argmax", "sample"):
        config = GenerationConfig(commit=commit, **FAST)
        staged = denoise_canvas(model, _prefilled(model, prompt), config, generator=torch.Generator().manual_seed(4))
        result = generate(model, prompt, generation_config=config, seed=4, max_new_tokens=L)
        assert torch.equal(staged.tokens, staged.argmax if commit == "argmax" else staged.sample)
        assert torch.equal(_canvas(result, 0), staged.tokens)
    # The two really differ: the sampled canvas still holds the uniform noise of the non-accepted positions.
    assert not torch.equal(staged.sample, staged.argmax)


# --- determinism and batches -------------------------------------------------------------------------------------


def test_same_seed_same_tokens_and_generator_equals_seed(model):
    prompt = random_ids(V, 2, 5)
    run = functools.partial(generate, model, prompt, max_new_tokens=2 * L, **FAST)
    a = run(seed=1).sequences
    assert torch.equal(run(seed=1).sequences, a)
    assert not torch.equal(run(seed=2).sequences, a)
    assert torch.equal(run(generator=torch.Generator().manual_seed(1)).sequences, a)
    # No seed: torch's global generator, as transformers uses it (seed it with torch.manual_seed).
    torch.manual_seed(1)
    assert torch.equal(run().sequences, a)


def test_rows_of_a_batch_stop_independently(model, two_rows):
    # Put the confidence bar between the two rows' first-step mean entropies: with stability_threshold=0 the
    # calmer row stops after one step and the other keeps denoising. The first step is the same as in `two_rows`
    # (same seed, same prompt), so which row stops is known in advance.
    first = two_rows.trace.steps[0].mean_entropy
    assert first[0] != first[1]
    calm = int(torch.argmin(first))
    bar = float(first.mean())
    r = generate(model, random_ids(V, 2, 5), seed=0, max_new_tokens=L, trace=True, stability_threshold=0,
                 confidence_threshold=bar, **FAST)
    steps = r.steps_per_canvas[0]
    assert steps[calm] == 1 and steps[1 - calm] > 1
    assert r.stop_reasons[0][calm] == "stable+confident"
    # The stopped row rides along: not active, its argmax (hence its committed canvas) frozen at step 1.
    for info in r.trace.steps[1:]:
        assert not bool(info.active[calm]) and bool(info.done[calm])
        assert torch.equal(info.argmax[calm], r.trace.steps[0].argmax[calm])
        # its logits are frozen too (transformers keeps the stopped row's processed logits), hence its entropy
        assert torch.equal(info.entropy[calm], r.trace.steps[0].entropy[calm])
    assert torch.equal(_canvas(r, 0)[calm], r.trace.steps[0].argmax[calm])
    # tokens_per_forward counts only the passes a row was active for.
    assert r.tokens_per_forward.tolist() == [L / s for s in steps]


def test_stability_zero_and_a_huge_bar_stop_every_row_after_one_step(model):
    r = generate(model, random_ids(V, 2, 5, seed=3), seed=0, max_new_tokens=2 * L, stability_threshold=0,
                 confidence_threshold=1e9, **FAST)
    assert r.steps_per_canvas == [[1, 1], [1, 1]]
    assert r.stop_reasons == [["stable+confident"] * 2] * 2
    assert torch.equal(r.tokens_per_forward, torch.tensor([float(L), float(L)]))


# --- the stop rule inside the loop, with a stub denoiser ---------------------------------------------------------


class _StubDenoiser:
    """Stands in for DiffusionGemma in denoise_canvas: logits = fn(canvas, call number), so that confidence and
    stability can be set by hand."""

    def __init__(self, fn, vocab_size: int = 16, canvas_length: int = 6):
        self.config = preset("tiny").replace(canvas_length=canvas_length, vocab_size=vocab_size)
        self.device, self.dtype, self.fn, self.calls = torch.device("cpu"), torch.float32, fn, 0
        self.self_conditioning: list[torch.Tensor | None] = []  # what each call was given

    def denoise(self, canvas, cache, *, self_conditioning_logits=None, **kwargs):  # sliding prefix etc. ignored
        self.calls += 1
        sc = self_conditioning_logits
        self.self_conditioning.append(None if sc is None else sc.clone())
        return self.fn(canvas, self.calls).float()


def _peaked(tokens: torch.Tensor, vocab_size: int = 16) -> torch.Tensor:
    """Logits whose tempered softmax is one-hot to fp32 precision: entropy ~1e-25, argmax = draw = `tokens`."""
    return 50.0 * torch.nn.functional.one_hot(tokens, vocab_size)


def _stub_run(fn, B: int = 2, **config) -> tuple[_StubDenoiser, object]:
    stub = _StubDenoiser(fn)
    cfg = GenerationConfig(**({"max_denoising_steps": 6, "confidence_threshold": 0.01} | config))
    staged = denoise_canvas(stub, SimpleNamespace(batch_size=B), cfg, generator=torch.Generator().manual_seed(0),
                            trace=True)
    return stub, staged


def test_the_loop_stops_only_when_stable_and_confident():
    fixed = torch.arange(6).repeat(2, 1)
    # confident and stable: step 1 has no history, step 2 repeats it
    stub, staged = _stub_run(lambda x, n: _peaked(fixed))
    assert staged.steps.tolist() == [2, 2] and stub.calls == 2 and staged.stop_reasons == ["stable+confident"] * 2
    # confident, but the argmax alternates every step: never stable
    _, staged = _stub_run(lambda x, n: _peaked((fixed + n) % 16))
    assert staged.steps.tolist() == [6, 6] and staged.stop_reasons == ["max_steps"] * 2
    # stable (token 0 always wins by a hair), but nearly uniform: never confident
    _, staged = _stub_run(lambda x, n: torch.zeros(2, 6, 16).index_fill_(-1, torch.tensor([0]), 0.1))
    assert staged.steps.tolist() == [6, 6]
    # one row of each: rows stop independently
    _, staged = _stub_run(lambda x, n: torch.stack([_peaked(fixed[0]), _peaked((fixed[1] + n) % 16)]))
    assert staged.steps.tolist() == [2, 6]


def test_jax_stop_rule_compares_the_prediction_with_its_input_canvas():
    # An "identity" denoiser predicts its input canvas: the JAX rule (argmax == input canvas) stops at step 1;
    # transformers' rule needs the argmax repeated once, at step 2.
    identity = lambda x, n: _peaked(x)
    _, jax = _stub_run(identity, stop_rule="jax")
    _, hf = _stub_run(identity, stop_rule="hf")
    assert jax.steps.tolist() == [1, 1] and hf.steps.tolist() == [2, 2]
    assert jax.stop_reasons == ["stable+confident"] * 2
    # A soft identity (p(input token) ~ 0.45): the prediction still reproduces the input canvas, while the
    # canvas passed on (accepted draws + noise) does not; the JAX rule looks at the input, so it still stops.
    _, soft = _stub_run(lambda x, n: 2.0 * torch.nn.functional.one_hot(x, 16), stop_rule="jax",
                        confidence_threshold=1e9)
    assert soft.steps.tolist() == [1, 1]
    assert not torch.equal(soft.sample, soft.argmax)


# --- Lite --------------------------------------------------------------------------------------------------------


def test_lite_fixed_schedule_is_bit_identical_to_an_adaptive_run_that_never_triggers(model):
    prompt = random_ids(V, 2, 6, seed=5)
    run = functools.partial(generate, model, prompt, seed=9, max_new_tokens=2 * L, trace=True, sampler="lite",
                            max_denoising_steps=5)
    fixed = run(adaptive=False, confidence_threshold=1e9)  # a bar any step clears: proves entropy is ignored
    never = run(adaptive=True, confidence_threshold=1e-12)  # a bar no random model clears
    assert fixed.steps_per_canvas == never.steps_per_canvas == [[5, 5], [5, 5]]
    assert torch.equal(fixed.sequences, never.sequences)
    for name, array in fixed.trace.arrays().items():
        if name != "seconds":
            assert np.array_equal(array, never.trace.arrays()[name]), name


@pytest.mark.parametrize("stability_steps", [1, 3])
def test_lite_adaptive_stops_after_stability_steps_calm_steps(model, stability_steps):
    r = generate(model, random_ids(V, 2, 6, seed=5), seed=9, max_new_tokens=2 * L, sampler="lite",
                 max_denoising_steps=5,
                 confidence_threshold=1e9, stability_steps=stability_steps)
    assert r.steps_per_canvas == [[stability_steps] * 2] * 2
    assert r.stop_reasons == [["adaptive"] * 2] * 2


def test_lite_frozen_tokens_never_change_and_are_what_a_sample_commit_returns(model):
    r = generate(model, random_ids(V, 2, 6, seed=5), seed=9, max_new_tokens=2 * L, trace=True, sampler="lite",
                 max_denoising_steps=6, commit="sample")
    grew = False
    for c in range(2):
        steps = [s for s in r.trace.steps if s.canvas == c]
        assert not bool(steps[0].accepted.any())  # nothing to compare with at step 1: nothing commits
        for i in range(1, len(steps)):
            before, now = steps[i - 1].accepted, steps[i].accepted
            assert bool((now >= before).all())  # the committed set only grows
            grew |= bool((now & ~before).any())
        for i in range(len(steps) - 1):
            frozen = steps[i].accepted
            for later in steps[i + 1:]:
                # once committed at step i, the position holds the same token in every later input canvas
                assert torch.equal(later.input_canvas[frozen], steps[i + 1].input_canvas[frozen])
        # commit="sample" returns the frozen tokens where committed (seed 003, section 4.2 rule 5)
        frozen = steps[-2].accepted
        assert torch.equal(_canvas(r, c)[frozen], steps[-1].input_canvas[frozen])
    assert grew


def test_lite_ends_uncommitted_positions_on_their_last_draw():
    # Seed 003, 4.2 rule 5: the returned canvas is where(committed, x, draw). A stub makes positions 0-1 change
    # mode every step with a confidence that drops every step (they never commit), position 2 change mode with a
    # rising confidence (it commits at step 2, "stronger"), and positions 3-5 keep one mode (they commit at step
    # 2, "unchanged"). Tempered logits are one-hot with margins of 12-17 nats: every draw is the mode, and the
    # confidences are distinct in fp32. The seed's commit rule (lite_commit="seed"): everything that may commit does.
    N = 6
    modes = lambda n: torch.tensor([(0 + n) % 16, (1 + n) % 16, (2 + n) % 16, 7, 8, 9]).repeat(2, 1)
    margins = lambda n: torch.tensor([18.0 - n, 18.0 - n, 11.0 + n, 15.0, 15.0, 15.0])

    def fn(canvas, n):
        t = S.temperature(N - n + 1, N, 0.4, 0.8)
        return margins(n)[:, None] * t * torch.nn.functional.one_hot(modes(n), 16).float()

    _, staged = _stub_run(fn, sampler="lite", adaptive=False, commit="sample", posterior="tempered",
                          lite_commit="seed")
    assert staged.steps.tolist() == [N, N]
    committed = staged.trace[-1].accepted
    assert committed.tolist() == [[False, False, True, True, True, True]] * 2
    assert torch.equal(staged.trace[1].accepted, committed)  # all of them at step 2
    assert torch.equal(staged.tokens, modes(N).where(~committed, modes(2)))
    assert torch.equal(staged.sample, staged.tokens)


def test_lite_reads_the_raw_posterior_by_default_and_the_tempered_one_on_request():
    # Seed 003, 4.2: confidence = max softmax(logits), untempered. Two steps (T = 0.8, then 0.6); position 0 changes
    # mode with a raw margin of 10 then 9 nats: its raw confidence drops (no commit), its tempered one rises
    # (12.5 -> 15 nats: commits). Positions 1-5 keep one mode and commit at step 2 either way.
    modes = lambda n: torch.tensor([n % 2, 3, 4, 5, 6, 7]).repeat(2, 1)
    margins = lambda n: torch.tensor([11.0 - n, 10.0, 10.0, 10.0, 10.0, 10.0])
    fn = lambda canvas, n: margins(n)[:, None] * torch.nn.functional.one_hot(modes(n), 16).float()
    run = functools.partial(_stub_run, fn, sampler="lite", adaptive=False, max_denoising_steps=2)
    stub, raw = run()
    tempered_stub, tempered = run(posterior="tempered")
    assert raw.trace[-1].accepted[:, 0].tolist() == [False, False]
    assert tempered.trace[-1].accepted[:, 0].tolist() == [True, True]
    assert raw.trace[-1].accepted[:, 1:].all() and tempered.trace[-1].accepted[:, 1:].all()
    # Entropy (traces, the adaptive stop) and the next step's self-conditioning read the same distribution.
    first = fn(None, 1)
    assert torch.allclose(raw.trace[0].entropy, S.token_entropy(first), rtol=1e-6, atol=0)
    assert torch.allclose(tempered.trace[0].entropy, S.token_entropy(first / 0.8), rtol=1e-6, atol=0)
    assert torch.allclose(stub.self_conditioning[1], first, rtol=1e-6, atol=0)
    assert torch.allclose(tempered_stub.self_conditioning[1], first / 0.8, rtol=1e-6, atol=0)
    # The entropy-bound sampler keeps transformers' tempered posterior unless asked.
    assert GenerationConfig().posterior_rule == "tempered" and GenerationConfig(sampler="lite").posterior_rule == "raw"
    assert GenerationConfig(posterior="raw").posterior_rule == "raw"


def test_initial_self_conditioning_is_zeros_as_transformers_or_uniform_as_seed_000(model):
    peaked = lambda canvas, n: _peaked(torch.arange(6).repeat(2, 1))
    stub, _ = _stub_run(peaked, max_denoising_steps=2, confidence_threshold=1e-30)
    assert stub.self_conditioning[0] is None  # transformers: no input, the MLP adds nothing
    stub, _ = _stub_run(peaked, max_denoising_steps=2, confidence_threshold=1e-30, initial_self_conditioning="uniform")
    assert torch.equal(stub.self_conditioning[0], torch.zeros(2, 6, 16))  # all-equal logits: a uniform posterior
    # On a real model the uniform input changes the first step (the mean embedding goes through the MLP).
    cache = _prefilled(model, random_ids(V, 1, 5))
    canvas = random_ids(V, 1, L, seed=3)
    plain = model.denoise(canvas, cache)
    uniform = model.denoise(canvas, cache, self_conditioning_logits=torch.zeros(1, L, V))
    assert not torch.allclose(plain, uniform, atol=1e-3)
    r = generate(model, random_ids(V, 1, 5), seed=1, max_new_tokens=L, initial_self_conditioning="uniform",
                 trace=True, **FAST)
    assert r.trace.summary["generation_config"]["initial_self_conditioning"] == "uniform"


# --- stage, then commit (issue item 5) ---------------------------------------------------------------------------


def test_best_of_k_canvases_at_one_position_then_commit_the_best(model):
    prompt = random_ids(V, 1, 6, seed=2)
    cache = _prefilled(model, prompt)
    before = _snapshot(cache)
    config = GenerationConfig(**FAST)
    candidates = []
    for k in range(3):
        staged = denoise_canvas(model, cache, config, generator=torch.Generator().manual_seed(100 + k), trace=True)
        # Staging never touches the cache: every candidate is denoised against exactly the same context.
        assert cache.length == 6
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(cache), before, strict=True))
        assert torch.equal(staged.mean_entropy, staged.trace[-1].mean_entropy)
        candidates.append(staged)
    assert len({tuple(s.tokens[0].tolist()) for s in candidates}) == 3  # different generators, different canvases
    best = min(candidates, key=lambda s: float(s.mean_entropy[0]))
    model.commit(best.tokens, cache)
    assert cache.length == 6 + L
    fresh = _prefilled(model, torch.cat([prompt, best.tokens], dim=-1), extra=0)
    probe = random_ids(V, 1, L, seed=9)
    torch.testing.assert_close(model.denoise(probe, cache), model.denoise(probe, fresh), atol=LOGITS_ATOL, rtol=0)
    # Changing one's mind: committing another candidate at the same start overwrites the first one.
    other = next(s for s in candidates if s is not best)
    model.commit(other.tokens, cache, start=6)
    assert cache.length == 6 + L
    fresh = _prefilled(model, torch.cat([prompt, other.tokens], dim=-1), extra=0)
    torch.testing.assert_close(model.denoise(probe, cache), model.denoise(probe, fresh), atol=LOGITS_ATOL, rtol=0)


def test_commit_only_the_confident_prefix_of_a_canvas(model):
    prompt = random_ids(V, 1, 6, seed=2)
    cache = _prefilled(model, prompt)
    staged = denoise_canvas(model, cache, GenerationConfig(**FAST), generator=torch.Generator().manual_seed(0),
                            trace=True)
    entropy = staged.trace[-1].entropy[0]
    # A bar at least the first position's entropy, so that the prefix is never empty.
    bar = max(float(entropy.median()), float(entropy[0]))
    above = (entropy > bar).nonzero().flatten()
    j = int(above[0]) if above.numel() else L
    assert 1 <= j <= L
    model.commit(staged.tokens[:, :j], cache)
    assert cache.length == 6 + j
    fresh = _prefilled(model, torch.cat([prompt, staged.tokens[:, :j]], dim=-1), extra=0)
    probe = random_ids(V, 1, L, seed=9)
    torch.testing.assert_close(model.denoise(probe, cache), model.denoise(probe, fresh), atol=LOGITS_ATOL, rtol=0)
    # The next canvas then starts right after the prefix: generate continues from this cache.
    r = generate(model, torch.empty(1, 0, dtype=torch.long), cache=cache, seed=0, max_new_tokens=L, **FAST)
    assert r.sequences.shape == (1, L) and r.cache.length == 6 + j


# --- traces and callbacks ----------------------------------------------------------------------------------------


def test_trace_arrays_have_consistent_shapes_and_save_without_vocabulary_tensors(two_rows, tmp_path):
    trace = two_rows.trace
    total = sum(max(steps) for steps in two_rows.steps_per_canvas)
    arrays = trace.arrays()
    assert len(trace.steps) == total == 9
    for name in ("input_canvas", "argmax", "accepted", "entropy"):
        assert arrays[name].shape == (total, 2, L), name
    for name in ("mean_entropy", "done", "active"):
        assert arrays[name].shape == (total, 2), name
    for name in ("canvas", "step", "temperature", "seconds"):
        assert arrays[name].shape == (total,), name
    assert arrays["canvas"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and arrays["step"].tolist() == [1, 2, 3] * 3
    assert arrays["temperature"].tolist() == [float(S.temperature(n, 3, 0.4, 0.8)) for n in (3, 2, 1)] * 3
    assert (arrays["entropy"] >= 0).all() and (arrays["seconds"] >= 0).all()
    np.testing.assert_allclose(arrays["entropy"].astype(np.float32).mean(-1), arrays["mean_entropy"], atol=1e-2)
    assert (arrays["accepted"].sum(-1) >= 1).all()  # at least one accepted position per row and step

    npz, js = trace.save(tmp_path / "t")
    assert (npz.name, js.name) == ("t.npz", "t.json")
    with np.load(npz) as saved:
        assert set(saved.files) == set(arrays)
        for name in saved.files:
            assert np.array_equal(saved[name], arrays[name]), name
            assert V not in saved[name].shape  # small enough to keep: no full-vocabulary tensor
    summary = json.loads(js.read_text())
    assert summary["steps_per_canvas"] == two_rows.steps_per_canvas
    assert summary["stop_reasons"] == two_rows.stop_reasons
    assert summary["batch_size"] == 2 and summary["canvas_length"] == L and summary["num_canvases"] == 3


def test_on_step_and_on_canvas_are_called_once_per_step_and_canvas(model, two_rows):
    steps, canvases = [], []
    r = generate(model, random_ids(V, 2, 5), seed=0, max_new_tokens=3 * L, **FAST,
                 on_step=lambda info: steps.append((info.canvas, info.step, info.num_steps)),
                 on_canvas=lambda c, tokens: canvases.append((c, tokens.clone())))
    assert steps == [(c, s, 3) for c in range(3) for s in (1, 2, 3)]
    assert [c for c, _ in canvases] == [0, 1, 2]
    for c, tokens in canvases:
        assert torch.equal(tokens, _canvas(r, c))
    assert torch.equal(r.sequences, two_rows.sequences)  # observing a run does not change it


# --- EOS and padding ---------------------------------------------------------------------------------------------


def _eos_setup(two_rows) -> tuple[int, int, int]:
    """An EOS id that row 0's first canvas produces at 0 < p < L - 1 and row 1's first canvas never does, and a
    pad id absent from the whole run, found from the EOS-free run `two_rows` (EOS changes nothing before it)."""
    first = _canvas(two_rows, 0)
    for p, tok in enumerate(first[0].tolist()):
        if 0 < p < L - 1 and tok not in first[0, :p].tolist() and tok not in first[1].tolist():
            break
    else:
        pytest.fail("no usable EOS candidate in the first canvas")
    used = set(two_rows.sequences.flatten().tolist())
    pad = next(t for t in range(V) if t not in used)
    return tok, p, pad


def test_eos_pads_the_rest_of_its_canvas_and_every_later_canvas_of_that_row(model, two_rows):
    eos, p, pad = _eos_setup(two_rows)
    r = generate(model, random_ids(V, 2, 5), seed=0, max_new_tokens=3 * L, trace=True, eos_token_id=eos,
                 pad_token_id=pad,
                 **FAST)
    first = _canvas(two_rows, 0)
    assert r.sequences.shape == (2, 5 + 3 * L)  # row 1 goes on, so every canvas is generated
    assert _canvas(r, 0)[0].tolist() == first[0, :p + 1].tolist() + [pad] * (L - p - 1)
    assert torch.equal(_canvas(r, 0)[1], first[1])
    for c in (1, 2):
        assert (_canvas(r, c)[0] == pad).all()  # the finished row only pads
        assert r.stop_reasons[c][0] == "finished"
    assert not bool((_canvas(r, 1)[1] == pad).all())  # the other row really continued
    # new_tokens: up to and including the first EOS; row 1 has no EOS in this run, hence every token.
    new = r.new_tokens()
    assert new[0] == first[0, :p + 1].tolist() and new[0][-1] == eos
    row1 = r.sequences[1, 5:].tolist()
    assert new[1] == (row1[:row1.index(eos) + 1] if eos in row1 else row1)
    # tokens_per_forward: useful (non-pad) tokens over the passes a row was active for.
    active = r.trace.arrays()["active"].sum(0)
    useful = (r.sequences[:, 5:] != pad).sum(-1)
    assert active[0] == 3  # row 0 spent only its first canvas's three steps
    assert r.tokens_per_forward.tolist() == pytest.approx((useful / torch.from_numpy(active)).tolist())
    assert r.tokens_per_forward[0] == pytest.approx((p + 1) / 3)


def test_generation_ends_when_every_row_has_seen_an_eos(model, two_rows):
    first = _canvas(two_rows, 0)
    eos = (int(first[0, 3]), int(first[1, 7]))
    r = generate(model, random_ids(V, 2, 5), seed=0, max_new_tokens=3 * L, eos_token_id=eos, **FAST)
    assert r.sequences.shape == (2, 5 + L) and len(r.steps_per_canvas) == 1
    # Without a pad id nothing is overwritten (as transformers): the canvas is kept as generated.
    assert torch.equal(_canvas(r, 0), first)


def test_everything_after_the_first_eos_is_padding_even_a_second_eos(model, two_rows):
    first = _canvas(two_rows, 0)
    eos = {int(first[0, 3]), int(first[0, 10]), int(first[1, 7])}  # row 0 holds an EOS at 3 and another at 10
    pad = next(t for t in range(V) if t not in set(two_rows.sequences.flatten().tolist()))
    r = generate(model, random_ids(V, 2, 5), seed=0, max_new_tokens=3 * L, eos_token_id=tuple(eos), pad_token_id=pad,
                 **FAST)
    for b in range(2):
        row = first[b].tolist()
        cut = next(i for i, t in enumerate(row) if t in eos)
        assert _canvas(r, 0)[b].tolist() == row[:cut + 1] + [pad] * (L - cut - 1)
    assert _canvas(r, 0)[0, 10] == pad


# --- the switches ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("context", "same"), [(5, True), (7, True), (8, False), (12, False)])
def test_jax_sliding_prefix_differs_only_once_the_context_exceeds_the_window(model, context, same):
    # transformers lets a canvas see the last sliding_window - 1 = 7 committed tokens in sliding layers, JAX the
    # last 8: the same keys while the context has at most 7 tokens.
    cache = _prefilled(model, random_ids(V, 2, context, seed=context))
    canvas = random_ids(V, 2, L, seed=1)
    hf = model.denoise(canvas, cache)
    jax = model.denoise(canvas, cache, sliding_prefix=model.config.sliding_window)
    assert torch.equal(hf, jax) is same


def test_sliding_prefix_switch_reaches_generate(model):
    run = functools.partial(generate, model, random_ids(V, 1, 5), seed=0, max_new_tokens=2 * L, trace=True, **FAST)
    hf, jax = run(), run(sliding_prefix="jax")
    entropy = lambda r, c: torch.stack([s.entropy for s in r.trace.steps if s.canvas == c])
    assert torch.equal(entropy(hf, 0), entropy(jax, 0))  # 5 context tokens: inside both windows
    assert not torch.equal(entropy(hf, 1), entropy(jax, 1))  # 5 + 16 context tokens: the windows differ


def test_truncate_cuts_to_max_new_tokens(model):
    run = functools.partial(generate, model, random_ids(V, 2, 5), seed=0, max_new_tokens=L + 4, **FAST)
    whole, cut = run(), run(truncate=True)
    assert whole.sequences.shape == (2, 5 + 2 * L)  # transformers keeps whole canvases
    assert cut.sequences.shape == (2, 5 + L + 4)
    assert torch.equal(cut.sequences, whole.sequences[:, :5 + L + 4])


def test_truncate_counts_only_the_kept_tokens_per_forward(model):
    r = generate(model, random_ids(V, 1, 5), seed=0, max_new_tokens=4, max_denoising_steps=2, truncate=True)
    assert r.sequences.shape == (1, 5 + 4)
    assert r.tokens_per_forward.tolist() == [4 / 2]  # 4 kept tokens over 2 denoising passes


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"entropy_bound": 0.0}, ConfigError, r"entropy_bound: must be a number > 0"),
    ({"entropy_bound": -0.1}, ConfigError, r"entropy_bound: must be a number > 0"),
    ({"t_max": 0.3}, ConfigError, r"t_max: must be >= t_min=0.4"),
    ({"t_min": 0.9}, ConfigError, r"t_max: must be >= t_min=0.9"),
    ({"sampler": "foo"}, ConfigError,
     r"sampler: must be one of 'entropy-bound', 'lite', 'ancestral', 'predictor-corrector', 'block-refinement', "
     r"'confidence', got 'foo'"),
    ({"temprature": 0.5}, ConfigError, r"unknown generation setting\(s\) temprature; valid: .*t_max"),
    ({"eos_token_id": V}, ValueError, r"eos_token_id \[512\] outside the vocabulary"),
    ({"pad_token_id": V}, ValueError, r"pad_token_id=512 is outside the vocabulary"),
])
def test_bad_settings_get_a_clear_error(model, kwargs, error, message):
    with pytest.raises(error, match=message):
        generate(model, random_ids(V, 1, 5), **kwargs)


@pytest.mark.parametrize(("input_ids", "message"), [
    (torch.empty(1, 0, dtype=torch.long), r"empty prompt"),
    (torch.tensor([[1, 2, V]]), r"input_ids must lie in \[0, vocab_size=512\), got values in \[1, 512\]"),
    (torch.tensor([[-1, 2]]), r"input_ids must lie in \[0, vocab_size=512\)"),
    (torch.tensor([1, 2, 3]), r"input_ids must be an integer tensor of shape \(batch, length\)"),
    (torch.tensor([[1.0, 2.0]]), r"input_ids must be an integer tensor"),
])
def test_bad_prompts_get_a_clear_error(model, input_ids, message):
    with pytest.raises(ValueError, match=message):
        generate(model, input_ids)


@pytest.mark.parametrize("prompt_length", [30, 50])
def test_prompt_that_does_not_fit_the_context_gets_a_clear_error(prompt_length):
    # 40 positions: a 30-token prompt leaves no room for a 16-token canvas, a 50-token one does not even fit.
    small = DiffusionGemma(preset("tiny").replace(max_position_embeddings=40))
    with pytest.raises(ValueError, match=r"exceed the model's context \(max_position_embeddings=40\)"):
        generate(small, random_ids(V, 1, prompt_length))


# --- memory (issue item 7) ---------------------------------------------------------------------------------------


def test_entropy_chunking_does_not_change_a_single_bit(model, monkeypatch, two_rows):
    # Entropy is computed in row chunks so that only a chunk of (rows, V) fp32 temporaries is alive at a time. One
    # row per chunk is the extreme: the run must be bit-identical to the default chunking (one chunk here).
    monkeypatch.setattr(S, "token_entropy", functools.partial(S.token_entropy, chunk_rows=1))
    r = generate(model, random_ids(V, 2, 5), seed=0, max_new_tokens=3 * L, trace=True, **FAST)
    assert torch.equal(r.sequences, two_rows.sequences)
    assert np.array_equal(r.trace.arrays()["entropy"], two_rows.trace.arrays()["entropy"])
    assert np.array_equal(r.trace.arrays()["mean_entropy"], two_rows.trace.arrays()["mean_entropy"])




@pytest.mark.parametrize("sampler", ["entropy-bound", "lite"])
def test_a_step_holds_at_most_one_vocabulary_tensor_beyond_the_logits(model, sampler):
    # Issue item 7: per step, at most one fp32 (B, L, V) tensor beyond the logits (entropy chunks count by size).
    # The previous step's logits are freed once denoise has read them; entropy runs in place on half-size chunks.
    B = 2
    cache = _prefilled(model, random_ids(V, B, 5))
    existing = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), *cache.keys,
                                                          *cache.values, cache.is_token)}
    full = B * L * V * 4  # one fp32 (B, L, V) tensor
    with LiveVocabTensors(V, exclude=existing) as mode:
        denoise_canvas(model, cache, GenerationConfig(sampler=sampler, **FAST), generator=torch.Generator())
    assert mode.peak / full <= 2.0, f"peak {mode.peak / full:.2f} x (B, L, V) fp32"


def test_generation_result_counts_canvases_like_transformers(two_rows):
    # steps_per_canvas is [canvas][row]; sequences hold the prompt and whole canvases.
    assert len(two_rows.steps_per_canvas) == 3 and all(len(c) == 2 for c in two_rows.steps_per_canvas)
    assert two_rows.prompt_length == 5
    assert two_rows.cache.length == 5 + 2 * L  # the last canvas is left uncommitted, as in transformers
    assert two_rows.tokens_per_forward.tolist() == pytest.approx([L / 3] * 2)  # 3 canvases of 16 over 9 passes
