"""`dgemma finetune`: fine-tune a checkpoint on chats, OpenAI-style `{"messages": [...]}` JSONL (docs/training.md,
"Fine-tuning"). The same trainer as `dgemma train --init-from MODEL --objective sft`, with a fine-tuning recipe:
no weight decay, a short warm-up, lr 2e-5 for every weight or 2e-4 with --lora-rank R (adapters on the frozen
base, saved as adapter_config.json + adapter_model.safetensors), --seq-len 8 canvases. Every TrainConfig flag
overrides it; --resume continues RUN, bit-exactly."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from dgemma.cli.common import add_config_args
from dgemma.config import ConfigError
from dgemma.distributed import Dist, shared
from dgemma.run_dir import read_record
from dgemma.train import TrainConfig, train

FIXED = ("init_from", "objective", "preset", "vocab_size")  # set by --model and the command itself


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("finetune", help="fine-tune a checkpoint on chats (full or LoRA)", description=__doc__)
    p.add_argument("--model", type=Path, required=True, metavar="PATH",
                   help="the checkpoint to start from (Hugging Face layout with tokenizer.json, or a run)")
    p.add_argument("--data", type=Path, required=True, metavar="CHATS.jsonl",
                   help='one {"messages": [{"role": ..., "content": ...}, ...]} per line')
    p.add_argument("--out", type=Path, required=True, metavar="RUN", help="the run directory (new or empty, unless "
                   "--resume)")
    p.add_argument("--resume", action="store_true", help="continue RUN from its newest intact checkpoint")
    p.add_argument("--minutes", type=float, metavar="M", help="stop (and checkpoint) after M minutes")
    p.add_argument("--until-step", type=int, metavar="N", help="stop (and checkpoint) at step N")
    p.add_argument("--print-config", action="store_true", help="print the resolved TrainConfig as JSON and exit")
    add_config_args(p, TrainConfig, skip=FIXED)
    p.set_defaults(func=run)


def recipe(model: Path, lora_rank: int) -> TrainConfig:
    """The fine-tuning defaults for `model` (its canvas sets --seq-len)."""
    base = TrainConfig(init_from=str(model), objective="sft", lora_rank=lora_rank)
    lr = 2e-4 if lora_rank else 2e-5
    return base.replace(seq_len=8 * base.model_config.canvas_length, lr=lr, min_lr=lr / 10, warmup_steps=10,
                        max_steps=500, weight_decay=0.0, eval_every=50, save_every=100)


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if f.name not in FIXED and getattr(args, f.name) is not None}
    record = read_record(args.out) if args.resume else None
    if record is not None:
        base = TrainConfig.from_json(record["train_config"], str(args.out / "run.json"))
    else:
        base = recipe(args.model, given.get("lora_rank", 0))
    return base.replace(**given, init_from=str(args.model), objective="sft")


def run(args: argparse.Namespace) -> int:
    try:  # every rank of a torchrun job parses the same flags and files: rank 0 shows what is wrong with them
        if args.minutes is not None and args.minutes <= 0:
            raise ConfigError(f"--minutes must be > 0, got {args.minutes}")
        cfg = resolve_config(args)
        if args.print_config:
            print(json.dumps(cfg.to_json(), indent=2))
            return 0
    except Exception as e:
        raise shared(e) from None
    dist = Dist.from_env(cfg.device)  # under torchrun: this rank of the job; else one process
    try:
        result = train(cfg, args.data, args.out, resume=args.resume, max_minutes=args.minutes,
                       until_step=args.until_step, dist=dist)
    finally:
        dist.close()
    val = f", held-out loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    if dist.is_main:
        print(f"done: step {result.step}{val}; chat with: dgemma chat --model {args.out}")
    return 0
