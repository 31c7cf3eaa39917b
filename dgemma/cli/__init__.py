"""`dgemma` command line: argparse subcommands, each a thin module with `register(subparsers)` that parses
arguments and calls one library function."""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import bench as bench_cmd
from dgemma.cli import chat as chat_cmd
from dgemma.cli import data as data_cmd
from dgemma.cli import demo as demo_cmd
from dgemma.cli import distill as distill_cmd
from dgemma.cli import eval as eval_cmd
from dgemma.cli import export as export_cmd
from dgemma.cli import finetune as finetune_cmd
from dgemma.cli import generate as generate_cmd
from dgemma.cli import inspect as inspect_cmd
from dgemma.cli import lm_eval as lm_eval_cmd
from dgemma.cli import serve as serve_cmd
from dgemma.cli import train as train_cmd
from dgemma.cli import viz as viz_cmd
from dgemma.cli.flags import Parser
from dgemma.train.distributed import should_print

COMMANDS = (generate_cmd, chat_cmd, inspect_cmd, data_cmd, train_cmd, finetune_cmd, distill_cmd, export_cmd,
            eval_cmd, lm_eval_cmd, viz_cmd, bench_cmd, demo_cmd, serve_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dgemma", description="Block-diffusion language models (DiffusionGemma) in PyTorch: run, train, "
        "evaluate and measure them. `dgemma demo` shows the whole path on a CPU in about seven minutes.")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point. Errors a user can fix (bad paths, configs, checkpoints, data, inputs, memory) print one line and
    exit 2; `dgemma --debug COMMAND` raises them with their traceback instead."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):  # `dgemma lm-eval`: every flag after it is lm-eval's
        args.harness_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:  # ConfigError, CheckpointError, DataError, GenerationError, files: fixable
        if args.debug:
            raise
        if should_print(e):  # in a torchrun job, an error every rank raises alike is shown by rank 0 alone
            print(f"dgemma {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2


def one_line(e: BaseException) -> str:
    """An error as one line: its message with line breaks folded (an OSError with its file name)."""
    text = str(e)
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return " ".join(text.split()) or type(e).__name__
