"""Where one denoising step of the fast path spends its time (docs/benchmarks.md, "Where the fast step's time goes").

Times, on a random model of a preset (default bench-small, fp32, batch 1, the bench's prompt length): the layers
(`fast_sampler.DenoiseStep`, final norm included), one vocabulary matmul (the tied head over the canvas), the fused
sampler pass (`sampling_kernels.head_and_sample`: head, temperature, stats, draw, next soft embedding), the two ways to
draw one token per position: `torch.multinomial` (the readable path and transformers) against the two-level
inverse-CDF draw (`draw_cdf`), and the layers by part (attention, dense MLP, router, routed experts, norms;
forward hooks). Medians over --repeats (the parts: means), printed as one JSON object. Run it on a quiet machine.

    python runs/profile_fast_step.py --preset bench-small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from dgemma.model import kernels
from dgemma.model.config import PRESETS
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling import fast_sampler, rules
from dgemma.sampling import kernels as sampling_kernels
from dgemma.testing.hf import randomize_


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench-small")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = PRESETS[args.preset]
    model = randomize_(DiffusionGemma(config), 0).eval()
    L, V, D = config.canvas_length, config.vocab_size, config.hidden_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (1, config.sliding_window + L // 4), generator=g)
    cache = model.new_cache(1, prompt.shape[1])
    model.commit(prompt, cache, impl="fast")
    canvas = torch.randint(0, V, (1, L), generator=g)
    step = fast_sampler.DenoiseStep(model, cache)
    final = step(canvas)
    weight, cap = model.embed_tokens.weight, config.final_logit_softcapping
    head = lambda rows, out: kernels.logits_into(rows, weight, cap, out)
    temp = rules.temperature(8, 16, 0.4, 0.8)
    probs = torch.softmax(model.logits(final).div_(temp), -1).view(-1, V)
    uniforms = torch.rand(L, generator=g, dtype=torch.float64)
    with torch.no_grad():
        result = {
            "preset": args.preset, "threads": torch.get_num_threads(), "load": os.getloadavg()[0],
            "ms_layers": median_ms(lambda: step(canvas), args.repeats),
            "ms_head_matmul": median_ms(lambda: head(final.view(-1, D), None), args.repeats),
            "ms_head_and_sample": median_ms(lambda: sampling_kernels.head_and_sample(
                final, head, temp, generator=g, embed=weight, embed_scale=D**0.5), args.repeats),
            "ms_multinomial": median_ms(lambda: torch.multinomial(probs, 1, generator=g), args.repeats),
            "ms_draw_cdf": median_ms(lambda: sampling_kernels.draw_cdf(probs, uniforms), args.repeats),
        }
        result["ms_layers_by_part"] = layers_by_part(model, lambda: step(canvas), args.repeats)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}))


PARTS = {"self_attn": "attention (projections, norms, rope, SDPA)", "mlp": "dense MLP", "router": "router",
         "experts": "routed experts", "input_layernorm": "block norms", "post_attention_layernorm": "block norms",
         "pre_feedforward_layernorm": "block norms", "post_feedforward_layernorm": "block norms",
         "pre_feedforward_layernorm_2": "block norms", "post_feedforward_layernorm_1": "block norms",
         "post_feedforward_layernorm_2": "block norms"}


def layers_by_part(model: DiffusionGemma, run, repeats: int) -> dict[str, float]:
    """Mean ms per step in each part of the blocks, timed by forward hooks (which add a little to each part); "rest"
    is the step's time outside them (embedding, self-conditioning, masks, residual adds, final norm)."""
    spent: dict[str, float] = {}
    started: dict[str, float] = {}
    handles = []
    for name, module in model.layers.named_modules():
        part = PARTS.get(name.rsplit(".", 1)[-1])
        if part is None:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: started.__setitem__(
            name, time.perf_counter())))
        handles.append(module.register_forward_hook(lambda m, a, o, name=name, part=part: spent.__setitem__(
            part, spent.get(part, 0.0) + time.perf_counter() - started[name])))
    try:
        run()
        spent.clear()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        total = time.perf_counter() - start
    finally:
        for h in handles:
            h.remove()
    parts = {part: 1000 * s / repeats for part, s in sorted(spent.items(), key=lambda kv: -kv[1])}
    rest = 1000 * total / repeats - sum(parts.values())
    return {**{k: round(v, 2) for k, v in parts.items()}, "rest": round(rest, 2)}


if __name__ == "__main__":
    main()
