"""How large the Monte Carlo error of a held-out bound is, on real data: the exact model (the training split's unigram
as a model of i.i.d. tokens, whose posterior is closed-form: dgemma/eval/likelihoods.py:unigram_posterior) scored by
`dgemma eval`'s code at several T and in continuous time, each with independent replicates. Its true bound is its
exact NLL at every T, so every row should land within a few Monte Carlo SEs of the first line; the shared single draw
of the old protocol made it "fall" with T (docs/training.md).

    python runs/exact_reference.py --data DIR [--seq-len 128] [--windows 128] [--t-samples 4] [--replicates 4]
    python runs/exact_reference.py --smoke      # a toy corpus, seconds

Prints a markdown table: T, the bound ± between-window SE ± Monte Carlo SE, its distance from the exact NLL in Monte
Carlo SEs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from dgemma.data.shards import TokenDataset, unigram_log_probs
from dgemma.eval.likelihoods import heldout_nelbo, unigram_posterior, unigram_reference

STEPS = (4, 16, 64, 256, None)  # None: continuous time


def table(data: Path, *, seq_len: int, windows: int, t_samples: int, replicates: int, canvas: int) -> list[str]:
    val = TokenDataset(data, "val")
    log_p = unigram_log_probs(data)
    exact = unigram_reference(log_p, val, seq_len=seq_len, max_windows=windows)
    posterior = unigram_posterior(torch.from_numpy(log_p), canvas)
    lines = [f"Exact NLL of the unigram model on the scored tokens: {exact.mean:.4f} ± {exact.se:.4f} (between "
             f"windows; {exact.windows} windows of {seq_len}, canvas {canvas}, {t_samples} t-samples, {replicates} "
             "independent replicates)", "",
             "| T | NELBO | ± SE (windows) | ± MC SE | minus exact NLL | in MC SEs |", "|---|---:|---:|---:|---:|---:|"]
    for T in STEPS:
        r = heldout_nelbo(lambda ctx: posterior, val, canvas_length=canvas, vocab_size=len(log_p), seq_len=seq_len,
                          num_steps=T, num_t_samples=min(t_samples, T or t_samples), replicates=replicates,
                          model_sha="unigram", max_windows=windows, progress=False)
        e, mc = r["estimate"], r["mc_se"]
        lines.append(f"| {'continuous' if T is None else T} | {e.mean:.4f} | {e.se:.4f} | {mc:.4f} | "
                     f"{e.mean - exact.mean:+.4f} | {(e.mean - exact.mean) / mc:+.1f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="a prepared dataset (dgemma data prepare)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--windows", type=int, default=128)
    p.add_argument("--t-samples", type=int, default=4)
    p.add_argument("--replicates", type=int, default=4)
    p.add_argument("--canvas", type=int, default=32, help="canvas length (the cpu-small preset's: 32)")
    p.add_argument("--smoke", action="store_true", help="a toy corpus and a few windows (seconds)")
    args = p.parse_args()
    if args.smoke:
        from dgemma.data.prepare import prepare
        from dgemma.data.tokenizer import write_toy_corpus

        tmp = Path(tempfile.mkdtemp())
        prepare(tmp / "data", [str(write_toy_corpus(tmp / "toy"))], tokenizer="bpe:300", val_fraction=0.1, quiet=True)
        args.data, args.seq_len, args.windows, args.canvas = tmp / "data", 32, 8, 8
    elif args.data is None:
        p.error("--data DIR is required (or --smoke)")
    if args.replicates < 2:
        p.error(f"--replicates must be >= 2 for a Monte Carlo SE, got {args.replicates}")
    print("\n".join(table(args.data, seq_len=args.seq_len, windows=args.windows, t_samples=args.t_samples,
                          replicates=args.replicates, canvas=args.canvas)))


if __name__ == "__main__":
    main()
