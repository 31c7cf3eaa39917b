"""Every config dataclass of the package builds from empty and from partial input, or fails with the package's own
error naming the field; never a TypeError or AttributeError. And no code reads a dataclass field's default as a
class attribute, which on a `slots=True` dataclass is a member descriptor (issue 10: `dgemma train` without
--preset and `ModelConfig.from_hf({})` both failed that way)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any

import pytest

import dgemma
from dgemma.eval.bench import BenchSettings
from dgemma.eval.evaluate import EvalError, EvalSettings
from dgemma.model.config import PRESETS, ConfigError, ModelConfig, RopeConfig
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.train.config import TRAIN_PRESETS, TrainConfig

PACKAGE = Path(dgemma.__file__).parent
# The user-facing settings dataclasses: what a file, a command line or a caller fills in, field by field.
CONFIG_CLASSES = (ModelConfig, GenerationConfig, RopeConfig, TrainConfig, BenchSettings, EvalSettings)


def all_dataclasses() -> dict[str, type]:
    """Every dataclass defined in a dgemma module, by qualified name."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], "dgemma."):
        if info.name.endswith("__main__"):  # importing it runs the command line
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == info.name:
                found[f"{info.name}.{obj.__qualname__}"] = obj
    return found


def test_every_settings_dataclass_is_covered():
    names = {n for n, cls in all_dataclasses().items() if cls.__name__.endswith(("Config", "Settings"))}
    covered = {f"{cls.__module__}.{cls.__qualname__}" for cls in CONFIG_CLASSES}
    assert names == covered, f"config dataclasses not covered by this test: {sorted(names - covered)}"


def test_no_code_reads_a_dataclass_default_as_a_class_attribute():
    """`SomeConfig.field` or `cls.field` (inside a dataclass) where `field` is a dataclass field: on a slots dataclass
    that is a member descriptor, on any other it silently ignores a subclass's or an instance's value."""
    classes = all_dataclasses()
    fields_of = {cls.__name__: {f.name for f in dataclasses.fields(cls)} for cls in classes.values()}
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls_node in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + [tree]:
            own = fields_of.get(getattr(cls_node, "name", ""), set())
            for node in ast.walk(cls_node):
                if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                    continue
                name, attr = node.value.id, node.attr
                if (name in fields_of and attr in fields_of[name]) or (name == "cls" and attr in own):
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}.{attr}")
    assert not bad, "dataclass fields read as class attributes:\n" + "\n".join(sorted(set(bad)))


# --- builders: each config class from a dict, the way the package reads it ---------------------------------------

def build(cls: type, d: dict[str, Any]) -> Any:
    if cls is ModelConfig:
        return ModelConfig.from_hf(d)
    if cls is GenerationConfig:
        return GenerationConfig.from_hf(d)
    if cls is RopeConfig:
        return RopeConfig.from_hf(d, "rope")
    if cls is TrainConfig:
        return TrainConfig.from_json(d)
    obj = cls(**d)
    if cls is EvalSettings:
        obj.check()
    return obj


def full_inputs(cls: type) -> list[dict[str, Any]]:
    """Complete inputs in each class's own serialized form."""
    if cls is ModelConfig:
        return [json.loads(json.dumps(c.to_hf()))["text_config"] for c in PRESETS.values()]
    if cls is GenerationConfig:
        return [GenerationConfig(eos_token_id=(1, 4), pad_token_id=0, bos_token_id=2).to_hf()]
    if cls is RopeConfig:
        return [RopeConfig("proportional", 1e6, 0.25).to_hf(), RopeConfig().to_hf()]
    if cls is TrainConfig:
        return [c.to_json() for c in TRAIN_PRESETS.values()]
    if cls is BenchSettings:
        return [dataclasses.asdict(BenchSettings(preset="tiny", steps=2, repeats=1))]
    return [dataclasses.asdict(EvalSettings(steps=(4,), num_prompts=2))]


ERRORS = (ConfigError, EvalError)  # EvalSettings.check reports every bad setting as one EvalError


def partial_inputs(cls: type) -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = [("empty", {})]
    for i, full in enumerate(full_inputs(cls)):
        for key in full:
            cases.append((f"{i}: only {key}", {key: full[key]}))
            cases.append((f"{i}: all but {key}", {k: v for k, v in full.items() if k != key}))
    return cases


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_config_builds_from_empty_and_partial_input_or_says_which_field(cls):
    assert build(cls, {}) == (cls() if cls is not ModelConfig else build(cls, {}))  # empty: the documented defaults
    for full in full_inputs(cls):
        build(cls, full)  # every complete input builds
    outcomes = {"built": 0, "refused": 0}
    for label, d in partial_inputs(cls):
        try:
            build(cls, d)
            outcomes["built"] += 1
        except ERRORS as e:
            outcomes["refused"] += 1
            assert str(e).strip(), f"{cls.__name__} {label}: an empty error message"
            # The message names a field of the class (or a key of the input), so a user knows what to fix.
            names = {f.name for f in dataclasses.fields(cls)} | set(d) | {"preset", "rope", "impls"}
            assert any(n in str(e) for n in names), f"{cls.__name__} {label}: {e} names no field"
        except Exception as e:  # a TypeError/AttributeError/KeyError is the bug class this test guards against
            pytest.fail(f"{cls.__name__} from {label} {d!r} raised {type(e).__name__}: {e}")
    assert outcomes["built"] > 0


def test_empty_inputs_give_the_documented_defaults():
    """The defaults each class documents: transformers' class defaults for config.json keys (not the 26B values),
    transformers' generation defaults, the cpu-small training recipe."""
    m = ModelConfig.from_hf({})
    assert (m.vocab_size, m.hidden_size, m.num_hidden_layers, m.sliding_window, m.num_experts, m.canvas_length) == \
        (262_144, 2304, 30, 512, 0, 256)
    assert m.layer_types[5] == m.layer_types[-1] == "full_attention" and m.layer_types[0] == "sliding_attention"
    assert ModelConfig.from_hf({"num_hidden_layers": 3}).layer_types == ("sliding_attention",) * 2 + \
        ("full_attention",)
    assert GenerationConfig.from_hf({}) == GenerationConfig()
    assert GenerationConfig().max_denoising_steps == 48 and GenerationConfig().entropy_bound == 0.1
    assert TrainConfig.from_json({}) == TrainConfig()
    assert TRAIN_PRESETS["cpu-small"] == TrainConfig(time_embedding=True, diffusion_time="continuous")
    assert TrainConfig().preset == "cpu-small"
    assert RopeConfig.from_hf({}, "rope") == RopeConfig()


@pytest.mark.parametrize("build_bad, message", [
    (lambda: TrainConfig.from_json({"preset": "huge"}), "preset: must be one of"),
    (lambda: TrainConfig.from_json({"nope": 1}), "unknown TrainConfig field"),
    (lambda: ModelConfig.from_hf({"hidden_size": "wide"}), "hidden_size: must be a positive int"),
    (lambda: ModelConfig.from_hf({"num_experts": 4, "top_k_experts": 9}), "top_k_experts"),
    (lambda: ModelConfig.from_hf({"unknown_key": 1, "sliding_window": -1}), "sliding_window"),
    (lambda: GenerationConfig.from_hf({"t_max": 0.1}), "t_max: must be >= t_min"),
    (lambda: RopeConfig.from_hf({"rope_type": "proportional", "theta": 1}, "rope"), "unsupported RoPE keys"),
    (lambda: BenchSettings(preset=None), "exactly one of a preset and a checkpoint"),
])
def test_bad_partial_inputs_are_config_errors_naming_the_key(build_bad, message):
    with pytest.raises(ConfigError, match=message):
        build_bad()
