"""The sampler's two measured rules (issue 23, docs/sampling.md): the noise level a time-embedding model is told
(`time_level`: the canvas's level by default, seed 003's n / N as a switch) and Lite's commit rule (`lite_commit`:
gradual by default, seed 003's all-at-once as a switch), on real tiny models and through the real CLI."""

from __future__ import annotations

import math

import pytest
import torch

from dgemma import generate, preset
from dgemma.cli import main
from dgemma.model.config import TIME_FEATURES, ConfigError
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.model.layers import time_features
from dgemma.sampling import rules as S
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.api import APIError, parse_completion_request
from dgemma.testing.hf import randomize_
from dgemma.train.diffusion import alpha
from tests.helpers import traced_cli_settings

N = 6


def _model(time_embedding: bool = True) -> DiffusionGemma:
    return randomize_(DiffusionGemma(preset("tiny").replace(time_embedding=time_embedding)), 0).eval()


def _prompt() -> torch.Tensor:
    return torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(3))


# --- the level rule -------------------------------------------------------------------------------------------------

def test_canvas_level_inverts_the_training_schedule():
    a = torch.linspace(0, 1, 101)
    s = S.canvas_level(a)
    assert s[0] == 1 and s[-1] == 0  # pure noise is level 1, a clean canvas level 0
    assert bool((s[1:] <= s[:-1]).all())  # more clean positions, a lower level
    torch.testing.assert_close(alpha(s.double(), torch.float64), a.double(), atol=1e-6, rtol=0)  # alpha(s) == a


def test_time_level_is_per_row_from_the_canvas_or_the_schedule():
    share = torch.tensor([0.0, 0.25, 1.0])
    canvas = S.time_level(GenerationConfig(), share, 3, 4)
    torch.testing.assert_close(canvas, torch.tensor([1.0, 2 / 3, 0.0]))  # arccos(0.5) = pi / 3
    schedule = S.time_level(GenerationConfig(time_level="schedule"), share, 3, 4)
    assert schedule.tolist() == [0.75] * 3
    assert S.time_level(GenerationConfig(time_level="noise"), share, 3, 4).tolist() == [1.0] * 3


@pytest.mark.parametrize("time_level", ["canvas", "schedule"])
def test_a_time_embedding_model_is_told_each_rows_canvas_level(time_level):
    """What reaches the model's time embedding at each denoising pass is the level of that row's input canvas: 1
    at the first step, then canvas_level of the share the previous step accepted (or n / N with the switch)."""
    model = _model()
    seen: list[torch.Tensor] = []
    hook = model.time_proj.register_forward_hook(lambda mod, inputs, out: seen.append(inputs[0].detach().clone()))
    try:
        r = generate(model, _prompt(), seed=4, max_new_tokens=16, max_denoising_steps=N, trace=True,
                     time_level=time_level, stability_threshold=N, confidence_threshold=1e-30)
    finally:
        hook.remove()
    steps = r.trace.steps
    denoise = [f for f in seen if f.shape[1] == model.config.canvas_length]  # not the prompt's commit
    assert len(steps) == len(denoise) == N
    for k, (info, features) in enumerate(zip(steps, denoise, strict=True)):
        if time_level == "schedule":
            want = torch.full((2,), (N - k) / N)
        else:
            want = torch.ones(2) if k == 0 else S.canvas_level(steps[k - 1].accepted.float().mean(-1))
        torch.testing.assert_close(info.level, want, atol=0, rtol=0)
        told = time_features(info.level[:, None].expand(-1, features.shape[1]), TIME_FEATURES)
        torch.testing.assert_close(features, told.to(features.dtype), atol=0, rtol=0)
    levels = torch.stack([s.level for s in steps])
    if time_level == "canvas":
        assert bool((levels[1:] > 0.5).all())  # the canvases stay mostly noise: never "nearly clean"
        assert not torch.equal(levels[:, 0], levels[:, 1])  # each row its own level
    assert r.trace.arrays()["level"].shape == (N, 2)


# --- the Lite commit rule -----------------------------------------------------------------------------------------

def test_lite_commits_grow_within_their_quota():
    """The default (scheduled) rule: after step k of N at most ceil(L * k / N) positions per row are committed, the
    set only grows, and it grows over several steps rather than at step 2."""
    model = _model()
    L = model.config.canvas_length
    r = generate(model, _prompt(), seed=4, max_new_tokens=L, max_denoising_steps=N, sampler="lite", adaptive=False,
                 trace=True)
    counts = torch.stack([s.accepted.sum(-1) for s in r.trace.steps])  # (N, B) committed after each step
    quota = torch.tensor([math.ceil(L * k / N) for k in range(1, N + 1)])[:, None]
    assert bool((counts <= quota).all()), counts.T.tolist()
    assert bool((counts[1:] >= counts[:-1]).all())
    assert bool(((counts > 0) & (counts < L)).sum(0).ge(3).all()), counts.T.tolist()  # partial on 3+ steps


# Recorded with the code before the two rules existed (commit b487fb1): 2 rows, 2 canvases of 16, 6 steps, seed 4,
# a time-embedding tiny model: the new tokens and the committed count after each step.
SEED_LITE = [[207, 182, 118, 337, 212, 308, 201, 151, 399, 436, 170, 465, 209, 208, 162, 106, 247, 181, 311, 118, 311,
              298, 258, 399, 124, 14, 8, 23, 465, 418, 256, 505],
             [476, 473, 399, 100, 138, 433, 162, 67, 304, 1, 479, 485, 9, 466, 163, 288, 287, 260, 310, 191, 209, 3,
              146, 276, 164, 117, 474, 304, 241, 478, 429, 329]]
SEED_LITE_COMMITTED = [0, 12, 26, 29, 31, 32, 0, 21, 28, 31, 32, 32]


def test_the_seed_switches_reproduce_seed_003s_sampler_exactly():
    run = lambda **kw: generate(_model(), _prompt(), seed=4, max_new_tokens=32, max_denoising_steps=N, sampler="lite",
                                trace=True, **kw)
    old = run(time_level="schedule", lite_commit="seed")
    assert old.sequences[:, 5:].tolist() == SEED_LITE
    assert [int(s.accepted.sum()) for s in old.trace.steps] == SEED_LITE_COMMITTED  # 12 of 32 at step 2 already
    new = run()
    assert new.sequences[:, 5:].tolist() != SEED_LITE
    assert int(new.trace.steps[1].accepted.sum()) <= 2 * math.ceil(16 * 2 / N)


# --- the settings ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "flag"), [("time_level", "--time-level"), ("lite_commit", "--lite-commit")])
def test_a_bad_value_is_one_error_naming_the_setting(field, flag, capsys):
    with pytest.raises(ConfigError, match=rf"{field}: must be one of '\w+', '\w+'(, '\w+')?, got 'often'"):
        GenerationConfig(**{field: "often"})
    request = lambda value: parse_completion_request({"prompt": [1, 2], field: value}, tokenizer=None,
                                                     base_config=GenerationConfig(), model_name="tiny")
    with pytest.raises(APIError, match=rf"{field}: must be one of") as e:
        request("often")
    assert e.value.status == 400 and e.value.param == field
    switch = {"time_level": "schedule", "lite_commit": "seed"}[field]  # the non-default value reaches the config
    assert getattr(request(switch).submissions[0].config, field) == switch
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "1,2", flag, "often"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1
    assert err[0].startswith("dgemma generate: error:") and flag in err[0] and "often" in err[0]


def test_the_settings_reach_the_sampler_and_its_trace(tmp_path, capsys):
    summary = traced_cli_settings(tmp_path, capsys, "--max-denoising-steps", "3", "--sampler", "lite", "--time-level",
                                  "schedule", "--lite-commit", "seed")
    assert summary["time_level"] == "schedule" and summary["lite_commit"] == "seed"
    default = GenerationConfig()
    assert (default.time_level, default.lite_commit) == ("canvas", "scheduled")
    # dgemma's switches are not generation_config.json keys (docs/sampling.md): reading one back gives the defaults
    back = GenerationConfig.from_hf(GenerationConfig(time_level="schedule", lite_commit="seed").to_hf())
    assert back == default

