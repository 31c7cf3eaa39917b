"""`dgemma chat`: multi-turn chat, one user turn per line of stdin (a terminal or a pipe; EOF ends). The KV cache
is kept between turns, so each turn encodes only what is new: the previous answer's last canvas (never committed
by generate) and the new user turn, in the checkpoint's chat template (chat_template.jinja, sandboxed) when it has
one, else dgemma's built-in Gemma template. `/reset` clears the history, `/quit` exits."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dgemma.cli.flags import UsageError, add_model_args, add_runtime_args, add_sampler_args, overrides, positive_int
from dgemma.cli.loading import chat_template, load, refuse_autoregressive
from dgemma.io.console import Streamer
from dgemma.serving.chat import ChatSession, ContextFullError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="multi-turn chat on stdin, reusing the KV cache", description=__doc__)
    add_model_args(p)
    add_runtime_args(p)
    add_sampler_args(p, seed_help="the sampling seed; turn i draws with seed + i (default: random)")
    p.add_argument("--system", metavar="TEXT", help="a system prompt for the conversation")
    p.add_argument("--max-context", type=positive_int, default=8192, metavar="N",
                   help="KV-cache slots for the whole conversation (default 8192, at most the model's maximum)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    refuse_autoregressive(args, "dgemma chat")
    model, gcfg, tok = load(args)
    if tok is None:
        raise UsageError("chat needs a tokenizer: pass --tokenizer PATH or put tokenizer.json in the model directory")
    session = ChatSession(model, tok, system=args.system, max_context=args.max_context, seed=args.seed,
                          template=chat_template(args), generation_config=gcfg,
                          force=args.force, **overrides(args, gcfg))  # force: generate's memory pre-flight
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = _read_line()
        if line is None:
            print("dgemma chat: error: that line is not UTF-8 text; it was skipped (the conversation goes on)",
                  file=sys.stderr)
            continue
        if not line or line.strip() == "/quit":
            break
        text = line.strip()
        if text == "/reset":
            session.reset()
            print("(history cleared)", file=sys.stderr)
            continue
        if not text:
            continue
        streamer = Streamer(tok, gcfg.eos_token_id, gcfg.pad_token_id, 1)
        try:
            session.reply(text, on_step=streamer.on_step, on_canvas=streamer.on_canvas)
        except ContextFullError as e:
            print(f"{e} (--max-context); /reset to start over", file=sys.stderr)
            continue
        finally:
            streamer.close()
        if not streamer.shown[0]:
            print(flush=True)  # an empty answer still ends its line, so a pipe reads one line per turn
    return 0


def _read_line() -> str | None:
    """One line of stdin ("" at EOF), or None when it is not UTF-8 (read as bytes, so one bad line costs only
    itself: the session survives it)."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes underneath (tests)
        return sys.stdin.readline()
    raw = buffer.readline()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
