"""`dgemma export SRC --out DIR`: a plain checkpoint (the Hugging Face layout that transformers loads) from a run, a
checkpoint, or a LoRA adapter (fine-tuning with --lora-rank), whose delta is merged into its base's weights
(dgemma/lora.py). The tokenizer and chat template files come along."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from dgemma import lora
from dgemma.checkpoint import MODEL_FILES, resolve_model_dir, save_pretrained
from dgemma.cli.common import DTYPES, UsageError
from dgemma.model import load_model


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("export", help="write a plain checkpoint from a run or a LoRA adapter (merged)",
                              description=__doc__)
    p.add_argument("src", type=Path, metavar="SRC", help="a run directory, a checkpoint, or an adapter directory")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write it (new or empty)")
    p.add_argument("--base", type=Path, metavar="PATH", help="an adapter's base checkpoint (default: the one its "
                   "adapter_config.json names)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the source's")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    src = resolve_model_dir(args.src)
    if args.out.exists() and any(args.out.iterdir()):
        raise UsageError(f"--out {args.out} exists and is not empty")
    dtype = DTYPES.get(args.dtype)
    if lora.is_adapter(src):
        model = lora.load_merged(src, base=args.base, dtype=dtype)
        what = f"{src} merged into {lora.base_of(src, lora.read_config(src), args.base)}"
    else:
        if args.base is not None:
            raise UsageError("--base goes with an adapter; SRC is a whole checkpoint")
        model, what = load_model(src, dtype=dtype), str(src)
    save_pretrained(model, args.out)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, args.out / name)
    size = sum(p.numel() for p in model.parameters())
    print(f"exported {what} to {args.out} ({size:,} parameters, {str(model.dtype).removeprefix('torch.')})")
    return 0

