"""The sampler's numerics at the edges: every value `GenerationConfig` accepts is one the kernels compute (extreme
finite values of every numeric sampling field, through one generate step of both kernel sets), and the others are
refused naming the field."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgemma.model.config import ConfigError
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import FLOAT32_MAX, GenerationConfig
from tests.helpers import random_model

EXTREMES = [5e-324, -5e-324, 1e-300, 1e-45, 1e-38, 1e-6, 0.0, 1.0, 2.0, 100.0, 1e30, FLOAT32_MAX, -FLOAT32_MAX,
            1e308, -1e308, -1.0, math.inf, math.nan]
FIELDS = ["t_min", "t_max", "entropy_bound", "confidence_threshold", "top_p", "min_p", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "commit_threshold", "edit_threshold", "logit_bias"]


@pytest.fixture(scope="module")
def model():
    return random_model("tiny")


def _settings(field: str, v: float) -> dict:
    """`field` at `v`, with what it needs to apply (a sampler that reads it, a t_max above t_min)."""
    kw: dict = {"logit_bias": {5: v}} if field == "logit_bias" else {field: v}
    if field == "t_min":
        kw["t_max"] = 1.0 if not v >= 0.5 else FLOAT32_MAX  # (t_min=FLOAT32_MAX: "t_max must be >= t_min=...")
    if field in ("commit_threshold", "edit_threshold"):
        kw["sampler"] = "block-refinement"
    if field in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        kw["logit_bias"] = {7: -100}  # a penalty and a bias together
    return kw


def _works_or_names_the_field(model, field: str, v: float) -> None:
    base = GenerationConfig.for_model(model.config).replace(max_new_tokens=8, max_denoising_steps=2)
    try:
        config = base.replace(**_settings(field, v))
    except ConfigError as e:
        assert field in str(e), f"{field}={v!r}: the error does not name the field: {e}"
        return
    for impl, extra in (("reference", {}), ("fast", {"loop": "readable"})):
        out = generate(model, torch.tensor([[1, 2, 3]]), generation_config=config, seed=0, impl=impl, **extra)
        new = out.sequences[0, 3:]
        assert new.numel() > 0 and bool(((new >= 0) & (new < model.config.vocab_size)).all()), (field, v, impl)


@pytest.mark.parametrize("field", FIELDS)
def test_every_extreme_value_is_computed_or_refused_by_name(model, field):
    """top_p 1e-300 (0 in float32) cut every token and repetition_penalty 5e-324 divided by zero: both passed
    validation and failed in torch.multinomial (a 500 from the server, a traceback from the CLI)."""
    for v in EXTREMES:
        _works_or_names_the_field(model, field, v)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), v=st.floats(allow_nan=False, allow_infinity=False, width=64))
def test_any_finite_value_is_computed_or_refused_by_name(model, field, v):
    _works_or_names_the_field(model, field, v)


@pytest.mark.parametrize("top_k", [1, 2**31, 10**30])
def test_top_k_of_any_size_is_computed(model, top_k):
    _works_or_names_the_field(model, "top_k", top_k)


@pytest.mark.parametrize("flags, code, words", [
    (["--top-p", "1e-300"], 0, None),
    (["--top-p", "5e-324"], 0, None),
    (["--repetition-penalty", "5e-324"], 2, "dgemma generate: error: repetition_penalty: must be in [0.01, 100]"),
    (["--repetition-penalty", "1e308"], 2, "dgemma generate: error: repetition_penalty:"),
])
def test_the_cli_computes_or_refuses_extreme_controls_in_one_line(capsys, flags, code, words):
    """Both printed a traceback (torch.multinomial's "probability tensor contains either inf, nan or element < 0")."""
    from dgemma import cli

    got = cli.main(["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "2,45,300", "--seed", "0",
                    "--max-new-tokens", "16", "--max-denoising-steps", "2", *flags])
    err = capsys.readouterr().err
    assert got == code, err
    if words:
        assert err.strip().count("\n") == 0 and err.startswith(words), err
