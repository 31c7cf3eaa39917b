"""What `--quantize int8` costs in quality (docs/benchmarks.md, "Quantization"), measured, not assumed:

1. per preset, random weights (`testing.hf.randomize_`): max and mean |logit error| of the int8 model, and of the
   bf16 model for scale, against the fp32 model, on one prompt and one canvas (a self-conditioned denoise step);
2. a trained `cpu-small` (`bash runs/cpu_small_results.sh` makes one; without one, this script trains one for
   --train-steps with `dgemma train`): the held-out NELBO (nats/token, same windows and noise draws) in fp32 and
   int8, and the x0 cross-entropy;
3. the same model: generation agreement at the same seed: the share of committed tokens identical to fp32's, and the
   share of whole canvases identical, over --prompts held-out prompts (readable sampler: the same draws as long as
   the logits agree).

Prints a markdown summary and one JSON object (to --json PATH too).

    python runs/quant_quality.py
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import dgemma
from dgemma.data.shards import TokenDataset
from dgemma.eval.evaluate import pick_prompts
from dgemma.eval.likelihoods import heldout_x0_ce, model_nelbo
from dgemma.model.config import PRESETS
from dgemma.testing.hf import randomize_
from dgemma.weights import quantize

ROOT = Path(__file__).resolve().parents[1]
CPU_PRESETS = ["tiny", "lite-tiny", "cpu-small", "bench-small", "dg-380m", "lite-380m"]


def logit_errors(name: str, seed: int = 0) -> dict[str, float]:
    cfg = PRESETS[name]
    model = randomize_(dgemma.DiffusionGemma(cfg), seed).eval()
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, min(64, cfg.sliding_window + 8)), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)
    sc = torch.randn(1, cfg.canvas_length, cfg.vocab_size, generator=g)
    first: list[torch.Tensor] = []  # the first layer's output in the decoder pass (the last call of layer 0)

    def run(m: dgemma.DiffusionGemma) -> torch.Tensor:
        hook = m.layers[0].register_forward_hook(lambda mod, args, out: first.append(out[0].float()))
        try:
            return m(prompt, canvas, self_conditioning_logits=sc, impl="fast")
        finally:
            hook.remove()

    ref = run(model)
    ref_first = first[-1]
    out = {"logit_std": float(ref.std())}
    bf16 = run(copy.deepcopy(model).to(torch.bfloat16))
    bf16_first = first[-1]
    q = quantize.quantize_model(model, "int8")
    for label, logits, x in (("bf16", bf16, bf16_first), ("int8", run(q), None)):
        x = first[-1] if x is None else x
        err = (logits - ref).abs()
        out[f"{label}_max"], out[f"{label}_mean"] = float(err.max()), float(err.mean())
        out[f"{label}_argmax_agree"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        out[f"{label}_layer0_rel"] = float((x - ref_first).norm() / ref_first.norm())
    return out


def ensure_trained(model: Path, data: Path, steps: int, smoke: bool) -> None:
    """Prepare the default corpus (or, --smoke, a toy one) and train cpu-small (tiny) unless `model` exists."""
    if model.exists():
        return
    dg = [sys.executable, "-m", "dgemma"]
    if not (data / "meta.json").exists():
        extra = []
        if smoke:
            from dgemma.data.tokenizer import write_toy_corpus

            toy = write_toy_corpus(data.parent / "toy")
            extra = ["--corpus", str(toy), "--cache-dir", str(data.parent / ".cache"), "-q"]
        subprocess.run([*dg, "data", "prepare", "--out", str(data), *extra], check=True)
    preset = ["--preset", "tiny", "--vocab-size", "1024", "--batch-size", "2", "--eval-batches", "1"] if smoke \
        else ["--preset", "cpu-small"]
    subprocess.run([*dg, "train", *preset, "--data", str(data), "--out", str(model), "--max-steps", str(steps)],
                   check=True)


def trained_quality(run: Path, data: Path, prompts: int, windows: int, new_tokens: int, seed: int,
                    steps: int | None) -> dict:
    fp32 = dgemma.load_model(run, dtype=torch.float32)
    int8 = dgemma.load_model(run, dtype=torch.float32, quantize="int8")
    bf16 = dgemma.load_model(run, dtype=torch.bfloat16)
    val = TokenDataset(data, "val")
    L, V = fp32.config.canvas_length, fp32.config.vocab_size
    out: dict = {"model": str(run), "prompts": prompts, "windows": windows}
    # logits of a half-noised held-out canvas after 3 clean ones, fp32 against bf16 and int8
    g = torch.Generator().manual_seed(seed)
    rows = min(8, val.num_tokens // (4 * L))
    x = torch.from_numpy(val.read(0, rows * 4 * L).astype("int64")).view(rows, 4 * L)
    noise = torch.randint(0, V, (rows, L), generator=g)
    noisy = torch.where(torch.rand(rows, L, generator=g) < 0.5, noise, x[:, 3 * L:])
    ref = fp32(x[:, :3 * L], noisy)
    for label, model in (("bf16", bf16), ("int8", int8)):
        logits = model(x[:, :3 * L], noisy)
        err = (logits - ref).abs()
        out[f"{label}_logits"] = {"max": float(err.max()), "mean": float(err.mean()), "logit_std": float(ref.std()),
                                  "argmax_agree": float((logits.argmax(-1) == ref.argmax(-1)).float().mean())}
    for label, model in (("fp32", fp32), ("int8", int8)):
        common = dict(seq_len=4 * L, num_steps=16, batch_size=4, max_windows=windows, seed=seed, progress=False)
        r = model_nelbo(model, val, num_t_samples=4, **common)  # each model's own draws: the change carries both MC SEs
        nelbo = r["estimate"]
        x0 = heldout_x0_ce(model, val, objective="clean-context", **common)["estimate"]
        out[label] = {"nelbo": nelbo.mean, "nelbo_se": nelbo.se, "nelbo_mc_se": r["mc_se"], "x0_ce": x0.mean}
    out["nelbo_change"] = out["int8"]["nelbo"] - out["fp32"]["nelbo"]
    out["nelbo_change_mc_se"] = math.hypot(out["int8"]["nelbo_mc_se"], out["fp32"]["nelbo_mc_se"])
    same = {"bf16": 0, "int8": 0}
    same_canvases = {"bf16": 0, "int8": 0}
    total = canvases = 0
    seconds = {"fp32": 0.0, "bf16": 0.0, "int8": 0.0}
    for i, p in enumerate(pick_prompts(val, prompts, 32)):
        results = {}
        for label, model in (("fp32", fp32), ("bf16", bf16), ("int8", int8)):
            start = time.perf_counter()
            kw = {} if steps is None else {"max_denoising_steps": steps}
            results[label] = dgemma.generate(model, p[None], seed=seed + i, max_new_tokens=new_tokens,
                                             eos_token_id=(), pad_token_id=None, **kw).sequences[0, p.numel():]
            seconds[label] += time.perf_counter() - start
        a = results["fp32"]
        total += a.numel()
        canvases += -(-a.numel() // L)
        for label in ("bf16", "int8"):
            b = results[label]
            same[label] += int((a == b).sum())
            same_canvases[label] += sum(int(torch.equal(a[c:c + L], b[c:c + L])) for c in range(0, a.numel(), L))
    out["token_agreement"] = {k: v / total for k, v in same.items()}
    out["canvas_agreement"] = {k: v / canvases for k, v in same_canvases.items()}
    out["generate_seconds"] = seconds
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(CPU_PRESETS))
    p.add_argument("--model", type=Path, default=ROOT / "runs/out/cpu-small/diffusion-s0",
                   help="a trained diffusion run (default: what runs/cpu_small_results.sh writes)")
    p.add_argument("--data", type=Path, default=ROOT / "runs/out/cpu-small/data")
    p.add_argument("--train-steps", type=int, default=200, help="steps for `dgemma train` when --model is missing")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--windows", type=int, default=64, help="held-out windows of 4 canvases for the NELBO")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, help="max denoising steps per canvas (default: the checkpoint's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-trained", action="store_true", help="only the per-preset logit errors")
    p.add_argument("--smoke", action="store_true", help="tiny everything, a two-step toy training (tests)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.presets, args.prompts, args.windows, args.new_tokens, args.train_steps = "tiny", 1, 1, 32, 2
        args.steps = 4
        out_dir = Path(os.environ.get("OUT", "out"))
        args.model, args.data = out_dir / "quant-run", out_dir / "quant-data"
    if not args.no_trained:
        ensure_trained(args.model, args.data, args.train_steps, args.smoke)
    report = {"torch": torch.__version__, "torchao": quantize.torchao_version(), "load_average": os.getloadavg()[0],
              "presets": {}}
    print("| preset (random weights) | logit std | max / mean logit error, bf16 | int8 | argmax agreement, bf16 "
          "| int8 | first-layer relative error, bf16 | int8 |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for name in [n for n in args.presets.split(",") if n]:
        r = report["presets"][name] = logit_errors(name)
        print(f"| {name} | {r['logit_std']:.2f} | {r['bf16_max']:.3f} / {r['bf16_mean']:.4f} | "
              f"{r['int8_max']:.3f} / {r['int8_mean']:.4f} | {100 * r['bf16_argmax_agree']:.1f}% | "
              f"{100 * r['int8_argmax_agree']:.1f}% | {r['bf16_layer0_rel']:.2e} | {r['int8_layer0_rel']:.2e} |",
              flush=True)
    if args.no_trained:
        print(json.dumps(report))
        return
    report["trained"] = trained_quality(args.model, args.data, args.prompts, args.windows, args.new_tokens, args.seed,
                                        args.steps)
    t = report["trained"]
    print(f"\ntrained {t['model']}: held-out NELBO fp32 {t['fp32']['nelbo']:.4f} ± {t['fp32']['nelbo_se']:.4f}, int8 "
          f"{t['int8']['nelbo']:.4f} (change {t['nelbo_change']:+.4f} ± {t['nelbo_change_mc_se']:.4f} MC SE "
          "nats/token); x0 CE fp32 "
          f"{t['fp32']['x0_ce']:.4f}, int8 {t['int8']['x0_ce']:.4f}; load {report['load_average']:.2f}")
    for label in ("bf16", "int8"):
        e = t[f"{label}_logits"]
        print(f"  {label} vs fp32: logit error max {e['max']:.4f} / mean {e['mean']:.5f} (logit std "
              f"{e['logit_std']:.2f}), argmax agreement {100 * e['argmax_agree']:.1f}%; generation at the same seed: "
              f"{100 * t['token_agreement'][label]:.1f}% of tokens, {100 * t['canvas_agreement'][label]:.1f}% of "
              f"canvases identical ({t['prompts']} prompts x {args.new_tokens} tokens)")
    text = json.dumps(report)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
