"""LoRA adapters on DiffusionGemma with `peft` (the `finetune` extra), saved in the format peft, transformers and vLLM
load: `adapter_config.json` + `adapter_model.safetensors`, keyed by the transformers module paths.

peft wraps dgemma's modules directly (`peft.inject_adapter_in_model`): attention projections are `nn.Linear`s
(`lora.Linear`), the routed experts are 3-D parameters (E, out, in), which peft's `target_parameters` adapts per expert
(`ParamWrapper`). dgemma's names are the checkpoint's without `model.decoder.` (dgemma/weights/checkpoint.py), so one
target regex matches both models:

    dgemma        layers.3.self_attn.q_proj
    transformers  model.decoder.layers.3.self_attn.q_proj   and   model.encoder.language_model.layers.3.self_attn.q_proj

transformers' encoder and decoder are separate modules that share (tie) their weights, so peft puts one LoRA on each;
dgemma runs both roles through one module with one LoRA. The adapter file therefore holds each layer's LoRA twice,
under the decoder and the encoder path, with the same values: loaded by peft on the transformers model, it computes
what dgemma computes. (The vision tower's `q_proj`s are wrapped linears the regex leaves alone.)

Merging (`merge`) folds each delta into the base weight once, through peft's own `merge()` of each layer, and unwraps
the layers, which leaves a plain DiffusionGemma that `save_pretrained` writes as an ordinary checkpoint. Do not merge
with peft's `merge_and_unload` on the transformers model: the tied encoder and decoder weights would get the delta
twice.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from dgemma.io import fsio, quiet
from dgemma.io.dirkind import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from dgemma.model.config import ConfigError, ModelConfig, is_real, read_json
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.weights.checkpoint import (
    CheckpointError,
    open_safetensors,
    read_tensor,
    resolve_model_dir,
    write_safetensors,
)

CONFIG, WEIGHTS = ADAPTER_CONFIG, ADAPTER_WEIGHTS
PREFIX = "base_model.model."  # what peft's PeftModel puts before the wrapped model's module paths
DECODER, ENCODER = "model.decoder.", "model.encoder.language_model."
ATTENTION = r"(model\.(decoder|encoder\.language_model)\.)?layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
MODULE_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")  # what an adapter's target_modules may name
PARAMETER_NAMES = ("experts.gate_up_proj", "experts.down_proj")  # and its target_parameters
TARGETS = {  # --lora-targets: modules (a regex fully matching a module path) and 3-D parameters adapted
    "attention": (ATTENTION, []),
    "attention+experts": (ATTENTION, list(PARAMETER_NAMES)),
}


class AdapterError(CheckpointError):
    """An adapter that cannot be used with this model; the message names the file, the key and the shapes."""


def _peft() -> Any:
    try:
        with quiet.optional_imports():  # torchao's and torch's import-time noise (dgemma/io/quiet.py)
            import peft
    except ImportError:
        raise AdapterError("LoRA needs peft: pip install 'dgemma[finetune]'") from None
    return peft


def check_adapter(rank: int, alpha: float, targets: str, config: ModelConfig) -> None:
    """Refuse (ConfigError) LoRA settings that cannot train on a model of `config` (TrainConfig checks its own with
    it, so before anything is built or written): the rank an int >= 0 (0: no adapters) and at most the width of the
    narrowest adapted layer (min(in, out) of a projection or an expert matrix; a larger rank adds nothing but
    parameters), alpha > 0 (alpha / rank scales the update). The widths come from the model built on the meta device
    (no memory), so the rule holds for every geometry."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"TrainConfig.lora_rank: must be an int >= 0, got {rank!r}")
    if not alpha > 0:
        raise ConfigError(f"TrainConfig.lora_alpha: must be > 0 (the update B A is scaled by alpha / rank), got "
                          f"{alpha!r}")
    if rank <= 0:
        return
    with torch.device("meta"):
        model = DiffusionGemma(config)
    narrowest, width = narrowest_adapted(model, *TARGETS[targets])
    if rank > width:
        raise ConfigError(f"TrainConfig.lora_rank: {rank} exceeds the width of the narrowest adapted layer "
                          f"({narrowest}: {width}); use a rank from 1 to {width}")


def narrowest_adapted(model: torch.nn.Module, modules: str | list[str], parameters: Any) -> tuple[str, int]:
    """The adapted layer of `model` with the smallest width min(in, out), and that width: the largest rank a LoRA
    on it can use (a larger one adds parameters and nothing else). `modules` is peft's `target_modules` (a regex
    matched against whole module names, or a list of module-name suffixes), `parameters` its `target_parameters`
    (expert matrices, by name suffix)."""
    def targeted(name: str) -> bool:
        if isinstance(modules, str):
            return re.fullmatch(modules, name) is not None
        return any(name == m or name.endswith("." + m) for m in modules)

    widths = {name: min(m.in_features, m.out_features) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and targeted(name)}
    widths |= {name: min(p.shape[-2:]) for name, p in model.named_parameters()
               if any(name.endswith(target) for target in parameters or ())}
    if not widths:
        raise ConfigError(f"no layer of the model matches the LoRA targets {modules!r} / {parameters!r}")
    narrowest = min(widths, key=lambda name: widths[name])
    return narrowest, widths[narrowest]


def lora_config(rank: int, alpha: float, targets: str, base: str | None = None) -> Any:
    """The peft LoraConfig of an adapter on `targets` (a key of TARGETS)."""
    modules, parameters = TARGETS[targets]
    return _peft().LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=modules,
                              target_parameters=parameters or None, base_model_name_or_path=base)


def attach(model: DiffusionGemma, config: Any) -> DiffusionGemma:
    """Wrap the targeted modules of `model` in place with freshly initialised LoRA layers (A random, B zero, so the
    model computes what it did); only the LoRA weights stay trainable."""
    peft = _peft()
    try:
        peft.inject_adapter_in_model(config, model, adapter_name="default")
    except ValueError as e:
        raise AdapterError(f"cannot put LoRA on this model: {e}") from None
    return model


def has_lora(model: torch.nn.Module) -> bool:
    return any(".lora_A." in n for n, _ in model.named_parameters())


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights under the keys peft saves for the transformers model (decoder and encoder copies)."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_A." not in name and ".lora_B." not in name:
            continue
        key = name.replace(".default.", ".")
        t = t.detach().to("cpu").contiguous()
        out[PREFIX + DECODER + key] = t
        if key.startswith("layers."):
            out[PREFIX + ENCODER + key] = t.clone()  # its own storage: safetensors refuses shared tensors
    return out


def config_json(config: Any) -> dict[str, Any]:
    """adapter_config.json's content, as peft's `PeftConfig.save_pretrained` writes it (sets as lists)."""
    d = config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}


def save_adapter(model: torch.nn.Module, config: Any, path: str | os.PathLike[str],
                 generation_config: GenerationConfig | None = None) -> None:
    """Write adapter_config.json and adapter_model.safetensors (and `generation_config`, which
    `load_generation_config` reads) into `path`, each atomically (temporary name, fsync, rename), weights first."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = adapter_state(model)
    write_safetensors(path / WEIGHTS, state)
    if generation_config is not None:
        fsio.write_text(path / "generation_config.json", json.dumps(generation_config.to_hf(), indent=2) + "\n")
    fsio.write_text(path / CONFIG, json.dumps(config_json(config), indent=2, sort_keys=True) + "\n")


def is_adapter(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    return (path / CONFIG).is_file() and not (path / "config.json").is_file()


def read_config(path: str | os.PathLike[str]) -> Any:
    """The LoraConfig of an adapter directory; AdapterError naming the file and field if it is not a plain LoRA."""
    file = Path(path) / CONFIG
    try:  # config.json's reading rules: a regular file, a size cap, no nesting too deep for the parser
        d = read_json(file)
    except ConfigError as e:
        raise AdapterError(str(e)) from None
    if d.get("peft_type") != "LORA":
        raise AdapterError(f"{file}: field 'peft_type' must be \"LORA\", got {d.get('peft_type')!r}")
    for field, ok in (("use_dora", False), ("lora_bias", False), ("bias", "none")):
        if d.get(field, ok) != ok:
            raise AdapterError(f"{file}: field {field!r} = {d[field]!r}: dgemma reads plain LoRA adapters only")
    _check_fields(file, d)
    d.pop("runtime_config", None)  # what peft's from_pretrained drops; the file is not read a second time
    try:
        LoraConfig = _peft().LoraConfig
        return LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**d))
    except (TypeError, ValueError) as e:
        raise AdapterError(f"{file}: not a LoRA config peft reads ({e})") from None


def _check_fields(file: Path, d: dict[str, Any]) -> None:
    """The fields dgemma relies on, each refused with the file and the key: `r` a positive int, `lora_alpha` a
    finite number > 0, `target_modules` a regex or a non-empty list of attention projection names, and
    `target_parameters` null or a list of expert parameter names."""
    r, alpha = d.get("r"), d.get("lora_alpha")
    if not _positive_int(r):
        raise AdapterError(f"{file}: field 'r' must be a positive integer (the LoRA rank), got {r!r}")
    if not _positive_real(alpha):
        raise AdapterError(f"{file}: field 'lora_alpha' must be a finite number > 0, got {alpha!r}")
    modules = d.get("target_modules")
    if isinstance(modules, str):
        if not modules:
            raise AdapterError(f"{file}: field 'target_modules' is an empty regex; give the modules to adapt")
    elif not isinstance(modules, list) or not modules or not all(
            isinstance(m, str) and m.rsplit(".", 1)[-1] in MODULE_NAMES for m in modules):
        raise AdapterError(f"{file}: field 'target_modules' must be a regex or a non-empty list of module names "
                           f"({', '.join(MODULE_NAMES)}), got {modules!r}")
    for field, ok, what in (("alpha_pattern", _positive_real, "a finite number > 0"),
                            ("rank_pattern", _positive_int, "a positive integer")):
        pattern = d.get(field) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{file}: field {field!r} must be an object of module name -> {what}, got {pattern!r}")
        for key, v in pattern.items():
            if not ok(v):
                raise AdapterError(f"{file}: field {field!r}[{key!r}] must be {what}, got {v!r}")
    parameters = d.get("target_parameters")
    if parameters is not None and (not isinstance(parameters, list) or not all(
            isinstance(p, str) and p in PARAMETER_NAMES for p in parameters)):
        raise AdapterError(f"{file}: field 'target_parameters' must be null or a list of "
                           f"{', '.join(PARAMETER_NAMES)}, got {parameters!r}")


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _positive_real(v: Any) -> bool:
    return is_real(v) and v > 0


def _check_rank(model: DiffusionGemma, config: Any, file: Path) -> None:
    """An adapter's rank is at most the width of the narrowest layer it adapts (`narrowest_adapted`)."""
    try:
        name, width = narrowest_adapted(model, config.target_modules, config.target_parameters)
    except ConfigError as e:
        raise AdapterError(f"{file}: {e}") from None
    if config.r > width:
        raise AdapterError(f"{file}: field 'r' = {config.r} is larger than {name}'s width {width}; a LoRA rank is "
                           "at most the width of the layers it adapts")


def load_adapter(model: DiffusionGemma, path: str | os.PathLike[str]) -> Any:
    """Attach the adapter in `path` to `model` (in place) and load its weights; returns its LoraConfig."""
    config = read_config(path)
    _check_rank(model, config, Path(path) / CONFIG)
    attach(model, config)
    with torch.no_grad():
        for name, t in read_weights(model, path).items():
            model.get_parameter(name).copy_(t)
    return config


def read_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The LoRA tensors of the adapter file in `path` by dgemma's names without peft's adapter name
    (`layers.3.self_attn.q_proj.lora_A.weight`): the decoder copies, once each encoder copy is checked to equal its
    decoder copy. AdapterError naming the file and the key for an unreadable file, a key outside the decoder and
    encoder paths, or copies that differ. Which keys a model needs, and their shapes, `read_weights` checks."""
    file = Path(path) / WEIGHTS
    try:  # the checkpoint's reading rules: a regular file, its length as its header says, every tensor finite
        with open_safetensors(file) as f:
            tensors = {k: read_tensor(f, file, k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
    except CheckpointError as e:
        raise AdapterError(str(e)) from None
    found: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        rest = key.removeprefix(PREFIX)
        if rest.startswith(DECODER):
            found[rest.removeprefix(DECODER)] = t
        elif not rest.startswith(ENCODER):
            raise AdapterError(f"{file}: unexpected key {key!r} (not under {PREFIX + DECODER} or {PREFIX + ENCODER})")
    for key, t in tensors.items():
        rest = key.removeprefix(PREFIX)
        if rest.startswith(ENCODER):
            name = rest.removeprefix(ENCODER)
            if name not in found or not torch.equal(found[name], t):
                raise AdapterError(f"{file}: {key!r} differs from its decoder copy {PREFIX + DECODER + name!r}: "
                                   "dgemma's encoder and decoder share one set of weights, so one LoRA")
    return found


def read_weights(model: DiffusionGemma, path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The LoRA tensors of the adapter in `path`, by `model`'s parameter names (`model` has the adapter attached).
    A file that does not fit the model (another geometry, missing or extra keys, encoder and decoder copies that
    differ) raises AdapterError naming the file, the key and the shapes."""
    expected = {k.replace(".default.", "."): k for k in model.state_dict() if ".lora_A." in k or ".lora_B." in k}
    shapes = dict(model.state_dict().items())
    file = Path(path) / WEIGHTS
    found = read_tensors(path)
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    wrong = [f"{PREFIX + DECODER + k} has shape {tuple(found[k].shape)} but this model needs "
             f"{tuple(shapes[expected[k]].shape)}" for k in sorted(set(found) & set(expected))
             if found[k].shape != shapes[expected[k]].shape]
    if missing or unexpected or wrong:
        parts = [f"{len(keys)} {what} key(s), e.g. {PREFIX + DECODER + keys[0]}"
                 for keys, what in ((missing, "missing"), (unexpected, "unexpected")) if keys] + wrong[:3]
        raise AdapterError(f"{file}: does not fit this model (an adapter for another checkpoint?): "
                           + "; ".join(parts))
    return {expected[k]: t for k, t in found.items()}


def merge(model: DiffusionGemma) -> DiffusionGemma:
    """Fold every LoRA delta into its base weight (peft's per-layer `merge`) and unwrap the layers, in place: a plain
    DiffusionGemma whose state dict is the checkpoint's again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    while True:
        layer = next(((n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)), None)
        if layer is None:
            return model
        name, module = layer  # outermost first: nested wrappers (two expert parameters) unwrap one at a time
        with torch.no_grad():
            module.merge()
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, module.base_layer)


def base_of(path: Path, config: Any, base: str | os.PathLike[str] | None) -> Path:
    where = base if base is not None else config.base_model_name_or_path
    if not where:
        raise AdapterError(f"{path / CONFIG}: no base_model_name_or_path; pass the base checkpoint")
    if not Path(where).exists():
        raise AdapterError(f"{path / CONFIG}: its base checkpoint {where} (base_model_name_or_path) does not exist; "
                           "pass the base checkpoint")
    return resolve_model_dir(where)
