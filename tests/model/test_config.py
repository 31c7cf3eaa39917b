"""Reading and validating config.json / generation_config.json, and the presets."""

from __future__ import annotations

import json

import pytest

from dgemma.model.config import FULL, PRESETS, SLIDING, ConfigError, ModelConfig, RopeConfig, preset, read_json
from dgemma.sampling.generation_config import GenerationConfig


def _google_style_text() -> dict:
    """The released model's config.json as third parties report it: global_* keys, no per_layer_config."""
    return {
        "model_type": "diffusion_gemma_text", "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112,
        "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "global_head_dim": 512, "num_global_key_value_heads": 2, "sliding_window": 1024, "num_experts": 128,
        "top_k_experts": 8, "moe_intermediate_size": 704, "max_position_embeddings": 262144,
        "use_bidirectional_attention": "vision",
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}},
    }


def test_google_config_with_global_keys_gives_the_26b_preset():
    cfg = ModelConfig.from_hf({"model_type": "diffusion_gemma", "canvas_length": 256,
                               "text_config": _google_style_text()})
    assert cfg.replace(use_bidirectional_attention=None) == PRESETS["diffusiongemma-26b-a4b"]
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [5, 11, 17, 23, 29]
    assert cfg.final_logit_softcapping == 30.0  # never in config.json; transformers' class attribute
    assert (cfg.layer_head_dim(0), cfg.layer_num_kv_heads(0), cfg.layer_head_dim(5), cfg.layer_num_kv_heads(5)) == \
        (256, 8, 512, 2)
    assert cfg.rotary_dims(5) == 128 and cfg.rotary_dims(0) == 256


def test_per_layer_config_form_and_bare_text_config_read_the_same():
    saved = PRESETS["diffusiongemma-26b-a4b"].to_hf()
    assert "global_head_dim" not in saved["text_config"]
    assert saved["text_config"]["per_layer_config"]["05"] == {"head_dim": 512, "num_key_value_heads": 2}
    from_top = ModelConfig.from_hf(saved)
    bare = dict(saved["text_config"], canvas_length=256)
    assert from_top == ModelConfig.from_hf(bare) == PRESETS["diffusiongemma-26b-a4b"]


def test_round_trip_of_every_preset_and_empty_per_layer_config():
    for cfg in [*PRESETS.values(), preset("tiny").replace(global_head_dim=16, num_global_key_value_heads=None)]:
        assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_defaults_follow_transformers_when_keys_are_absent():
    cfg = ModelConfig.from_hf({"model_type": "diffusion_gemma_text", "num_hidden_layers": 7, "num_experts": 4,
                               "top_k_experts": 2, "moe_intermediate_size": 8})
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL, FULL)  # every 6th full, and the last forced full
    assert (cfg.hidden_size, cfg.sliding_window, cfg.global_head_dim, cfg.canvas_length) == (2304, 512, 512, 256)
    assert cfg.full_rope == RopeConfig("proportional", 1e6, 0.25)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 0, "hidden_size: must be a positive int, got 0"),
    ("num_key_value_heads", 3, "num_key_value_heads: 3 must divide num_attention_heads=16"),
    ("layer_types", (SLIDING,) * 30, "layer_types: the last layer must be 'full_attention'"),
    ("layer_types", (FULL,) * 3, "layer_types: has 3 entries but num_hidden_layers is 30"),
    ("top_k_experts", 200, r"top_k_experts: must be in \[1, num_experts=128\], got 200"),
    ("head_dim", 255, "head_dim: must be even"),
    ("hidden_activation", "silu", "hidden_activation: only 'gelu_pytorch_tanh'"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention: only None or 'vision'"),
    ("final_logit_softcapping", -1.0, "final_logit_softcapping: must be > 0 or None"),
])
def test_invalid_model_values_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        PRESETS["diffusiongemma-26b-a4b"].replace(**{field: value})


@pytest.mark.parametrize("text, message", [
    ({"per_layer_config": {"1": {"sliding_window": 4}}, "layer_types": [SLIDING, FULL], "num_hidden_layers": 2},
     r"per_layer_config\['1'\] overrides \['sliding_window'\]"),
    ({"per_layer_config": {"0": {"head_dim": 64}}, "layer_types": [SLIDING, FULL], "num_hidden_layers": 2},
     r"per_layer_config\['0'\] overrides a layer that is not full_attention"),
    ({"rope_parameters": {SLIDING: {"rope_type": "default", "partial_rotary_factor": 0.5}}},
     r"rope_parameters.sliding_attention.partial_rotary_factor: must be 1.0 for rope_type 'default'"),
    ({"rope_parameters": {SLIDING: {"rope_type": "yarn"}}}, "rope_type: must be 'default' or 'proportional'"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ({"model_type": "llama"}, "model_type 'llama' is not a DiffusionGemma text config"),
])
def test_invalid_hf_configs_name_the_file_and_key(text, message):
    with pytest.raises(ConfigError, match="my/config.json: .*" + message):
        ModelConfig.from_hf(dict(_google_style_text(), **text), source="my/config.json")


def test_generation_config_reads_and_writes_the_transformers_layout():
    saved = {"confidence_threshold": 0.005, "eos_token_id": [1, 106], "max_denoising_steps": 12,
             "max_new_tokens": 48, "pad_token_id": 0, "return_dict_in_generate": True,
             "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
             "stability_threshold": 1, "t_max": 0.8, "t_min": 0.4, "transformers_version": "5.23.0"}
    gen = GenerationConfig.from_hf(saved)
    assert gen == GenerationConfig(max_new_tokens=48, max_denoising_steps=12, eos_token_id=(1, 106), pad_token_id=0)
    assert GenerationConfig.from_hf(gen.to_hf()) == gen
    assert GenerationConfig().eos_token_id == () and GenerationConfig().pad_token_id is None  # no global default
    assert GenerationConfig(eos_token_id=1).eos_token_id == (1,)


@pytest.mark.parametrize("kwargs, message", [
    ({"t_min": 0.9}, r"t_max: must be >= t_min=0.9"),
    ({"entropy_bound": 0.0}, "entropy_bound: must be a number > 0"),
    ({"max_denoising_steps": 0}, "max_denoising_steps: must be a positive int"),
    ({"stability_threshold": -1}, "stability_threshold: must be an int >= 0"),
    ({"confidence_threshold": 0}, "confidence_threshold: must be > 0"),
    ({"eos_token_id": [1, "x"]}, "eos_token_id: must be an int >= 0"),
])
def test_invalid_generation_values_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GenerationConfig(**kwargs)


def test_generation_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "generation_config.json"
    bad.write_text('{"sampler_config": {"entropy_bound": -2.0}}')
    with pytest.raises(ConfigError, match=f"{bad}: entropy_bound: must be a number > 0"):
        GenerationConfig.from_hf(read_json(bad), source=str(bad))
    bad.write_text('{"t_min": 0.4,\n "t_max": }')
    with pytest.raises(ConfigError, match=f"{bad}: invalid JSON at line 2, column 11: Expecting value"):
        read_json(bad)
    with pytest.raises(ConfigError, match="file not found"):
        read_json(tmp_path / "nope.json")


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'huge'; choose one of ") as e:
        preset("huge")
    assert all(name in str(e.value) for name in PRESETS)
