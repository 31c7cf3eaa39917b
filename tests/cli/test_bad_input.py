"""Every bad input gets one clear error (issue 12): a table of malformed configs, checkpoints, API arguments and
command lines, each row asserting the error type and that the message names the problem; CLI rows assert exit code
2 and one stderr line without a traceback. Then property-based fuzzing (hypothesis) of the JSON configs and the
safetensors header: only ConfigError / CheckpointError ever escape."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dgemma
from dgemma import cli
from dgemma.model.config import ConfigError, ModelConfig, RopeConfig
from dgemma.model.costs import MemoryPreflightError, check_memory
from dgemma.sampling.generation_config import GenerationConfig, GenerationError
from dgemma.train.config import TrainConfig
from dgemma.weights.checkpoint import CheckpointError

TINY = dgemma.preset("tiny")  # vocab 512, canvas 16
V, L = TINY.vocab_size, TINY.canvas_length
RANDOM = ["--preset", "tiny", "--random-init"]
FAST = ["--max-denoising-steps", "2", "--max-new-tokens", "16"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "tiny"
    dgemma.save_pretrained(dgemma.init_weights(dgemma.DiffusionGemma(TINY)), path)
    return path


@pytest.fixture(scope="module")
def model(ckpt) -> dgemma.DiffusionGemma:
    return dgemma.load_model(ckpt)


def copy_ckpt(ckpt: Path, tmp: Path) -> Path:
    dest = tmp / "ckpt"
    shutil.copytree(ckpt, dest)
    return dest


def edit_config(path: Path, name: str, edit) -> None:
    f = path / name
    cfg = json.loads(f.read_text())
    edit(cfg)
    f.write_text(json.dumps(cfg))


def text_edit(**kv):
    return lambda c: c["text_config"].update(kv)


def deep_json(depth: int = 100_000) -> str:
    return '{"text_config": ' + "[" * depth + "]" * depth + "}"


# --- files on disk: (name, how to break a copy of the tiny checkpoint, error type, what the message names) ------------

def _config_dir(p: Path) -> None:
    (p / "config.json").unlink()
    (p / "config.json").mkdir()


def _config_loop(p: Path) -> None:
    (p / "config.json").unlink()
    os.symlink("config.json", p / "config.json")


def _nan_weight(p: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(p / "model.safetensors")
    key = "model.decoder.layers.1.mlp.down_proj.weight"
    state[key][0, 0] = math.nan
    save_file(state, p / "model.safetensors", metadata={"format": "pt"})


def _inf_weight(p: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(p / "model.safetensors")
    state["model.decoder.embed_tokens.weight"][3, 3] = math.inf
    save_file(state, p / "model.safetensors", metadata={"format": "pt"})


def _sharded_with(shard: str):
    def edit(p: Path) -> None:
        from safetensors import safe_open

        with safe_open(p / "model.safetensors", "pt") as f:
            keys = list(f.keys())
        (p / "model.safetensors").rename(p / "model-00001-of-00001.safetensors")
        wm = {k: "model-00001-of-00001.safetensors" for k in keys}
        wm[keys[0]] = shard
        (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return edit


CHECKPOINT_CASES = [
    ("no text_config ({})", lambda p: (p / "config.json").write_text("{}"), CheckpointError, "no text_config"),
    ("top level without text_config",
     lambda p: edit_config(p, "config.json", lambda c: c.pop("text_config")), CheckpointError, "no text_config"),
    ("layer_types: 5", lambda p: edit_config(p, "config.json", text_edit(layer_types=5)), CheckpointError,
     "layer_types.*5"),
    ("eos_token_id: 'x'", lambda p: edit_config(p, "config.json", text_edit(eos_token_id="x")), CheckpointError,
     "eos_token_id.*'x'"),
    ("per_layer_config {'1': 5}", lambda p: edit_config(p, "config.json", text_edit(per_layer_config={"1": 5})),
     CheckpointError, r"per_layer_config\['1'\].*5"),
    ("num_hidden_layers: '4'", lambda p: edit_config(p, "config.json", text_edit(num_hidden_layers="4")),
     CheckpointError, "num_hidden_layers.*'4'"),
    ("rope_theta: 'x'", lambda p: edit_config(p, "config.json", lambda c: c["text_config"]["rope_parameters"]
                                              ["sliding_attention"].update(rope_theta="x")),
     CheckpointError, "rope_theta.*'x'"),
    ("rope_theta: Infinity", lambda p: edit_config(p, "config.json", lambda c: c["text_config"]["rope_parameters"]
                                                   ["full_attention"].update(rope_theta=math.inf)),
     CheckpointError, "rope_theta.*inf"),
    ("rope_parameters entry not an object", lambda p: edit_config(p, "config.json", lambda c: c["text_config"]
                                                                  ["rope_parameters"].update(full_attention=3)),
     CheckpointError, "full_attention.*3"),
    ("rms_norm_eps: Infinity", lambda p: edit_config(p, "config.json", text_edit(rms_norm_eps=math.inf)),
     CheckpointError, "rms_norm_eps.*inf"),
    ("rms_norm_eps: NaN", lambda p: edit_config(p, "config.json", text_edit(rms_norm_eps=math.nan)),
     CheckpointError, "rms_norm_eps.*nan"),
    ("pad_token_id: -5", lambda p: edit_config(p, "config.json", text_edit(pad_token_id=-5)), CheckpointError,
     "pad_token_id.*-5"),
    ("pad_token_id: [] (found by the fuzzer)", lambda p: edit_config(p, "config.json", text_edit(pad_token_id=[])),
     CheckpointError, r"pad_token_id.*\[\]"),
    ("bos_token_id: 1.5", lambda p: edit_config(p, "config.json", text_edit(bos_token_id=1.5)), CheckpointError,
     "bos_token_id.*1.5"),
    ("attention_k_eq_v: 'yes'", lambda p: edit_config(p, "config.json", text_edit(attention_k_eq_v="yes")),
     CheckpointError, "attention_k_eq_v.*'yes'"),
    ("deeply nested JSON", lambda p: (p / "config.json").write_text(deep_json()), CheckpointError,
     "nested too deeply"),
    ("config.json is a directory", _config_dir, CheckpointError, "config.json: a directory, not a regular file"),
    ("config.json is a symlink loop", _config_loop, CheckpointError, "config.json: cannot read"),
    ("generation eos_token_id: 1.5",
     lambda p: edit_config(p, "generation_config.json", lambda c: c.update(eos_token_id=1.5)), CheckpointError,
     "generation_config.json.*eos_token_id.*1.5"),
    ("generation t_max: Infinity",
     lambda p: edit_config(p, "generation_config.json", lambda c: c.update(t_max=math.inf)), CheckpointError,
     "generation_config.json.*t_max.*inf"),
    ("generation t_min: NaN",
     lambda p: edit_config(p, "generation_config.json", lambda c: c.update(t_min=math.nan)), CheckpointError,
     "t_min.*nan"),
    ("generation entropy_bound: Infinity",
     lambda p: edit_config(p, "generation_config.json", lambda c: c.update(sampler_config={"entropy_bound": math.inf})),
     CheckpointError, "entropy_bound.*inf"),
    ("generation confidence_threshold: -Infinity",
     lambda p: edit_config(p, "generation_config.json", lambda c: c.update(confidence_threshold=-math.inf)),
     CheckpointError, "confidence_threshold.*-inf"),
    ("generation pad_token_id: -5",
     lambda p: edit_config(p, "generation_config.json", lambda c: c.update(pad_token_id=-5)), CheckpointError,
     "pad_token_id.*-5"),
    ("generation_config.json is a list", lambda p: (p / "generation_config.json").write_text("[1]"),
     CheckpointError, "expected a JSON object"),
    ("NaN weight", _nan_weight, CheckpointError, r"layers\.1\.mlp\.down_proj\.weight.*non-finite.*1 NaN"),
    ("inf weight", _inf_weight, CheckpointError, r"embed_tokens\.weight.*non-finite.*1 inf"),
    ("shard path ../..", _sharded_with("../../elsewhere/model.safetensors"), CheckpointError,
     r"index\.json: weight_map.*'\.\./\.\./elsewhere/model\.safetensors' climbs out of the directory"),
    ("absolute shard path", _sharded_with("/etc/passwd"), CheckpointError, r"'/etc/passwd' is an absolute path"),
    ("shard symlink to a file that is not safetensors (followed, as cat would)",
     lambda p: (os.symlink("/etc/hostname", p / "link.safetensors"), _sharded_with("link.safetensors")(p)),
     CheckpointError, r"link\.safetensors: not a readable safetensors file"),
    ("weight_map is a list", lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
     CheckpointError, "no 'weight_map' object"),
    ("index is not JSON", lambda p: (p / "model.safetensors.index.json").write_text("{"), CheckpointError,
     "index.json: invalid JSON"),
    ("shard named in the index is missing", _sharded_with("model-00002-of-00002.safetensors"), CheckpointError,
     "does not exist"),
    ("dtype int64", lambda p: None, "dtype", "floating-point dtype"),
    ("truncated weights", lambda p: os.truncate(p / "model.safetensors", 100), CheckpointError,
     "not a readable safetensors file"),
]


@pytest.mark.parametrize("name,edit,error,message", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_bad_checkpoint_is_one_error(ckpt, tmp_path, name, edit, error, message):
    path = copy_ckpt(ckpt, tmp_path)
    edit(path)
    if error == "dtype":  # the argument, not the files
        with pytest.raises(ValueError, match=message):
            dgemma.load_model(path, dtype=torch.int64)
        return
    with pytest.raises(error, match=message) as e:
        dgemma.load_model(path)
    assert str(path) in str(e.value)  # names the file


# --- configs through the API: ConfigError naming key and value ------------------------------------------------------

CONFIG_CASES = [
    ("ModelConfig rms_norm_eps inf", lambda: TINY.replace(rms_norm_eps=math.inf), "rms_norm_eps.*inf"),
    ("ModelConfig layer_types int", lambda: TINY.replace(layer_types=5), "layer_types.*5"),
    ("ModelConfig num_hidden_layers str", lambda: TINY.replace(num_hidden_layers="4"), "num_hidden_layers.*'4'"),
    ("ModelConfig pad_token_id -5", lambda: TINY.replace(pad_token_id=-5), "pad_token_id.*-5"),
    ("ModelConfig eos list with str", lambda: TINY.replace(eos_token_id=(1, "x")), "eos_token_id"),
    ("ModelConfig softcap nan", lambda: TINY.replace(final_logit_softcapping=math.nan), "final_logit_softcapping"),
    ("RopeConfig theta inf", lambda: RopeConfig(rope_theta=math.inf), "rope_theta.*inf"),
    ("RopeConfig theta str", lambda: RopeConfig(rope_theta="x"), "rope_theta.*'x'"),
    ("from_hf text_config list", lambda: ModelConfig.from_hf({"text_config": [1]}, "c.json"), "c.json: text_config"),
    ("from_hf layer_types dict", lambda: ModelConfig.from_hf({"layer_types": {"a": 1}}, "c.json"), "layer_types"),
    ("from_hf per_layer_config list value",
     lambda: ModelConfig.from_hf({"per_layer_config": {"0": [1]}}, "c.json"), r"per_layer_config\['0'\]"),
    ("from_hf per_layer_config negative",
     lambda: ModelConfig.from_hf({"per_layer_config": {"-1": {}}}, "c.json"), r"per_layer_config\['-1'\]"),
    ("TrainConfig grad_accum 2**64-1", lambda: TrainConfig(grad_accum=2**64 - 1), "grad_accum.*at most 65,536"),
    ("GenerationConfig t_max inf", lambda: GenerationConfig(t_max=math.inf), "t_max.*inf"),
    ("GenerationConfig t_max 1e-45", lambda: GenerationConfig(t_min=0.0, t_max=1e-45), "t_max.*1e-45"),
    ("GenerationConfig t_min nan", lambda: GenerationConfig(t_min=math.nan), "t_min.*nan"),
    ("GenerationConfig entropy_bound inf", lambda: GenerationConfig(entropy_bound=math.inf), "entropy_bound.*inf"),
    ("GenerationConfig confidence inf", lambda: GenerationConfig(confidence_threshold=math.inf),
     "confidence_threshold.*inf"),
    ("GenerationConfig eos 1.5", lambda: GenerationConfig(eos_token_id=1.5), "eos_token_id.*1.5"),
    ("GenerationConfig eos str", lambda: GenerationConfig(eos_token_id="x"), "eos_token_id.*'x'"),
    ("GenerationConfig truncate str", lambda: GenerationConfig(truncate="no"), "truncate.*'no'"),
    ("generation from_hf sampler_config entropy str",
     lambda: GenerationConfig.from_hf({"sampler_config": {"entropy_bound": "x"}}, "g.json"), "g.json.*entropy_bound"),
]


@pytest.mark.parametrize("name,make,message", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_value_is_a_config_error(name, make, message):
    with pytest.raises(ConfigError, match=message):
        make()


# --- API arguments ---------------------------------------------------------------------------------------------------

def _nan_model(model):
    bad = dgemma.DiffusionGemma(TINY)
    bad.load_state_dict(model.state_dict())
    with torch.no_grad():
        bad.layers[0].mlp.down_proj.weight.fill_(math.nan)
    return bad.eval()


PROMPT = torch.tensor([[2, 45, 300]])
API_CASES = [
    ("decoder_input_ids 5 tokens", lambda m: dgemma.generate(m, PROMPT, decoder_input_ids=torch.zeros(1, 5).long(),
                                                             max_new_tokens=16, max_denoising_steps=2),
     GenerationError, r"decoder_input_ids.*\(1, 5\)"),
    ("decoder_input_ids out of range",
     lambda m: dgemma.generate(m, PROMPT, decoder_input_ids=torch.full((1, L), V), max_new_tokens=16,
                               max_denoising_steps=2), ValueError, "decoder_input_ids must lie in"),
    ("decoder_input_ids negative in forward",
     lambda m: m(PROMPT, decoder_input_ids=torch.full((1, L), -1)), ValueError, "decoder_input_ids must lie in"),
    ("denoise canvas out of range",
     lambda m: m.denoise(torch.full((1, L), V + 3), m.new_cache(1, 4)), ValueError, "canvas must lie in.*515"),
    ("denoise float canvas", lambda m: m.denoise(torch.zeros(1, L), m.new_cache(1, 4)), ValueError,
     "canvas must be an integer tensor"),
    ("input_ids out of range", lambda m: dgemma.generate(m, torch.tensor([[1, V]]), max_new_tokens=16),
     ValueError, "input_ids must lie in"),
    ("seed 2**70", lambda m: dgemma.generate(m, PROMPT, seed=2**70, max_new_tokens=16), GenerationError,
     r"seed.*1180591620717411303424"),
    ("seed str", lambda m: dgemma.generate(m, PROMPT, seed="1", max_new_tokens=16), GenerationError, "seed.*'1'"),
    ("t_max 1e-45", lambda m: dgemma.generate(m, PROMPT, t_min=0.0, t_max=1e-45), ConfigError, "t_max.*1e-45"),
    ("t_max inf", lambda m: dgemma.generate(m, PROMPT, t_max=math.inf), ConfigError, "t_max.*inf"),
    ("NaN weights, reference sampler",
     lambda m: dgemma.generate(_nan_model(m), PROMPT, max_new_tokens=16, max_denoising_steps=2, seed=0),
     GenerationError, "non-finite logits at canvas 0, step 1"),
    ("NaN weights, fast sampler",
     lambda m: dgemma.generate(_nan_model(m), PROMPT, max_new_tokens=16, max_denoising_steps=2, seed=0, impl="fast"),
     GenerationError, "non-finite logits at canvas 0, step 1"),
    ("NaN weights, lite sampler",
     lambda m: dgemma.generate(_nan_model(m), PROMPT, max_new_tokens=16, max_denoising_steps=2, seed=0,
                               sampler="lite"), GenerationError, "non-finite logits"),
    ("26B weights past the free memory",
     lambda m: check_memory(dgemma.preset("diffusiongemma-26b-a4b"), torch.float32, "cpu", weights=True, batch_size=1),
     MemoryPreflightError, r"needs about .* GB .*weights .* free on cpu"),
    ("huge batch past the free memory",
     lambda m: dgemma.generate(m, torch.full((2**21, 1), 3), max_new_tokens=16, max_denoising_steps=2),
     MemoryPreflightError, "sampler"),
]


@pytest.mark.parametrize("name,call,error,message", API_CASES, ids=[c[0] for c in API_CASES])
def test_bad_api_argument_is_one_error(model, name, call, error, message):
    with pytest.raises(error, match=message):
        call(model)


def test_memory_preflight_can_be_forced(model):
    parts = check_memory(dgemma.preset("diffusiongemma-26b-a4b"), torch.float32, "cpu", weights=True, force=True)
    assert parts["weights"] > 90e9  # ~25B parameters in fp32


# --- the command line: exit 2, one line, no traceback -----------------------------------------------------------------

def _trace(tmp: Path, model_dir: Path) -> Path:
    base = tmp / "t"
    assert cli.main(["generate", "--model", str(model_dir), "--prompt-ids", "2,45", "--seed", "0", *FAST, "--trace",
                     str(base), "--json"]) == 0
    return base


def _corrupt_npz(tmp: Path, ckpt: Path, how: str) -> list[str]:
    base = _trace(tmp, ckpt)
    npz = base.with_suffix(".npz")
    data = bytearray(npz.read_bytes())
    if how == "truncated":
        npz.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "crc":  # flip a byte inside the first member's compressed data
        data[len(data) // 4] ^= 0xFF
        npz.write_bytes(bytes(data))
    elif how == "negative":
        with np.load(npz) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["argmax"][0, 0, 0] = -7
        np.savez(npz, **arrays)
    return ["viz", str(base), "--out", str(tmp / "pics")]


def _viz_out_is_file(tmp: Path, ckpt: Path) -> list[str]:
    base = _trace(tmp, ckpt)
    (tmp / "afile").write_text("x")
    return ["viz", str(base), "--out", str(tmp / "afile")]


def _batch_file_not_utf8(tmp: Path, ckpt: Path) -> list[str]:
    (tmp / "b.txt").write_bytes(b"hello\n\xff\xfe bad\n")
    return ["generate", *RANDOM, "--batch-file", str(tmp / "b.txt")]


def _generate_bad_config(tmp: Path, ckpt: Path) -> list[str]:
    path = copy_ckpt(ckpt, tmp)
    edit_config(path, "config.json", text_edit(num_hidden_layers="4"))
    return ["generate", "--model", str(path), "--prompt-ids", "2"]


def _generate_nan_weights(tmp: Path, ckpt: Path) -> list[str]:
    path = copy_ckpt(ckpt, tmp)
    _nan_weight(path)
    return ["generate", "--model", str(path), "--prompt-ids", "2"]


CLI_CASES = [
    ("generate --t-max inf", lambda t, c: ["generate", *RANDOM, "--prompt-ids", "2", "--t-max", "inf"], "t_max.*inf"),
    ("generate --t-max nan", lambda t, c: ["generate", *RANDOM, "--prompt-ids", "2", "--t-max", "nan"], "t_max.*nan"),
    ("generate --entropy-bound inf",
     lambda t, c: ["generate", *RANDOM, "--prompt-ids", "2", "--entropy-bound", "inf"], "entropy_bound.*inf"),
    ("generate --batch-file DIR", lambda t, c: ["generate", *RANDOM, "--batch-file", str(t)], "cannot read"),
    ("generate --batch-file missing", lambda t, c: ["generate", *RANDOM, "--batch-file", str(t / "nope")],
     "cannot read"),
    ("generate --batch-file not UTF-8", _batch_file_not_utf8, "line 2 is not UTF-8"),
    ("generate --prompt-ids negative", lambda t, c: ["generate", *RANDOM, "--prompt-ids", "2,-4"], "outside"),
    ("generate on a config with a bad value", _generate_bad_config, "num_hidden_layers.*'4'"),
    ("generate on NaN weights", _generate_nan_weights, "non-finite"),
    ("generate --prompt-ids x", lambda t, c: ["generate", *RANDOM, "--prompt-ids", "2,x"], "comma-separated integers"),
    ("generate --max-new-tokens 0", lambda t, c: ["generate", *RANDOM, "--prompt-ids", "2", "--max-new-tokens", "0"],
     "max_new_tokens"),
    ("generate --max-denoising-steps -1",
     lambda t, c: ["generate", *RANDOM, "--prompt-ids", "2", "--max-denoising-steps", "-1"],
     "max_denoising_steps"),
    ("generate --prompt blank", lambda t, c: ["generate", *RANDOM, "--prompt", "  "], "empty prompt"),
    ("generate --model missing", lambda t, c: ["generate", "--model", str(t / "nope"), "--prompt-ids", "2"],
     "does not exist"),
    ("generate 26B preset past free memory",
     lambda t, c: ["generate", "--preset", "diffusiongemma-26b-a4b", "--random-init", "--prompt-ids", "2"],
     r"needs about \d+\.\d+ GB"),
    ("viz truncated npz", lambda t, c: _corrupt_npz(t, c, "truncated"), "not a readable trace archive"),
    ("viz CRC-bad npz", lambda t, c: _corrupt_npz(t, c, "crc"), "not a readable trace archive"),
    ("viz negative ids", lambda t, c: _corrupt_npz(t, c, "negative"), "negative token ids"),
    ("viz --out is a file", _viz_out_is_file, "exists and is not a directory"),
    ("viz missing trace", lambda t, c: ["viz", str(t / "none"), "--out", str(t / "o")], "missing"),
    ("inspect on a symlink-loop config", lambda t, c: (_config_loop(copy_ckpt(c, t)), ["inspect", str(t / "ckpt")])[1],
     "config.json"),
]


@pytest.mark.parametrize("name,argv,message", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_cli_input_is_one_line_and_exit_2(ckpt, tmp_path, capsys, name, argv, message):
    args = argv(tmp_path, ckpt)
    capsys.readouterr()
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"dgemma {args[0]}: error: ")
    assert re.search(message, lines[0]), lines[0]


def test_debug_flag_shows_the_traceback():
    with pytest.raises(ConfigError, match="t_max"):
        cli.main(["--debug", "generate", *RANDOM, "--prompt-ids", "2", "--t-max", "inf"])


def test_memory_preflight_refuses_the_26b_preset_at_once(capsys, monkeypatch):
    import dgemma

    def built(*a, **k):
        raise AssertionError("the model was built before the memory check refused it")

    monkeypatch.setattr(dgemma.DiffusionGemma, "__init__", built)  # a tripwire: refused before any weight exists
    assert cli.main(["generate", "--preset", "diffusiongemma-26b-a4b", "--random-init", "--prompt-ids", "2"]) == 2
    err = capsys.readouterr().err
    assert "weights 10" in err and "free on cpu" in err and "--force" in err  # ~100 GB of fp32 weights


def test_chat_survives_a_line_that_is_not_utf8(ckpt, tok_path, monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfe oops\nhello\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    code = cli.main(["chat", *RANDOM, "--tokenizer", str(tok_path), *FAST, "--seed", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "not UTF-8" in err and "Traceback" not in err
    # The bad line writes nothing to stdout; the next one is answered, and every answer (even an empty one, which
    # an untrained model may sample) ends its line.
    assert out.endswith("\n")


def test_viz_warns_about_ids_beyond_the_tokenizer(ckpt, tmp_path, tok_path, capsys):
    pytest.importorskip("matplotlib")
    from dgemma.data.tokenizer import build_test_tokenizer

    small = tmp_path / "small.json"
    build_test_tokenizer(300, small)
    base = _trace(tmp_path, ckpt)
    capsys.readouterr()
    code = cli.main(["viz", str(base), "--out", str(tmp_path / "pics"), "--tokenizer", str(small), "--canvas", "0"])
    err = capsys.readouterr().err
    assert code == 0
    assert "warning: the trace holds token ids up to" in err


# --- fuzzing -------------------------------------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                                        max_size=4), max_leaves=12)
MODEL_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "head_dim", "global_head_dim",
              "num_key_value_heads", "num_global_key_value_heads", "per_layer_config", "rope_parameters",
              "eos_token_id", "pad_token_id", "bos_token_id", "rms_norm_eps", "num_experts", "top_k_experts",
              "model_type", "tie_word_embeddings", "sliding_window", "canvas_length", "attention_k_eq_v",
              "self_conditioning", "hidden_activation", "final_logit_softcapping", "moe_intermediate_size"]
GEN_KEYS = ["max_new_tokens", "max_length", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
            "confidence_threshold", "eos_token_id", "pad_token_id", "bos_token_id", "sampler_config"]
VALUES = JSON | st.sampled_from([math.inf, -math.inf, math.nan, -5, 0, 1, 4, 16, "full_attention",
                                 ["sliding_attention", "full_attention"], {"1": 5}, {"1": {"head_dim": 8}},
                                 {"full_attention": {"rope_theta": "x"}}, {"entropy_bound": math.inf}])
EXAMPLES = int(os.environ.get("DGEMMA_FUZZ_EXAMPLES", "0")) or None  # a longer fuzz: DGEMMA_FUZZ_EXAMPLES=5000
FUZZ = settings(max_examples=EXAMPLES or 80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


@FUZZ
@given(st.dictionaries(st.sampled_from(MODEL_KEYS), VALUES, max_size=6), st.booleans())
def test_fuzzed_model_config_raises_only_config_error(d, nested):
    with contextlib.suppress(ConfigError):
        ModelConfig.from_hf({"text_config": d} if nested else d, "fuzz.json")


@FUZZ
@given(st.dictionaries(st.sampled_from(GEN_KEYS), VALUES, max_size=6))
def test_fuzzed_generation_config_raises_only_config_error(d):
    with contextlib.suppress(ConfigError):
        GenerationConfig.from_hf(d, "fuzz.json")


@settings(max_examples=EXAMPLES or 40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(MODEL_KEYS), VALUES, max_size=4))
def test_fuzzed_config_json_on_disk_raises_only_checkpoint_error(tmp_path_factory, d):
    path = tmp_path_factory.mktemp("fuzzcfg")
    (path / "config.json").write_text(json.dumps({"text_config": {**TINY.to_hf()["text_config"], **d}}))
    with contextlib.suppress(CheckpointError):
        dgemma.load_model(path)


@settings(max_examples=EXAMPLES or 80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.binary(max_size=64),
    st.dictionaries(st.text(max_size=6), st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets"]),
                                                         VALUES | st.sampled_from(["F32", "I64", "BF16", [0, 8],
                                                                                   [2, 2], [0, 2**70]]),
                                                         max_size=3), max_size=3).map(lambda h: json.dumps(h).encode()),
), st.integers(0, 64))
def test_fuzzed_safetensors_header_raises_only_checkpoint_error(tmp_path_factory, header, body):
    path = tmp_path_factory.mktemp("fuzzst")
    (path / "config.json").write_text(json.dumps(TINY.to_hf()))
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * body)
    with contextlib.suppress(CheckpointError):
        dgemma.load_model(path)
