"""Issue 23's measurements of the diffusion recipe (docs/training.md, "Continuous time"): the same model trained for the
same steps (the same windows in the same order) with one switch of how noise levels are drawn changed at a time, each
scored on the same held-out windows with the same noise draws (common random numbers, so differences are paired):

    the continuous-time NELBO (the chain's T -> infinity limit), the discrete-time NELBO at T = 16, 64 and 256 (does
    the bound tighten as T grows?), the x0 cross-entropy, and the AR baseline's cross-entropy on the same windows,
    with the unigram model's for scale; paired differences to the first variant with their SE, and the recipes
    trained from a second seed (NAME@seed1) against the same seed's first variant.

Two settings: `demo` (what `dgemma demo` trains: `cpu-tiny` on Shakespeare with a BPE of 8,192 ids) and `cpu-small`
(the README's model on the default corpus). Training runs go `--jobs` at a time, one CPU thread each; a run that has
its last checkpoint is not retrained and a scored one not rescored (OUT/NAME/score.json), so the script resumes.

    python runs/time_ablations.py --setting demo --steps 550      # about an hour on 2 cores (13 runs, then scoring)
    python runs/time_ablations.py --smoke                         # the same pipeline, tiny model, toy corpus
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from harness import chosen, paired_difference, saved_score, score_once, train_once

from dgemma.data.tokenizer import write_toy_corpus
from dgemma.io.fsio import write_text

ROOT = Path(__file__).resolve().parents[1]
CONT = ["--diffusion-time", "continuous"]
AR_RUN = "{ar}"  # in a variant's flags: the `ar` variant's run directory (that variant trains first)
# name -> (what it changes, `dgemma train` flags on top of the setting's base).
VARIANTS: list[tuple[str, str, list[str]]] = [
    ("discrete", "time conditioning, t ~ U{1..16} per canvas (cpu-small's recipe before issue 23)", []),
    ("continuous", "levels s ~ U(0, 1] per canvas (continuous time)", CONT),
    ("continuous+sc0", "continuous, no self-conditioning pre-pass", [*CONT, "--self-conditioning-prob", "0"]),
    ("continuous+observed", "continuous, the posterior takes each token's own observation by Bayes",
     [*CONT, "--observed-likelihood"]),
    ("discrete+observed", "discrete, the posterior takes each token's own observation by Bayes",
     ["--observed-likelihood"]),
    ("ar", "the AR baseline (same backbone, data, batch and schedule)", ["--objective", "ar"]),
    ("unigram+observed", "no network: the unigram distribution as p(x0 | x_s), with the observation term (not "
     "trained)", []),
    ("discrete@seed1", "`discrete` from training seed 1", ["--seed", "1"]),
    ("continuous@seed1", "`continuous` from training seed 1", [*CONT, "--seed", "1"]),
    ("continuous+observed@seed1", "`continuous+observed` from training seed 1",
     [*CONT, "--observed-likelihood", "--seed", "1"]),
    # Started from the `ar` run's weights (trained first, for the same steps: twice the compute of the rows above).
    ("from-ar", "continuous, started from the `ar` run's weights (its time input new, at zero)",
     [*CONT, "--init-from", AR_RUN]),
    ("from-ar+observed", "`from-ar` with the observed likelihood (the demo's recipe)",
     [*CONT, "--observed-likelihood", "--init-from", AR_RUN]),
    ("from-ar@seed1", "`from-ar` from training seed 1 (the same `ar` run)",
     [*CONT, "--init-from", AR_RUN, "--seed", "1"]),
    ("from-ar+observed@seed1", "`from-ar+observed` from training seed 1 (the same `ar` run)",
     [*CONT, "--observed-likelihood", "--init-from", AR_RUN, "--seed", "1"]),
]
# The variant each row's paired difference is against (default: `discrete`, or `discrete@seed1` for a seed-1 row).
PAIRED_WITH = {"from-ar": "continuous", "from-ar+observed": "from-ar", "from-ar@seed1": "continuous@seed1",
               "from-ar+observed@seed1": "from-ar@seed1"}
SETTINGS = {
    "demo": {"corpus": ["--corpus", "default:shakespeare", "--tokenizer", "bpe:8192"],
             "train": ["--preset", "cpu-tiny", "--time-embedding", "--warmup-steps", "20"]},
    "cpu-small": {"corpus": [], "train": ["--preset", "cpu-small"]},
    "smoke": {"corpus": None, "train": ["--preset", "tiny", "--time-embedding", "--vocab-size", "1024",
                                        "--batch-size", "2", "--eval-batches", "1"]},
}
EVAL_T = (16, 64, 256)
CANVAS = {"demo": 16, "cpu-small": 32, "smoke": 16}  # each setting's preset canvas length


def train(name: str, flags: list[str], args: argparse.Namespace) -> str:
    base = SETTINGS[args.setting]["train"]
    if "ar" in flags:  # the AR objective has no time input
        base = [f for f in base if f not in ("--time-embedding", "--observed-likelihood")]
    if AR_RUN in flags:  # the checkpoint decides the geometry
        i = base.index("--vocab-size") if "--vocab-size" in base else len(base)
        base = base[:i] + base[i + 2:]
    flags = [str(args.out / "ar") if f == AR_RUN else f for f in flags]
    return train_once(args.out, name, args.steps, [*base, "--data", str(args.out / "data"), "--eval-every",
                                                   str(args.steps), "--save-every", str(args.steps), *flags])


def _settings(args: argparse.Namespace) -> dict:
    return {"setting": args.setting, "steps": args.steps, "windows": args.windows, "t_samples": args.t_samples,
            "seq_len": args.seq_len, "eval_t": list(EVAL_T)}


def score(name: str, args: argparse.Namespace) -> dict:
    """The variant's score, kept in OUT/NAME/score.json with the settings that made it."""
    return score_once(args.out / name / "score.json", _settings(args), lambda: _score(name, args))


def _score(name: str, args: argparse.Namespace) -> dict:
    import torch

    from dgemma.data.shards import TokenDataset
    from dgemma.eval.likelihoods import heldout_ar_ce, heldout_x0_ce, model_nelbo
    from dgemma.weights.checkpoint import resolve_model_dir
    from dgemma.weights.loading import load_model

    torch.set_num_threads(1)
    model = load_model(resolve_model_dir(args.out / name)).eval()
    val = TokenDataset(args.out / "data", split="val")
    common = dict(seq_len=args.seq_len, max_windows=args.windows, progress=False)
    if name == "ar":
        r = heldout_ar_ce(model, val, **common)
        return {"name": name, "ar_ce": r["estimate"].to_dict()}
    out: dict = {"name": name}
    for T in (*EVAL_T, None):
        key = "continuous" if T is None else f"T{T}"
        r = model_nelbo(model, val, num_steps=T, num_t_samples=args.t_samples, seed=0, **common)
        out[f"nelbo_{key}"] = r["estimate"].to_dict() | {"mc_se": r["mc_se"]}
        out[f"per_window_{key}"] = r["per_window"]
    time = "continuous" if "continuous" in FLAGS[name] else "discrete"
    ce = heldout_x0_ce(model, val, num_steps=16, time=time, seed=0, **common)
    out["x0_ce"] = ce["estimate"].to_dict()
    return out


FLAGS = {name: flags for name, _, flags in VARIANTS}


def reference_score(args: argparse.Namespace) -> dict:
    """The `unigram+observed` row: no network at all, the training split's unigram distribution as every
    position's p(x0 | x_s), with the observation term (dgemma/diffusion/noise.py:observe), scored like the variants.
    What the observed likelihood's bound is before any context is learned."""
    return score_once(args.out / "unigram+observed.json", _settings(args), lambda: _reference_score(args))


def _reference_score(args: argparse.Namespace) -> dict:
    import torch

    from dgemma.data.shards import TokenDataset
    from dgemma.diffusion.noise import observe
    from dgemma.eval.likelihoods import heldout_nelbo

    train_split, val = TokenDataset(args.out / "data", split="train"), TokenDataset(args.out / "data", split="val")
    V = train_split.meta["vocab_size"]
    counts = np.bincount(train_split.read(0, len(train_split)), minlength=V).astype(np.float64) + 0.5
    log_unigram = torch.tensor(np.log(counts / counts.sum()), dtype=torch.float32)
    L = CANVAS[args.setting]

    def posterior(x0, xt, level):
        return observe(log_unigram.expand(*x0.shape, -1).clone(), xt, level.repeat_interleave(L, dim=1))

    out: dict = {"name": "unigram+observed"}
    for T in (*EVAL_T, None):
        key = "continuous" if T is None else f"T{T}"
        r = heldout_nelbo(lambda context: posterior, val, canvas_length=L, vocab_size=len(log_unigram),
                          seq_len=args.seq_len, num_steps=T, num_t_samples=args.t_samples, replicates=2,
                          model_sha="unigram+observed", max_windows=args.windows, seed=0, progress=False)
        out[f"nelbo_{key}"] = r["estimate"].to_dict() | {"mc_se": r["mc_se"]}
        out[f"per_window_{key}"] = r["per_window"]
    return out


def headline(r: dict) -> str:
    """A variant's headline bound: the tighter of its continuous-time and T = 16 bounds (`dgemma eval`'s rule)."""
    return min(("continuous", "T16"), key=lambda k: r[f"nelbo_{k}"]["mean"])


def table(results: list[dict], unigram: float | None) -> str:
    by = {r["name"]: r for r in results}
    ar = by.get("ar", {}).get("ar_ce", {}).get("mean")
    what = {n: w for n, w, _ in VARIANTS}
    lines = ["| variant | what changes | NELBO continuous | T=16 | T=64 | T=256 | headline, paired difference | "
             "headline / AR CE | share of AR's gain over unigram | x0 CE |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["name"] == "ar":
            continue
        cells = [f"{r[f'nelbo_{k}']['mean']:.3f} ± {r[f'nelbo_{k}']['se']:.3f}"
                 for k in ("continuous", *[f"T{T}" for T in EVAL_T])]
        h = headline(r)
        other = by.get(PAIRED_WITH.get(r["name"], "discrete@seed1" if r["name"].endswith("@seed1") else "discrete"))
        diff = "–"
        if other is not None and other is not r:
            o = headline(other)
            diff = f"{paired_difference(r[f'per_window_{h}'], other[f'per_window_{o}'], h, o)} vs `{other['name']}`"
        value = r[f"nelbo_{h}"]["mean"]
        ratio = f"{value / ar:.3f}" if ar else "–"
        share = f"{(unigram - value) / (unigram - ar):.0%}" if ar and unigram else "–"
        ce = f"{r['x0_ce']['mean']:.3f}" if "x0_ce" in r else "–"
        lines.append(f"| {r['name']} | {what[r['name']]} | {' | '.join(cells)} | {diff} | {ratio} | {share} | {ce} |")
    if ar:
        lines.append(f"| ar | {what['ar']} | AR CE {ar:.3f} ± {by['ar']['ar_ce']['se']:.3f} | | | | | 1 | 100% | |")
    if unigram:
        lines.append(f"\nUnigram cross-entropy (training split's token frequencies on the held-out split): "
                     f"{unigram:.3f} nats/token. Headline: the tighter of a variant's continuous-time and T = 16 "
                     "bounds (`dgemma eval`'s rule); each row's paired difference is against the variant named.")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=("demo", "cpu-small"), default="demo")
    p.add_argument("--steps", type=int, default=550, help="training steps of every variant (default 550)")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once, one thread each (default 2)")
    p.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    p.add_argument("--windows", type=int, default=128, help="held-out windows scored (default 128)")
    p.add_argument("--t-samples", type=int, default=4, help="stratified levels per canvas (default 4)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="default runs/out/time-ablations-SETTING")
    p.add_argument("--smoke", action="store_true", help="tiny model, toy corpus, 2 steps")
    args = p.parse_args()
    if args.smoke:
        args.setting, args.steps, args.windows, args.t_samples, args.seq_len = "smoke", 2, 2, 1, 32
    args.out = args.out or ROOT / "runs" / "out" / f"time-ablations-{args.setting}"
    variants = [v for v in VARIANTS if v[0] != "unigram+observed"]  # the reference row is scored, not trained
    if args.only:
        keep = chosen(p, args.only, [name for name, _, _ in VARIANTS])
        variants = [v for v in variants if v[0] in keep]
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data"
    if not (data / "meta.json").exists():
        corpus = SETTINGS[args.setting]["corpus"]
        if corpus is None:  # the smoke test's toy corpus
            corpus = ["--corpus", str(write_toy_corpus(args.out / "toy")), "--tokenizer", "bpe:1024"]
        subprocess.run([sys.executable, "-m", "dgemma", "data", "prepare", "--out", str(data), "-q", *corpus],
                       check=True)
    later = [v for v in variants if AR_RUN in v[2]]  # started from the `ar` run: trained once it is
    first = [v for v in variants if v not in later] + ([v for v in VARIANTS if v[0] == "ar"]
                                                         if later and not any(v[0] == "ar" for v in variants) else [])
    with ProcessPoolExecutor(args.jobs) as pool:
        for stage in (first, later):
            for line in pool.map(train, [v[0] for v in stage], [v[2] for v in stage], [args] * len(stage)):
                print(line, flush=True)
        list(pool.map(score, [v[0] for v in first + later], [args] * len(first + later)))
    from dgemma.data.shards import unigram_cross_entropy

    results = [r for name, _, _ in VARIANTS if (r := saved_score(args.out / name / "score.json", _settings(args)))
               is not None]
    results.append(reference_score(args))
    md = table(results, unigram_cross_entropy(data))
    write_text(args.out / "time_ablations.md", md + "\n")
    write_text(args.out / "time_ablations.json", json.dumps(
        {**_settings(args), "results": [{k: v for k, v in r.items() if not k.startswith("per_window")}
                                        for r in results]}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
