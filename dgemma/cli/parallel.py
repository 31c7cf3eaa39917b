"""`--parallel ep|tp|ep+tp` of `dgemma generate` and `dgemma serve`: one process per rank under torchrun (a gloo
process group on the CPU, NCCL on CUDA), each holding its shard of the model (dgemma/parallel/); every rank runs the
same generation on identical logits, rank 0's seed (drawn there when --seed is not given), and only rank 0 prints.
(serve: rank 0 answers HTTP, the other ranks replay its model calls: dgemma/serving/ranks.py.)"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
from collections.abc import Callable
from typing import Any

from dgemma.cli.flags import UsageError
from dgemma.model.config import ConfigError
from dgemma.parallel import LAYOUTS


def add_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", choices=LAYOUTS, help="split the model over the ranks of a torchrun job: the routed "
                   "experts (ep), the attention heads, KV cache and dense MLP (tp), or both (ep+tp); "
                   "docs/parallel.md")


def run_ranked(args: argparse.Namespace, run: Callable[[argparse.Namespace], int]) -> int:
    """run(args) on this rank of the torchrun job, with the model that `loading.load` builds split over the ranks."""
    if "WORLD_SIZE" not in os.environ:
        raise UsageError(f"--parallel {args.parallel} runs one process per rank under torchrun (WORLD_SIZE is not "
                         f"set): torchrun --nproc-per-node K -m dgemma {args.command} --parallel {args.parallel} ...")
    for flag, given in (("--quantize", getattr(args, "quantize", None)),
                        ("--offload-experts", getattr(args, "offload_experts", False))):
        if given:
            raise UsageError(f"{flag} does not combine with --parallel (each rank holds a plain shard)")
    import torch.distributed as dist

    from dgemma.train.distributed import Dist, shared

    job = Dist.from_env(args.device)
    try:
        args.device, args.dist = str(job.device), job
        if job.world_size > 1 and hasattr(args, "seed"):  # serve has none: each request brings its own
            seed: list[Any] = [args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)]
            dist.broadcast_object_list(seed, src=0)  # every rank draws what rank 0 draws
            args.seed = seed[0]
        with contextlib.ExitStack() as stack:
            if not job.is_main:  # only rank 0 prints; an error still reaches this rank's stderr (dgemma.cli.main)
                devnull = stack.enter_context(open(os.devnull, "w"))
                stack.enter_context(contextlib.redirect_stdout(devnull))
                stack.enter_context(contextlib.redirect_stderr(devnull))
            with job.peers_lost():
                try:
                    check_before_loading(args)
                    return run(args)
                except ConfigError as e:  # a flag, a file, a shape: the same on every rank, rank 0's to show
                    shared(e)
                    raise
    finally:
        job.close()


def check_before_loading(args: argparse.Namespace) -> None:
    """The layout against the model's config.json (or preset) before any weight is read: a model the world size does
    not split is refused at once, not after every rank has loaded it. A config that cannot be read is left to the
    loader to name."""
    from dgemma.model.config import preset
    from dgemma.parallel import check_layout
    from dgemma.weights import checkpoint

    try:
        config = preset(args.preset) if args.preset is not None else checkpoint.read_model_config(
            checkpoint.resolve_model_dir(args.model))
    except (ValueError, OSError):
        return
    check_layout(config, args.parallel, args.dist.world_size)


def split(model: Any, args: argparse.Namespace) -> Any:
    """`model` split over the job's ranks under --parallel, every rank agreeing (a refusal is rank 0's to show)."""
    from dgemma.parallel import parallelize

    args.dist.agree(lambda: parallelize(model, args.parallel))
    return model
