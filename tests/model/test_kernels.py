"""Each kernel in dgemma/model/kernels.py against its readable twin (fp32, CPU): the sorted MoE dispatch, the fast model
forward as a whole, the fused sampler statistics and draws, and `dgemma bench` as an in-process smoke test. The
attention kernels: tests/model/test_attention.py; the fast sampler loop: tests/sampling/test_fast_sampler.py. No timing
asserts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dgemma.cli import main
from dgemma.model import kernels
from dgemma.model.config import preset
from dgemma.model.layers import Experts
from dgemma.sampling import rules
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
    truth = rules.token_entropy(z.double())
    assert ((entropy.double() - truth).abs() <= 1e-6 + 1e-6 * truth).all()  # nearer fp64 than the fp32 reference
    assert (entropy - rules.token_entropy(z)).abs().max() < 1e-5  # which is within 6e-6 of it here


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
    temp = rules.temperature(5, 12, 0.4, 0.8)
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
    head = lambda rows, o: kernels.logits_into(rows, weight, 30.0, o)
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


def test_bench_cli_smoke(capsys):
    """`dgemma bench --json` at fixed steps: every per-implementation figure its module docstring documents is there
    and finite, the counts are what 2 canvases x 2 fixed steps imply, and each derived figure is the one its own
    timings give (not a timing assert: the relations hold whatever the machine's speed)."""
    import math
    import re

    from dgemma.eval import bench

    steps, canvases, canvas = 2, 2, preset("tiny").canvas_length
    assert main(["bench", "--preset", "tiny", "--denoising-steps", str(steps), "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    documented = re.findall(r"^    (\w+)  +\S", bench.__doc__, re.M)
    assert "tokens_per_forward" in documented and "peak_memory_bytes" in documented, documented
    gen = report["generation"]
    assert (gen["steps"], gen["canvases"], gen["canvas_length"], gen["batch"]) == (steps, canvases, canvas, 1)
    peak = report["peak"]
    assert math.isfinite(peak["matmul_flops_per_second"]) and peak["matmul_flops_per_second"] > 0
    assert math.isfinite(peak["copy_bytes_per_second"]) and peak["copy_bytes_per_second"] > 0
    close = dict(rel_tol=1e-9)
    for impl in ("reference", "fast"):
        r = gen["results"][impl]
        missing = [k for k in documented if k not in r]
        assert not missing, (impl, missing)
        for key in documented:
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] > 0, (impl, key, r[key])
        # fixed steps: every canvas runs all its steps, so a forward yields canvas / steps tokens
        assert r["generated_tokens"] == canvases * canvas and r["denoising_passes"] == canvases * steps, r
        assert r["tokens_per_forward"] == canvas / steps, r
        assert r["repeats"] == 1 and r["all_tokens_per_second"] == [r["tokens_per_second"]], r
        total_ms = 1e3 * r["seconds_per_run"]
        assert math.isclose(r["tokens_per_second"], r["generated_tokens"] / r["seconds_per_run"], **close), r
        # the wall time is prefill + one commit between the canvases + the denoising passes
        commits_ms = (canvases - 1) * r["ms_per_commit"]
        assert math.isclose(r["ms_per_denoise_step"] * r["denoising_passes"],
                            total_ms - r["ms_prefill"] - commits_ms, **close), r
        assert r["ms_prefill"] < r["ms_to_first_canvas"] < total_ms, r
        for objective in ("clean-context", "ar"):
            t = report["training"]["results"][impl][objective]
            assert all(math.isfinite(v) and v > 0 for v in t.values()), (impl, objective, t)
            seconds = t["ms_per_step"] / 1e3
            tokens = report["training"]["batch"] * report["training"]["seq_len"]
            assert math.isclose(t["tokens_per_second"], tokens / seconds, **close), t
            assert math.isclose(t["mfu"], t["model_flops_per_step"] / seconds / peak["matmul_flops_per_second"],
                                **close), t
        train = report["training"]["results"][impl]
        assert math.isclose(train["diffusion/ar_time"],
                            train["clean-context"]["ms_per_step"] / train["ar"]["ms_per_step"], **close), train
    ratio = gen["results"]["fast"]["tokens_per_second"] / gen["results"]["reference"]["tokens_per_second"]
    assert math.isclose(gen["ratios"]["fast/reference"], ratio, **close), gen["ratios"]
    bound = gen["bounds"]["denoise_step"]
    assert bound["flops"] > 0 and bound["bytes"] > 0, bound
    assert math.isclose(bound["ms_bound"], max(bound["ms_compute_bound"], bound["ms_memory_bound"]), **close), bound
    assert math.isclose(bound["ms_compute_bound"], 1e3 * bound["flops"] / peak["matmul_flops_per_second"],
                        **close), bound
    assert math.isclose(bound["ms_memory_bound"], 1e3 * bound["bytes"] / peak["copy_bytes_per_second"],
                        rel_tol=1e-5), bound  # the report rounds the bytes to an integer
    assert report["commit"] and report["machine"]["cores"]


def test_bench_refuses_the_26b_geometry_on_cpu(capsys):
    assert main(["bench", "--preset", "diffusiongemma-26b-a4b"]) == 2
    assert "GB" in capsys.readouterr().err
