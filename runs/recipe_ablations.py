"""The recipe ablations of docs/training.md ("What the recipe options are worth"): `cpu-small` trained on the default
corpus for the same steps (the same tokens, in the same order) with one recipe switch changed at a time, then each
scored on the same held-out windows with the same noise draws (common random numbers, so differences are paired):

    held-out NELBO at T = 16 (the training T) and at T = 256 (closer to the continuous-time bound), each with its
    standard error, the paired difference to the baseline at T = 16 with the SE of that difference, and the x0
    cross-entropy (seed 003's measure).

Training runs go `--jobs` at a time, each on one CPU thread (two runs on a 2-core machine use it fully); a variant
whose run already has its last checkpoint is not retrained, and one already scored with the same settings is not
rescored (OUT/NAME/score.json), so the script resumes where it stopped and `--only` adds rows to the table. Writes
OUT/ablations.json and OUT/ablations.md (the table of every variant scored so far, then, for the recipes also
trained from seed 1 (NAME@seed1), their gain over the same seed's baseline per seed and averaged: the SEs are over
held-out windows and do not see a training run's luck), and prints them.

    python runs/recipe_ablations.py                      # about 2 hours on 2 cores (17 runs of 400 steps)
    python runs/recipe_ablations.py --smoke              # the same pipeline, tiny model, toy corpus (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from harness import chosen, paired_difference, saved_score, score_once, train_once

from dgemma.data.tokenizer import write_toy_corpus
from dgemma.io.fsio import write_text

ROOT = Path(__file__).resolve().parents[1]

# name -> (what it changes, `dgemma train` flags). Each builds on the named earlier variant's flags.
VARIANTS: list[tuple[str, str, list[str]]] = [
    ("baseline", "cpu-small before these ablations: x0 cross-entropy, t ~ U{1..16} per canvas, no time input",
     []),
    ("time", "+ time conditioning (the dg model is told t/T)", ["--time-embedding"]),
    ("time+strat", "+ stratified (low-discrepancy) t over each micro-batch", ["--time-embedding",
                                                                              "--t-sampling", "stratified"]),
    ("time+strat+elbo", "+ the NELBO-weighted loss", ["--time-embedding", "--t-sampling", "stratified",
                                                      "--loss-weighting", "elbo"]),
    ("time+strat+sc0", "+ no self-conditioning pre-pass", ["--time-embedding", "--t-sampling", "stratified",
                                                           "--self-conditioning-prob", "0"]),
    ("time+strat+lr1e-3", "+ peak lr 1e-3 (3e-3 today)", ["--time-embedding", "--t-sampling", "stratified",
                                                          "--lr", "1e-3", "--min-lr", "1e-4"]),
    ("time+strat+canvas16", "+ canvas 16 (32 today)", ["--time-embedding", "--t-sampling", "stratified",
                                                       "--canvas-length", "16"]),
    # The switches that helped, together (stratified levels left out: they did not help).
    ("time+canvas16", "time conditioning and canvas 16", ["--time-embedding", "--canvas-length", "16"]),
    ("time+sc0+canvas16", "time conditioning, canvas 16, no self-conditioning pre-pass",
     ["--time-embedding", "--canvas-length", "16", "--self-conditioning-prob", "0"]),
    # A lower peak learning rate was much worse, so the other direction: diffusion's lr tuned apart from AR's.
    ("time+lr6e-3", "time conditioning, peak lr 6e-3 (3e-3 today; the AR baseline keeps 3e-3)",
     ["--time-embedding", "--lr", "6e-3", "--min-lr", "6e-4"]),
    ("time+canvas16+lr6e-3", "time conditioning, canvas 16, peak lr 6e-3",
     ["--time-embedding", "--canvas-length", "16", "--lr", "6e-3", "--min-lr", "6e-4"]),
    ("time+sc0+lr6e-3", "time conditioning, no self-conditioning pre-pass, peak lr 6e-3",
     ["--time-embedding", "--self-conditioning-prob", "0", "--lr", "6e-3", "--min-lr", "6e-4"]),
    ("time+ar0.5", "time conditioning, + a next-token loss on the clean stream (weight 0.5)",
     ["--time-embedding", "--ar-weight", "0.5"]),
    # Training noise: the same recipes from another seed (weights, data order and noise draws). The SEs above are
    # over held-out windows only; these rows say how far a run's luck alone moves the NELBO.
    ("baseline@seed1", "the `baseline` row from training seed 1", ["--seed", "1"]),
    ("time@seed1", "the `time` row from training seed 1", ["--time-embedding", "--seed", "1"]),
    ("time+canvas16@seed1", "the `time+canvas16` row from training seed 1", ["--time-embedding", "--canvas-length",
                                                                            "16", "--seed", "1"]),
    ("time+ar0.5@seed1", "the `time+ar0.5` row from training seed 1", ["--time-embedding", "--ar-weight", "0.5",
                                                                      "--seed", "1"]),
]
EVAL_T = (16, 256)


def train(name: str, flags: list[str], args: argparse.Namespace) -> str:
    # The baseline is pinned (cpu-small as it was before these ablations: no time input, no next-token loss), so
    # the rows stay what they say after the preset adopts what they found.
    base = ["--preset", "tiny", "--vocab-size", "1024", "--batch-size", "2", "--eval-batches", "1"] if args.smoke \
        else ["--preset", "cpu-small", "--no-time-embedding", "--ar-weight", "0"]
    return train_once(args.out, name, args.steps, [*base, "--data", str(args.out / "data"), "--eval-every",
                                                   str(args.eval_every), *flags])


def _settings(args: argparse.Namespace) -> dict:
    return {"steps": args.steps, "windows": args.windows, "t_samples": args.t_samples, "seq_len": args.seq_len,
            "eval_t": list(EVAL_T)}


def score(name: str, args: argparse.Namespace) -> dict:
    """The variant's score, kept in OUT/NAME/score.json with the settings that made it."""
    return score_once(args.out / name / "score.json", _settings(args), lambda: _score(name, args))


def _score(name: str, args: argparse.Namespace) -> dict:
    import torch

    from dgemma.data.shards import TokenDataset
    from dgemma.eval.likelihoods import heldout_x0_ce, model_nelbo
    from dgemma.weights.checkpoint import resolve_model_dir
    from dgemma.weights.loading import load_model

    torch.set_num_threads(1)
    model = load_model(resolve_model_dir(args.out / name)).eval()
    val = TokenDataset(args.out / "data", split="val")
    out: dict = {"name": name, "canvas_length": model.config.canvas_length}
    for T in EVAL_T:
        r = model_nelbo(model, val, seq_len=args.seq_len, num_steps=T, num_t_samples=args.t_samples,
                        max_windows=args.windows, seed=0, progress=False)
        out[f"nelbo_T{T}"] = r["estimate"].to_dict() | {"mc_se": r["mc_se"]}
        out[f"per_window_T{T}"] = r["per_window"]
    ce = heldout_x0_ce(model, val, seq_len=args.seq_len, num_steps=16, max_windows=args.windows, seed=0,
                       progress=False)
    out["x0_ce"] = ce["estimate"].to_dict()
    return out


def table(results: list[dict]) -> str:
    base = results[0]
    lines = ["| variant | what changes | NELBO T=16 | vs baseline at T=16 (paired) | NELBO T=256 | x0 CE |",
             "|---|---|---:|---:|---:|---:|"]
    what = {n: w for n, w, _ in VARIANTS}
    for r in results:
        cells = [f"{r[f'nelbo_T{T}']['mean']:.3f} ± {r[f'nelbo_T{T}']['se']:.3f}" for T in EVAL_T]
        diff = "–" if r is base else paired_difference(r["per_window_T16"], base["per_window_T16"], "T16", "T16")
        ce = f"{r['x0_ce']['mean']:.3f} ± {r['x0_ce']['se']:.3f}"
        lines.append(f"| {r['name']} | {what[r['name']]} | {cells[0]} | {diff} | {cells[1]} | {ce} |")
    return "\n".join(lines)


def seed_table(results: list[dict]) -> str:
    """Each recipe trained from two seeds: its paired gain over the baseline of the same seed, per seed and averaged.
    The `baseline` row is the baseline's own seed-to-seed change (training noise alone). Empty without replicates."""
    by = {r["name"]: r for r in results}
    gain = lambda a, b: float(np.mean(np.asarray(by[a]["per_window_T16"]) - np.asarray(by[b]["per_window_T16"])))
    if "baseline@seed1" not in by:
        return ""
    lines = ["| recipe | vs baseline, seed 0 | vs baseline, seed 1 | mean over seeds |", "|---|---:|---:|---:|",
             f"| baseline (seed 1 - seed 0) | – | – | {gain('baseline@seed1', 'baseline'):+.3f} |"]
    for name, _, _ in VARIANTS:
        if name != "baseline" and "@" not in name and f"{name}@seed1" in by and name in by:
            g0, g1 = gain(name, "baseline"), gain(f"{name}@seed1", "baseline@seed1")
            lines.append(f"| {name} | {g0:+.3f} | {g1:+.3f} | {(g0 + g1) / 2:+.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="training steps of every variant (default 400)")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once, one thread each (default 2)")
    p.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    p.add_argument("--windows", type=int, default=128, help="held-out windows scored (default 128)")
    p.add_argument("--t-samples", type=int, default=4, help="stratified t per canvas (default 4)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "runs" / "out" / "ablations")),
                   help="where the data, the runs and the table go (default $OUT, else runs/out/ablations)")
    p.add_argument("--smoke", action="store_true", help="tiny model, toy corpus, 2 steps, 4 variants")
    args = p.parse_args()
    variants = VARIANTS
    if args.smoke:
        args.steps, args.windows, args.t_samples, args.seq_len, args.eval_every = 2, 2, 1, 32, 1
        variants = [v for v in VARIANTS if v[0] in ("baseline", "time", "baseline@seed1", "time@seed1")]
    if args.only:
        keep = chosen(p, args.only, [name for name, _, _ in VARIANTS])
        variants = [v for v in VARIANTS if v[0] in keep or v[0] == "baseline"]
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data"
    if not (data / "meta.json").exists():
        extra = ["--corpus", str(write_toy_corpus(args.out / "toy")), "--tokenizer", "bpe:1024"] if args.smoke else []
        subprocess.run([sys.executable, "-m", "dgemma", "data", "prepare", "--out", str(data), "-q", *extra],
                       check=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        for line in pool.map(train, [v[0] for v in variants], [v[2] for v in variants], [args] * len(variants)):
            print(line, flush=True)
        list(pool.map(score, [v[0] for v in variants], [args] * len(variants)))
    # The table: every variant scored with these settings (earlier --only calls included), in VARIANTS order.
    results = [r for name, _, _ in VARIANTS if (r := saved_score(args.out / name / "score.json", _settings(args)))
               is not None]
    md = table(results)
    if seeds := seed_table(results):
        md += "\n\nOver training seeds (NELBO at T = 16, nats/token):\n\n" + seeds
    write_text(args.out / "ablations.md", md + "\n")
    write_text(args.out / "ablations.json", json.dumps(
        {**_settings(args), "results": [{k: v for k, v in r.items() if not k.startswith("per_window")}
                                        for r in results]}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
