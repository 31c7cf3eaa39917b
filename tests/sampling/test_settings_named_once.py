"""A generation setting is named once, where GenerationConfig declares it: the CLI's sampler flags and their
overrides, the server's accepted request fields and a trace's summary are generated from the fields' metadata, so a
new field reaches all of them without an edit elsewhere; and the request rules each have one home
(sampling/request_rules.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from dgemma.cli.flags import Parser, add_sampler_args, overrides
from dgemma.model.config import setting
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.sampling.request_rules import canvas_count, committed_length, new_token_room
from dgemma.serving.api import APIError, parse_completion_request
from tests.helpers import model_config

# The names clients and docs use today: every one must keep working
SERVER_FIELDS = {"max_denoising_steps", "entropy_bound", "t_min", "t_max", "sampler", "stability_threshold",
                 "confidence_threshold", "commit", "stop_rule", "sliding_prefix", "posterior",
                 "initial_self_conditioning", "self_conditioning", "adaptive", "stability_steps", "time_level",
                 "lite_commit", "corrector_steps", "commit_threshold", "edit_threshold", "top_k", "min_p",
                 "repetition_penalty", "top_p", "presence_penalty", "frequency_penalty", "logit_bias"}
CLI_FLAGS = {"--sampler", "--time-level", "--lite-commit", "--corrector-steps", "--commit-threshold",
             "--edit-threshold", "--self-conditioning", "--max-new-tokens", "--max-denoising-steps",
             "--entropy-bound", "--t-min", "--t-max",
             "--top-k", "--top-p", "--min-p", "--repetition-penalty", "--presence-penalty", "--frequency-penalty",
             "--logit-bias"}


@dataclass(frozen=True, slots=True)
class WithKnob(GenerationConfig):
    """A later sampler's new setting, declared as every field is and nowhere else."""

    knob: int = setting("a later sampler's knob", 3, metavar="N")


def parser(config: type[GenerationConfig] = GenerationConfig) -> Parser:
    p = Parser(prog="dgemma generate")
    add_sampler_args(p, config=config)
    return p


def flags(p: Parser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def request(body: dict, base: GenerationConfig) -> GenerationConfig:
    return parse_completion_request({"prompt": [1, 2], **body}, tokenizer=None, base_config=base,
                                    model_name="tiny").submissions[0].config


def test_the_generated_sets_are_the_dataclass_fields():
    fields = {f.name: f.metadata for f in dataclasses.fields(GenerationConfig)}
    assert set(GenerationConfig.request_settings()) == {n for n, m in fields.items() if m.get("request", True)}
    assert set(GenerationConfig.request_settings()) == SERVER_FIELDS
    generated = {"--" + f.name.replace("_", "-") for f in GenerationConfig.flags()}
    assert generated == {"--" + n.replace("_", "-") for n, m in fields.items() if m.get("flag", True)}
    assert CLI_FLAGS <= generated and generated <= flags(parser())
    unset = ("max_length", "eos_token_id", "pad_token_id", "bos_token_id")  # to_hf writes them only when set
    traced = {m.get("traced_as", n) for n, m in fields.items() if n not in (*unset, "entropy_bound")}
    summary = GenerationConfig().summary()
    assert traced <= set(summary) and summary["sampler_config"]["entropy_bound"] == 0.1  # where the file keeps it


@pytest.mark.parametrize("name", sorted(SERVER_FIELDS))
def test_the_server_takes_every_request_setting_by_its_name(name):
    default = getattr(GenerationConfig(), name)
    value = dict(default) if name == "logit_bias" else default
    if value is not None:
        assert getattr(request({name: value}, GenerationConfig()), name) == default


def test_settings_of_the_model_or_the_library_are_not_request_fields():
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "max_length", "truncate", "max_new_tokens"):
        with pytest.raises(APIError, match=rf"unsupported field.*{name}"):
            request({name: getattr(GenerationConfig(), name)}, GenerationConfig())


def test_a_new_field_reaches_the_flags_the_server_and_the_trace():
    p = parser(WithKnob)
    assert "--knob" in flags(p) and "--knob" not in flags(parser())
    help_text = " ".join(p.format_help().split())
    assert "--knob N a later sampler's knob (default: 3)" in help_text
    assert overrides(p.parse_args(["--knob", "5", "--top-k", "2"]), WithKnob()) == {"knob": 5, "top_k": 2}

    assert "knob" in WithKnob.request_settings() and "knob" not in GenerationConfig.request_settings()
    assert request({"knob": 7}, WithKnob()).knob == 7
    with pytest.raises(APIError, match=r"unsupported field.*knob"):
        request({"knob": 7}, GenerationConfig())
    with pytest.raises(APIError) as refused:  # the other settings are checked as ever
        request({"knob": 7, "top_k": -1}, WithKnob())
    assert refused.value.param == "top_k"

    model = DiffusionGemma(model_config("tiny")).eval()
    out = generate(model, torch.tensor([[1, 2, 3]]), generation_config=WithKnob(knob=4, max_new_tokens=4,
                                                                                max_denoising_steps=2), trace=True)
    assert out.trace.summary["generation_config"]["knob"] == 4


def test_every_canvas_but_the_last_is_committed():
    """generate's cache, the engine's room and the canvas counts follow request_rules' one rule."""
    model = DiffusionGemma(model_config("tiny")).eval()
    L = model.config.canvas_length
    for max_new in (1, L, L + 1, 3 * L):
        out = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=max_new, max_denoising_steps=1, seed=0,
                       eos_token_id=())  # no early stop: every canvas is made
        assert out.cache.length == committed_length(3, max_new, L)
        assert out.sequences.shape[1] == 3 + canvas_count(max_new, L) * L
    room = new_token_room(3, 3 + 2 * L, 10_000, L)  # two canvases committed, a third left uncommitted
    assert room == 3 * L and committed_length(3, room, L) == 3 + 2 * L
    assert new_token_room(3 + 2 * L + 1, 3 + 2 * L, 10_000, L) == 0
