"""One fast denoising step of a preset under each lean-inference variant, measured in alternation in one process
(docs/benchmarks.md, "Quantization and expert offload" and "The CPU step"): the rounds visit every variant in turn,
reversing the order every other round, so drift on a shared machine hits all of them alike; medians.

    layers (DenoiseStep, final norm included), per variant:
      fp32 experts=loop / grouped           the sorted-expert dispatch's backends (kernels.moe_experts)
      fp32 experts=grouped, (E, D, 2Ie)     grouped, the expert weights stored transposed (same shapes, the other
                                            strides: the grouped matmul reads them without a transpose)
      bf16                                  the whole model in bfloat16 (AMX / AVX512-BF16 where the CPU has them)
      int8                                  weight-only int8 (dgemma/weights/quantize.py)
      offload (warm)                        experts memory-mapped from a file, pages in the page cache
      offload (cold)                        the same with the file's pages dropped before every step (a read from disk)
    head + sampler (sampling kernels: head_and_sample), fp32 and bf16, and fp32 with the previous `tempered_stats`

Prints one JSON object (medians in ms, the load average before and after).

    python runs/step_variants.py --preset bench-small --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dgemma.model import kernels
from dgemma.model.config import PRESETS
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling import fast_sampler, rules
from dgemma.sampling import kernels as sampling_kernels
from dgemma.testing.hf import randomize_
from dgemma.weights import offload, quantize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench-small")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip", default="", help="comma-separated variants to leave out")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    cfg = PRESETS[args.preset]
    L, V, D = cfg.canvas_length, cfg.vocab_size, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (1, cfg.sliding_window + L // 4), generator=g)
    canvas = torch.randint(0, V, (1, L), generator=g)
    base = randomize_(DiffusionGemma(cfg), 0).eval()
    tmp = Path(tempfile.mkdtemp(prefix="dgemma-variants-"))
    models = {"fp32": base, "bf16": copy.deepcopy(base).to(torch.bfloat16)}
    if cfg.is_moe:
        models["fp32 transposed experts"] = copy.deepcopy(base)
        for block in models["fp32 transposed experts"].layers:
            for w in (block.experts.gate_up_proj, block.experts.down_proj):
                w.data = w.data.transpose(1, 2).contiguous().transpose(1, 2)
    models["int8"] = quantize.quantize_model(copy.deepcopy(base), "int8")
    if cfg.is_moe:
        models["offload"] = offload.offload_experts(copy.deepcopy(base), tmp / "experts.safetensors")
    caches = {}
    for name, m in models.items():
        caches[name] = m.new_cache(1, prompt.shape[1])
        m.commit(prompt, caches[name], impl="fast")

    def layers(name: str, backend: str = "auto", evict: bool = False):
        step = fast_sampler.DenoiseStep(models[name], caches[name])

        def run() -> None:
            if evict:
                offload.evict(models[name])
            with _backend(backend):
                step(canvas)
        return run

    temp = rules.temperature(8, 16, 0.4, 0.8)

    def head(name: str):
        m = models[name]
        final = fast_sampler.DenoiseStep(m, caches[name])(canvas)
        weight, cap = m.embed_tokens.weight, cfg.final_logit_softcapping
        fn = lambda rows, out: kernels.logits_into(rows, weight, cap, out)
        ws = sampling_kernels.Workspace(L, V, final.device)
        return lambda: sampling_kernels.head_and_sample(final, fn, temp, generator=g, embed=weight, embed_scale=D**0.5,
                                               workspace=ws)

    def previous_stats(z: torch.Tensor, work: torch.Tensor | None = None):
        """`tempered_stats` as it was before this change: argmax, then amax, and a batched dot product."""
        argmax = z.argmax(-1)
        d = z.sub_(z.amax(-1, keepdim=True)).clamp_(min=sampling_kernels.SHIFTED_LOGIT_FLOOR)
        e = torch.exp(d, out=work) if work is not None else d.exp()
        s = e.sum(-1, keepdim=True)
        ed = torch.matmul(e[:, None, :], d[:, :, None]).view(-1)
        return e.div_(s), argmax, s.log().squeeze(-1) - ed / s.squeeze(-1)

    def with_stats(fn, stats):
        def run() -> None:
            original, sampling_kernels.tempered_stats = sampling_kernels.tempered_stats, stats
            try:
                fn()
            finally:
                sampling_kernels.tempered_stats = original
        return run

    variants = {"layers fp32 experts=loop": layers("fp32", "loop"),
                "layers fp32 experts=grouped": layers("fp32", "grouped"),
                "layers bf16": layers("bf16"), "layers int8": layers("int8"),
                "head+sampler fp32": head("fp32"), "head+sampler bf16": head("bf16"),
                "head+sampler fp32, previous tempered_stats": with_stats(head("fp32"), previous_stats)}
    if cfg.is_moe:
        variants["layers fp32 experts=grouped, (E, D, 2Ie)"] = layers("fp32 transposed experts", "grouped")
        variants |= {"layers offload (warm)": layers("offload"), "layers offload (cold)": layers("offload", evict=True)}
    if not cfg.is_moe:
        variants = {k: v for k, v in variants.items() if "experts=" not in k or k.endswith("loop")}
    variants = {k: v for k, v in variants.items() if k not in args.skip.split(",")}
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()  # warm-up
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                start = time.perf_counter()
                variants[name]()
                times[name].append(1e3 * (time.perf_counter() - start))
    print(json.dumps({"preset": args.preset, "threads": torch.get_num_threads(), "rounds": args.rounds,
                      "load_before": load_before, "load_after": os.getloadavg()[0],
                      "ms": {k: round(statistics.median(v), 2) for k, v in times.items()}}))


class _backend:
    """Force `kernels.moe_experts`'s backend inside the block ("auto": leave it be)."""

    def __init__(self, backend: str):
        self.backend, self.original = backend, kernels.moe_experts

    def __enter__(self) -> None:
        if self.backend != "auto":
            original, backend = self.original, self.backend
            kernels.moe_experts = lambda *a, **kw: original(*a, **{**kw, "backend": backend})

    def __exit__(self, *exc: object) -> None:
        kernels.moe_experts = self.original


if __name__ == "__main__":
    main()
