"""Each fast path in dgemma/kernels.py against its readable twin (fp32, CPU): attention and its masks, the sorted
MoE dispatch, the static denoise step (and that torch.compile takes it whole), the fused sampler statistics and
draws, the sync-free sampler loop's decisions, and `dgemma bench` as an in-process smoke test. No timing asserts."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dgemma import kernels, sampling
from dgemma.bench import randomize_
from dgemma.cli import main
from dgemma.config import FULL, SLIDING, GenerationConfig, RopeConfig, preset
from dgemma.generate import denoise_canvas, generate
from dgemma.model import DiffusionGemma, Experts, reference_attention
from tests.helpers import random_ids
from tests.live_tensors import LiveVocabTensors

TOL = 1e-4  # fp32 logits, fast vs readable

GEOMETRIES = {
    "tiny": preset("tiny"),
    # like tests/hf_reference.py's "k8-of-16": 16 experts top-8, six layers in the default 5:1 pattern, other RoPE
    "k8-of-16": preset("tiny").replace(
        num_experts=16, top_k_experts=8, num_hidden_layers=6, layer_types=(),
        sliding_rope=RopeConfig("default", 5_000.0), full_rope=RopeConfig("proportional", 200_000.0, 0.5)),
}


def _model(name: str, seed: int = 0) -> DiffusionGemma:
    return randomize_(DiffusionGemma(GEOMETRIES[name]), seed).eval()


# --- attention and masks ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive-with-empty-row"])
def test_attention_matches_reference_attention(kind):
    g = torch.Generator().manual_seed(0)
    B, H, K, S, Dh = 2, 4, 2, 5, 8
    T = S if kind == "causal" else 9
    q, k, v = (torch.randn(B, n, t, Dh, generator=g) for n, t in ((H, S), (K, T), (K, T)))
    allowed = torch.rand(B, 1, S, T, generator=g) > 0.3
    allowed[..., -1] = True
    if kind == "none":
        mask, dense = None, None
    elif kind == "causal":
        mask, dense = "causal", torch.ones(S, T, dtype=torch.bool).tril()[None, None]
    elif kind == "bool":
        mask, dense = allowed, allowed
    else:
        allowed[0, 0, 1] = False  # a padding query that sees nothing: the reference averages every value
        mask, dense = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min), allowed
    torch.testing.assert_close(kernels.attention(q, k, v, mask), reference_attention(q, k, v, dense),
                               atol=1e-5, rtol=0)


def _dense(mask: kernels.Mask, shape: tuple[int, int, int]) -> torch.Tensor:
    B, S, T = shape
    if mask is None:
        return torch.ones(B, 1, S, T, dtype=torch.bool)
    if isinstance(mask, str):
        return torch.ones(S, T, dtype=torch.bool).tril().expand(B, 1, S, T)
    if mask.dtype != torch.bool:
        mask = mask == 0
    return mask.expand(B, 1, S, T)


@pytest.mark.parametrize("padding", [False, True])
def test_fast_masks_equal_kv_cache_masks(padding):
    config = preset("tiny")
    model = DiffusionGemma(config)
    cache = model.new_cache(2, 64)
    W, L = config.sliding_window, config.canvas_length
    prompt = random_ids(config.vocab_size, 2, 11, seed=0)
    attention_mask = torch.ones_like(prompt)
    if padding:
        attention_mask[0, :4] = 0
    for start, S, keep in ((0, 11, attention_mask), (11, L, None), (0, 5, None)):  # prefill, a canvas, a short one
        if start == 0:
            cache = model.new_cache(2, 64)
        cache.prepare_write(random_ids(config.vocab_size, 2, S, seed=1), start, keep if padding else None)
        new_keep = cache.key_padding[:, start:start + S]
        fast = kernels.commit_masks(cache, start, S, W, torch.float32, new_keep)
        for kind, prefix, window in ((FULL, None, None), (SLIDING, W - 1, W)):
            ref = cache.mask(start, S, prefix=prefix, causal=True, window=window, new_keep=new_keep)
            T = S + start - cache.visible_start(start, prefix)
            assert torch.equal(_dense(fast[kind], (2, S, T)), _dense(ref, (2, S, T))), (start, kind)
            if not padding:
                assert fast[kind] is None or isinstance(fast[kind], str) or fast[kind].shape[0] == 1
        cache.finish_write(start + S)
        prefixes = {FULL: None, SLIDING: W - 1}
        fast = kernels.denoise_masks(cache, start + S, L, prefixes)
        for kind, prefix in prefixes.items():
            ref = cache.mask(start + S, L, prefix=prefix, causal=False)
            T = L + start + S - cache.visible_start(start + S, prefix)
            assert torch.equal(_dense(fast[kind], (2, L, T)), _dense(ref, (2, L, T)))
            assert (fast[kind] is None) == (not cache.has_padding)  # no mask tensor at all without padding


# --- routed experts -------------------------------------------------------------------------------------------------

def _routing(N: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(N, E, generator=g) * 2, -1)
    weights, experts = probs.topk(k, -1)
    return weights / weights.sum(-1, keepdim=True), experts


BACKENDS = ["loop", "auto"] + (["grouped"] if hasattr(F, "grouped_mm") else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E, k", [(8, 2), (16, 8), (32, 4)])
def test_moe_dispatch_matches_reference_experts(E, k, backend):
    config = preset("tiny").replace(num_experts=E, top_k_experts=k)
    experts = randomize_(Experts(config), seed=E)
    N = 37  # some experts get no token at all with E=32
    x = torch.randn(N, config.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, ids = _routing(N, E, k, seed=2)
    with torch.no_grad():
        want = experts(x, weights, ids)
        got = kernels.moe_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_moe_dispatch_gradients_match_reference():
    """Training runs the fast path: its gradients must be the loop's (the grouped kernel is inference-only)."""
    config = preset("tiny")
    weights, ids = _routing(23, config.num_experts, config.top_k_experts, seed=3)
    grads = []
    for impl in ("reference", "fast"):
        experts = randomize_(Experts(config), seed=0)
        x = torch.randn(23, config.hidden_size, generator=torch.Generator().manual_seed(4), requires_grad=True)
        w = weights.clone().requires_grad_()
        (experts(x, w, ids, impl).square().sum()).backward()
        grads.append([x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


# --- the model forward ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_fast_logits_match_reference(geometry, padding):
    """commit (prefill, then a canvas past the window) and denoise (with and without self-conditioning), and the
    encoder's own logits: the fast path within 1e-4 of the readable one."""
    model = _model(geometry)
    V, L = model.config.vocab_size, model.config.canvas_length
    prompt, canvas, second = random_ids(V, 2, 11, seed=5), random_ids(V, 2, L, seed=6), random_ids(V, 2, L, seed=7)
    mask = torch.ones_like(prompt)
    if padding:
        mask[0, :5] = 0
    sc = torch.randn(2, L, V, generator=torch.Generator().manual_seed(8)) * 4
    out = {}
    for impl in ("reference", "fast"):
        model.impl = impl
        cache = model.new_cache(2, 11 + L)
        enc = model.commit(prompt, cache, attention_mask=mask, return_logits=True)
        first, conditioned = model.denoise(canvas, cache), model.denoise(canvas, cache, self_conditioning_logits=sc)
        enc2 = model.commit(second, cache, return_logits=True)
        out[impl] = [enc[mask.bool()], first, conditioned, enc2, model.denoise(canvas, cache)]
    for got, want in zip(out["fast"], out["reference"], strict=True):
        assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_denoise_step_matches_denoise(static, padding):
    model = _model("k8-of-16")
    V, L = model.config.vocab_size, model.config.canvas_length
    mask = torch.ones(2, 11, dtype=torch.long)
    if padding:
        mask[1, :3] = 0
    cache = model.new_cache(2, 11 + 2 * L)  # spare slots: the static step must mask them
    model.commit(random_ids(V, 2, 11, seed=9), cache, attention_mask=mask)
    canvas = random_ids(V, 2, L, seed=10)
    sc = torch.randn(2, L, V, generator=torch.Generator().manual_seed(11)) * 4
    step = kernels.DenoiseStep(model, cache, static=static)
    for _ in range(2):  # before and after a second commit (the sliding window then cuts into the context)
        want = model.denoise(canvas, cache, self_conditioning_logits=sc)
        got = model.logits(step(canvas, model.soft_embedding(sc)))
        assert (got - want).abs().max() <= TOL
        assert (model.logits(step(canvas)) - model.denoise(canvas, cache)).abs().max() <= TOL
        model.commit(canvas, cache)


def test_denoise_step_compiles_whole():
    """torch.compile(fullgraph=True) takes the static step in one graph (traced by aot_eager: seconds, not minutes),
    and a new canvas position reuses it (the committed length is a device scalar, not a guard)."""
    if not hasattr(torch, "compile"):
        pytest.skip("no torch.compile")
    torch._dynamo.reset()
    model = randomize_(DiffusionGemma(preset("tiny").replace(num_hidden_layers=2, layer_types=(SLIDING, FULL),
                                                             num_experts=4)), 0).eval()
    V, L = model.config.vocab_size, model.config.canvas_length
    cache = model.new_cache(1, 11 + L)
    model.commit(random_ids(V, 1, 11, seed=12), cache)
    step = kernels.DenoiseStep(model, cache, compile="aot_eager")
    canvas = random_ids(V, 1, L, seed=13)
    assert (model.logits(step(canvas)) - model.denoise(canvas, cache)).abs().max() <= TOL
    model.commit(canvas, cache)
    counters = torch._dynamo.utils.counters
    before = sum(counters["stats"].values())
    assert (model.logits(step(canvas)) - model.denoise(canvas, cache)).abs().max() <= TOL
    assert sum(counters["stats"].values()) == before or counters["stats"]["unique_graphs"] <= 1


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DGEMMA_TEST_INDUCTOR"), reason="inductor codegen takes minutes on 2 cores; "
                    "set DGEMMA_TEST_INDUCTOR=1")
def test_denoise_step_compiles_with_inductor():
    model = _model("tiny")
    V, L = model.config.vocab_size, model.config.canvas_length
    cache = model.new_cache(1, 11 + L)
    model.commit(random_ids(V, 1, 11, seed=12), cache)
    try:
        step = kernels.DenoiseStep(model, cache, compile=True)
        got = model.logits(step(random_ids(V, 1, L, seed=13)))
    except Exception as e:  # no C++ toolchain for inductor: not this code's failure
        if "compiler" in str(e).lower() or "InductorError" in type(e).__name__:
            pytest.skip(f"inductor unavailable: {e}")
        raise
    assert (got - model.denoise(random_ids(V, 1, L, seed=13), cache)).abs().max() <= TOL


# --- sampling -------------------------------------------------------------------------------------------------------

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
    truth = sampling.token_entropy(z.double())
    assert ((entropy.double() - truth).abs() <= 1e-6 + 1e-6 * truth).all()  # nearer fp64 than the fp32 reference
    assert (entropy - sampling.token_entropy(z)).abs().max() < 1e-5  # which is within 6e-6 of it here


def test_logits_into_matches_model_logits():
    model = _model("tiny")
    h = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(14)) * 3
    torch.testing.assert_close(kernels.logits_into(model, h), model.logits(h), atol=2e-5, rtol=0)
    assert torch.equal(kernels.logits_into(model, h, torch.empty(7, model.config.vocab_size)),
                       kernels.logits_into(model, h))


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
    model = _model("tiny")
    B, L, V, D = 2, 16, model.config.vocab_size, model.config.hidden_size
    final = torch.randn(B, L, D, generator=torch.Generator().manual_seed(16)) * 2
    temp = sampling.temperature(5, 12, 0.4, 0.8)
    z = model.logits(final).div_(temp)
    results = []
    for chunk, ws in ((None, None), (5, None), (7, kernels.Workspace(7, V, torch.device("cpu")))):
        g = torch.Generator().manual_seed(17)
        out = kernels.head_and_sample(final, lambda rows, o: kernels.logits_into(model, rows, o), temp, generator=g,
                                      embed=model.embed_tokens.weight, embed_scale=D**0.5, chunk_rows=chunk,
                                      workspace=ws)
        results.append(out)
        assert torch.equal(out.argmax, z.argmax(-1))
        torch.testing.assert_close(out.entropy, sampling.token_entropy(z), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.soft, model.soft_embedding(z), atol=1e-4, rtol=1e-5)
    for other in results[1:]:  # the same uniforms whatever the chunking
        assert torch.equal(other.draw, results[0].draw)


class _Scripted:
    """Stands in for the model in both sampler loops: pass i returns scripted logits (N, B, L, V)[i], whatever the
    canvas, so that both samplers see the same logits and their decisions can be compared one for one."""

    def __init__(self, script: torch.Tensor):
        self.script, self.calls = script, 0
        L, V = script.shape[2:]
        self.config = SimpleNamespace(canvas_length=L, vocab_size=V, sliding_window=4, time_embedding=False,
                                      hidden_size=3)
        self.embed_tokens = torch.nn.Embedding(V, 3)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def next(self) -> torch.Tensor:
        self.calls += 1
        return self.script[self.calls - 1].clone()

    def denoise(self, canvas: torch.Tensor, cache: object, **_: object) -> torch.Tensor:
        return self.next()


def _script(N: int, B: int, L: int, V: int) -> torch.Tensor:
    """Moderate logits with a spread of entropies; row b turns confident (near one-hot, stable) at step 3 + 3b."""
    g = torch.Generator().manual_seed(18)
    script = torch.randn(N, B, L, V, generator=g) * torch.linspace(0.5, 6.0, L)[:, None]
    target = torch.randint(0, V, (B, L), generator=g)
    for b in range(B):
        script[2 + 3 * b:, b] = 40.0 * F.one_hot(target[b], V)
    return script


@pytest.mark.parametrize("stop_rule", ["hf", "jax"])
@pytest.mark.parametrize("sync_every", [1, 3])
def test_fast_sampler_takes_the_reference_decisions(stop_rule, sync_every):
    N, B, L, V = 12, 3, 6, 16
    script = _script(N, B, L, V)
    config = GenerationConfig(max_denoising_steps=N, stop_rule=stop_rule)
    finished = torch.tensor([False, False, True])  # a row whose sequence already ended rides along uncounted
    cache = SimpleNamespace(batch_size=B)
    records: dict[str, list] = {"reference": [], "fast": []}
    ref_model, fast_model = _Scripted(script), _Scripted(script)
    want = denoise_canvas(ref_model, cache, config, generator=torch.Generator().manual_seed(0), finished=finished,
                          on_step=records["reference"].append)
    got = kernels.denoise_canvas(fast_model, cache, config, generator=torch.Generator().manual_seed(1),
                                 finished=finished, on_step=records["fast"].append, sync_every=sync_every,
                                 step=lambda x, soft, t: fast_model.next(),
                                 head=lambda rows, out: rows.clone() if out is None else out.copy_(rows))
    ref, fast = records["reference"], records["fast"]
    assert len(ref) < N and len(fast) >= len(ref)  # every row stopped early; the fast loop may notice later
    for a, b in zip(ref, fast, strict=False):
        assert torch.equal(a.accepted, b.accepted), a.step
        assert torch.equal(a.argmax, b.argmax), a.step
        assert torch.equal(a.done, b.done), a.step
        assert torch.equal(a.active, b.active), a.step
        assert a.temperature == b.temperature
        torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=1e-5)
    for name in ("steps", "passes", "tokens", "argmax"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.stop_reasons == want.stop_reasons
    assert want.steps.tolist() == [4, 7, 10]  # the script makes row b confident and stable from step 3 + 3b




@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_fast_sampler_memory_is_two_chunks_of_logits(chunk_rows):
    """The fast loop never holds (B, L, V) logits from one step to the next: per step, a chunk of logits and one of
    probabilities (the workspace), so memory is bounded by the chunk, not by the batch."""
    model = _model("tiny")
    B, L, V = 2, model.config.canvas_length, model.config.vocab_size
    cache = model.new_cache(B, 11)
    model.commit(random_ids(V, B, 11, seed=20), cache)
    rows = chunk_rows or B * L
    with LiveVocabTensors(V, {p.untyped_storage().data_ptr() for p in model.parameters()}) as mode:
        kernels.denoise_canvas(model, cache, GenerationConfig(max_denoising_steps=3), chunk_rows=chunk_rows,
                               generator=torch.Generator().manual_seed(0))
    assert mode.peak <= 2 * rows * V * 4, f"peak {mode.peak / (rows * V * 4):.2f} chunks"


# --- generate and bench -----------------------------------------------------------------------------------------------

def test_generate_fast_runs_and_restores_the_model_impl():
    model = _model("tiny")
    prompt = random_ids(500, 2, 11, seed=19)
    a = generate(model, prompt, seed=0, impl="fast", max_new_tokens=32, max_denoising_steps=3, trace=True)
    b = generate(model, prompt, seed=0, impl="fast", max_new_tokens=32, max_denoising_steps=3)
    assert model.impl == "reference"
    assert torch.equal(a.sequences, b.sequences)  # seeded: reproducible
    assert a.sequences.shape == (2, 11 + 32) and a.trace is not None and len(a.trace.steps) == 6
    ref = generate(model, prompt, seed=0, max_new_tokens=32, max_denoising_steps=3)
    assert a.steps_per_canvas == ref.steps_per_canvas and torch.equal(a.tokens_per_forward, ref.tokens_per_forward)
    with pytest.raises(ValueError, match="compile"):
        generate(model, prompt, compile=True)


def test_bench_cli_smoke(capsys):
    assert main(["bench", "--preset", "tiny", "--steps", "2", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for impl in ("reference", "fast"):
        r = report["generation"]["results"][impl]
        for field in ("tokens_per_second", "tokens_per_forward", "ms_per_denoise_step", "ms_per_commit",
                      "ms_prefill", "ms_to_first_canvas", "peak_memory_bytes"):
            assert r[field] is not None and r[field] > 0, (impl, field)
        assert r["generated_tokens"] == 2 * 16 and r["denoising_passes"] == 2 * 2
        t = report["training"]["results"][impl]
        assert t["clean-context"]["mfu"] > 0 and t["ar"]["tokens_per_second"] > 0
    assert report["generation"]["ratios"]["fast/reference"] > 0
    assert report["peak"]["matmul_flops_per_second"] > 0 and report["peak"]["copy_bytes_per_second"] > 0
    assert report["generation"]["bounds"]["denoise_step"]["ms_bound"] > 0
    assert report["commit"] and report["machine"]["cores"]


def test_bench_refuses_the_26b_geometry_on_cpu(capsys):
    assert main(["bench", "--preset", "diffusiongemma-26b-a4b"]) == 2
    assert "GB" in capsys.readouterr().err
