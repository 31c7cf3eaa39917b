"""The training side: forward process, masks against brute-force rules, training forward == sampling-time
commit + denoise, chunked losses against eager ones."""

from __future__ import annotations

import math

import pytest
import torch

from dgemma import DiffusionGemma, init_weights, preset
from dgemma.diffusion.noise import alpha_bar, q_sample
from dgemma.model.attention import causal_masks, clean_context_masks, noisy_context_masks
from dgemma.model.config import FULL, SLIDING
from dgemma.train.diffusion import OBJECTIVES, chunked_soft_embedding, sample_canvas_t, training_loss, x0_cross_entropy
from tests.helpers import random_ids

CFG = preset("tiny")  # canvas 16, window 8, vocab 512
L, W, V = CFG.canvas_length, CFG.sliding_window, CFG.vocab_size


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    m = init_weights(DiffusionGemma(CFG), seed=3, std=0.2)
    with torch.no_grad():  # distinct encoder/decoder scalars, so a role mix-up cannot go unnoticed
        for i, block in enumerate(m.layers):
            block.layer_scalar.fill_(0.8 + 0.1 * i)
            block.encoder_layer_scalar.fill_(1.25 - 0.1 * i)
    return m


def test_alpha_bar_runs_from_clean_to_noise():
    t = torch.arange(0, 17)
    ab = alpha_bar(t, 16)
    assert ab[0] == 1.0 and ab[-1] < 1e-12
    assert (ab[1:] < ab[:-1]).all()


def test_corruption_rate_matches_alpha_bar():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, 64, (64, 4096), generator=g)
    t = torch.full((64, 4096 // 16), 6)
    xt = q_sample(x0, t, 16, 16, 64, g)
    ab = float(alpha_bar(torch.tensor(6), 16))
    expected = ab + (1 - ab) / 64  # a uniform redraw can land on the clean token
    assert abs((xt == x0).float().mean().item() - expected) < 0.005
    per_canvas = sample_canvas_t(1000, 4, 16, g)
    assert per_canvas.min() == 1 and per_canvas.max() == 16


def _dense_rule(objective: str, kind: str, T: int) -> torch.Tensor:
    """The visibility rules, one query/key pair at a time."""
    n = 2 * T if objective == "clean-context" else T
    out = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            if objective == "clean-context":
                qn, kn, qp, kp = q >= T, k >= T, q % T, k % T
            else:
                qn = kn = objective == "noisy-context"
                qp, kp = q, k
            if objective == "ar":
                ok = kp <= qp and (kind == FULL or qp - kp < W)
            elif not qn:  # clean (encoder) query
                ok = not kn and kp <= qp and (kind == FULL or qp - kp < W)
            elif kn:  # canvas query, canvas key: same canvas only (or earlier canvases for noisy-context)
                same = kp // L == qp // L
                earlier = objective == "noisy-context" and kp < (qp // L) * L
                ok = same or (earlier and (kind == FULL or kp >= (qp // L) * L - (W - 1)))
            else:  # canvas query, clean key: the committed prefix before its canvas
                start = (qp // L) * L
                ok = kp < start and (kind == FULL or kp >= start - (W - 1))
            out[q, k] = ok
    return out


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_masks_equal_dense_reference(objective):
    T = 3 * L
    build = {"clean-context": lambda: clean_context_masks(T, L, W),
             "noisy-context": lambda: noisy_context_masks(T, L, W), "ar": lambda: causal_masks(T, W)}
    masks = build[objective]()
    for kind in (FULL, SLIDING):
        assert torch.equal(masks[kind][0, 0], _dense_rule(objective, kind, T)), kind


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_clean_context_forward_equals_commit_then_denoise(model, impl):
    """Training sees each canvas as sampling will (up to fp32 rounding of different matmul shapes; a role or mask
    mistake shows as O(1)): clean prefix committed, canvas denoised against it, with
    and without self-conditioning (the pre-pass posterior re-embedded == denoise fed the pre-pass logits)."""
    T, B = 4 * L, 2
    x0, xt = random_ids(V, B, T, seed=1), random_ids(V, B, T, seed=2)
    pos = torch.arange(T)
    tokens, positions, masks = torch.cat([x0, xt], 1), torch.cat([pos, pos])[None], clean_context_masks(T, L, W)
    with torch.no_grad():
        plain = model.logits(model.sequence_hidden(tokens, positions, masks, num_clean=T, impl=impl)[:, T:])
        pre = model.sequence_hidden(tokens, positions, masks, num_clean=T, impl=impl)[:, T:]
        soft = chunked_soft_embedding(model, pre, chunk_rows=7)
        conditioned = model.logits(model.sequence_hidden(tokens, positions, masks, num_clean=T, soft=soft,
                                                         impl=impl)[:, T:])
        sc_logits = model.logits(pre)
    for b in range(T // L):
        cache = model.new_cache(B, T)
        model.commit(x0[:, : b * L], cache, impl=impl)
        canvas = slice(b * L, (b + 1) * L)
        torch.testing.assert_close(model.denoise(xt[:, canvas], cache, impl=impl), plain[:, canvas], atol=1e-3, rtol=0)
        sc = model.denoise(xt[:, canvas], cache, self_conditioning_logits=sc_logits[:, canvas], impl=impl)
        torch.testing.assert_close(sc, conditioned[:, canvas], atol=1e-3, rtol=0)


def test_noisy_context_and_ar_are_causal_across_canvases(model):
    T = 3 * L
    x, y = random_ids(V, 1, T, seed=4), random_ids(V, 1, T, seed=4)
    y[0, 2 * L + 3] = (y[0, 2 * L + 3] + 1) % V  # change one token of the last canvas
    pos = torch.arange(T)[None]
    with torch.no_grad():
        for masks, num_clean in ((noisy_context_masks(T, L, W), 0), (causal_masks(T, W), T)):
            a = model.sequence_hidden(x, pos, masks, num_clean=num_clean)
            b = model.sequence_hidden(y, pos, masks, num_clean=num_clean)
            limit = 2 * L if num_clean == 0 else 2 * L + 3  # block-causal vs token-causal
            # Unchanged up to rounding (the change moves expert batch sizes); visibly changed where it may be seen.
            torch.testing.assert_close(a[:, :limit], b[:, :limit], atol=1e-4, rtol=0)
            assert (a[:, limit:] - b[:, limit:]).abs().max() > 1e-2


def test_chunked_cross_entropy_equals_eager_loss_and_gradients(model):
    hidden = torch.randn(300, CFG.hidden_size, generator=torch.Generator().manual_seed(5), requires_grad=True)
    targets = random_ids(V, 300, seed=6)
    results = []
    for chunk in (None, 64):
        model.zero_grad()
        hidden.grad = None
        loss = x0_cross_entropy(model, hidden, targets, chunk_rows=chunk)
        loss.backward()
        results.append((loss.detach(), hidden.grad.clone(), model.embed_tokens.weight.grad.clone()))
    for eager, chunked in zip(*results, strict=True):
        torch.testing.assert_close(chunked, eager, atol=1e-6, rtol=0)
    assert results[0][0] > math.log(V) * 0.5  # a real loss, not a degenerate zero


def test_soft_embedding_chunking_is_exact(model):
    hidden = torch.randn(2, 40, CFG.hidden_size, generator=torch.Generator().manual_seed(7))
    soft = lambda rows: chunked_soft_embedding(model, hidden, chunk_rows=rows)
    assert torch.equal(soft(80), soft(80))
    torch.testing.assert_close(soft(7), soft(80),
                               atol=1e-5, rtol=1e-5)  # soft embeddings of order 10: fp32 rounding of other shapes


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_training_loss_is_reproducible_and_trains_every_parameter_it_should(objective):
    m = init_weights(DiffusionGemma(CFG), seed=8)
    x0 = random_ids(V, 2, 2 * L + (objective == "ar"), seed=9)
    runs = []
    for _ in range(2):
        m.zero_grad()
        out = training_loss(m, x0, objective=objective, self_conditioning_prob=1.0, ar_weight=0.5,
                            generator=torch.Generator().manual_seed(10))
        out.loss.backward()
        runs.append((out.loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    assert torch.isfinite(runs[0][0]) and 0.5 * math.log(V) < runs[0][0] < 3 * math.log(V)
    sc_grad = m.self_conditioning.gate_proj.weight.grad
    if objective == "ar":
        assert sc_grad is None or sc_grad.abs().sum() == 0  # no canvas, no self-conditioning
    else:
        assert sc_grad is not None and sc_grad.abs().sum() > 0


def test_bad_training_input_is_refused():
    m = DiffusionGemma(CFG)
    with pytest.raises(ValueError, match="not a whole number of canvases of 16"):
        training_loss(m, random_ids(V, 1, 20))
    with pytest.raises(ValueError, match="unknown objective 'mlm'"):
        training_loss(m, random_ids(V, 1, 16), objective="mlm")  # type: ignore[arg-type]


def test_ar_decoding_with_the_cache_equals_the_ar_training_forward(model):
    """An `ar` model decodes by committing token after token and reading their next-token logits."""
    ids = random_ids(V, 2, 20, seed=11)
    cache = model.new_cache(2, 20)
    pieces = [model.next_token_logits(ids[:, :12], cache)]
    pieces += [model.next_token_logits(ids[:, i:i + 1], cache) for i in range(12, 20)]
    with torch.no_grad():
        whole = model.logits(model.sequence_hidden(ids, torch.arange(20)[None], causal_masks(20, W), num_clean=20))
    torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-4, rtol=0)


# --- recipe switches -------------------------------------------------------------------------------------------------

def test_stratified_levels_cover_the_range_and_stay_uniform():
    g = torch.Generator().manual_seed(0)
    one = sample_canvas_t(4, 4, 16, g, stratified=True)  # 16 canvases, T = 16: every level exactly once
    assert sorted(one.reshape(-1).tolist()) == list(range(1, 17))
    draws = torch.stack([sample_canvas_t(3, 2, 16, g, stratified=True) for _ in range(20_000)])
    assert draws.min() == 1 and draws.max() == 16
    # each position's marginal is uniform on {1..16} (so every loss stays unbiased)
    freq = torch.bincount(draws[:, 1, 0], minlength=17)[1:].float() / draws.shape[0]
    assert (freq - 1 / 16).abs().max() < 0.01
    # and a batch of 6 canvases has no level twice in a stratum: its spread beats independent draws'
    iid = torch.stack([sample_canvas_t(3, 2, 16, g) for _ in range(20_000)])
    assert draws.float().view(20_000, -1).std(1).var() < 0.5 * iid.float().view(20_000, -1).std(1).var()


def test_elbo_loss_is_the_nelbo_estimate_of_the_same_logits(model):
    """loss_weighting="elbo" is T x the reverse-step KL of dgemma/train/heldout.py at each canvas's level, from the same
    forward; chunked and unchunked agree, and the gradient is finite."""
    from dgemma.diffusion.likelihood import reverse_kl

    x0 = random_ids(V, 2, 4 * L, seed=5)
    g = lambda: torch.Generator().manual_seed(11)
    eager = training_loss(model, x0, loss_weighting="elbo", self_conditioning_prob=0.0, chunk_rows=None, generator=g())
    chunked = training_loss(model, x0, loss_weighting="elbo", self_conditioning_prob=0.0, chunk_rows=24, generator=g())
    assert torch.allclose(eager.loss, chunked.loss, rtol=1e-5)
    # redo the draws and the forward by hand
    gen = g()
    t = sample_canvas_t(2, 4, 16, gen)
    xt = q_sample(x0, t, 16, L, V, gen)
    S = x0.shape[1]
    pos = torch.arange(S)
    hidden = model.sequence_hidden(torch.cat([x0, xt], 1), torch.cat([pos, pos])[None],
                                   clean_context_masks(S, L, W, x0.device), num_clean=S)
    logits = model.logits(hidden[:, S:]).reshape(-1, V)
    kl = reverse_kl(logits, x0.reshape(-1), xt.reshape(-1), t.repeat_interleave(L, 1).reshape(-1), 16)
    assert eager.loss.item() == pytest.approx(16 * kl.mean().item(), rel=1e-5)
    assert eager.cross_entropy.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, x0.reshape(-1)).item(),
                                                 rel=1e-5)
    model.zero_grad()
    chunked.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(x).all() for x in grads)
    model.zero_grad()


def test_recipe_switches_are_checked():
    x0 = random_ids(V, 1, L, seed=0)
    m = init_weights(DiffusionGemma(CFG), seed=0)
    with pytest.raises(ValueError, match="t_sampling"):
        training_loss(m, x0, t_sampling="sobol")
    with pytest.raises(ValueError, match="loss_weighting"):
        training_loss(m, x0, loss_weighting="snr")


def test_blocks_compiled_for_training_run_the_experts_in_both_passes():
    """`dgemma train`'s per-block torch.compile (train/distributed.py: wrap) with a MoE model and the fast kernels:
    the self-conditioning pre-pass (no gradients) takes the experts as one opaque op, the training pass breaks the
    graph at the expert loop's host read, and both agree with eager. Traced by aot_eager (seconds, not minutes);
    inductor's code generation is what runs/profile_train_step.py --compile-blocks times."""
    from dgemma.model import kernels

    eager = init_weights(DiffusionGemma(CFG, impl="fast"), seed=5, std=0.2).train()
    assert CFG.num_experts and eager.layers[0].is_moe
    compiled = init_weights(DiffusionGemma(CFG, impl="fast"), seed=5, std=0.2).train()
    kernels.register_expert_loop_op()
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    for block in compiled.layers:
        block.compile(backend="aot_eager")
    x0 = random_ids(V, 2, 3 * L, seed=6)
    results = []
    for m in (eager, compiled):
        out = training_loss(m, x0, self_conditioning_prob=1.0, generator=torch.Generator().manual_seed(7))
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad for p in m.parameters()]))
    assert counts["stats"]["unique_graphs"] >= 2 * len(compiled.layers)  # each block: pre-pass and training graphs
    assert not any("expert_loop" in str(reason) or "AttributeError" in str(reason)
                   for reason in counts["graph_break"]), dict(counts["graph_break"])
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
