"""Each kernel in dgemma/kernels.py against its readable twin (fp32, CPU): the sorted MoE dispatch, the fast model
forward as a whole, the fused sampler statistics and draws, and `dgemma bench` as an in-process smoke test. The
attention kernels: tests/test_attention.py; the fast sampler loop: tests/test_fast_sampler.py. No timing asserts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dgemma import kernels, sampling
from dgemma.cli import main
from dgemma.config import preset
from dgemma.model import Experts
from dgemma.testing.hf import randomize_
from tests.helpers import GEOMETRY_NAMES, random_ids, random_model

TOL = 1e-4  # fp32 logits, fast vs readable


# --- routed experts -------------------------------------------------------------------------------------------------

def _routing(N: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(N, E, generator=g) * 2, -1)
    weights, experts = probs.topk(k, -1)
    return weights / weights.sum(-1, keepdim=True), experts


BACKENDS = ["loop", "auto", "padded"] + (["grouped"] if hasattr(F, "grouped_mm") else [])


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
@pytest.mark.parametrize("geometry", list(GEOMETRY_NAMES))
def test_fast_logits_match_reference(geometry, padding):
    """commit (prefill, then a canvas past the window) and denoise (with and without self-conditioning), and the
    encoder's own logits: the fast path within 1e-4 of the readable one."""
    model = random_model(geometry)
    V, L = model.config.vocab_size, model.config.canvas_length
    prompt, canvas, second = random_ids(V, 2, 11, seed=5), random_ids(V, 2, L, seed=6), random_ids(V, 2, L, seed=7)
    mask = torch.ones_like(prompt)
    if padding:
        mask[0, :5] = 0
    sc = torch.randn(2, L, V, generator=torch.Generator().manual_seed(8)) * 4
    out = {}
    for impl in ("reference", "fast"):
        cache = model.new_cache(2, 11 + L)
        enc = model.next_token_logits(prompt, cache, attention_mask=mask, impl=impl)
        first = model.denoise(canvas, cache, impl=impl)
        conditioned = model.denoise(canvas, cache, self_conditioning_logits=sc, impl=impl)
        enc2 = model.next_token_logits(second, cache, impl=impl)
        out[impl] = [enc[mask.bool()], first, conditioned, enc2, model.denoise(canvas, cache, impl=impl)]
    for got, want in zip(out["fast"], out["reference"], strict=True):
        assert (got - want).abs().max() <= TOL


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
    model = random_model("tiny")
    h = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(14)) * 3
    weight, cap = model.embed_tokens.weight, model.config.final_logit_softcapping
    torch.testing.assert_close(kernels.logits_into(h, weight, cap), model.logits(h), atol=2e-5, rtol=0)
    assert torch.equal(kernels.logits_into(h, weight, cap, torch.empty(7, model.config.vocab_size)),
                       kernels.logits_into(h, weight, cap))


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
    temp = sampling.temperature(5, 12, 0.4, 0.8)
    z = model.logits(final).div_(temp)
    results = []
    for chunk, ws in ((None, None), (5, None), (7, kernels.Workspace(7, V, torch.device("cpu")))):
        g = torch.Generator().manual_seed(17)
        head = lambda rows, o: kernels.logits_into(rows, model.embed_tokens.weight, 30.0, o)
        out = kernels.head_and_sample(final, head, temp, generator=g,
                                      embed=model.embed_tokens.weight, embed_scale=D**0.5, chunk_rows=chunk,
                                      workspace=ws)
        results.append(out)
        assert torch.equal(out.argmax, z.argmax(-1))
        torch.testing.assert_close(out.entropy, sampling.token_entropy(z), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.soft, model.soft_embedding(z), atol=1e-4, rtol=1e-5)
    for other in results[1:]:  # the same uniforms whatever the chunking
        assert torch.equal(other.draw, results[0].draw)


def test_bench_cli_smoke(capsys):
    assert main(["bench", "--preset", "tiny", "--denoising-steps", "2", "--repeats", "1", "--json"]) == 0
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
