"""`dgemma finetune`: fine-tune a checkpoint on chats, OpenAI-style `{"messages": [...]}` JSONL (docs/training.md,
"Fine-tuning"). The same trainer as `dgemma train --init-from MODEL --objective sft`, with a fine-tuning recipe:
no weight decay, a short warm-up, lr 2e-5 for every weight or 2e-4 with --lora-rank R (adapters on the frozen
base, saved as adapter_config.json + adapter_model.safetensors), --seq-len 8 canvases. Every TrainConfig flag
overrides it; --resume continues RUN, bit-exactly."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from dgemma.cli.flags import MODEL_HELP, add_config_args, positive_float, positive_int
from dgemma.cli.train import run_training
from dgemma.train.config import TrainConfig
from dgemma.train.run_dir import read_record

FIXED = ("init_from", "objective", "preset", "vocab_size")  # set by --model and the command itself


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("finetune", help="fine-tune a checkpoint on chats (full or LoRA)", description=__doc__)
    p.add_argument("--model", type=Path, required=True, metavar="DIR",
                   help="the model to start from, with its tokenizer.json: " + MODEL_HELP)
    p.add_argument("--data", type=Path, required=True, metavar="CHATS.jsonl",
                   help='one {"messages": [{"role": ..., "content": ...}, ...]} per line')
    p.add_argument("--out", type=Path, required=True, metavar="RUN", help="the run directory (new or empty, unless "
                   "--resume)")
    p.add_argument("--resume", action="store_true", help="continue RUN from its newest intact checkpoint")
    p.add_argument("--minutes", type=positive_float, metavar="M", help="stop (and checkpoint) after M minutes")
    p.add_argument("--until-step", type=positive_int, metavar="N", help="stop (and checkpoint) at step N")
    p.add_argument("--print-config", action="store_true", help="print the resolved TrainConfig as JSON and exit")
    add_config_args(p, TrainConfig, skip=FIXED, shown=RECIPE_SHOWN)
    p.set_defaults(func=run)


# What `recipe` sets, as --help shows it (the values that depend on the model or on --lora-rank, in words).
RECIPE_SHOWN = {"seq_len": "8 canvases of the model", "lr": "2e-5, or 2e-4 with --lora-rank", "min_lr": "lr / 10",
                "warmup_steps": 10, "max_steps": 500, "weight_decay": 0.0, "eval_every": 50, "save_every": 100}


def recipe(model: Path, lora_rank: int) -> TrainConfig:
    """The fine-tuning defaults for `model` (its canvas sets --seq-len)."""
    base = TrainConfig(init_from=str(model), objective="sft", lora_rank=lora_rank)
    lr = 2e-4 if lora_rank else 2e-5
    return base.replace(seq_len=8 * base.model_config.canvas_length, lr=lr, min_lr=lr / 10, warmup_steps=10,
                        max_steps=500, weight_decay=0.0, eval_every=50, save_every=100)


def finetune_config(args: argparse.Namespace) -> TrainConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if f.name not in FIXED and getattr(args, f.name) is not None}
    record = read_record(args.out) if args.resume else None
    if record is not None:
        base = TrainConfig.from_json(record["train_config"], str(args.out / "run.json"))
    else:
        base = recipe(args.model, given.get("lora_rank", 0))
    return base.replace(**given, init_from=str(args.model), objective="sft")


def run(args: argparse.Namespace) -> int:
    return run_training(args, finetune_config, f"chat with: dgemma chat --model {args.out}")
