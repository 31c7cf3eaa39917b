"""The bounded chain (dgemma/sampling/families.py:chain_likelihood): the ancestral sampler at temperature 1 throughout
without self-conditioning is the reverse chain whose NELBO dgemma/diffusion/likelihood.py computes, and only it is
labelled so. The statistical test draws the sampler's last step many times from one canvas and compares the draws
with the reverse step the NELBO's reconstruction term uses (`reverse_kl` at t = 1 on `clean_context_posterior`); a
tempered or self-conditioned chain fails it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dgemma.cli import main
from dgemma.diffusion.likelihood import clean_context_posterior, reverse_kl
from dgemma.model.config import FULL, SLIDING, ConfigError, preset
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.families import chain_departures, chain_likelihood
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.sampling.readable import ReadableSampler
from dgemma.sampling.request_rules import sliding_prefix
from dgemma.sampling.trace import load_trace
from dgemma.testing.hf import randomize_
from tests.helpers import random_ids, random_init_model, random_model

CHAIN = GenerationConfig(sampler="ancestral", t_min=1, t_max=1, self_conditioning="off", max_denoising_steps=16)


# --- the label -------------------------------------------------------------------------------------------------------

def test_only_the_bounded_chain_is_labelled_with_the_nelbo():
    assert chain_likelihood(CHAIN) == "NELBO at T=16"
    assert chain_likelihood(CHAIN.replace(max_denoising_steps=4)) == "NELBO at T=4"
    # predictor-corrector without a corrector pass is the ancestral chain token for token
    assert chain_likelihood(CHAIN.replace(sampler="predictor-corrector", corrector_steps=0)) == "NELBO at T=16"
    departures = {  # each one change away from the chain, and what the label says departs
        "default ancestral": (dict(t_min=0.4, t_max=0.8, self_conditioning="on"),
                              ["temperature 0.8 -> 0.4", "self_conditioning='on'"]),
        "self-conditioned": (dict(self_conditioning="on"), ["self_conditioning='on'"]),
        "constant 0.9": (dict(t_min=0.9, t_max=0.9), ["temperature 0.9"]),
        "entropy-bound": (dict(sampler="entropy-bound"), ["sampler='entropy-bound'", "commit='argmax'"]),
        "corrector": (dict(sampler="predictor-corrector"), ["sampler='predictor-corrector' with corrector_steps=1"]),
        "top_k": (dict(top_k=5), ["top_k=5"]),
        "logit_bias": (dict(logit_bias={3: 1.0}), ["logit_bias=((3, 1.0),)"]),
        "argmax commit": (dict(commit="argmax"), ["commit='argmax'"]),
        "jax window": (dict(sliding_prefix="jax"), ["sliding_prefix='jax'"]),
    }
    for name, (changes, why) in departures.items():
        config = CHAIN.replace(**changes)
        assert chain_likelihood(config) is None, name
        assert chain_departures(config) == why, name
    assert chain_likelihood(CHAIN, constrained=True) is None and chain_departures(CHAIN, constrained=True) == [
        "a grammar"]
    # the transformers-default sampler and settings: no likelihood
    assert chain_likelihood(GenerationConfig()) is None


def test_a_constant_temperature_and_no_self_conditioning_are_settings():
    assert GenerationConfig(t_min=0.7, t_max=0.7).t_max == 0.7
    with pytest.raises(ConfigError, match=r"t_max: must be >= t_min=0.9 \(equal: a constant temperature\), got 0.8"):
        GenerationConfig(t_min=0.9, t_max=0.8)
    with pytest.raises(ConfigError, match=r"self_conditioning: must be one of 'on', 'off', got 'no'"):
        GenerationConfig(self_conditioning="no")
    with pytest.raises(ConfigError, match=r"initial_self_conditioning: 'uniform' is the first step's"):
        GenerationConfig(self_conditioning="off", initial_self_conditioning="uniform")
    model = random_model("tiny")
    with pytest.raises(ValueError, match="self_conditioning='off'"):
        ReadableSampler(model, CHAIN, 1, self_conditioning_logits=torch.zeros(1, 16, 512))


# --- the statistical test ------------------------------------------------------------------------------------------

DRAWS = 2000  # rows drawing the last step from one canvas; at this many a wrong step fails by far (module docstring)
P_VALUE = 1e-3  # the chain passes above it; the seeds are fixed, so the outcome is too


def _small_model(**changes) -> DiffusionGemma:
    """Small enough to draw the step DRAWS times in about a second: 64 tokens, canvases of 4, one sliding and one full
    layer (the 11-token prompt reaches past the sliding window of 8)."""
    config = preset("tiny").replace(vocab_size=64, canvas_length=4, num_experts=0, num_hidden_layers=2,
                                    layer_types=(SLIDING, FULL), **changes)
    return randomize_(DiffusionGemma(config), 0).eval()


@pytest.fixture(scope="module", params=["plain", "time-embedding, observed likelihood"])
def setting(request):
    """A model, a committed prompt (DRAWS rows), the first canvas x_1, and x_{1/2}: the chain's own first step from
    it, which every row is then given (N = 2)."""
    model = _small_model(**({} if request.param == "plain" else dict(time_embedding=True, observed_likelihood=True)))
    V, L = model.config.vocab_size, model.config.canvas_length
    prompt, x1 = random_ids(V, 1, 11, seed=1), random_ids(V, 1, L, seed=2)
    cache = model.new_cache(DRAWS, 11 + L)
    with torch.no_grad():
        model.commit(prompt.expand(DRAWS, -1), cache)
        sampler = ReadableSampler(model, CHAIN.replace(max_denoising_steps=2), 1,
                                  generator=torch.Generator().manual_seed(9), canvas=x1.clone())
        one = model.new_cache(1, 11 + L)
        model.commit(prompt, one)
        sampler.step(sampler.denoiser(one)(*sampler.inputs()))
    return model, prompt, cache, x1, sampler.state.x.clone()


def _last_step(model, config, cache, x1, x_half) -> torch.Tensor:
    """DRAWS draws of x0 from the sampler's last step, every row at x_{1/2} = `x_half` after a first step from `x1`
    (the same in every row, so a self-conditioned chain feeds every row the same first posterior): (DRAWS, L)."""
    L = model.config.canvas_length
    sampler = ReadableSampler(model, config, DRAWS, generator=torch.Generator().manual_seed(11),
                              canvas=x1.expand(DRAWS, L).clone())
    forward = sampler.denoiser(cache, sliding_prefix=sliding_prefix(model.config, config))
    with torch.no_grad():
        assert not sampler.step(forward(*sampler.inputs()))  # level 1 -> 1/2
        sampler.state.x = x_half.expand(DRAWS, L).clone()  # the canvas the step is drawn from, one for every row
        assert sampler.step(forward(*sampler.inputs()))  # level 1/2 -> 0
    return sampler.staged().tokens


def _nelbo_reverse_step(model, prompt, x_half) -> torch.Tensor:
    """p(x0 = j | x_{1/2}) for every position and j, (L, V) float64, as the NELBO at T = 2 has it: its t = 1 term
    KL(q(x0 | x_1, x0 = j) || p(x0 | x_1)) is -log p(j | x_1) (`reverse_kl`), on the clean-context posterior given the
    prompt, told level 1 / 2."""
    L, V = model.config.canvas_length, model.config.vocab_size
    with torch.no_grad():
        logits = clean_context_posterior(model, prompt)(torch.zeros(1, L, dtype=torch.long), x_half,
                                                        torch.tensor([[0.5]]))[0]  # (L, V)
    j = torch.arange(V)
    kl = reverse_kl(logits.repeat_interleave(V, 0), j.repeat(L), x_half[0].repeat_interleave(V),
                    torch.ones(L * V, dtype=torch.long), 2)
    return (-kl).exp().view(L, V)


def _g_test(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """The p-value of the G-test of the draws (rows, L) against p (L, V), positions independent: per position, the
    tokens expected at least 5 times each a cell, the rest pooled in one."""
    counts = F.one_hot(tokens, p.shape[1]).sum(0).double()
    expected = tokens.shape[0] * p
    g, dof = 0.0, 0
    for o, e in zip(counts, expected, strict=True):
        big = e >= 5
        o, e = torch.cat([o[big], o[~big].sum()[None]]), torch.cat([e[big], e[~big].sum()[None]])
        o, e = o[e > 0], e[e > 0]
        g += float(2 * torch.where(o > 0, o * (o / e).log(), torch.zeros_like(o)).sum())
        dof += len(o) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(g / 2, dtype=torch.float64)))


@pytest.mark.parametrize("changes", [{}, dict(t_min=0.4, t_max=0.8, self_conditioning="on"),
                                     dict(self_conditioning="on"), dict(t_min=0.8, t_max=0.8)],
                         ids=["the chain", "default temperatures, self-conditioned", "self-conditioned", "tempered"])
def test_what_is_labelled_the_bounded_chain_draws_the_nelbo_reverse_step(setting, changes):
    """The setting `chain_likelihood` labels with the NELBO draws x0 from exactly the reverse step the NELBO's
    terms use (the draws fit it); a tempered or self-conditioned chain, labelled none, does not (far below P_VALUE:
    this is the test that fails if temperature or self-conditioning leaked into the chain)."""
    model, prompt, cache, x1, x_half = setting
    config = CHAIN.replace(max_denoising_steps=2, **changes)
    p = _nelbo_reverse_step(model, prompt, x_half)
    torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[0], dtype=torch.float64))
    p_value = _g_test(_last_step(model, config, cache, x1, x_half), p)
    if chain_likelihood(config) == "NELBO at T=2":
        assert p_value > P_VALUE, p_value
    else:
        assert chain_likelihood(config) is None and p_value < 1e-9, p_value


# --- reachable from the command line ------------------------------------------------------------------------------

def test_dgemma_generate_samples_the_bounded_chain(capsys, tmp_path):
    argv = ["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "2,45,300", "--seed", "0",
            "--max-new-tokens", "16", "--sampler", "ancestral", "--t-min", "1", "--t-max", "1",
            "--self-conditioning", "off", "--max-denoising-steps", "4", "--trace", str(tmp_path / "run"), "--json"]
    assert main(argv) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["steps_per_canvas"] == [4]  # the chain runs its N steps
    summary = load_trace(tmp_path / "run").summary["generation_config"]
    assert (summary["sampler"], summary["t_min"], summary["t_max"], summary["self_conditioning"]) == (
        "ancestral", 1.0, 1.0, "off")
    assert chain_likelihood(CHAIN.replace(**{k: summary[k] for k in ("max_denoising_steps", "sliding_prefix")},
                                          commit=summary["commit_rule"])) == "NELBO at T=4"
    lib = generate(random_init_model(), torch.tensor([[2, 45, 300]]), seed=0, eos_token_id=(1,), pad_token_id=0,
                   generation_config=CHAIN.replace(max_denoising_steps=4, max_new_tokens=16),
                   impl="fast")  # --impl's default
    assert rec["token_ids"] == lib.new_tokens()[0]
