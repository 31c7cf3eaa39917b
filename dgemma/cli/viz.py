"""`dgemma viz TRACE --out DIR`: pictures of a generation trace (dgemma/eval/viz.py) and an HTML canvas player."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from dgemma.cli.flags import MODEL_HELP, UsageError, nonnegative_int, shown_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("viz", help="plots, a GIF and an HTML player of a trace (dgemma generate --trace FILE)",
                       description=__doc__)
    p.add_argument("trace", type=Path, metavar="TRACE", help="the trace: FILE, FILE.json or FILE.npz")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the pictures")
    p.add_argument("--tokenizer", type=Path, metavar="PATH", help="tokenizer.json or its folder: show tokens as text")
    p.add_argument("--model", type=Path, metavar="DIR", help="whose tokenizer.json to use: " + MODEL_HELP)
    p.add_argument("--row", type=nonnegative_int, default=0, metavar="N", help="batch row to draw (default 0)")
    p.add_argument("--canvas", type=nonnegative_int, action="append", metavar="C",
                   help="canvas to draw (repeatable; default all)")
    p.add_argument("--gif-canvas", type=nonnegative_int, metavar="C",
                   help="canvas of the GIF (default: the first drawn)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dgemma.data.tokenizer import load_tokenizer
    from dgemma.eval.viz import render_trace
    from dgemma.sampling.trace import load_trace

    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory")
    trace = load_trace(args.trace)
    tok_path = args.tokenizer
    if tok_path is None and args.model is not None:  # a run keeps tokenizer.json at its root and in checkpoints
        from dgemma.weights.checkpoint import resolve_model_dir

        tok_path = next((p for p in (args.model / "tokenizer.json", resolve_model_dir(args.model) / "tokenizer.json")
                         if p.is_file()), None)
        if tok_path is None:
            print(f"dgemma viz: {args.model} has no tokenizer.json; showing token ids", file=sys.stderr)
    tokenizer = load_tokenizer(tok_path) if tok_path is not None else None
    if tokenizer is not None:
        top = max(int(trace.arrays[k].max()) for k in ("input_canvas", "argmax"))
        if top >= tokenizer.vocab_size:
            print(f"dgemma viz: warning: the trace holds token ids up to {top} but {tokenizer.source} knows "
                  f"{tokenizer.vocab_size:,}; ids beyond it show as nothing (a model with a larger vocabulary, or "
                  "the wrong tokenizer?)", file=sys.stderr)
    command = "dgemma viz " + shlex.join([shown_path(args.trace), "--out", shown_path(args.out), *_flags(args)])
    try:
        written = render_trace(trace, args.out, command=command, tokenizer=tokenizer, row=args.row,
                               canvases=args.canvas, gif_canvas=args.gif_canvas)
    except ImportError as e:  # matplotlib or pillow missing: say how to install them, in one line
        print(f"dgemma viz: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _flags(args: argparse.Namespace) -> list[str]:
    """The optional flags as given, for the command line printed on every figure."""
    out: list[str] = []
    for flag, value in (("--tokenizer", args.tokenizer), ("--model", args.model), ("--gif-canvas", args.gif_canvas)):
        if value is not None:
            out += [flag, shown_path(value) if isinstance(value, Path) else str(value)]
    if args.row:
        out += ["--row", str(args.row)]
    for c in args.canvas or []:
        out += ["--canvas", str(c)]
    return out
