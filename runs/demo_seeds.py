"""The demo's recipe across training seeds: does its diffusion model write (words per 64 tokens, against held-out
text's) and depend on its prompt (prompt dependence above zero by 2 SE) whatever the seed? A different seed stands in
for another CPU's floating-point rounding, which changes the models as much. The table "The demo across training
seeds" in docs/training.md.

Each seed is a whole `dgemma demo` (its default budget, seed 0 sampling) in OUT/seed-N; the table goes to stdout
and OUT/seeds.json. Minutes per seed on 2 quiet cores.

    python runs/demo_seeds.py --seeds 0,1,2 --out runs/out/demo-seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import random
import sys
from pathlib import Path

from dgemma.eval.demo import DEMO, run_demo
from dgemma.train.config import train_preset

MIN_WORDS = 25  # words per 64 tokens the diffusion model's continuations must reach
MIN_SE = 2.0  # prompt dependence above zero by this many standard errors


def smoke_recipe(root: Path):
    """A toy corpus and the `tiny` preset: the script's plumbing in seconds (the figures mean nothing)."""
    from dgemma.data.tokenizer import toy_corpus

    text = root / "toy-text"
    text.mkdir(parents=True, exist_ok=True)
    rng, sentences = random.Random(0), toy_corpus(12)[14:]
    for i in range(60):
        (text / f"d{i:03d}.txt").write_text(" ".join(rng.choice(sentences) for _ in range(12)))
    return dataclasses.replace(DEMO, corpus=(str(text),), tokenizer="bpe:512", diffusion_steps=2, ar_steps=3,
                               diffusion=train_preset("tiny").replace(eval_batches=1, eval_every=100, save_every=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    p.add_argument("--out", type=Path, default=Path("runs/out/demo-seeds"))
    p.add_argument("--smoke", action="store_true", help="a toy corpus and model, 2 steps: the plumbing only")
    args = p.parse_args()
    recipe = smoke_recipe(args.out) if args.smoke else DEMO
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        seeded = dataclasses.replace(recipe, diffusion=recipe.diffusion.replace(seed=seed))  # the AR baseline's too
        log = io.StringIO()
        result = run_demo(args.out / f"seed-{seed}", recipe=seeded, stream=log, live=False,
                          max_new_tokens=16 if args.smoke else 64)
        (args.out / f"seed-{seed}" / "demo.log").write_text(log.getvalue())
        f = result.figures
        d = f["diffusion"]
        rows.append({"seed": seed, "nelbo": d["heldout_nelbo"], "tokens_per_forward": d["tokens_per_forward"],
                     "words_per_64_tokens": d["words_per_64_tokens"],
                     "heldout_words_per_64_tokens": f["heldout_text"]["words_per_64_tokens"],
                     "real_word_share": d["real_word_share"], "prompt_dependence": d["prompt_dependence"],
                     "prompt_dependence_se": d["prompt_dependence_se"],
                     "ar_words_per_64_tokens": f["ar"]["words_per_64_tokens"], "texts": result.diffusion_texts})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "texts"}), file=sys.stderr, flush=True)
    (args.out / "seeds.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("| training seed | held-out NELBO | tokens/forward | words per 64 tokens (held-out text) | real words | "
          "prompt dependence | passes |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ok = r["words_per_64_tokens"] >= MIN_WORDS and r["prompt_dependence"] > MIN_SE * r["prompt_dependence_se"]
        print(f"| {r['seed']} | {r['nelbo']:.2f} | {r['tokens_per_forward']:.2f} | {r['words_per_64_tokens']:.0f} "
              f"({r['heldout_words_per_64_tokens']:.0f}) | {100 * r['real_word_share']:.0f}% | "
              f"{r['prompt_dependence']:.2f} ± {r['prompt_dependence_se']:.2f} | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    main()
