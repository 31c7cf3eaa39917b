"""Peak memory of the loss forward + backward, chunked cross-entropy against the naive one: the table "Chunked
cross-entropy" in docs/training.md (GPT-2 vocabulary V = 50,257, 8,192 rows, D = 256: 6,290 MiB naive, 934 MiB at
chunk_rows 1,024).

Each variant runs in its own process; its figure is that process's peak resident set (ru_maxrss) minus its resident
set just before the loss, so the model, the inputs and the runtime are not counted.

    python runs/bench_ce_memory.py
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from pathlib import Path

import torch

import dgemma
from dgemma.train.diffusion import x0_cross_entropy

CHUNKS = ["none", "1024", "256"]


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def measure(chunk: str, rows: int, vocab: int) -> None:
    """One variant in this process: prints `loss peak_bytes`."""
    torch.set_num_threads(1)
    cfg = dgemma.preset("cpu-small").replace(vocab_size=vocab)
    model = dgemma.init_weights(dgemma.DiffusionGemma(cfg), seed=0)
    g = torch.Generator().manual_seed(0)
    final = torch.randn(rows, cfg.hidden_size, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    before = rss_bytes()
    loss = x0_cross_entropy(model, final, targets, None if chunk == "none" else int(chunk))
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(f"{loss.item():.6f} {peak - before}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=50_257)
    p.add_argument("--variant", choices=CHUNKS, help=argparse.SUPPRESS)  # internal: run one variant here
    args = p.parse_args()
    if args.variant:
        return measure(args.variant, args.rows, args.vocab)
    print(f"{args.rows:,} rows, V = {args.vocab:,}, D = 256 (cpu-small)")
    print("| chunk_rows | loss | peak above baseline |\n|---|---:|---:|")
    for chunk in CHUNKS:
        out = subprocess.run([sys.executable, __file__, "--variant", chunk, "--rows", str(args.rows),
                              "--vocab", str(args.vocab)], check=True, capture_output=True, text=True).stdout
        loss, peak = out.split()
        name = "naive (none)" if chunk == "none" else f"{int(chunk):,}"
        print(f"| {name} | {float(loss):.6f} | {int(peak) / 2**20:,.0f} MiB |")


if __name__ == "__main__":
    main()
