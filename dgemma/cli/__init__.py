"""`dgemma` command line: argparse subcommands, each a thin module with `register(subparsers)` that parses
arguments and calls one library function."""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import bench as bench_cmd
from dgemma.cli import chat as chat_cmd
from dgemma.cli import data as data_cmd
from dgemma.cli import demo as demo_cmd
from dgemma.cli import eval as eval_cmd
from dgemma.cli import generate as generate_cmd
from dgemma.cli import inspect as inspect_cmd
from dgemma.cli import train as train_cmd
from dgemma.cli import viz as viz_cmd

COMMANDS = (generate_cmd, chat_cmd, inspect_cmd, data_cmd, train_cmd, eval_cmd, viz_cmd, bench_cmd, demo_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dgemma", description="Block-diffusion language models (DiffusionGemma) in PyTorch: run, train, "
        "evaluate and measure them. `dgemma demo` shows the whole path on a CPU in a few minutes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point. Errors a user can fix (bad paths, configs, checkpoints, inputs) print one line and exit 2."""
    from dgemma.checkpoint import CheckpointError
    from dgemma.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:  # input a user can fix
        print(f"dgemma {args.command}: error: {e}", file=sys.stderr)
        return 2
