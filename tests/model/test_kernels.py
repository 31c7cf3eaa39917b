"""Each kernel in dgemma/model/kernels.py against its readable twin (fp32, CPU): the sorted MoE dispatch, the fast model
forward as a whole, the head, and `dgemma bench` as an in-process smoke test. The attention kernels:
tests/model/test_attention.py; the sampling kernels: tests/sampling/test_kernels.py. No timing asserts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dgemma.cli import main
from dgemma.model import kernels
from dgemma.model.config import preset
from dgemma.model.layers import Experts
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


# --- the head -------------------------------------------------------------------------------------------------------

def test_logits_into_matches_model_logits():
    model = random_model("tiny")
    h = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(14)) * 3
    weight, cap = model.embed_tokens.weight, model.config.final_logit_softcapping
    torch.testing.assert_close(kernels.logits_into(h, weight, cap), model.logits(h), atol=2e-5, rtol=0)
    assert torch.equal(kernels.logits_into(h, weight, cap, torch.empty(7, model.config.vocab_size)),
                       kernels.logits_into(h, weight, cap))


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
