"""What `dgemma generate`, `chat`, `serve` (and `eval`, `bench`) build from their flags before they run: the device
and torch's threads, the model and its tokenizer (one call to dgemma/weights/loading.py), the chat template, the
grammar the output must follow, and the refusal of an autoregressive run where only the diffusion sampler runs."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from dgemma.cli.flags import UsageError, constraint_flag
from dgemma.data.templates import ChatTemplate, load_chat_template
from dgemma.data.tokenizer import TURN_END, Tokenizer, check_vocab, load_tokenizer
from dgemma.io import fsio
from dgemma.io.threads import usable_cores
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.weights import loading
from dgemma.weights.loading import DTYPES


def device_of(name: str) -> str:
    """A --device choice as a torch device name: "auto" is CUDA when available, else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def set_threads(threads: int | None) -> None:
    """--threads: torch's intra-op threads for the rest of the process; None: the cores this process may use
    (dgemma.io.threads.usable_cores, the one rule for a default thread count, the same however busy the machine is),
    unless OMP_NUM_THREADS says (a user's, or torchrun's one per rank)."""
    if threads is not None or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(usable_cores() if threads is None else threads)


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
    if getattr(args, "dist", None) is not None:  # --parallel under torchrun: this rank's shard (dgemma/parallel/)
        from dgemma.cli.parallel import split

        model = split(model, args)
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
    """The one line of a command that runs only the diffusion sampler (chat), pointed at an AR run."""
    if autoregressive(args):
        raise UsageError(f"{args.model} is an autoregressive run (objective 'ar'); {command} runs the diffusion "
                         f"sampler, which does not decode it: use `dgemma generate --model {args.model}` (token by "
                         f"token), or give {command} the diffusion run")
