"""The demo's diffusion sampler, chosen across training seeds: for each trained seed of `runs/demo_seeds.py`
(OUT/seed-N), each sampler setting continues the demo's three prompts K times (draw k of prompt i: seed 1000k + i,
draws no other setting or seed shares), and the table gives, over those 3K continuations:

  words per 64 tokens   how much of the output is words (held-out text: about 39); its SE over continuations
  real words            the share of words, marks and line breaks that is a word of the training corpus
  prompt dependence     nats/token: how much less likely the seed's own AR baseline (the demo's scorer, trained on
                        the same data, so a judge only of "does it fit its prompt") finds a continuation after another
                        prompt than after its own; per draw k over the three prompts, its SE over continuations
  tokens per forward    new tokens per model pass (the AR baseline: 1.00)

The table "Choosing the demo's sampler" in docs/training.md. No training: minutes on 2 cores.

    python runs/demo_samplers.py --runs runs/out/demo-seeds --seeds 0,1,2 --draws 4
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from dgemma.data.shards import decode_documents
from dgemma.data.tokenizer import load_tokenizer
from dgemma.eval.decoding import real_word_share, words, words_per_64_tokens
from dgemma.eval.demo import DEMO
from dgemma.eval.judging import prompt_dependence, retokenize
from dgemma.sampling.generate import generate
from dgemma.weights.checkpoint import resolve_model_dir
from dgemma.weights.loading import load_generation_config, load_model

SETTINGS = {  # name -> generate() overrides of the checkpoint's generation config
    "entropy-bound (checkpoint's: bound 0.1, 48 steps)": {},
    "entropy-bound, bound 0.3": {"entropy_bound": 0.3},
    "ancestral, 16 steps": {"sampler": "ancestral", "max_denoising_steps": 16},
    "ancestral, 8 steps": {"sampler": "ancestral", "max_denoising_steps": 8},
}


def mean_se(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.mean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def one_seed(run: Path, draws: int) -> list[dict]:
    model = load_model(resolve_model_dir(run / "diffusion"), impl="fast").eval()
    ar = load_model(resolve_model_dir(run / "ar")).eval()
    tok = load_tokenizer(run / "diffusion" / "tokenizer.json")
    settings = load_generation_config(run / "diffusion")
    eos = settings.eos_token_id
    scorer = copy.deepcopy(ar).to(torch.float64)
    vocabulary = {w for doc in decode_documents(run / "data") for w in words(doc)}
    prompts = [torch.tensor([eos[0], *tok.encode(p, add_special_tokens=False)]) for p in DEMO.prompts]
    rows = []
    for name, overrides in SETTINGS.items():
        per64, real, gaps, per_forward = [], [], [], []
        for k in range(draws):
            samples, texts = [], []
            for i, ids in enumerate(prompts):
                result = generate(model, ids[None], generation_config=settings, max_new_tokens=64, seed=1000 * k + i,
                                  **overrides)
                new = result.new_tokens()[0]
                samples.append(new)
                texts.append(tok.decode(new, skip_special_tokens=True))
                per64.append(words_per_64_tokens(texts[-1:], max(len(new), 1)))
                real.append(real_word_share(texts[-1:], vocabulary))
                per_forward.append(float(result.tokens_per_forward[0]))
            nll = np.array(prompt_dependence(scorer, prompts, retokenize(tok, samples, eos))["nll"])
            n = len(prompts)
            gaps += [float(np.mean([nll[i, j] - nll[i, i] for j in range(n) if j != i])) for i in range(n)]
        row = {"seed": run.name, "sampler": name}
        for key, xs in (("words_per_64_tokens", per64), ("real_words", real), ("prompt_dependence", gaps),
                        ("tokens_per_forward", per_forward)):
            row[key], row[key + "_se"] = mean_se(xs)
        rows.append(row)
        print(f"{run.name:8s} {name:48s} words/64 {row['words_per_64_tokens']:5.1f} ± "
              f"{row['words_per_64_tokens_se']:.1f}  real {row['real_words']:.0%}  prompt dependence "
              f"{row['prompt_dependence']:+.3f} ± {row['prompt_dependence_se']:.3f}  tokens/forward "
              f"{row['tokens_per_forward']:.2f}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=Path("runs/out/demo-seeds"), help="runs/demo_seeds.py's --out")
    p.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    p.add_argument("--draws", type=int, default=4, help="continuations per prompt and setting")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for seed in args.seeds.split(","):
        run = args.runs / f"seed-{seed}"
        if not (run / "diffusion").is_dir():
            sys.exit(f"{run}: no trained demo there (python runs/demo_seeds.py --seeds {seed} --out {args.runs})")
        rows += one_seed(run, args.draws)
    (args.runs / "samplers.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
