"""The sampler's two measured rules (docs/sampling.md, "What the time level and the Lite commit rule are worth"): a
time-conditioned diffusion model sampled with each `time_level` ("canvas", the default, vs the seed's "schedule")
and the Lite sampler with each `lite_commit` ("scheduled", the default, vs the seed's), on the same held-out prompts
with the same seed, each setting scored on:

    copied   share of fresh-noise input positions whose argmax equals their input token (chance is 1 / V): per step
             and overall. Fresh noise: every position at step 1, else those the previous step did not accept/commit
    steps    denoising steps per canvas; tokens per forward (useful tokens per denoising pass)
    gen-PPL  of the samples under an AR judge trained on the same data (each sample given its prompt)
    entropy  the samples' unigram token entropy (nats; low = repetitive)
    commits  Lite: the share of positions committed after each step

The models are trained on Shakespeare (BPE 8,192) with the real CLI (a run that already has its checkpoint is not
retrained); every setting runs on both diffusion models:

    diffusion           dgemma train --preset cpu-tiny --time-embedding --diffusion-time continuous --max-steps 550
    diffusion-observed  the same with --observed-likelihood: the posterior takes each token's own observation, and
                        the sampler gives that term only to the positions it carried over (the ancestral chain: to
                        every position, at the chain's level)
    judge               dgemma train --preset cpu-tiny --objective ar --max-steps 960
    diffusion-from-ar   diffusion-observed started from the judge's weights (--init-from): the demo's recipe

(the demo's budget: these are bit for bit the runs `dgemma demo` and runs/time_ablations.py train with the same
flags and seed, so their checkpoints may be copied in).

    python runs/sampler_levels.py            # about 45 minutes on 2 cores (training 16), then the table
    python runs/sampler_levels.py --smoke    # the same pipeline: tiny models, toy corpus, 2 steps (seconds)

Writes OUT/sampler_levels.json and OUT/sampler_levels.md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from dgemma.io.fsio import write_text
from dgemma.sampling.generation_config import CHAINS

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("diffusion", "diffusion-observed", "diffusion-from-ar")

# name -> generate() settings. The first of each pair is the seed's rule, the second dgemma's default.
SETTINGS: list[tuple[str, dict]] = [
    ("entropy-bound, level schedule (seed)", {"sampler": "entropy-bound", "time_level": "schedule"}),
    ("entropy-bound, level canvas (default)", {"sampler": "entropy-bound", "time_level": "canvas"}),
    ("entropy-bound, level noise", {"sampler": "entropy-bound", "time_level": "noise"}),
    ("lite, level schedule, commit seed (seed 003)", {"sampler": "lite", "time_level": "schedule",
                                                      "lite_commit": "seed"}),
    ("lite, level canvas, commit seed", {"sampler": "lite", "time_level": "canvas", "lite_commit": "seed"}),
    ("lite, level schedule, commit scheduled", {"sampler": "lite", "time_level": "schedule",
                                                "lite_commit": "scheduled"}),
    ("lite, level canvas, commit scheduled (default)", {"sampler": "lite", "time_level": "canvas",
                                                        "lite_commit": "scheduled"}),
    ("lite, level noise, commit scheduled", {"sampler": "lite", "time_level": "noise", "lite_commit": "scheduled"}),
    # the ancestral sampler at the run's temperatures, self-conditioned: no likelihood describes it
    ("ancestral (the run's temperatures, self-conditioned; no likelihood)", {"sampler": "ancestral"}),
    # the chain the NELBO at T = N bounds (sampling/families.py:chain_likelihood)
    ("ancestral at temperature 1, no self-conditioning (the chain the NELBO bounds)",
     {"sampler": "ancestral", "t_min": 1.0, "t_max": 1.0, "self_conditioning": "off"}),
    ("predictor-corrector, 1 corrector a step (2N passes)", {"sampler": "predictor-corrector", "corrector_steps": 1}),
    # the committing samplers (issue 24): diffusers' block refinement, with and without editing, and Fast-dLLM's
    # confidence threshold
    ("block-refinement, threshold 0.95", {"sampler": "block-refinement", "commit_threshold": 0.95}),
    ("block-refinement, threshold 0.95, editing 0.99", {"sampler": "block-refinement", "commit_threshold": 0.95,
                                                        "edit_threshold": 0.99}),
    ("block-refinement, threshold 0.7", {"sampler": "block-refinement", "commit_threshold": 0.7}),
    ("confidence, threshold 0.9", {"sampler": "confidence", "commit_threshold": 0.9}),
    ("confidence, threshold 0.7", {"sampler": "confidence", "commit_threshold": 0.7}),
]


def train(args: argparse.Namespace) -> None:
    """Prepare the data and train the two runs with the real CLI, unless already there."""
    dgemma = [sys.executable, "-m", "dgemma"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    data = args.out / "data"
    if not (data / "meta.json").exists():
        extra = ["--corpus", "default:shakespeare", "--tokenizer", "bpe:8192"]
        if args.smoke:
            from dgemma.data.tokenizer import write_toy_corpus

            extra = ["--corpus", str(write_toy_corpus(args.out / "toy")), "--tokenizer", "bpe:1024"]
        subprocess.run([*dgemma, "data", "prepare", "--out", str(data), "-q", *extra], check=True, env=env)
    base = ["--preset", "tiny", "--vocab-size", "1024", "--batch-size", "2", "--eval-batches", "1",
            "--max-steps", "2"] if args.smoke else ["--preset", "cpu-tiny"]
    diffusion = ["--time-embedding", "--diffusion-time", "continuous", *([] if args.smoke else ["--max-steps", "550"])]
    runs = {"diffusion": [*base, *diffusion], "diffusion-observed": [*base, *diffusion, "--observed-likelihood"],
            "judge": [*base, "--objective", "ar", *([] if args.smoke else ["--max-steps", "960"])],
            # the demo's recipe: the judge's weights (the checkpoint decides the geometry), trained as diffusion
            "diffusion-from-ar": [*(base[base.index("--batch-size"):] if args.smoke else []), *diffusion,
                                  "--observed-likelihood", "--init-from", str(args.out / "judge")]}
    for name, flags in runs.items():  # in order: the judge before the run that starts from it
        if not (args.out / name / "checkpoints" / "latest").exists():
            print(f"training {name} ...", flush=True)
            with open(args.out / f"{name}.log", "w") as log:
                subprocess.run([*dgemma, "train", "--data", str(data), "--out", str(args.out / name), "--resume",
                                *flags], check=True, env=env, stdout=log, stderr=subprocess.STDOUT)


def measure(args: argparse.Namespace) -> dict:
    import torch

    from dgemma.data.shards import TokenDataset
    from dgemma.eval.decoding import generative_perplexity, quality, run_ar
    from dgemma.weights.checkpoint import resolve_model_dir
    from dgemma.weights.loading import load_model

    torch.set_num_threads(args.threads)
    models = {name: load_model(resolve_model_dir(args.out / name)).eval() for name in MODELS}
    judge = load_model(resolve_model_dir(args.out / "judge")).eval()
    L, V = models["diffusion"].config.canvas_length, models["diffusion"].config.vocab_size
    val = TokenDataset(args.out / "data", split="val")
    stride = max(args.prompt_length, len(val) // args.prompts)  # prompts spread over the held-out split
    prompts = torch.stack([torch.from_numpy(val.read(i * stride, args.prompt_length))
                           for i in range(args.prompts)])
    out: dict = {"prompts": args.prompts, "prompt_length": args.prompt_length, "max_new_tokens": args.max_new_tokens,
                 "steps": args.steps, "seed": args.seed, "canvas_length": L, "vocab_size": V, "chance": 1 / V,
                 "results": [], "references": []}
    real = [val.read(i * stride + args.prompt_length, args.max_new_tokens).tolist() for i in range(args.prompts)]
    ar = run_ar(judge, list(prompts), max_new_tokens=args.max_new_tokens, eos=(), seed=args.seed, progress=False)
    for name, samples in (("held-out text (the prompts' true continuations)", real),
                          ("the AR judge's own samples (temperature 1)", ar.samples)):
        ppl = generative_perplexity(judge, list(prompts), samples)["gen_ppl"]
        out["references"].append({"name": name, "gen_ppl": ppl, "token_entropy": quality(samples)["token_entropy"]})
    for model_name, model in models.items():
        for name, settings in SETTINGS:
            out["results"].append({"model": model_name, **_measure(model, judge, prompts, name, settings, args)})
            print(f"{model_name}, {name}: copied {out['results'][-1]['copied']:.1%}, gen-PPL "
                  f"{out['results'][-1]['gen_ppl']:.0f}", flush=True)
    return out


def _measure(model, judge, prompts, name: str, settings: dict, args: argparse.Namespace) -> dict:
    import torch

    from dgemma.eval.decoding import generative_perplexity, quality
    from dgemma.sampling.generate import generate

    r = generate(model, prompts, seed=args.seed, max_new_tokens=args.max_new_tokens, truncate=True,
                 max_denoising_steps=args.steps, trace=True, eos_token_id=(), **settings)
    chain = r.trace.summary["generation_config"]["sampler"] in CHAINS  # no fresh noise: nothing to copy
    P = max(info.step for info in r.trace.steps)  # passes a canvas: N, or N (1 + K) with K corrector passes
    copied, fresh_n = [0.0] * P, [0.0] * P
    committed, rows = [0.0] * P, [0.0] * P
    prev = None
    for info in r.trace.steps:  # canvas after canvas; a canvas's first step is all fresh noise
        k = info.step - 1
        fresh = torch.ones_like(info.accepted) if info.step == 1 else ~prev
        fresh &= info.active[:, None]
        copied[k] += float(((info.argmax == info.input_canvas) & fresh).sum())
        fresh_n[k] += float(fresh.sum())
        committed[k] += float(info.accepted[info.active].float().mean(-1).sum())
        rows[k] += float(info.active.sum())
        prev = info.accepted
    samples = [s[:args.max_new_tokens] for s in r.new_tokens()]
    ppl = generative_perplexity(judge, list(prompts), samples)
    per_step = [c / n if n else math.nan for c, n in zip(copied, fresh_n, strict=True)]
    return {
        "name": name, **settings,
        "copied": math.nan if chain else sum(copied) / max(sum(fresh_n), 1),
        "copied_per_step": [math.nan] * P if chain else per_step,
        "steps_per_canvas": sum(map(sum, r.steps_per_canvas)) / sum(map(len, r.steps_per_canvas)),
        "tokens_per_forward": float(r.tokens_per_forward.mean()), "gen_ppl": ppl["gen_ppl"],
        "token_entropy": quality(samples)["token_entropy"],
        "committed_per_step": [c / n if n else math.nan for c, n in zip(committed, rows, strict=True)],
        "sample": samples[0][:24],
    }


def table(m: dict) -> str:
    N = m["steps"]
    shown = sorted({0, N // 4, N // 2, 3 * N // 4, N - 1})
    head = " | ".join(f"step {k + 1}" for k in shown)
    lines = [f"| model | setting | copied, all steps | copied at {head} | steps/canvas | tokens/forward | gen-PPL | "
             "entropy |", "|---|---|---:|" + "---:|" * len(shown) + "---:|---:|---:|---:|"]
    pct = lambda x: "–" if x != x else f"{x:.1%}"
    at = lambda values, k: values[k] if k < len(values) else math.nan  # a sampler that stopped sooner has no step k
    for r in m["results"]:
        steps = " | ".join(pct(at(r["copied_per_step"], k)) for k in shown)
        lines.append(f"| {r['model']} | {r['name']} | {pct(r['copied'])} | {steps} | {r['steps_per_canvas']:.2f} | "
                     f"{r['tokens_per_forward']:.2f} | {r['gen_ppl']:.0f} | {r['token_entropy']:.2f} |")
    dash = " | ".join("–" for _ in range(len(shown) + 3))
    for r in m["references"]:
        lines.append(f"| – | {r['name']} | {dash} | {r['gen_ppl']:.0f} | {r['token_entropy']:.2f} |")
    lite = [r for r in m["results"] if r["sampler"] in ("lite", "block-refinement", "confidence")]
    shown = sorted({*shown, min(1, N - 1)})  # step 2 too: where the seed's rule commits
    lines += ["", f"Lite and the committing samplers: share of positions committed after step "
              f"({', '.join(str(k + 1) for k in shown)}) of {N} (– where every canvas had stopped):",
              ""]
    lines += [f"- {r['model']}, {r['name']}: " + ", ".join(pct(at(r["committed_per_step"], k)) for k in shown)
              for r in lite]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    p.add_argument("--prompt-length", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--steps", type=int, default=16, help="max_denoising_steps (default 16, the training T)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "runs" / "out" / "sampler_levels")),
                   help="where the data, the runs and the table go (default $OUT, else runs/out/sampler_levels)")
    p.add_argument("--smoke", action="store_true", help="tiny models, toy corpus, 2 training steps, 2 prompts")
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.prompt_length, args.max_new_tokens, args.steps = 2, 8, 16, 4
    args.out.mkdir(parents=True, exist_ok=True)
    train(args)
    m = measure(args)
    write_text(args.out / "sampler_levels.json", json.dumps(m, indent=1) + "\n")  # before the table: kept whatever
    md = table(m)
    write_text(args.out / "sampler_levels.md", md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
