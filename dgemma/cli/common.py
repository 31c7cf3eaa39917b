"""What the subcommands share: the argparse types every numeric flag is parsed with (so a bad number is argparse's own
error at parse time, before anything is read or written), and for `dgemma generate` and `dgemma chat` model and
tokenizer loading, the sampler flags, UsageError, and the streaming display (committed text, and in a terminal the
canvas being refined)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, NoReturn

import torch

from dgemma.data.templates import ChatTemplate, load_chat_template
from dgemma.data.tokenizer import TURN_END, Tokenizer, check_vocab, load_tokenizer
from dgemma.io import fsio
from dgemma.io.console import Streamer  # noqa: F401 (the subcommands' terminal view, re-exported)
from dgemma.io.threads import usable_cores
from dgemma.model.attention import IMPLS
from dgemma.model.config import ConfigError
from dgemma.sampling.generation_config import (
    FLOAT32_MAX,
    LITE_COMMITS,
    SAMPLERS,
    SEED_RANGE,
    TIME_LEVELS,
    GenerationConfig,
    is_seed,
)
from dgemma.weights import loading
from dgemma.weights.loading import DTYPES  # the one table of dtype names (--dtype of every command)

# --dtype and --device take these choices on every command, the same as TrainConfig's ("auto": dgemma decides;
# tests/cli/test_cli_design.py holds every command to them).
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("int8", "int4")
MODEL_HELP = ("a checkpoint directory (Hugging Face layout) or a training run directory (its newest complete "
              "checkpoint; a LoRA run or adapter is merged into its base)")


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


# --- argparse types: each returns the parsed value or raises ArgumentTypeError, which argparse shows as
# `dgemma CMD: error: argument --flag: MESSAGE` and exit 2 ------------------------------------------------------------

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
    if not is_seed(v):
        raise argparse.ArgumentTypeError(f"must be {SEED_RANGE}, got {text!r}")
    return v


# A dataclass's fields are checked by the dataclass (TrainConfig.__post_init__: finite floats, positive counts), the
# one home of those rules; argparse only parses them, and a seed with the one seed rule.
_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "str | None": str}


METAVARS = {"preset": "PRESET", "init_from": "DIR"}  # one metavar per concept, on every command


def add_config_args(p: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                    shown: dict[str, Any] | None = None) -> None:
    """One --kebab-case flag per dataclass field (but `skip`), typed from its annotation, with the field's help and
    choices. Every flag defaults to None (= not given), so the defaults live only in the dataclass and its presets;
    `--help` shows the value a run gets without the flag: `shown[name]` (a command's own recipe) or the field's."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        text = f.metadata.get("help") or ""
        if "default" not in text:
            text += f" (default: {(shown or {}).get(f.name, f.default)})"
        kw: dict[str, Any] = {"default": None, "dest": f.name, "help": text.replace("%", "%%")}
        if f.type in ("bool", "bool | None"):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = seed if f.name == "seed" else _TYPES[str(f.type)]
            kw["choices"] = f.metadata.get("choices")
            by_type = {int: "N", float: "X", seed: "SEED", str: "NAME"}[kw["type"]]
            kw["metavar"] = None if kw["choices"] else METAVARS.get(f.name, by_type)
        p.add_argument("--" + f.name.replace("_", "-"), **kw)


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


def device_of(name: str) -> str:
    """A --device choice as a torch device name: "auto" is CUDA when available, else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def add_quantize_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--quantize", choices=QUANTIZATIONS, help=help)


THREADS_HELP = "the cores this process may use"


def add_runtime_args(p: argparse.ArgumentParser, threads_help: str = THREADS_HELP) -> None:
    """How a loaded model runs, on every command that runs one: --impl (the attention and expert kernels,
    dgemma/model/attention.py) and --threads (torch's intra-op threads, set before the model is loaded)."""
    p.add_argument("--impl", choices=IMPLS, default="fast", help=IMPL_HELP)
    add_threads_arg(p, threads_help)


IMPL_HELP = "kernels: the readable reference path or the fast one (SDPA, grouped experts; dgemma/model/kernels.py)"


def add_threads_arg(p: argparse.ArgumentParser, default_help: str = THREADS_HELP) -> None:
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help=f"torch intra-op threads (default: {default_help})")


def set_threads(threads: int | None) -> None:
    """--threads: torch's intra-op threads for the rest of the process; None: the cores this process may use
    (dgemma.io.threads.usable_cores, the one rule for a default thread count, the same however busy the machine is),
    unless OMP_NUM_THREADS says (a user's, or torchrun's one per rank)."""
    if threads is not None or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(usable_cores() if threads is None else threads)


def add_sampler_args(p: argparse.ArgumentParser, seed_help: str | None = "the sampling seed (default: random)"
                     ) -> None:
    """Flags that override the checkpoint's generation_config.json for this run. They are GenerationConfig settings,
    so GenerationConfig checks them (`overrides`: one rule for the command line and the server); --seed is argparse's
    `seed` (left out with seed_help=None)."""
    p.add_argument("--sampler", choices=SAMPLERS, help="the sampler (default: entropy-bound, transformers'; "
                   "docs/sampling.md)")
    p.add_argument("--time-level", choices=TIME_LEVELS,
                   help="noise level told to a time-embedding model: canvas (what the canvas holds, default), "
                        "schedule (n/N, DiffusionGemma's original) or noise (always 1)")
    p.add_argument("--lite-commit", choices=LITE_COMMITS,
                   help="Lite's commit rule: scheduled (gradual, default) or seed (all at once, as the original Lite)")
    p.add_argument("--corrector-steps", type=int, metavar="K",
                   help="predictor-corrector: corrector passes after each ancestral step (default 1)")
    p.add_argument("--commit-threshold", type=float, metavar="P",
                   help="block-refinement, confidence: a drawn token at least this probable commits (default 0.95)")
    p.add_argument("--edit-threshold", type=float, metavar="P",
                   help="block-refinement, confidence: a committed token changes to a new draw this probable "
                        "(default: never)")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens to generate (default: the checkpoint's)")
    p.add_argument("--max-denoising-steps", type=int, metavar="N",
                   help="the most denoising steps per canvas; the sampler may stop earlier (default: the checkpoint's)")
    p.add_argument("--entropy-bound", type=float, metavar="X",
                   help="entropy budget of a denoising step (default: the checkpoint's)")
    p.add_argument("--t-min", type=float, metavar="X", help="final temperature (default: the checkpoint's)")
    p.add_argument("--t-max", type=float, metavar="X", help="initial temperature (default: the checkpoint's)")
    controls = p.add_argument_group("sampling controls", "on every denoising step's draw (docs/sampling.md, "
                                    "\"Sampling controls\"); default: off")
    controls.add_argument("--top-k", type=int, metavar="K", help="keep each position's K most probable tokens")
    controls.add_argument("--top-p", type=float, metavar="P",
                          help="keep the fewest most probable tokens of each position that reach probability P")
    controls.add_argument("--min-p", type=float, metavar="P",
                          help="keep the tokens at least P times as probable as the position's most probable one")
    controls.add_argument("--repetition-penalty", type=float, metavar="X",
                          help="> 1 makes tokens of the prompt and the output so far less likely")
    controls.add_argument("--presence-penalty", type=float, metavar="X",
                          help="subtracted from the logits of tokens the output holds ([-2, 2])")
    controls.add_argument("--frequency-penalty", type=float, metavar="X",
                          help="subtracted once per occurrence in the output ([-2, 2])")
    controls.add_argument("--logit-bias", type=_logit_bias, metavar="ID=BIAS[,ID=BIAS]",
                          help="added to those tokens' logits ([-100, 100])")
    if seed_help is not None:
        p.add_argument("--seed", type=seed, metavar="SEED", help=seed_help)


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


def constraint_from(args: argparse.Namespace, tok: Tokenizer | None, gcfg: GenerationConfig) -> Any:
    """The Constraint the flags ask for (None without one), ending at `gcfg`'s EOS; a UsageError naming the flag for
    what cannot be built."""
    from dgemma.sampling.constraint import Constraint, ConstraintError

    name = constraint_flag(args)
    if name is None:
        return None
    flag = name[2:].replace("-", "_")
    if tok is None:
        raise UsageError(f"{name} needs the model's tokenizer (the grammar is compiled against it): pass --tokenizer "
                         "PATH or put tokenizer.json in the model directory")
    common = dict(eos_token_id=gcfg.eos_token_id)
    try:
        if flag == "json_object":
            return Constraint.json_object(tok, **common)
        if flag == "regex":
            return Constraint.regex(args.regex, tok, **common)
        path = getattr(args, flag)
        try:
            text = fsio.read_bytes(path, 1 << 20).decode("utf-8")
        except (OSError, fsio.UnsafeFileError, UnicodeDecodeError) as e:
            raise UsageError(f"{name} {path}: cannot read ({fsio.reason(e) if isinstance(e, OSError) else e})"
                             ) from None
        return Constraint.json_schema(text, tok, **common) if flag == "json_schema" else Constraint.lark(text, tok,
                                                                                                         **common)
    except ConstraintError as e:
        raise UsageError(f"{name}: {e}") from None


def overrides(args: argparse.Namespace, gcfg: GenerationConfig) -> dict[str, Any]:
    """generate()'s keyword overrides from the sampler flags given (GenerationConfig.overrides checks them)."""
    return gcfg.overrides(sampler=args.sampler, time_level=args.time_level, lite_commit=args.lite_commit,
                          corrector_steps=args.corrector_steps, commit_threshold=args.commit_threshold,
                          edit_threshold=args.edit_threshold,
                          max_new_tokens=args.max_new_tokens,
                          max_denoising_steps=args.max_denoising_steps, entropy_bound=args.entropy_bound,
                          t_min=args.t_min, t_max=args.t_max, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          logit_bias=args.logit_bias)


def _logit_bias(text: str) -> dict[int, float]:
    """--logit-bias ID=BIAS[,ID=BIAS]: token ids and their biases (GenerationConfig checks the ranges)."""
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


def chat_template(args: argparse.Namespace) -> ChatTemplate:
    """The chat template of --tokenizer's directory, else --model's (`chat_template.jinja` or tokenizer_config.json's,
    rendered in jinja2's sandbox), else dgemma's built-in Gemma template: the one template of chat, generate --chat
    and serve."""
    dirs = [None if p is None else p if p.is_dir() else p.parent for p in (args.tokenizer, args.model)]
    return load_chat_template(*dirs)


def load(args: argparse.Namespace) -> tuple[Any, GenerationConfig, Tokenizer | None]:
    """The model (from --model, or --preset --random-init) running on --impl with --threads, the generation settings
    that travel beside it (the checkpoint's generation_config.json; a random preset's: `GenerationConfig.for_model`)
    and its tokenizer (None if there is none)."""
    if (args.model is None) == (args.preset is None):
        raise UsageError("give exactly one of --model DIR and --preset NAME")
    args.device = device_of(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    dtype = DTYPES.get(args.dtype)
    weights = dict(dtype=dtype, device=args.device, impl=args.impl, force=getattr(args, "force", False),
                   quantize=getattr(args, "quantize", None), offload_experts=getattr(args, "offload_experts", False))
    set_threads(args.threads)
    if args.preset is not None:
        if not args.random_init:
            raise UsageError(f"--preset {args.preset} has no weights: add --random-init, or load one with --model")
        model = loading.build_model(args.preset, **weights)
        gcfg = GenerationConfig.for_model(model.config)
    else:
        if args.random_init:
            raise UsageError("--random-init goes with --preset; --model loads the checkpoint's weights")
        model = loading.load_model(args.model, **weights)
        gcfg = loading.load_generation_config(args.model)
    path = args.tokenizer or (args.model / "tokenizer.json" if args.model is not None else None)
    tok = None
    if path is not None and (args.tokenizer is not None or path.exists()):
        try:
            tok = load_tokenizer(path)
            check_vocab(tok, model.config)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.preset is not None:  # a random model with a chat tokenizer stops at <turn|>, as Gemma's does
            gcfg = gcfg.stopping_at(tok.token_to_id(TURN_END))
    return model, gcfg, tok


def autoregressive(args: argparse.Namespace) -> bool:
    """Whether --model is an autoregressive run (objective 'ar': `dgemma demo`'s baseline, `dgemma train --objective
    ar`), as its train_config.json says (the architecture is the same): it decodes token by token, not with the
    diffusion sampler (which would print noise)."""
    if getattr(args, "model", None) is None:
        return False
    from dgemma.train.config import CONFIG_JSON
    from dgemma.weights.checkpoint import resolve_model_dir

    try:
        config = json.loads(fsio.read_text(resolve_model_dir(args.model) / CONFIG_JSON))
    except (OSError, ValueError, fsio.UnsafeFileError):  # none readable: not known to be autoregressive
        return False
    return isinstance(config, dict) and config.get("objective") == "ar"


def refuse_autoregressive(args: argparse.Namespace, command: str) -> None:
    """The one line of a command that runs only the diffusion sampler (chat, serve), pointed at an AR run."""
    if autoregressive(args):
        raise UsageError(f"{args.model} is an autoregressive run (objective 'ar'); {command} runs the diffusion "
                         f"sampler, which does not decode it: use `dgemma generate --model {args.model}` (token by "
                         f"token), or give {command} the diffusion run")


def run_training(args: argparse.Namespace, config_from_args: Any, next_step: str) -> int:
    """What `dgemma train` and `dgemma finetune` do with their parsed flags: resolve the TrainConfig (every rank of a
    torchrun job parses the same flags and files, so rank 0 alone shows what is wrong with them), run the trainer as
    this rank of the job (or as the one process), and print where to go next."""
    from dgemma.train.distributed import Dist, shared
    from dgemma.train.loop import train

    allow_new_data = getattr(args, "allow_new_data", False)
    try:
        cfg = config_from_args(args)
        if args.print_config:
            print(json.dumps(cfg.to_json(), indent=2))
            return 0
        if allow_new_data and not args.resume:
            raise ConfigError("--allow-new-data goes with --resume")
        dist = Dist.from_env(cfg.device)  # under torchrun: this rank of the job (the process group); else one process
    except Exception as e:
        shared(e)
        raise
    try:
        with dist.peers_lost():
            result = train(cfg, args.data, args.out, resume=args.resume, allow_new_data=allow_new_data,
                           max_minutes=args.minutes, until_step=args.until_step, dist=dist)
    finally:
        dist.close()
    val = f", held-out loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    if dist.is_main:
        print(f"done: step {result.step}{val}; {next_step}")
    return 0
