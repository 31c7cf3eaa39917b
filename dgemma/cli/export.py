"""`dgemma export RUN --out DIR`: a training run's newest complete checkpoint (or the checkpoint directory given),
sharded by torchrun ranks or not, written as one consolidated Hugging Face checkpoint (config.json,
generation_config.json, model.safetensors, tokenizer.json) that `dgemma generate --model DIR` and transformers load.
Runs in one process, whatever the number of ranks that trained the run. A LoRA run's checkpoint (or any adapter
directory: adapter_config.json + adapter_model.safetensors) is merged into its base (dgemma/weights/lora.py): a plain
checkpoint with the chat template files of the run."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dgemma.io import dirkind, fsio
from dgemma.model.config import ConfigError
from dgemma.train.distributed import export
from dgemma.weights import lora
from dgemma.weights.checkpoint import MODEL_FILES, resolve_model_dir, save_pretrained
from dgemma.weights.loading import DTYPES, load_generation_config, load_model


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("export", help="write a run's checkpoint (sharded or not) as a Hugging Face checkpoint",
                              description=__doc__)
    p.add_argument("run", type=Path, metavar="RUN", help="a training run directory (its newest complete checkpoint) "
                   "or one checkpoint directory (RUN/checkpoints/step-XXXXXXX)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write it (new or empty)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="weights dtype of the exported checkpoint")
    p.add_argument("--base", type=Path, metavar="PATH", help="a LoRA adapter's base checkpoint (default: the one its "
                   "adapter_config.json names)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    ckpt = resolve_model_dir(args.run)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{args.run}: no such run or checkpoint directory")
    dirkind.require(args.out, {dirkind.MISSING, dirkind.EMPTY}, "--out")
    adapter = lora.is_adapter(ckpt)
    if args.base is not None and not adapter:
        raise ConfigError(f"--base goes with a LoRA adapter; {ckpt} is a whole checkpoint")
    with publishing(args.out) as tmp:
        if adapter:
            model = load_model(ckpt, base=args.base, dtype=DTYPES[args.dtype])
            save_pretrained(model, tmp, generation_config=load_generation_config(ckpt, base=args.base))
            for name in MODEL_FILES:  # the tokenizer and the chat template the run was fine-tuned with
                if (ckpt / name).is_file():
                    fsio.copy_file(ckpt / name, tmp / name)
        else:
            export(ckpt, tmp, DTYPES[args.dtype])
    if adapter:
        print(f"exported {ckpt} merged into {lora.base_of(ckpt, lora.read_config(ckpt), args.base)} to {args.out}")
    else:
        print(f"exported {ckpt} to {args.out}")
    return 0


@contextlib.contextmanager
def publishing(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` (new or empty) that is renamed to `out` once the block has written it: an
    export that fails (a full disk, a bad tensor) leaves no half-written or empty `out` behind, only what was there."""
    tmp = fsio.temp_name(out)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsio.fsync_dir(tmp)
        os.replace(tmp, out)  # over an empty directory too (POSIX rename)
    except fsio.NoSpaceError as e:  # named by the file it would have become
        shutil.rmtree(tmp, ignore_errors=True)
        where = out / e.path.relative_to(tmp) if e.path.is_relative_to(tmp) else e.path
        raise fsio.no_space(e, where, e.needed) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsio.fsync_dir(out.parent)
