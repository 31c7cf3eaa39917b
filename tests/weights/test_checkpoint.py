"""dgemma.weights.checkpoint: loading transformers' DiffusionGemma checkpoints, saving them back, and failing clearly.

One tiny random HF model is built and saved once per module; each test copies that directory and corrupts the copy.
Every failure must be a `CheckpointError` whose message names the file, the key and the shapes involved.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import builtins
import json
import pickle
import re
import shutil
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dgemma.weights.checkpoint as ckpt
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.testing.hf import build_hf_model, hf_logits, load_hf_model, save_hf_model
from dgemma.weights.checkpoint import CheckpointError, checkpoint_state, save_pretrained
from dgemma.weights.loading import load_generation_config, load_model

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
TEXT_KEY = re.compile(r"^model\.decoder\.|^model\.encoder\.language_model\.layers\.\d+\.layer_scalar$")
SHARD_BYTES = 200_000  # the tiny model is ~1.6 MB: about ten shards


# --- fixtures and helpers -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model() -> Any:
    return build_hf_model("tiny", seed=0)


@pytest.fixture(scope="module")
def hf_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    save_hf_model(hf_model, path)
    return path


@pytest.fixture(scope="module")
def hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(hf_dir / SINGLE)


@pytest.fixture(scope="module")
def sharded_dir(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sharded")
    save_pretrained(load_model(hf_dir), path, max_shard_bytes=SHARD_BYTES)
    return path


@pytest.fixture
def ckpt_dir(hf_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the HF checkpoint, free to corrupt."""
    return Path(shutil.copytree(hf_dir, tmp_path / "ckpt"))


def edit_json(file: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    obj = json.loads(file.read_text())
    edit(obj)
    file.write_text(json.dumps(obj))


def edit_weights(file: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.detach().cpu().flatten().view(torch.uint8), b.detach().cpu().flatten().view(torch.uint8)))


def text_keys(tensors: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in tensors if TEXT_KEY.match(k)}


def files_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def pickle_trap(marker: Path) -> bytes:
    """A pickle that creates `marker` when unpickled (by pickle.load or by torch.load with weights_only=False)."""

    class Trap:
        def __reduce__(self) -> tuple[Any, ...]:
            return builtins.open, (str(marker), "w")

    return pickle.dumps(Trap())


# --- loading transformers' checkpoints ----------------------------------------------------------------------------

def test_load_gives_every_hf_text_tensor_bit_for_bit(hf_model, hf_dir, hf_tensors):
    state = checkpoint_state(load_model(hf_dir))
    hf_state = hf_model.state_dict()
    assert set(state) == text_keys(hf_tensors)
    for key, tensor in state.items():
        assert same_bits(tensor, hf_state[key]), key
    # The encoder's layer scalars are separate buffers, and the fixture made them differ from the decoder's.
    for i in range(4):
        enc = state[f"model.encoder.language_model.layers.{i}.layer_scalar"]
        assert not torch.equal(enc, state[f"model.decoder.layers.{i}.layer_scalar"])


def test_vision_duplicate_encoder_and_lm_head_tensors_are_ignored(ckpt_dir, hf_dir, hf_tensors):
    assert any(k.startswith("model.encoder.vision_tower.") for k in hf_tensors)  # transformers saves the vision tower
    junk = torch.full((3, 5), 7.0)  # shapes and values that would break the model if they were used

    def add(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = junk.clone()
        t["model.encoder.language_model.embed_tokens.weight"] = junk.clone()
        t["model.encoder.language_model.layers.0.mlp.gate_proj.weight"] = junk.clone()
        t["model.encoder.embed_vision.extra.weight"] = junk.clone()

    edit_weights(ckpt_dir / SINGLE, add)
    loaded, reference = checkpoint_state(load_model(ckpt_dir)), checkpoint_state(load_model(hf_dir))
    assert loaded.keys() == reference.keys()
    assert all(same_bits(loaded[k], reference[k]) for k in reference)


def test_bf16_load_gives_bf16_tensors_rounded_from_the_checkpoint(hf_dir, hf_tensors):
    model = load_model(hf_dir, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    state = checkpoint_state(model)
    for key, tensor in state.items():
        assert same_bits(tensor, hf_tensors[key].to(torch.bfloat16)), key


def test_bf16_load_reads_one_tensor_at_a_time(hf_dir, monkeypatch):
    """Peak memory: each tensor read from the file must be released before the next is read, so an fp32 -> bf16
    load never holds more than one fp32 tensor (never a full fp32 copy of the model)."""
    alive: dict[str, weakref.ref[torch.Tensor]] = {}
    overlaps: list[str] = []
    real_safe_open = ckpt.safe_open

    class TrackingHandle:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._handle = real_safe_open(*args, **kwargs)

        def __enter__(self) -> TrackingHandle:
            self._handle.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self._handle.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._handle, name)

        def get_tensor(self, key: str) -> torch.Tensor:
            overlaps.extend(f"{old} alive when reading {key}" for old, ref in alive.items() if ref() is not None)
            tensor = self._handle.get_tensor(key)
            assert key not in alive, f"{key} read twice"
            alive[key] = weakref.ref(tensor)
            return tensor

    monkeypatch.setattr(ckpt, "safe_open", TrackingHandle)
    model = load_model(hf_dir, dtype=torch.bfloat16)
    assert not overlaps, overlaps[:3]
    assert all(ref() is None for ref in alive.values()), "a tensor read from the file outlived the load"
    assert set(alive) == set(checkpoint_state(model))  # every text tensor read exactly once, nothing else
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict().values())


def test_safetensors_are_loaded_and_a_pickle_next_to_them_is_never_touched(ckpt_dir, tmp_path):
    marker = tmp_path / "unpickled"
    (ckpt_dir / "pytorch_model.bin").write_bytes(pickle_trap(marker))
    load_model(ckpt_dir)
    assert not marker.exists()


# --- saving ---------------------------------------------------------------------------------------------------------

def test_save_writes_exactly_the_text_tensors_transformers_writes(hf_dir, hf_tensors, tmp_path):
    model, settings = load_model(hf_dir), load_generation_config(hf_dir)
    save_pretrained(model, tmp_path, generation_config=settings)
    assert files_in(tmp_path) == ["config.json", "generation_config.json", SINGLE]
    saved = load_file(tmp_path / SINGLE)
    assert set(saved) == text_keys(hf_tensors)
    for key, tensor in saved.items():
        assert same_bits(tensor, hf_tensors[key]), key
    with safe_open(str(tmp_path / SINGLE), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    reloaded = load_model(tmp_path)
    assert reloaded.config == model.config
    assert load_generation_config(tmp_path) == settings != GenerationConfig()


def test_sharded_save_round_trips_and_later_saves_remove_stale_shards(hf_dir, hf_tensors, tmp_path):
    model = load_model(hf_dir)
    save_pretrained(model, tmp_path, max_shard_bytes=SHARD_BYTES)
    index = json.loads((tmp_path / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert files_in(tmp_path) == sorted(["config.json", "generation_config.json", INDEX, *shards])
    assert set(index["weight_map"]) == text_keys(hf_tensors)
    total = sum(t.numel() * t.element_size() for t in checkpoint_state(model).values())
    assert index["metadata"]["total_size"] == total
    for key, tensor in checkpoint_state(load_model(tmp_path)).items():
        assert same_bits(tensor, hf_tensors[key]), key

    save_pretrained(model, tmp_path, max_shard_bytes=2 * SHARD_BYTES)  # fewer shards: the extra old ones go
    fewer = sorted(set(json.loads((tmp_path / INDEX).read_text())["weight_map"].values()))
    assert 1 < len(fewer) < len(shards)
    assert files_in(tmp_path) == sorted(["config.json", "generation_config.json", INDEX, *fewer])

    save_pretrained(model, tmp_path)  # unsharded: the index and every shard go
    assert files_in(tmp_path) == ["config.json", "generation_config.json", SINGLE]
    for key, tensor in checkpoint_state(load_model(tmp_path)).items():
        assert same_bits(tensor, hf_tensors[key]), key


def test_hf_save_dgemma_load_dgemma_save_hf_load_gives_identical_logits(hf_dir, tmp_path):
    save_pretrained(load_model(hf_dir), tmp_path)
    g = torch.Generator().manual_seed(0)
    prompt, canvas = torch.randint(0, 512, (2, 11), generator=g), torch.randint(0, 512, (2, 16), generator=g)
    expected, _ = hf_logits(load_hf_model(hf_dir), prompt, canvas)
    actual, _ = hf_logits(load_hf_model(tmp_path), prompt, canvas)
    assert torch.equal(actual, expected)


def _fail_halfway(calls_before_failure: int = 0) -> Callable[..., None]:
    """A save_file that writes the file for real, then (after `calls_before_failure` good calls) cuts it in half and
    raises, like a full disk."""
    real_save_file = ckpt.save_file
    calls = 0

    def save_file(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
        nonlocal calls
        real_save_file(tensors, filename, metadata=metadata)
        calls += 1
        if calls > calls_before_failure:
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

    return save_file


def test_interrupted_save_leaves_no_partial_file(hf_dir, ckpt_dir, tmp_path, monkeypatch):
    model = load_model(hf_dir)
    monkeypatch.setattr(ckpt, "save_file", _fail_halfway())

    fresh = tmp_path / "fresh"
    with pytest.raises(OSError, match=r"(?i)no space left"):
        save_pretrained(model, fresh)
    assert files_in(fresh) == []  # no weights, no temporary file, and no config that would describe missing weights

    before = {name: (ckpt_dir / name).read_bytes() for name in files_in(ckpt_dir)}
    with pytest.raises(OSError, match=r"(?i)no space left"):
        save_pretrained(model, ckpt_dir)
    assert {name: (ckpt_dir / name).read_bytes() for name in files_in(ckpt_dir)} == before
    load_model(ckpt_dir)


def test_interrupted_sharded_resave_never_mixes_old_and_new_shards(hf_dir, sharded_dir, tmp_path, monkeypatch):
    path = Path(shutil.copytree(sharded_dir, tmp_path / "ckpt"))
    model = load_model(hf_dir)
    model.norm.weight.data += 1  # the new save differs from the old one
    monkeypatch.setattr(ckpt, "save_file", _fail_halfway(calls_before_failure=1))
    with pytest.raises(OSError, match=r"(?i)no space left"):
        save_pretrained(model, path, max_shard_bytes=SHARD_BYTES)
    assert not (path / INDEX).exists()  # shard 1 is new, the rest old: nothing may point at that mix
    assert not [name for name in files_in(path) if name.endswith(".tmp")]
    with pytest.raises(CheckpointError, match=f"no {re.escape(SINGLE)} or {re.escape(INDEX)}"):
        load_model(path)


def test_a_leftover_temporary_file_is_never_taken_for_weights(ckpt_dir):
    leftover = f".{SINGLE}.1234.abcd.tmp"
    shutil.copy(ckpt_dir / SINGLE, ckpt_dir / leftover)  # even a complete one
    load_model(ckpt_dir)  # ignored next to real weights
    (ckpt_dir / SINGLE).unlink()
    with pytest.raises(CheckpointError, match=rf"no {re.escape(SINGLE)} .*interrupted save.*{re.escape(leftover)}"):
        load_model(ckpt_dir)


def test_saved_files_get_the_usual_permissions(hf_dir, tmp_path):
    save_pretrained(load_model(hf_dir), tmp_path, max_shard_bytes=SHARD_BYTES)
    umask = os.umask(0)
    os.umask(umask)
    for name in files_in(tmp_path):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


# --- one clear error per failure mode -----------------------------------------------------------------------------

def test_missing_directory(tmp_path):
    path = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: not a checkpoint directory \(does not exist"):
        load_model(path)


def test_directory_without_config_json(ckpt_dir):
    (ckpt_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / 'config.json'))}: file not found"):
        load_model(ckpt_dir)


def test_invalid_json_config_names_line_and_column(ckpt_dir):
    (ckpt_dir / "config.json").write_text('{\n  "text_config": {,\n}\n')
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(ckpt_dir / 'config.json'))}: invalid JSON at line 2, "
                       r"column 19"):  # the comma
        load_model(ckpt_dir)


def test_invalid_config_value_names_the_field(ckpt_dir):
    edit_json(ckpt_dir / "config.json", lambda c: c["text_config"].update(hidden_size=0))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(ckpt_dir / 'config.json'))}: hidden_size: must be a "
                       r"positive int, got 0"):
        load_model(ckpt_dir)


def test_missing_weights_file(ckpt_dir):
    (ckpt_dir / SINGLE).unlink()
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir))}: no {re.escape(SINGLE)} or "
                       rf"{re.escape(INDEX)}$"):
        load_model(ckpt_dir)


def test_pickle_only_checkpoint_is_refused_and_never_unpickled(ckpt_dir, tmp_path, monkeypatch):
    marker, armed = tmp_path / "unpickled", tmp_path / "armed"
    pickle.loads(pickle_trap(armed))
    assert armed.exists()  # the trap works: unpickling it would create the marker
    (ckpt_dir / SINGLE).unlink()
    (ckpt_dir / "pytorch_model.bin").write_bytes(pickle_trap(marker))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("dgemma tried to unpickle a file")

    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, name, refuse)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir))}: only pickle weights "
                       r"\(pytorch_model\.bin\); dgemma never unpickles"):
        load_model(ckpt_dir)
    assert not marker.exists()


def test_missing_key_is_named(ckpt_dir):
    key = "model.decoder.layers.2.self_attn.q_proj.weight"
    edit_weights(ckpt_dir / SINGLE, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / SINGLE))}: does not match "
                       rf"{re.escape(str(ckpt_dir / 'config.json'))}: 1 missing key\(s\): {re.escape(key)}$"):
        load_model(ckpt_dir)


def test_unexpected_decoder_key_is_named(ckpt_dir):
    key = "model.decoder.layers.0.self_attn.q_proj.bias"
    edit_weights(ckpt_dir / SINGLE, lambda t: t.update({key: torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / SINGLE))}: does not match .*config\.json: "
                       rf"1 unexpected key\(s\): {re.escape(key)}$"):
        load_model(ckpt_dir)


def test_wrong_shape_names_key_and_both_shapes(ckpt_dir):
    key = "model.decoder.layers.1.self_attn.k_norm.weight"  # full layer: head_dim 48
    edit_weights(ckpt_dir / SINGLE, lambda t: t.update({key: torch.ones(16)}))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(ckpt_dir / SINGLE))}: does not match .*1 shape "
                       rf"mismatch\(es\): {re.escape(key)} in model\.safetensors has shape \(16,\) but config\.json "
                       r"implies \(48,\)$"):
        load_model(ckpt_dir)


def test_truncated_safetensors_file(ckpt_dir):
    """safetensors checks the header against the file size when the file is opened, so the cut is caught there."""
    data = (ckpt_dir / SINGLE).read_bytes()
    (ckpt_dir / SINGLE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / SINGLE))}: not a readable safetensors file "
                       r"\(.*incomplete metadata, file not fully covered\)"):
        load_model(ckpt_dir)


def test_file_that_is_not_safetensors(ckpt_dir):
    (ckpt_dir / SINGLE).write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                                  dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / SINGLE))}: not a readable safetensors "
                       r"file \(.*header"):
        load_model(ckpt_dir)


def test_index_naming_a_missing_shard(sharded_dir, tmp_path):
    path = Path(shutil.copytree(sharded_dir, tmp_path / "ckpt"))
    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    shard = sorted(set(weight_map.values()))[1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path / INDEX))}: shard {re.escape(repr(shard))} "
                       rf"\(holding 'model\.decoder\.[^']+'\) does not exist in {re.escape(str(path))}$"):
        load_model(path)


def test_index_mapping_a_key_to_a_shard_without_it(sharded_dir, tmp_path):
    path = Path(shutil.copytree(sharded_dir, tmp_path / "ckpt"))
    key = "model.decoder.norm.weight"

    def move(index: dict[str, Any]) -> None:
        others = sorted(set(index["weight_map"].values()) - {index["weight_map"][key]})
        index["weight_map"][key] = others[0]

    edit_json(path / INDEX, move)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path / INDEX))}: maps {re.escape(repr(key))} to "
                       r"model-\d+-of-\d+\.safetensors, which does not contain it$"):
        load_model(path)


def test_index_without_weight_map(sharded_dir, tmp_path):
    path = Path(shutil.copytree(sharded_dir, tmp_path / "ckpt"))
    edit_json(path / INDEX, lambda index: index.pop("weight_map"))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path / INDEX))}: no 'weight_map' object"):
        load_model(path)


def test_generation_config_eos_outside_the_vocabulary(ckpt_dir):
    edit_json(ckpt_dir / "generation_config.json", lambda g: g.update(eos_token_id=[1, 512]))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / 'generation_config.json'))}: "
                       r"eos_token_id=\(1, 512\) is outside the vocabulary \(token ids \[512\] >= vocab_size=512"):
        load_model(ckpt_dir)


def test_config_json_token_id_outside_the_vocabulary(ckpt_dir):
    edit_json(ckpt_dir / "config.json", lambda c: c["text_config"].update(bos_token_id=600))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / 'config.json'))}: bos_token_id=600 is "
                       r"outside the vocabulary \(token ids \[600\] >= vocab_size=512"):
        load_model(ckpt_dir)


def test_config_with_more_layers_than_the_weights_names_the_missing_keys(ckpt_dir):
    def six_layers(c: dict[str, Any]) -> None:
        text = c["text_config"]
        text["num_hidden_layers"] = 6
        text["layer_types"] += ["sliding_attention", "full_attention"]
        text["per_layer_config"]["5"] = text["per_layer_config"]["3"]

    edit_json(ckpt_dir / "config.json", six_layers)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / SINGLE))}: does not match "
                       rf"{re.escape(str(ckpt_dir / 'config.json'))}: \d+ missing key\(s\): "
                       r"model\.decoder\.layers\.4\.[^;]*\(and \d+ more\)$"):
        load_model(ckpt_dir)


def test_config_with_another_hidden_size_names_key_and_both_shapes(ckpt_dir):
    edit_json(ckpt_dir / "config.json", lambda c: c["text_config"].update(hidden_size=32))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / SINGLE))}: does not match .*config\.json: "
                       r"\d+ shape mismatch\(es\): model\.decoder\.embed_tokens\.weight in model\.safetensors has "
                       r"shape \(512, 64\) but config\.json implies \(512, 32\)"):
        load_model(ckpt_dir)


def test_non_floating_tensor_is_named(ckpt_dir):
    key = "model.decoder.norm.weight"
    edit_weights(ckpt_dir / SINGLE, lambda t: t.update({key: torch.ones(64, dtype=torch.int64)}))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt_dir / SINGLE))}: does not match .*1 non-floating "
                       rf"tensor\(s\): {re.escape(key)} in model\.safetensors is I64, not floating point$"):
        load_model(ckpt_dir)


def test_a_training_run_directory_loads_its_newest_complete_checkpoint(tmp_path):
    """`load_model(RUN)` (and so `dgemma generate --model RUN`) takes the newest checkpoint whose trainer state is in
    place; a run with none is a clear error."""
    from dgemma import DiffusionGemma, init_weights, preset
    from dgemma.io.dirkind import CHECKPOINTS, STATE

    run = tmp_path / "run"
    (run / CHECKPOINTS).mkdir(parents=True)
    with pytest.raises(CheckpointError, match="a training run with no complete checkpoint yet"):
        load_model(run)
    for step, seed in ((5, 1), (10, 2), (15, 3)):
        ckpt = run / CHECKPOINTS / f"step-{step:07d}"
        save_pretrained(init_weights(DiffusionGemma(preset("tiny")), seed=seed), ckpt)
        if step != 15:  # step 15 is an interrupted save: weights written, trainer state missing
            (ckpt / STATE).write_bytes(b"")
    want = load_model(run / CHECKPOINTS / "step-0000010")
    got = load_model(run)
    assert all(torch.equal(a, b) for a, b in zip(want.state_dict().values(), got.state_dict().values(), strict=True))


# --- one loader, one saver ----------------------------------------------------------------------------------------

def test_save_and_load_round_trip_with_the_generation_settings_beside_the_model(tmp_path):
    """`save_pretrained(model, dir, generation_config=)` and `load_model(dir, dtype=, device=)` /
    `load_generation_config(dir)`: the same weights, the same logits, the settings carried beside the model."""
    from dgemma import DiffusionGemma, GenerationConfig, init_weights, load_generation_config, preset

    model = init_weights(DiffusionGemma(preset("tiny")), seed=3).eval()
    settings = GenerationConfig(eos_token_id=(1, 4), pad_token_id=0, max_denoising_steps=7)
    save_pretrained(model, tmp_path / "ckpt", generation_config=settings)
    loaded = load_model(tmp_path / "ckpt")
    assert type(loaded) is DiffusionGemma and loaded.config == model.config
    assert load_generation_config(tmp_path / "ckpt") == settings
    state, again = model.state_dict(), loaded.state_dict()
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 20), generator=g)
    canvas = torch.randint(0, 512, (2, 16), generator=g)
    assert torch.equal(loaded(ids, canvas), model(ids, canvas))

    bf16 = load_model(str(tmp_path / "ckpt"), dtype=torch.bfloat16, device="cpu")
    assert bf16.dtype == torch.bfloat16 and bf16.device.type == "cpu"
    assert torch.equal(bf16(ids, canvas), model.to(torch.bfloat16)(ids, canvas))
    save_pretrained(loaded, tmp_path / "default")  # no settings given: transformers' defaults
    assert load_generation_config(tmp_path / "default") == GenerationConfig()
    for read in (load_model, load_generation_config):
        with pytest.raises(CheckpointError, match="does not exist"):
            read(tmp_path / "nowhere")
