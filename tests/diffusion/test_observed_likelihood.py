"""The observed likelihood (dgemma/diffusion/noise.py, ModelConfig.observed_likelihood): the posterior is the network's
prediction times q(x_s | x0) of each token's own observation; the same term in training, the bounds and both
sampling loops."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import dgemma
from dgemma.diffusion.likelihood import clean_context_posterior, posterior_logits
from dgemma.diffusion.noise import MAX_BOOST, alpha, observation_boost, observation_levels, observe
from dgemma.model.config import ConfigError, ModelConfig
from dgemma.model.kernels import logits_into
from dgemma.sampling import kernels, rules
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.sampling.sampler import denoise_canvas
from tests.eval import test_evaluate
from tests.helpers import random_ids


def test_the_boost_is_bayes_for_the_tokens_own_observation():
    """With a flat network prediction the posterior of the observed value is q(x0 = x_s | x_s) under a uniform
    prior, alpha + (1 - alpha) / V; a fully noised token (s = 1) tells nothing; s = 0 is finite and certain."""
    V = 7
    tokens = torch.tensor([[3, 0, 6]])
    for s in (0.2, 0.5, 0.9):
        p = torch.softmax(observe(torch.zeros(1, 3, V), tokens, torch.tensor(s)), -1)
        a = float(alpha(torch.tensor(s), torch.float64))
        torch.testing.assert_close(p.gather(-1, tokens[..., None]).squeeze(-1), torch.full((1, 3), a + (1 - a) / V))
    assert float(observation_boost(torch.tensor(1.0), V)) < 1e-30
    assert float(observation_boost(torch.tensor(0.0), V)) == MAX_BOOST
    p0 = torch.softmax(observe(torch.zeros(1, 3, V), tokens, torch.tensor(0.0)), -1)
    assert torch.equal(p0.argmax(-1), tokens) and bool(torch.isfinite(p0).all())
    logits = torch.randn(1, 3, V)
    assert torch.equal(observe(logits, tokens, torch.tensor(1.0)), logits)  # pure noise: the network's own


def test_a_sampler_canvas_observes_carried_tokens_only():
    level = torch.tensor([0.3, 1.0])
    carried = torch.tensor([[True, False], [False, False]])
    assert torch.equal(observation_levels(level, carried), torch.tensor([[0.3, 1.0], [1.0, 1.0]]))


def test_the_flag_round_trips_and_validates(tmp_path):
    cfg = dgemma.preset("tiny").replace(observed_likelihood=True, time_embedding=True)
    assert ModelConfig.from_hf(cfg.to_hf()).observed_likelihood
    assert "observed_likelihood" not in dgemma.preset("tiny").to_hf()["text_config"]  # transformers' keys only
    with pytest.raises(ConfigError, match="observed_likelihood"):
        dgemma.preset("tiny").replace(observed_likelihood="yes")


def test_training_and_the_bound_read_the_same_posterior():
    """The NELBO's posterior is the head plus the observation; the training-side posterior_logits is the same
    function, and it refuses to run without the observation it needs."""
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny").replace(
        observed_likelihood=True, time_embedding=True)), seed=1).eval()
    L = model.config.canvas_length
    x0, xt = random_ids(500, 1, 2 * L, seed=0), random_ids(500, 1, 2 * L, seed=1)
    level = torch.tensor([[0.2, 0.6]])
    with torch.no_grad():
        got = clean_context_posterior(model)(x0, xt, level)
        plain = dgemma.DiffusionGemma(model.config.replace(observed_likelihood=False)).eval()
        plain.load_state_dict(model.state_dict())
        raw = clean_context_posterior(plain)(x0, xt, level)
    torch.testing.assert_close(got, observe(raw, xt, level.repeat_interleave(L, 1)))
    with pytest.raises(ValueError, match="observed_likelihood"):
        posterior_logits(model, torch.zeros(2, model.config.hidden_size))


class _Flat:
    """A scripted model whose network logits are all zero: every decision comes from the observation term."""

    def __init__(self, L: int, V: int):
        self.config = SimpleNamespace(canvas_length=L, vocab_size=V, sliding_window=4, time_embedding=False,
                                      observed_likelihood=True, hidden_size=3)
        self.embed_tokens = torch.nn.Embedding(V, 3)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.canvases: list[torch.Tensor] = []

    def denoise(self, canvas: torch.Tensor, cache: object, **_: object) -> torch.Tensor:
        self.canvases.append(canvas.clone())
        return torch.zeros(*canvas.shape, self.config.vocab_size)


def test_the_readable_sampler_observes_what_it_carried_and_not_its_fresh_noise():
    """Step 1 reads pure noise: a flat posterior (entropy log V), nothing copied. With every position accepted
    (a huge entropy bound), step 2's canvas is all carried: the posterior is certain of each carried token."""
    L, V = 4, 9
    model = _Flat(L, V)
    records = []
    config = GenerationConfig(sampler="entropy-bound", max_denoising_steps=3, entropy_bound=1e9)
    denoise_canvas(model, SimpleNamespace(batch_size=2), config,
                   generator=torch.Generator().manual_seed(0), on_step=records.append)
    torch.testing.assert_close(records[0].entropy, torch.full((2, L), math.log(V)))
    assert records[1].entropy.max() < 1e-3 and torch.equal(records[1].argmax, model.canvases[1])


def test_the_fast_kernel_adds_the_observation_before_tempering():
    g = torch.Generator().manual_seed(0)
    B, L, V, D = 2, 3, 11, 5
    final, weight = torch.randn(B, L, D, generator=g), torch.randn(V, D, generator=g)
    tokens = torch.randint(0, V, (B, L), generator=g)
    boost = observation_boost(torch.tensor([[0.1, 0.5, 1.0], [0.3, 0.0, 0.7]]), V)
    head = lambda rows, out: logits_into(rows, weight, 30.0, out)
    temp = torch.tensor(0.8)
    for chunk_rows in (None, 4):
        got = kernels.head_and_sample(final, head, temp, generator=torch.Generator().manual_seed(1),
                                      chunk_rows=chunk_rows, observed=(tokens, boost))
        z = head(final.reshape(-1, D), None).view(B, L, V).scatter_add(-1, tokens[..., None], boost[..., None]) / temp
        assert torch.equal(got.argmax, z.argmax(-1))
        torch.testing.assert_close(got.entropy, rules.token_entropy(z), atol=1e-5, rtol=1e-5)


def test_generation_with_an_observed_likelihood_model_runs_in_both_loops():
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny").replace(
        observed_likelihood=True, time_embedding=True)), seed=3).eval()
    prompt = random_ids(500, 2, 7, seed=4)
    for impl in ("reference", "fast"):
        out = generate(model, prompt, seed=0, impl=impl, max_new_tokens=32, max_denoising_steps=4,
                       sampler="entropy-bound")
        assert out.sequences.shape == (2, 7 + 32)


def test_the_ancestral_step_is_the_mixture_of_true_posteriors():
    """rules.ancestral_step equals sum_k p(k | x_s) q(x_{s'} | x_s, x0 = k), each posterior built by Bayes from the
    forward process; at s' = 0 it is p(x0 | x_s) itself."""
    V, s, s2 = 5, 0.6, 0.35
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 3, V, generator=g, dtype=torch.float64)
    x = torch.tensor([[0, 3, 4]])
    a, a2 = float(alpha(torch.tensor(s), torch.float64)), float(alpha(torch.tensor(s2), torch.float64))
    keep = lambda k: k * torch.eye(V, dtype=torch.float64) + (1 - k) / V  # q(to | from) as [from, to]
    p = torch.softmax(z, -1)
    for pos in range(3):
        i = int(x[0, pos])
        post = keep(a2) * keep(a / a2)[:, i][None, :] / keep(a)[:, i][:, None]  # [x0 = k, j]: q(j | x_s = i, k)
        torch.testing.assert_close(rules.ancestral_step(z, x, s, s2)[0, pos].double(), p[0, pos] @ post,
                                   rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rules.ancestral_step(z, x, s, 0.0).double(), p, rtol=1e-5, atol=1e-7)


def test_the_ancestral_chain_takes_n_steps_and_commits_its_last_draw():
    """`sampler="ancestral"`: N steps every canvas (never an early stop), the network told the schedule level n / N,
    and the final draw committed. A setting that names no sampler is transformers' entropy-bound one, for an
    observed-likelihood model too."""
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny").replace(
        observed_likelihood=True, time_embedding=True)), seed=3).eval()
    out = generate(model, random_ids(500, 1, 7, seed=4), seed=0, max_new_tokens=32, max_denoising_steps=4, trace=True,
                   sampler="ancestral")
    assert out.trace.summary["generation_config"]["sampler"] == "ancestral"
    assert all(n == 4 for row in out.steps_per_canvas for n in row)
    levels = [float(info.level[0]) for info in out.trace.steps[:4]]
    assert levels == [1.0, 0.75, 0.5, 0.25]
    assert GenerationConfig(sampler="ancestral").commit_rule == "sample"  # the chain's last draw is x0
    default = generate(model, random_ids(500, 1, 7, seed=4), seed=0, max_new_tokens=32, max_denoising_steps=4,
                       trace=True)
    assert default.trace.summary["generation_config"]["sampler"] == "entropy-bound"
    assert default.sequences.shape == out.sequences.shape


pair = test_evaluate.pair  # the fixture: prepared toy data and a tiny diffusion / AR pair


def test_a_diffusion_run_starts_from_an_ar_checkpoint_computing_what_it_computes(pair, tmp_path):
    """--init-from an AR run with the diffusion switches: the time input is new and starts at zero, so the step-0
    model's logits are the checkpoint's at every noise level; it trains, keeps the transformers sampler defaults, and
    resumes with the same command."""
    import io

    from dgemma.eval.curves import eval_points
    from dgemma.train.config import TrainConfig
    from dgemma.train.loop import initial_model, train
    from dgemma.weights.loading import load_generation_config, load_model

    root, runs = pair
    ar = load_model(runs["ar"]).eval()
    cfg = TrainConfig(init_from=str(runs["ar"]), time_embedding=True, observed_likelihood=True,
                      diffusion_time="continuous", seq_len=32, batch_size=2, max_steps=2, warmup_steps=1,
                      eval_every=2, eval_batches=1, save_every=2, chunk_rows=256, device="cpu")
    assert cfg.model_config.time_embedding and cfg.model_config.observed_likelihood
    assert not ar.config.time_embedding and not ar.config.observed_likelihood
    start = initial_model(cfg, torch.device("cpu")).eval()
    assert start.config == cfg.model_config and float(start.time_proj.weight.detach().abs().sum()) == 0.0
    V, L = ar.config.vocab_size, ar.config.canvas_length
    prompt, canvas = random_ids(V, 2, 7, seed=9), random_ids(V, 2, L, seed=10)
    with torch.no_grad():
        want = ar.denoise(canvas, _committed(ar, prompt))
        for t in (0.1, 0.9):
            torch.testing.assert_close(start.denoise(canvas, _committed(start, prompt), t=t), want)
    train(cfg, root / "data", tmp_path / "run", stream=io.StringIO())
    model = load_model(tmp_path / "run")
    assert model.config.time_embedding and model.config.observed_likelihood
    # the run records what its start had done (the AR run's 8 steps of 4 x 32 tokens), and its curve counts them
    start_state = torch.load(runs["ar"] / "checkpoints" / "step-0000008" / "trainer_state.pt", weights_only=True)
    inherited = json.loads((tmp_path / "run" / "run.json").read_text())["inherited"]
    assert inherited == {"checkpoint": str(runs["ar"] / "checkpoints" / "step-0000008"), "step": 8,
                         "tokens": 8 * 4 * 32, "cpu_s": start_state["cpu_s"]}
    curve = eval_points(tmp_path / "run", "val_nelbo_continuous")
    assert [p["tokens"] for p in curve] == [8 * 4 * 32 + step * 2 * 32 for step in (0, 2)]
    g = load_generation_config(tmp_path / "run")
    assert (g.sampler, g.max_denoising_steps, g.t_min, g.t_max) == ("entropy-bound", 48, 0.4, 0.8)
    assert train(cfg.replace(max_steps=3), root / "data", tmp_path / "run", resume=True, stream=io.StringIO()).step == 3
    assert json.loads((tmp_path / "run" / "run.json").read_text())["inherited"] == inherited  # kept on resume


def _committed(model, ids):
    cache = model.new_cache(ids.shape[0], ids.shape[1] + model.config.canvas_length)
    model.commit(ids, cache)
    return cache


def test_an_ar_checkpoint_takes_only_the_diffusion_switches(pair):
    """With init_from the checkpoint decides the geometry; the diffusion switches may be turned on (not a trained time
    input off), and not under LoRA, whose adapter adapts the checkpoint's own model."""
    from dgemma.train.config import TrainConfig

    _, runs = pair
    with pytest.raises(ConfigError, match="canvas_length: must be None with init_from"):
        TrainConfig(init_from=str(runs["ar"]), canvas_length=8)
    with pytest.raises(ConfigError, match="time_embedding: must be None with LoRA"):
        TrainConfig(init_from=str(runs["ar"]), time_embedding=True, lora_rank=4)
    TrainConfig(init_from=str(runs["ar"]), time_embedding=False)  # already off: nothing to drop
