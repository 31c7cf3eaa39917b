"""Hugging Face checkpoint I/O: `load(dir, build)` (what `dgemma.load_model` calls), `read_generation_config(dir)`
and `save_pretrained(model, dir, generation_config=)`. This module knows the file layout and the key table, not the
model class. A checkpoint's generation settings travel beside the model, never on it.

Layout (what transformers 5.23 writes for `DiffusionGemmaForBlockDiffusion`): `config.json`,
`generation_config.json`, and `model.safetensors` or shards with `model.safetensors.index.json`. Text weights live
under `model.decoder.*`; the encoder shares them (tied) except its own `layer_scalar` buffers under
`model.encoder.language_model.layers.N.layer_scalar`. The head is tied to the embedding and not saved. Vision
tensors (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`) are skipped: dgemma is text-only.

dgemma's parameter names are the checkpoint's without the `model.decoder.` prefix, so the key table is:

    model.decoder.<name>                                   <-> <name>
    model.encoder.language_model.layers.N.layer_scalar     <-> layers.N.encoder_layer_scalar

Reading follows one rule for every file of a checkpoint (config.json, generation_config.json, the index, the weights,
the tokenizer files): a file may be a symlink, followed the way `cat` follows it (the Hugging Face cache layout,
`snapshots/REV/*` -> `../../blobs/HASH`, loads as it is), but what it resolves to must be a regular file (a FIFO, a
device or a directory is refused at once, never read: dgemma/io/fsio.py). A file named inside another file (a shard in
the index's `weight_map`) must be a plain relative name in the directory: not absolute, no `..`, no NUL.

Loading reads tensors lazily and casts them one at a time into a model allocated once in the target dtype, so
peak host memory stays near one copy of the weights. Pickle files are never unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dgemma.io import fsio
from dgemma.io.dirkind import ADAPTER_CONFIG, CHECKPOINTS, INDEX, SHARDED_STATE, SINGLE, STATE
from dgemma.model.config import ConfigError, ModelConfig, read_json
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.weights.quantize import quantization_of

DECODER = "model.decoder."
IGNORED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "model.encoder.language_model.", "lm_head.")
PICKLE_GLOBS = ("pytorch_model*.bin", "pytorch_model.bin.index.json", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# The tokenizer and chat template files that travel with a checkpoint's weights (a run copies them into each one).
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not match its config; the message names file, key and shapes."""


class NonFiniteError(ValueError):
    """A NaN or an infinity where training needs a number (a loss, a gradient, a tensor about to be saved)."""


def to_checkpoint_key(name: str) -> str:
    """dgemma state-dict name -> checkpoint key."""
    if name.endswith(".encoder_layer_scalar"):
        return "model.encoder.language_model." + name.removesuffix(".encoder_layer_scalar") + ".layer_scalar"
    return DECODER + name


def _weight_files(path: Path) -> tuple[dict[str, Path], Path]:
    """(checkpoint key -> the safetensors file that holds it, the file that lists the keys: the index or the single
    file). Only `model.safetensors` and the shards its index names are read: temporary files of an interrupted save
    (`.model.safetensors.*.tmp`) and pickle files never are."""
    index, single = path / INDEX, path / SINGLE
    if os.path.lexists(index):
        try:
            weight_map = read_json(index).get("weight_map")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor names to shard files")
        files = {}
        for key, shard in weight_map.items():
            problem = fsio.plain_name_problem(shard)
            if problem:
                raise CheckpointError(f"{index}: weight_map[{key!r}]: {problem}; a shard must be named by a plain "
                                      f"file name inside {path}")
            f = path / shard
            if not os.path.lexists(f):
                raise CheckpointError(f"{index}: shard {shard!r} (holding {key!r}) does not exist in {path}")
            files[key] = f
        return files, index
    if os.path.lexists(single):
        with open_safetensors(single) as f:
            return {key: single for key in f.keys()}, single  # noqa: SIM118 (safe_open is not a Mapping)
    if (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: a sharded training checkpoint (torch.distributed.checkpoint, written by "
                              "torchrun ranks) without consolidated weights; write them with `dgemma export RUN "
                              "--out DIR`")
    pickles = sorted({p.name for pattern in PICKLE_GLOBS for p in path.glob(pattern)})
    if pickles:
        raise CheckpointError(f"{path}: only pickle weights ({', '.join(pickles)}); dgemma never unpickles files. "
                              "Convert them to safetensors first (for example with transformers' save_pretrained).")
    leftovers = sorted(p.name for p in path.glob(".model*.tmp"))
    hint = f" (only temporary files of an interrupted save, never loaded: {', '.join(leftovers)})" if leftovers else ""
    raise CheckpointError(f"{path}: no {SINGLE} or {INDEX}{hint}")


def open_safetensors(file: Path) -> Any:
    """safe_open, which checks the header and that the file is exactly as long as it says (so a truncated file fails
    here, not at the first read), of a regular file (the reading rule of the module docstring)."""
    try:
        fsio.check_regular(file)
        return safe_open(str(file), framework="pt", device="cpu")
    except fsio.UnsafeFileError as e:  # a FIFO, a device, a directory
        raise CheckpointError(str(e)) from None
    except (SafetensorError, OSError, ValueError) as e:  # truncated, not safetensors, unreadable, a dangling link
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _is_float(st_dtype: str) -> bool:
    """safetensors dtype names: F16, BF16, F32, F64, F8_E4M3, ... are floating; I*, U*, BOOL, C64 are not."""
    return st_dtype.startswith("F") or st_dtype == "BF16"


def list_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints of a training run, oldest first (temporary directories of an interrupted save are
    hidden: a checkpoint is complete once its trainer state is in place; that of a sharded one is a JSON file)."""
    root = Path(run) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()
             and ((p / STATE).is_file() or (p / SHARDED_STATE).is_file())]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run: Path) -> Path | None:
    ckpts = list_checkpoints(run)
    return ckpts[-1] if ckpts else None


def resolve_model_dir(path: str | os.PathLike[str]) -> Path:
    """A model directory for `path`: itself when it holds config.json, else, for a training run directory, its
    newest complete checkpoint (so `load_model(RUN)` and `dgemma generate --model RUN` work)."""
    path = Path(path)
    if (path / "config.json").is_file() or not (path / CHECKPOINTS).is_dir():
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"{path}: a training run with no complete checkpoint yet (nothing in {CHECKPOINTS}/)")
    return ckpt


def read_model_config(path: Path) -> ModelConfig:
    """The ModelConfig of the checkpoint directory `path` (its config.json); CheckpointError naming the file for a
    directory that is not a checkpoint, a LoRA adapter, or a malformed config."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory" + ("" if path.exists() else " (does not exist)"))
    config_path = path / "config.json"
    if not config_path.exists() and (path / ADAPTER_CONFIG).is_file():
        raise CheckpointError(f"{path}: a LoRA adapter, not a whole checkpoint: load it with dgemma.load_model(path) "
                              "(merged into its base), or write a merged checkpoint with `dgemma export`")
    try:
        raw = read_json(config_path)
        text = raw.get("text_config", raw)
        if not isinstance(text, dict) or not {"hidden_size", "num_hidden_layers", "vocab_size"} & set(text):
            raise ConfigError(f"{config_path}: no text_config and no model geometry (hidden_size, num_hidden_layers, "
                              "vocab_size): not a DiffusionGemma config.json")
        config = ModelConfig.from_hf(raw, source=str(config_path))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    _check_token_ids(config, config_path, config)
    return config


def read_generation_config(path: Path, config: ModelConfig) -> GenerationConfig | None:
    """The generation_config.json of the directory `path` (a checkpoint, or a LoRA adapter that carries its own),
    its token ids checked against `config`'s vocabulary; None when there is none. CheckpointError naming the file."""
    gen_path = path / "generation_config.json"
    if not gen_path.exists():
        return None
    try:
        generation_config = GenerationConfig.from_hf(read_json(gen_path), source=str(gen_path))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    _check_token_ids(generation_config, gen_path, config)
    return generation_config


def _check_token_ids(settings: ModelConfig | GenerationConfig, source: Path, config: ModelConfig) -> None:
    """The special token ids of `settings` (read from `source`) lie inside `config`'s vocabulary."""
    V = config.vocab_size
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(settings, name)
        ids = v if isinstance(v, tuple) else () if v is None else (v,)
        bad = [i for i in ids if i >= V]
        if bad:
            raise CheckpointError(f"{source}: {name}={v} is outside the vocabulary (token ids {bad} >= "
                                  f"vocab_size={V} in config.json)")


def load(path: str | os.PathLike[str], build: Callable[[ModelConfig], torch.nn.Module],
         dtype: torch.dtype | None = None, device: torch.device | str | None = None,
         preflight: Callable[[ModelConfig, torch.dtype], None] | None = None,
         stream: tuple[Callable[[torch.nn.Module], set[str]], Callable[..., None]] | None = None) -> Any:
    """Load a Hugging Face-format DiffusionGemma directory, or a training run's newest checkpoint, into the module
    `build(config)` makes (on the meta device; `dgemma.load_model` builds a DiffusionGemma). `dtype` defaults
    to the checkpoint's (that of `model.decoder.embed_tokens.weight`). Every problem with the checkpoint raises
    `CheckpointError`: a malformed config or generation_config.json, a shard outside the directory, a missing,
    misshapen or non-finite tensor.
    `preflight(config, dtype)` runs once the config and dtype are known, before any memory is allocated (the
    memory pre-flight of `dgemma.load_model`). `stream = (names, place)`: the state-dict names `names(model)` are
    not allocated; `place(model, name, read, file, key)` puts each in the model instead, from `read()` (the checked
    tensor) or from the file itself (a quantized load: `weights/quantize.py`; expert offload: `weights/offload.py`)."""
    path = resolve_model_dir(path)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    config = read_model_config(path)
    read_generation_config(path, config)  # checked here too: a checkpoint loads whole or not at all
    config_path = path / "config.json"
    files, listing = _weight_files(path)
    with torch.device("meta"):
        model = build(config)
    expected = model.state_dict()
    wanted = {to_checkpoint_key(n): n for n in expected}
    unexpected = sorted(k for k in files if k not in wanted and not k.startswith(IGNORED))
    missing = sorted(k for k in wanted if k not in files)

    with ExitStack() as stack:
        handles = {f: stack.enter_context(open_safetensors(f)) for f in sorted(set(files.values()))}
        if listing == path / INDEX:
            held = {f: set(h.keys()) for f, h in handles.items()}
            for key, f in files.items():
                if key not in held[f]:
                    raise CheckpointError(f"{listing}: maps {key!r} to {f.name}, which does not contain it")
        wrong_shape, wrong_dtype = [], []
        for key, name in wanted.items():
            if key not in files:
                continue
            info = handles[files[key]].get_slice(key)
            shape, st_dtype = tuple(info.get_shape()), info.get_dtype()
            if shape != tuple(expected[name].shape):
                wrong_shape.append(f"{key} in {files[key].name} has shape {shape} but {config_path.name} implies "
                                   f"{tuple(expected[name].shape)}")
            if not _is_float(st_dtype):
                wrong_dtype.append(f"{key} in {files[key].name} is {st_dtype}, not floating point")
        problems = (_describe(missing, "missing key(s)") + _describe(unexpected, "unexpected key(s)")
                    + _describe(wrong_shape, "shape mismatch(es)") + _describe(wrong_dtype, "non-floating tensor(s)"))
        if problems:
            raise CheckpointError(f"{listing}: does not match {config_path}: " + "; ".join(problems))
        if dtype is None:
            embed = to_checkpoint_key("embed_tokens.weight")
            dtype = _SAFETENSORS_DTYPES.get(handles[files[embed]].get_slice(embed).get_dtype(), torch.float32)
        if preflight is not None:
            preflight(config, dtype)
        # Allocated once, in the target dtype; each checkpoint tensor is read, cast into place and released before
        # the next is read, so peak host memory is the model plus its largest tensor.
        streamed = stream[0](model) if stream is not None else set()
        model = _allocate(model.to(dtype=dtype), device or "cpu", skip=streamed)
        target = model.state_dict()
        for key, name in wanted.items():
            read = lambda key=key: read_tensor(handles[files[key]], files[key], key)
            if name in streamed:
                stream[1](model, name, read, files[key], key)  # type: ignore[index]
            else:
                target[name].copy_(read())  # casts to the model dtype and moves to its device
    return model.eval()


def read_tensor(handle: Any, file: Path, key: str) -> torch.Tensor:
    """One tensor read from an open safetensors file, refused if unreadable or not finite (one cheap pass)."""
    try:
        tensor = handle.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read {key!r} ({e})") from None
    if not bool(torch.isfinite(tensor).all()):
        nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
        raise CheckpointError(f"{file}: tensor {key!r} holds non-finite values ({nan} NaN, {inf} inf "
                              f"of {tensor.numel()}); the checkpoint is corrupt or from a diverged run")
    return tensor


def _allocate(model: torch.nn.Module, device: torch.device | str, skip: set[str]) -> torch.nn.Module:
    """`model.to_empty(device=device)`, except that the tensors named in `skip` stay unallocated (meta)."""
    if not skip:
        return model.to_empty(device=device)
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None and f"{prefix}.{key}".lstrip(".") not in skip:
                    empty = torch.empty_like(t, device=device)
                    table[key] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) \
                        else empty
    return model


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _describe(items: list[str], label: str, limit: int = 5) -> list[str]:
    """One problem line, like `2 missing key(s): a, b`, naming at most `limit` items."""
    if not items:
        return []
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return [f"{len(items)} {label}: {', '.join(items[:limit])}{more}"]


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint keys (contiguous, on the CPU)."""
    return {to_checkpoint_key(n): t.detach().to("cpu").contiguous() for n, t in model.state_dict().items()}


def save_pretrained(model: Any, path: str | os.PathLike[str], *, max_shard_bytes: int = 5 * 2**30,
                    generation_config: GenerationConfig | None = None) -> None:
    """Write the transformers layout: config.json, generation_config.json (`generation_config`, default
    transformers' defaults) and safetensors, sharded above `max_shard_bytes`. Every file is written to a temporary
    name, flushed to disk and renamed, so an interrupted save never leaves a file that looks complete
    (dgemma/io/fsio.py: `atomic_write`; a full disk is one NoSpaceError). A tensor with a NaN or an infinity is
    refused (NonFiniteError) before anything is written. The vision tower is not written (text-only).

    Weights are written before the configs. A save interrupted part-way leaves the earlier weights loadable (or, when
    it was overwriting the shards of an earlier sharded save, no index at all, so nothing half-old half-new loads)."""
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    mode = quantization_of(model)
    if mode is not None:
        raise ValueError(f"a model quantized to {mode} cannot be saved in the checkpoint layout (its weights are no "
                         "longer float tensors): save the unquantized model, quantize when loading")
    path = Path(path)
    generation_config = generation_config or GenerationConfig()
    state = checkpoint_state(model)
    bad = nonfinite_tensor(iter(state.items()))
    if bad:
        raise NonFiniteError(f"{bad} has non-finite values (NaN or inf); nothing written to {path}")
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    stale = [path / SINGLE, path / INDEX, *path.glob("model-*-of-*.safetensors")]
    if len(shards) == 1:
        written = [SINGLE]
        write_safetensors(path / SINGLE, shards[0])
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        if any((path / n).exists() for n in names):  # the old index must not point at a mix of old and new shards
            (path / INDEX).unlink(missing_ok=True)
        for name, shard in zip(names, shards, strict=True):
            write_safetensors(path / name, shard)
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in shard}}
        fsio.write_text(path / INDEX, json.dumps(index, indent=2) + "\n")
        written = [*names, INDEX]
    for f in stale:  # weights of an earlier save in another layout would shadow or contradict these
        if f.name not in written and f.exists():
            f.unlink()
    fsio.write_text(path / "config.json", json.dumps(model.config.to_hf(), indent=2) + "\n")
    fsio.write_text(path / "generation_config.json", json.dumps(generation_config.to_hf(), indent=2) + "\n")


def write_safetensors(dest: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, written atomically (dgemma/io/fsio.py: a full disk is a NoSpaceError naming `dest`)."""
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    fsio.atomic_write(dest, lambda tmp, _f: save_file(tensors, str(tmp), metadata={"format": "pt"}), needed=needed)


def nonfinite_tensor(named: Iterator[tuple[str, Any]]) -> str | None:
    """The name of the first tensor (nested in dicts and lists too) with a NaN or an infinity, else None."""
    for name, value in named:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                return name
        elif isinstance(value, dict):
            found = nonfinite_tensor((f"{name}.{k}", v) for k, v in value.items())
            if found:
                return found
        elif isinstance(value, (list, tuple)):
            found = nonfinite_tensor((f"{name}.{i}", v) for i, v in enumerate(value))
            if found:
                return found
    return None

