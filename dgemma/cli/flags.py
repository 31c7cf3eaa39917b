"""The command line's vocabulary, shared by every subcommand: dgemma's parser (one line per error), the argparse types
every numeric flag is parsed with (so a bad number is argparse's own error at parse time, before anything is read or
written), one flag per config field (TrainConfig's, and GenerationConfig's sampler flags, generated from the fields'
metadata), the flags that choose, load and run a model, the grammar flags, and UsageError."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any, NoReturn

from dgemma.model.attention import IMPLS
from dgemma.model.config import ConfigError
from dgemma.sampling.generation_config import CHECKPOINT_KEYS, FLOAT32_MAX, GROUPS, GenerationConfig, seed_problem
from dgemma.weights.loading import DTYPES  # the one table of dtype names (--dtype of every command)

# --dtype and --device take these choices on every command, the same as TrainConfig's ("auto": dgemma decides;
# tests/cli/test_cli_design.py holds every command to them).
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("int8", "int4")
MODEL_HELP = ("a checkpoint directory (Hugging Face layout) or a training run directory (its newest complete "
              "checkpoint; a LoRA run or adapter is merged into its base)")
IMPL_HELP = "kernels: the readable reference path or the fast one (SDPA, grouped experts; dgemma/model/kernels.py)"
THREADS_HELP = "the cores this process may use"


class UsageError(ConfigError):
    """A bad command-line input (prompt, ids, tokenizer, flags). A ConfigError, so `dgemma` prints it on one line
    and exits 2."""


def shown_path(path: Path) -> str:
    """A path as a command printed in a report or a figure's footer shows it: relative to the current directory when
    it lies inside it (so pictures made from a run directory carry no absolute temporary paths), else as given."""
    if path.is_absolute():
        try:
            return str(path.relative_to(Path.cwd()))
        except ValueError:
            pass
    return str(path)


class HelpFormatter(argparse.HelpFormatter):
    """Every `--help` shows each option's default: "(default: X)" is appended to the help of an option that has a
    default (not None, not a switch's False) unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and has_default(action) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def has_default(action: argparse.Action) -> bool:
    """Whether an option has a default worth showing: a value, not None (= not given) nor a switch's False (0 is a
    value: `is`, not `in`, since 0 == False)."""
    return not any(action.default is v for v in (None, False, argparse.SUPPRESS))


class Parser(argparse.ArgumentParser):
    """dgemma's argparse parser (its subcommands' parsers are this class too, so all share HelpFormatter): a bad flag
    is one line on stderr, `dgemma CMD: error: argument --x: ...`, and exit 2, like every other error a user can fix
    (no usage block; `dgemma CMD --help` shows the flags)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


# --- argparse types: each returns the parsed value or raises ArgumentTypeError, which argparse shows as
# `dgemma CMD: error: argument --flag: MESSAGE` and exit 2 ------------------------------------------------------------

def int_value(text: str) -> int:
    """Any int (its range checked where the setting has its rule)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def finite_float(text: str) -> float:
    """A finite number float32 holds (what the model computes in): NaN, an infinity or 1e39 are refused."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a finite number (|x| <= {FLOAT32_MAX:.4g}), got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An int >= 1."""
    v = int_value(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {text!r}")
    return v


def nonnegative_int(text: str) -> int:
    """An int >= 0."""
    v = int_value(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (minutes, a target standard error)."""
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def seed(text: str) -> int:
    """A seed (dgemma.sampling.generation_config.is_seed, the one rule for seeds)."""
    v = int_value(text)
    problem = seed_problem(v, given=text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return v


def token_biases(text: str) -> dict[int, float]:
    """ID=BIAS[,ID=BIAS] (--logit-bias): token ids and their biases (GenerationConfig checks the ranges)."""
    out: dict[int, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"give ID=BIAS pairs separated by commas, got {item!r}") from None
        if not sep:
            raise argparse.ArgumentTypeError(f"give ID=BIAS pairs separated by commas, got {item!r}")
    return out


# --- one flag per config field --------------------------------------------------------------------------------------

# A dataclass's fields are checked by the dataclass (TrainConfig's and GenerationConfig's __post_init__: finite floats,
# positive counts, choices), the one home of those rules; argparse only parses them, and a seed with the one seed rule.
_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str,
          "tuple[tuple[int, float], ...]": token_biases}


def add_config_args(p: Any, cls: type, skip: tuple[str, ...] = (), shown: dict[str, Any] | None = None) -> None:
    """One flag per dataclass field but `skip` (`add_field_arg`)."""
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            add_field_arg(p, f, (shown or {}).get(f.name, f.default))


def add_field_arg(p: Any, f: dataclasses.Field[Any], shown: Any) -> argparse.Action:
    """The --kebab-case flag of the dataclass field `f` on `p` (a parser or a group), typed from its annotation, with
    the field's help, choices (None, which no flag can give, left out) and metavar (else one by type); returns its
    argparse action. It defaults to
    None (= not given), so the defaults live only in the dataclass and its presets; `--help` shows `shown`, the value
    a run gets without the flag, unless the help already says it."""
    text = f.metadata.get("help") or ""
    if "default" not in text:
        text += f" (default: {shown})"
    kw: dict[str, Any] = {"default": None, "dest": f.name, "help": text.replace("%", "%%")}
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if annotation in ("bool", "bool | None"):
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = seed if f.name == "seed" else _TYPES[annotation]
        kw["choices"] = tuple(c for c in f.metadata.get("choices") or () if c is not None) or None
        by_type = {int: "N", float: "X", seed: "SEED", str: "NAME"}.get(kw["type"])
        kw["metavar"] = None if kw["choices"] else f.metadata.get("metavar", by_type)
    return p.add_argument("--" + f.name.replace("_", "-"), **kw)


def add_sampler_args(p: argparse.ArgumentParser, seed_help: str | None = "the sampling seed (default: random)",
                     config: type[GenerationConfig] = GenerationConfig) -> None:
    """A flag per setting of `config` that has one (`GenerationConfig.flags`), in its group of `--help`
    (generation_config.GROUPS), each overriding the checkpoint's generation_config.json for this run. They are
    GenerationConfig settings, so GenerationConfig checks them (`overrides`: one rule for the command line and the
    server); --seed is argparse's `seed` (left out with seed_help=None)."""
    groups = {title: p.add_argument_group(title, text) for title, text in GROUPS.items()}
    for f in config.flags():
        add_field_arg(groups[f.metadata.get("group", "sampler")], f, _default_shown(f))
    if seed_help is not None:
        groups["sampler"].add_argument("--seed", type=seed, metavar="SEED", help=seed_help)


def _default_shown(f: dataclasses.Field[Any]) -> Any:
    """What a run gets without the sampler flag of `f`: the field's words for it, the checkpoint's value for what
    generation_config.json carries, else the field's default."""
    if "shown" in f.metadata:
        return f.metadata["shown"]
    return "the checkpoint's" if f.name in CHECKPOINT_KEYS else f.default


def overrides(args: argparse.Namespace, gcfg: GenerationConfig) -> dict[str, Any]:
    """generate()'s keyword overrides from the sampler flags given (GenerationConfig.overrides checks them)."""
    return gcfg.overrides(**{f.name: getattr(args, f.name) for f in type(gcfg).flags()})


# --- the model, how it runs, and what its output must be -------------------------------------------------------------

def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that choose and load the model: --model or --preset --random-init, dtype, device, quantization,
    offload, the memory pre-flight, and how it runs (add_runtime_args)."""
    p.add_argument("--model", type=Path, metavar="DIR", help=MODEL_HELP)
    p.add_argument("--preset", metavar="PRESET", help="a named preset (model/config.py PRESETS), with --random-init "
                   "(smoke tests)")
    p.add_argument("--random-init", action="store_true", help="random weights for --preset (dgemma.init_weights)")
    p.add_argument("--tokenizer", type=Path, metavar="PATH", help="tokenizer.json or its folder (default: in --model)")
    add_dtype_device_args(p, dtype_help="the checkpoint's, float32 for a preset")
    p.add_argument("--force", action="store_true",
                   help="skip the memory pre-flight (load and generate even if the estimate exceeds free memory)")
    add_quantize_arg(p, "weight-only quantization at load time (torchao: pip install 'dgemma[quant]'); int4 on CUDA")
    p.add_argument("--offload-experts", action="store_true",
                   help="keep the routed experts out of memory: memory-mapped from the checkpoint (CPU) or in pinned "
                        "host memory (CUDA), read per layer")


def add_dtype_device_args(p: argparse.ArgumentParser, dtype_help: str, device: str | None = "cpu") -> None:
    """--dtype and --device with the same choices on every command (DTYPE_CHOICES, DEVICES)."""
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=f"weights dtype (default auto: {dtype_help})")
    p.add_argument("--device", default=device, choices=DEVICES, help="where the model runs (auto: CUDA when available)")


def add_quantize_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--quantize", choices=QUANTIZATIONS, help=help)


def add_runtime_args(p: argparse.ArgumentParser, threads_help: str = THREADS_HELP) -> None:
    """How a loaded model runs, on every command that runs one: --impl (the attention and expert kernels,
    dgemma/model/attention.py) and --threads (torch's intra-op threads, set before the model is loaded)."""
    p.add_argument("--impl", choices=IMPLS, default="fast", help=IMPL_HELP)
    add_threads_arg(p, threads_help)


def add_threads_arg(p: argparse.ArgumentParser, default_help: str = THREADS_HELP) -> None:
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help=f"torch intra-op threads (default: {default_help})")


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured output (dgemma/sampling/constraint.py, llguidance): at most one grammar the output must follow."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", type=Path, metavar="FILE", help="the output is JSON valid against the JSON Schema "
                   "in FILE (needs llguidance: pip install 'dgemma[grammar]')")
    g.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    g.add_argument("--regex", metavar="PATTERN", help="the output matches the regular expression PATTERN whole")
    g.add_argument("--grammar", type=Path, metavar="FILE", help="the output follows the Lark grammar in FILE "
                   "(llguidance's dialect)")


def constraint_flag(args: argparse.Namespace) -> str | None:
    """The grammar flag given (`--regex ''` too: an empty pattern is refused, not ignored), or None."""
    return next((f"--{f.replace('_', '-')}" for f in ("json_schema", "json_object", "regex", "grammar")
                 if getattr(args, f, None) not in (None, False)), None)
