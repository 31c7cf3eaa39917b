"""`dgemma bench`: generation speed of dgemma's readable and fast paths (and transformers on the same checkpoint),
training throughput, each with the machine's measured ceilings; `--write-docs` appends the result to
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from dgemma.cli.flags import (
    IMPL_HELP,
    MODEL_HELP,
    add_dtype_device_args,
    add_quantize_arg,
    add_threads_arg,
    positive_int,
    seed,
)
from dgemma.cli.loading import device_of
from dgemma.eval import bench
from dgemma.model.attention import IMPLS


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="tokens/s, ms per denoise step and commit, training MFU",
                              description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="PRESET", help="random weights of a preset: tiny, bench-small, "
                     "diffusiongemma-26b-a4b (GPU) or any other in dgemma.model.config.PRESETS (default: tiny)")
    src.add_argument("--model", metavar="DIR", help=MODEL_HELP)
    p.add_argument("--compare-transformers", action="store_true",
                   help="also run transformers' generate (its default kernels) on the same checkpoint, alternating")
    p.add_argument("--impl", choices=IMPLS, action="append", help=IMPL_HELP + "; the path to time (repeatable; "
                   "default: both)")
    p.add_argument("--denoising-steps", type=positive_int, default=16, metavar="N",
                   help="denoising steps per canvas, every one run (adaptive stopping off)")
    p.add_argument("--canvases", type=positive_int, default=2, metavar="N", help="canvases per generate call")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="R", help="timed runs per implementation")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B", help="prompts per generate call")
    p.add_argument("--prompt-length", type=positive_int, metavar="T", help="default: sliding window + canvas/4")
    add_dtype_device_args(p, dtype_help="float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile the fast path's denoise step")
    add_quantize_arg(p, "weight-only quantization of dgemma's model (torchao; int4 on CUDA); transformers stays "
                        "float")
    p.add_argument("--offload-experts", action="store_true",
                   help="keep the expert weights in a memory-mapped file, read per layer (docs/benchmarks.md)")
    add_threads_arg(p, "torch's")
    p.add_argument("--no-train", action="store_true", help="skip the training-throughput measurement")
    p.add_argument("--train-preset", metavar="PRESET", help="default: cpu-small on CPU, lite-380m on CUDA")
    p.add_argument("--train-steps", type=positive_int, metavar="N",
                   help="timed optimizer steps per objective (default: R)")
    p.add_argument("--seed", type=seed, default=0, metavar="SEED", help="seed of the prompts and the sampler")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", metavar="PATH",
                   help="append a dated entry to docs/benchmarks.md (or PATH)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = bench.BenchSettings(
        preset=None if args.model else (args.preset or "tiny"), model_dir=args.model,
        impls=tuple(dict.fromkeys(args.impl or IMPLS)),
        compare_transformers=args.compare_transformers, steps=args.denoising_steps, canvases=args.canvases,
        repeats=args.repeats, batch=args.batch, prompt_length=args.prompt_length, device=device_of(args.device),
        dtype=None if args.dtype == "auto" else args.dtype, compile=args.compile, seed=args.seed,
        train=not args.no_train,
        train_preset=args.train_preset, train_steps=args.train_steps, threads=args.threads, quantize=args.quantize,
        offload_experts=args.offload_experts)
    report = bench.run(settings)
    print(bench.to_json(report) if args.json else bench.format_report(report))
    if args.write_docs:
        path = bench.write_docs(report, "dgemma bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"]
                                                                      else sys.argv[1:]), args.write_docs)
        print(f"appended to {path}", file=sys.stderr)
    return 0
