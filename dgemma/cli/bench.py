"""`dgemma bench`: generation speed of dgemma's readable and fast paths (and transformers on the same checkpoint),
training throughput, each with the machine's measured ceilings; `--write-docs` appends the result to
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from dgemma.cli.common import positive_int, seed
from dgemma.eval import bench


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="tokens/s, ms per denoise step and commit, training MFU",
                              description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="random weights of a preset: tiny, bench-small, diffusiongemma-26b-a4b (GPU) "
                                      "or any other in dgemma.config.PRESETS (default: tiny)")
    src.add_argument("--model", metavar="DIR", help="a checkpoint directory (Hugging Face layout)")
    p.add_argument("--compare-transformers", action="store_true",
                   help="also run transformers' generate (its default kernels) on the same checkpoint, alternating")
    p.add_argument("--impl", choices=("fast", "reference", "both"), default="both", help="dgemma path(s) to time")
    p.add_argument("--steps", type=positive_int, default=16, metavar="N", help="denoising steps per canvas, fixed (16)")
    p.add_argument("--canvases", type=positive_int, default=2, metavar="N", help="canvases per generate call (2)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="R", help="timed runs per implementation (3)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B", help="prompts per generate call (1)")
    p.add_argument("--prompt-length", type=positive_int, metavar="T", help="default: sliding window + canvas/4")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=sorted(bench.DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile the fast path's denoise step")
    p.add_argument("--quantize", choices=("int8", "int4"),
                   help="weight-only quantization of dgemma's model (torchao; int4 on CUDA); transformers stays float")
    p.add_argument("--offload-experts", action="store_true",
                   help="keep the expert weights in a memory-mapped file, read per layer (docs/benchmarks.md)")
    p.add_argument("--threads", type=positive_int, metavar="N", help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-train", action="store_true", help="skip the training-throughput measurement")
    p.add_argument("--train-preset", metavar="NAME", help="default: cpu-small on CPU, lite-380m on CUDA")
    p.add_argument("--train-steps", type=positive_int, metavar="N",
                   help="timed optimizer steps per objective (default: R)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", metavar="PATH",
                   help="append a dated entry to docs/benchmarks.md (or PATH)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = bench.BenchSettings(
        preset=None if args.model else (args.preset or "tiny"), model_dir=args.model,
        impls=("reference", "fast") if args.impl == "both" else (args.impl,),
        compare_transformers=args.compare_transformers, steps=args.steps, canvases=args.canvases,
        repeats=args.repeats, batch=args.batch, prompt_length=args.prompt_length, device=args.device,
        dtype=args.dtype, compile=args.compile, seed=args.seed, train=not args.no_train,
        train_preset=args.train_preset, train_steps=args.train_steps, threads=args.threads, quantize=args.quantize,
        offload_experts=args.offload_experts)
    report = bench.run(settings)
    print(bench.to_json(report) if args.json else bench.format_report(report))
    if args.write_docs:
        path = bench.write_docs(report, "dgemma bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"]
                                                                      else sys.argv[1:]), args.write_docs)
        print(f"appended to {path}", file=sys.stderr)
    return 0
