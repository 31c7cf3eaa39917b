"""`dgemma generate`: block-diffusion generation, printing each canvas as it is committed (and, in a terminal, the
canvas being refined). An autoregressive run (objective 'ar', `dgemma demo`'s baseline) is decoded token by token
instead, as `dgemma demo` and `dgemma eval` decode it (`eval.decoding.ar_decode`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dgemma.cli.flags import (
    UsageError,
    add_constraint_args,
    add_model_args,
    add_runtime_args,
    add_sampler_args,
    constraint_flag,
    overrides,
)
from dgemma.cli.loading import autoregressive, chat_template, constraint_from, load
from dgemma.cli.parallel import add_parallel_arg, run_ranked
from dgemma.data.tokenizer import Tokenizer, left_pad
from dgemma.io import fsio
from dgemma.io.console import Progress, Streamer
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationConfig, offset_seed
from dgemma.sampling.request_rules import canvas_count, resolve_generation_config
from dgemma.sampling.trace import check_trace_path

MAX_BATCH_FILE_BYTES = 1 << 24  # 16 MiB of prompts: far more than one batch, far less than memory
MAX_BATCH_PROMPTS = 4096  # prompts in one --batch-file batch (every prompt is a row of the same generate call)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text with a block-diffusion sampler", description=__doc__)
    add_model_args(p)
    add_runtime_args(p)
    p.add_argument("--prompt", metavar="TEXT", help="prompt text (needs a tokenizer)")
    p.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma-separated: 2,651,1234")
    p.add_argument("--batch-file", type=Path, metavar="FILE",
                   help="one prompt a line (blank lines skipped), one batch: a text file of at most "
                        f"{MAX_BATCH_FILE_BYTES >> 20} MiB and {MAX_BATCH_PROMPTS} prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the Gemma chat turn template")
    add_sampler_args(p)
    add_constraint_args(p)
    p.add_argument("--trace", type=Path, metavar="FILE", help="save a per-step trace: FILE (.npz) and FILE with .json")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming text")
    add_parallel_arg(p)
    p.set_defaults(func=run)


def parse_ids(spec: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(s) for s in spec.replace(" ", "").split(",") if s]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {spec!r}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"prompt ids {bad[:5]} are outside the model's vocabulary [0, {vocab_size})")
    return ids


def read_batch_file(path: Path) -> list[str]:
    """The prompts of --batch-file: its non-blank lines, stripped. One batch of at most MAX_BATCH_PROMPTS prompts in a
    regular file of at most MAX_BATCH_FILE_BYTES: a device, a FIFO or a larger file is refused before it is read
    whole (`dgemma generate --batch-file /dev/zero` once grew without bound)."""
    try:
        data = fsio.read_bytes(path, MAX_BATCH_FILE_BYTES)
    except (OSError, fsio.UnsafeFileError) as e:  # a directory, a device, no permission, missing, too large
        raise UsageError(f"--batch-file {path}: cannot read ({fsio.reason(e)}; give a text file of at most "
                         f"{MAX_BATCH_FILE_BYTES:,} bytes, one prompt a line)") from None
    try:
        content = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UsageError(f"--batch-file {path}: line {line} is not UTF-8 text ({e.reason} at byte {e.start})"
                         ) from None
    texts = [line.strip() for line in content.splitlines() if line.strip()]
    if not texts:
        raise UsageError(f"empty prompt: {path} has no non-blank lines")
    if len(texts) > MAX_BATCH_PROMPTS:
        raise UsageError(f"--batch-file {path}: {len(texts):,} prompts; one batch takes at most "
                         f"{MAX_BATCH_PROMPTS:,} (split the file and run generate once per part)")
    return texts


def read_prompts(args: argparse.Namespace, tok: Tokenizer | None, vocab_size: int) -> tuple[list[list[int]], list]:
    """Token ids of each prompt, and each prompt as given (text, or None for --prompt-ids)."""
    given = [name for name in ("prompt", "prompt_ids", "batch_file") if getattr(args, name) is not None]
    if len(given) != 1:
        flags = " and ".join("--" + g.replace("_", "-") for g in given)
        raise UsageError(f"give exactly one of --prompt, --prompt-ids, --batch-file (got {flags or 'none'})")
    if args.prompt_ids is not None:
        if args.chat:
            raise UsageError("--chat needs text (--prompt or --batch-file), not --prompt-ids")
        ids = parse_ids(args.prompt_ids, vocab_size)
        if not ids:
            raise UsageError("empty prompt: --prompt-ids has no ids")
        return [ids], [None]
    if args.batch_file is not None:
        texts = read_batch_file(args.batch_file)
    else:
        texts = [args.prompt]
        if not args.prompt.strip():
            raise UsageError("empty prompt: --prompt is blank")
    if tok is None:
        raise UsageError("text prompts need a tokenizer: pass --tokenizer PATH (or put tokenizer.json in the model "
                         "directory), or give --prompt-ids")
    # Without --chat the tokenizer's own post-processor decides on <bos> (Gemma's prepends it).
    template = chat_template(args) if args.chat else None
    rows = [template.encode(tok, [{"role": "user", "content": t}]) if template else tok.encode(t) for t in texts]
    return rows, texts


def run(args: argparse.Namespace) -> int:
    if args.parallel is not None:  # one rank of a torchrun job (dgemma/cli/parallel.py)
        return run_ranked(args, generate_text)
    return generate_text(args)


def generate_text(args: argparse.Namespace) -> int:
    if args.trace is not None:
        check_trace_path(args.trace)  # before the model is loaded and anything generated
    model, gcfg, tok = load(args)
    if autoregressive(args):
        return run_autoregressive(args, model, gcfg, tok)
    rows, texts = read_prompts(args, tok, model.config.vocab_size)
    constraint = constraint_from(args, tok, gcfg)
    kw = overrides(args, gcfg)
    input_ids, mask = left_pad(rows, gcfg.pad_token_id or 0, model.device)
    streamer = Streamer(tok, gcfg.eos_token_id, gcfg.pad_token_id, len(rows), quiet=args.json)
    # Where the text does not show it live (redirected, --json), a terminal on stderr shows the canvases done.
    total = canvas_count(kw.get("max_new_tokens", gcfg.max_new_tokens), model.config.canvas_length)
    canvases = Progress("generating", total, "canvases", enabled=sys.stderr.isatty() and not streamer.live)
    t0 = time.perf_counter()
    try:
        result = generate(model, input_ids, generation_config=gcfg, attention_mask=mask, seed=args.seed,
                          on_step=streamer.on_step,
                          on_canvas=lambda i, t: (streamer.on_canvas(i, t), canvases.update(1)),
                          trace=args.trace is not None, force=args.force, constraint=constraint, **kw)
    finally:
        streamer.close()
        canvases.close()
    wall = time.perf_counter() - t0
    if args.trace is not None:
        result.trace.save(args.trace)
    new = result.new_tokens()
    if args.json:
        for i, ids in enumerate(new):
            print(json.dumps({"prompt": texts[i], "prompt_ids": rows[i],
                              "text": None if tok is None else tok.decode(ids, skip_special_tokens=True),
                              "token_ids": ids, "tokens_per_forward": float(result.tokens_per_forward[i]),
                              # generate's lists are [canvas][row]; a row finished early shows 0 / "finished"
                              "steps_per_canvas": [c[i] for c in result.steps_per_canvas],
                              "stop_reasons": [c[i] for c in result.stop_reasons]}
                             | ({} if result.constraint_complete is None else
                                {"constraint_complete": result.constraint_complete[i],
                                 "constraint_failed": result.constraint_failed[i]})))
    n = sum(len(ids) for ids in new)
    canvases = len(result.steps_per_canvas)
    tpf = float(torch.as_tensor(result.tokens_per_forward, dtype=torch.float32).mean())
    print(f"{n} tokens generated for {len(rows)} prompt(s) in {canvases} canvas(es), {tpf:.2f} tokens/forward, "
          f"{wall:.2f} s, {n / max(wall, 1e-9):.1f} tokens/s", file=sys.stderr)
    if result.constraint_complete is not None:
        print(f"grammar: {sum(result.constraint_complete)} of {len(rows)} output(s) complete, "
              f"{result.constraint_pinned} token(s) pinned, {result.constraint_closed} closed within the budget, "
              f"{result.constraint_seconds:.2f} s of masks", file=sys.stderr)
        failed = [(i + 1, why) for i, why in enumerate(result.constraint_failed) if why is not None]
        if failed:  # llguidance gave up mid-way: those outputs are incomplete prefixes, and the run says so
            print(f"dgemma generate: error: {constraint_flag(args)}: the grammar failed for {len(failed)} of "
                  f"{len(rows)} output(s), which are incomplete (output {failed[0][0]}: {failed[0][1]})",
                  file=sys.stderr)
            return 1
    return 0


# the flags of the diffusion sampler alone: an autoregressive run refuses them (its controls are the rest)
DIFFUSION_ONLY = ("sampler", "time_level", "lite_commit", "corrector_steps", "commit_threshold", "edit_threshold",
                  "max_denoising_steps", "entropy_bound", "t_min", "trace", "json_schema", "json_object", "regex",
                  "grammar")


def run_autoregressive(args: argparse.Namespace, model: Any, gcfg: GenerationConfig, tok: Tokenizer | None) -> int:
    """An AR run's generation: each prompt decoded token by token (`ar_decode`) at temperature `t_max` (the
    diffusion schedule's first temperature, what `dgemma demo` samples its baseline at), with the sampling controls,
    --max-new-tokens and --seed (prompt i: seed + i); the text streamed as it comes."""
    from dgemma.eval.decoding import ar_decode

    given = next((f for f in DIFFUSION_ONLY if getattr(args, f, None) not in (None, False)), None)
    if given is not None:
        raise UsageError(f"--{given.replace('_', '-')}: {args.model} is an autoregressive run (objective 'ar'), "
                         "decoded token by token: the diffusion sampler's settings do not apply (--max-new-tokens, "
                         "--t-max as the temperature, --top-k, --top-p, --min-p, the penalties, --logit-bias and "
                         "--seed do)")
    rows, texts = read_prompts(args, tok, model.config.vocab_size)
    config = resolve_generation_config(gcfg, overrides(args, gcfg))
    started, new = time.perf_counter(), []
    for i, row in enumerate(rows):
        g = None if args.seed is None else torch.Generator(model.device).manual_seed(offset_seed(args.seed, i))
        printed = _Printed(tok) if not args.json else None
        new.append(ar_decode(model, torch.tensor(row), config, temperature=config.t_max, generator=g,
                             on_token=printed.add if printed is not None else None))
        if printed is not None:
            printed.end()
        else:
            print(json.dumps({"prompt": texts[i], "prompt_ids": row, "token_ids": new[-1],
                              "text": None if tok is None else tok.decode(new[-1], skip_special_tokens=True)}))
    wall = time.perf_counter() - started
    n = sum(map(len, new))
    print(f"{n} tokens generated for {len(rows)} prompt(s) autoregressively ({args.model} is an AR run: one forward "
          f"per token), temperature {config.t_max:g}, {wall:.2f} s, {n / max(wall, 1e-9):.1f} tokens/s",
          file=sys.stderr)
    return 0


class _Printed:
    """An AR continuation on stdout as its tokens come (text, or the ids space-separated without a tokenizer, as the
    diffusion path's), a line a prompt."""

    def __init__(self, tok: Tokenizer | None):
        self.tok, self.ids, self.shown = tok, [], ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        self._write(self._text().rstrip("\ufffd"))  # half a UTF-8 character waits for the rest

    def end(self) -> None:
        self._write(self._text())
        print(flush=True)

    def _text(self) -> str:
        if self.tok is None:
            return " ".join(map(str, self.ids))
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def _write(self, text: str) -> None:
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text
