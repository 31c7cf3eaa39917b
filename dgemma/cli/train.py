"""`dgemma train`: train a model from scratch on prepared token shards (or --resume a run), checkpointing into RUN.
Every TrainConfig field is a flag; --preset picks a recipe from dgemma.train.config.TRAIN_PRESETS (default cpu-small)
and the flags given override it (--print-config shows the result)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from dgemma.cli.flags import add_config_args, positive_float, positive_int
from dgemma.model.config import ConfigError
from dgemma.train.config import CONFIG_JSON, DEFAULT_PRESET, TrainConfig, train_preset
from dgemma.train.distributed import resumed_config
from dgemma.train.run_dir import read_record
from dgemma.weights.checkpoint import latest_checkpoint


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train a model from scratch on token shards (or resume a run)",
                              description=__doc__)
    add_run_args(p)
    add_config_args(p, TrainConfig, shown={"preset": DEFAULT_PRESET})  # TrainConfig's defaults: that recipe
    p.set_defaults(func=run)


def add_run_args(p: Any) -> None:
    """A run's flags besides its TrainConfig's (`train`, `distill`): its data and directory, resume, when to stop."""
    p.add_argument("--data", type=Path, required=True, metavar="DIR", help="a directory from `dgemma data prepare`")
    p.add_argument("--out", type=Path, required=True, metavar="RUN", help="the run directory (must be new or empty, "
                   "unless --resume)")
    p.add_argument("--resume", action="store_true", help="continue RUN from its newest intact checkpoint (bit-exact), "
                   "or start it when it has none: the same command starts a run and restarts it after a kill")
    p.add_argument("--allow-new-data", action="store_true", help="with --resume: continue on a data directory other "
                   "than the one the run was trained on (the resume is then not bit-exact)")
    p.add_argument("--minutes", type=positive_float, metavar="M", help="stop (and checkpoint) after M minutes")
    p.add_argument("--until-step", type=positive_int, metavar="N",
                   help="stop (and checkpoint) at step N; the learning-rate "
                   "schedule still spans --max-steps")
    p.add_argument("--print-config", action="store_true", help="print the resolved TrainConfig as JSON and exit")


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The preset's recipe (or, with --resume, the config the run recorded, when it has one), then the flags given."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if getattr(args, f.name) is not None}
    record = read_record(args.out) if args.resume else None
    ckpt = latest_checkpoint(args.out) if args.resume and record is None else None
    if record is not None:
        base = TrainConfig.from_json(record["train_config"], str(args.out / "run.json"))
        base = resumed_config(base, record, given)  # on another number of ranks: its windows per step
    elif ckpt is not None:  # a run from before run.json
        base = TrainConfig.from_json(json.loads((ckpt / CONFIG_JSON).read_text()), str(ckpt / CONFIG_JSON))
    else:  # a new run, or one killed before it recorded anything: --resume starts it
        base = train_preset(given.get("preset", DEFAULT_PRESET))
        # the checkpoint's geometry replaces the preset's, overrides included
        geometry = dict.fromkeys(("vocab_size", "canvas_length", "time_embedding", "observed_likelihood")) \
            if "init_from" in given else {}
        if "objective" in given:  # an AR baseline of a diffusion recipe drops the diffusion-only switches
            return base.with_objective(given.pop("objective"), **geometry | given)
        base = base.replace(**geometry) if geometry else base
    return base.replace(**given)


def run(args: argparse.Namespace) -> int:
    return run_training(args, train_config, f"generate with: dgemma generate --model {args.out} --prompt ...")


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
