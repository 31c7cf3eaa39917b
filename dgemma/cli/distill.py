"""`dgemma distill`: a few-step student of a diffusion model (docs/training.md, "Few-step samplers by distillation").
The student (by default a copy of the teacher) learns to predict in one step from level s what the frozen teacher
predicts after two steps of 1/(2N) (train/distill.py), for --student-steps N; its checkpoints carry
max_denoising_steps N, so `generate`, `serve` and `eval` sample it in N steps. The same trainer as `dgemma train
--objective distill` (resumable with the same command, locked, atomic checkpoints, torchrun, held-out curves), with
the teacher's recipe at a tenth of its learning rate for 500 steps; every TrainConfig flag overrides it. Progressive
rounds: distil the student again (--teacher STUDENT --student-steps N/2)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dgemma.cli.flags import add_config_args, add_field_arg
from dgemma.cli.train import add_run_args, run_training
from dgemma.train.config import TrainConfig
from dgemma.train.distill import teacher_recipe
from dgemma.train.distributed import resumed_config
from dgemma.train.run_dir import read_record

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# Set by the command (objective) or by the teacher (the model and its switches), or not what distillation computes.
FIXED = ("objective", "preset", "vocab_size", "canvas_length", "num_steps", "diffusion_time", "loss_weighting",
         "time_embedding", "observed_likelihood", "ar_weight", "lora_rank", "lora_alpha", "lora_targets")
OWN = ("teacher", "student_steps", "init_from")  # this command's flags, declared first
# The teacher's recipe fields a distillation keeps (its train_config.json; the rest are the distillation's).
FROM_TEACHER = ("seq_len", "batch_size", "grad_accum", "lr", "min_lr", "weight_decay", "beta1", "beta2", "clip",
                "eval_every", "eval_batches", "eval_t_samples", "save_every", "keep_last", "log_every", "seed",
                "self_conditioning_prob", "chunk_rows", "impl", "dtype", "compile", "device", "parallel",
                "activation_checkpointing")
LR_FACTOR, MAX_STEPS, WARMUP_STEPS = 0.1, 500, 20  # a first round's learning rate: the teacher's peak x LR_FACTOR
RECIPE_SHOWN = {"lr": f"the teacher's x {LR_FACTOR:g} (a distilled teacher's as it is)", "min_lr": "lr / 10",
                "max_steps": MAX_STEPS, "warmup_steps": WARMUP_STEPS, "init_from": "the teacher",
                **{k: "the teacher's" for k in FROM_TEACHER if k not in ("lr", "min_lr")}}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("distill", help="distil a diffusion run into a student that samples in fewer steps",
                              description=__doc__)
    add_run_args(p)
    for name in OWN:
        action = add_field_arg(p, FIELDS[name], RECIPE_SHOWN.get(name, FIELDS[name].default))
        if name != "init_from":
            action.required, action.help = True, action.help.replace("(default: None)", "(required)")
    add_config_args(p, TrainConfig, skip=FIXED + OWN, shown=RECIPE_SHOWN)
    p.set_defaults(func=run)


def recipe(teacher: str) -> dict[str, Any]:
    """The distillation's defaults from the teacher's own recipe: its window, batch, evaluation and optimizer, a tenth
    of its learning rate (a teacher that is itself a student keeps its rate), MAX_STEPS steps."""
    saved = teacher_recipe(teacher)
    out = {k: saved[k] for k in FROM_TEACHER if k in saved}
    if "lr" in out and saved.get("objective") != "distill":
        out["lr"] = out["lr"] * LR_FACTOR
    if "lr" in out:
        out["min_lr"] = out["lr"] / 10
    return out | {"max_steps": MAX_STEPS, "warmup_steps": WARMUP_STEPS}


def distill_config(args: argparse.Namespace) -> TrainConfig:
    """The run's recorded config (with --resume, when it has one) or the teacher's recipe, then the flags given."""
    given = {name: getattr(args, name) for name in FIELDS if name not in FIXED + OWN
             and getattr(args, name, None) is not None}
    own = {"objective": "distill", "teacher": str(args.teacher), "student_steps": args.student_steps,
           "init_from": str(args.init_from or args.teacher)}
    record = read_record(args.out) if args.resume else None
    if record is not None:
        base = TrainConfig.from_json(record["train_config"], str(args.out / "run.json"))
        base = resumed_config(base, record, given)  # as `dgemma train`: the same windows per step
        return base.replace(**given, **own)
    return TrainConfig(**(recipe(own["teacher"]) | given | own))


def run(args: argparse.Namespace) -> int:
    return run_training(args, distill_config, f"generate with: dgemma generate --model {args.out} --prompt ... "
                                              f"(its {args.student_steps} steps are in its generation_config.json)")
