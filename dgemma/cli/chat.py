"""`dgemma chat`: multi-turn chat, one user turn per line of stdin (a terminal or a pipe; EOF ends). The KV cache
is kept between turns, so each turn encodes only what is new: the previous answer's last canvas (never committed
by generate) and the new user turn. `/reset` clears the history, `/quit` exits."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from dgemma.cli.common import Streamer, UsageError, add_model_args, add_sampler_args, load, overrides
from dgemma.generate import generate
from dgemma.tokenizer import TURN_END, TURN_START, chat_token_ids, encode_template


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="multi-turn chat on stdin, reusing the KV cache", description=__doc__)
    add_model_args(p)
    add_sampler_args(p)
    p.add_argument("--system", metavar="TEXT", help="a system prompt for the conversation")
    p.add_argument("--max-context", type=int, default=8192, metavar="N",
                   help="KV-cache slots for the whole conversation (default 8192, at most the model's maximum)")
    p.set_defaults(func=run)


def next_turn_text(user: str) -> str:
    """Template text that closes the previous model turn and opens the next: the history then reads exactly as
    format_chat renders [..., model answer, user turn] (the answer's EOS, <turn|> or <eos>, becomes <turn|>)."""
    return f"{TURN_END}\n{TURN_START}user\n{user.strip()}{TURN_END}\n{TURN_START}model\n"


def run(args: argparse.Namespace) -> int:
    model, tok = load(args)
    if tok is None:
        raise UsageError("chat needs a tokenizer: pass --tokenizer PATH or put tokenizer.json in the model directory")
    gcfg = model.generation_config
    kw = overrides(args, gcfg)
    max_context = min(args.max_context, model.config.max_position_embeddings)
    L = model.config.canvas_length
    # Every canvas but the last is committed, so a turn needs its prompt plus whole canvases of room.
    answer_room = -(-kw.get("max_new_tokens", gcfg.max_new_tokens) // L) * L
    cache = model.new_cache(batch_size=1, max_length=max_context)
    pending: list[int] | None = None  # None: no history; else the last answer's uncommitted tokens, before EOS
    interactive = sys.stdin.isatty()
    turn = 0
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            break
        text = line.strip()
        if text == "/reset":
            cache.truncate(0)
            pending = None
            print("(history cleared)", file=sys.stderr)
            continue
        if not text:
            continue
        if pending is None:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            ids = chat_token_ids(tok, [*messages, {"role": "user", "content": text}])
        else:
            ids = pending + encode_template(tok, next_turn_text(text))
        if cache.length + len(ids) + answer_room > max_context:
            print(f"context full: {cache.length} + {len(ids)} prompt + {answer_room} answer tokens exceed "
                  f"--max-context {max_context}; /reset to start over", file=sys.stderr)
            continue
        streamer = Streamer(tok, gcfg.eos_token_id, gcfg.pad_token_id, 1)
        seed = None if args.seed is None else args.seed + turn
        try:
            result = generate(model, torch.tensor([ids], device=model.device), cache=cache, seed=seed,
                                  on_step=streamer.on_step, on_canvas=streamer.on_canvas, **kw)
        finally:
            streamer.close()
        if not streamer.shown[0]:
            print(flush=True)  # an empty answer still ends its line, so a pipe reads one line per turn
        cache, pending, turn = result.cache, streamer.last_canvas[0], turn + 1
    return 0
