"""Many LoRA adapters on one base (dgemma/weights/adapters.py), measured on the engine `dgemma serve --lora` runs:
throughput of concurrent requests that all run on the base, all on one adapter, and spread over several adapters and the
base in the same batches, and what one request costs alone on the base and on an adapter.

    python runs/bench_multi_lora.py                  # cpu-small with random weights, 4 rank-8 attention adapters
    python runs/bench_multi_lora.py --quick          # seconds: the tiny model the tests run
    python runs/bench_multi_lora.py --json out.json

In-process (no HTTP); the adapters are written to a temporary directory by the same path `dgemma finetune` saves
them (peft's format, random factors), then loaded as `--lora` loads them. A canvas runs exactly `--steps` denoising
steps (the early stop is off) and request i has seed i in every setting, so every setting does the same work. The
settings alternate within each round; medians over `--repeats` rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import dgemma
from dgemma.io.system import git_commit
from dgemma.serving.engine import Engine
from dgemma.weights import lora
from dgemma.weights.adapters import AdapterSet

NO_STOP = 1e-38  # confidence_threshold: a canvas never counts as confident, so it runs all its steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu-small", help="model geometry, random weights (default cpu-small)")
    p.add_argument("--adapters", type=int, default=4, help="adapters loaded (default 4)")
    p.add_argument("--rank", type=int, default=8, help="their LoRA rank (default 8)")
    p.add_argument("--targets", default="attention", choices=tuple(lora.TARGETS), help="what they adapt")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (and engine rows)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per canvas")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="the tiny model, small sizes: seconds")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.adapters, args.rank, args.concurrency = "tiny", 2, 4, 4
        args.max_tokens, args.steps, args.repeats = 16, 2, 1
    return args


def write_adapters(model: dgemma.DiffusionGemma, root: Path, n: int, rank: int, targets: str) -> list[tuple[str, Path]]:
    """`n` adapters with random factors, saved as `dgemma finetune` saves them."""
    out = []
    for i in range(n):
        copy_ = copy.deepcopy(model)
        config = lora.lora_config(rank, 2.0 * rank, targets)
        lora.attach(copy_, config)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():  # B too (peft starts it at zero: no delta)
            for name, p in copy_.named_parameters():
                if ".lora_" in name:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
        lora.save_adapter(copy_, config, root / f"adapter-{i}")
        out.append((f"adapter-{i}", root / f"adapter-{i}"))
    return out


def throughput(engine: Engine, jobs: list[tuple[list[int], str | None, int]],
               config: dgemma.GenerationConfig) -> float:
    """All `jobs` (prompt, adapter, seed) in flight at once; completion tokens per second."""
    tokens = [0] * len(jobs)

    def go(i: int) -> None:
        prompt, adapter, seed = jobs[i]
        done = threading.Event()
        out: list[int] = []

        def on_event(event: object) -> None:
            out.extend(getattr(event, "tokens", []))
            if type(event).__name__ == "DoneEvent":
                done.set()

        engine.submit(prompt, config, seed=seed, adapter=adapter, on_event=on_event)
        done.wait()
        tokens[i] = len(out)

    started = time.perf_counter()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset(args.preset)), seed=0).eval()
    V = model.config.vocab_size
    config = dgemma.GenerationConfig.for_model(model.config).replace(
        max_new_tokens=args.max_tokens, max_denoising_steps=args.steps, eos_token_id=(), confidence_threshold=NO_STOP)
    prompts = [torch.randint(1, V, (24,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.concurrency)]
    with tempfile.TemporaryDirectory() as tmp:
        pairs = write_adapters(model, Path(tmp), args.adapters, args.rank, args.targets)
        adapters = AdapterSet(model, pairs)
    names = [n for n, _ in pairs]
    c = args.concurrency
    settings = {
        "all on the base": [None] * c,
        "all on one adapter": [names[0]] * c,
        f"spread over {len(names)} adapters and the base": [([None, *names])[i % (len(names) + 1)] for i in range(c)],
    }
    context = 24 + args.max_tokens + model.config.canvas_length
    results: dict[str, list[float]] = {k: [] for k in settings}
    alone: dict[str, list[float]] = {"base": [], "adapter": []}
    with Engine(model, max_batch=c, max_context=context, impl="fast", adapters=adapters) as engine:
        throughput(engine, [(prompts[0], None, 0)], config)  # warm-up
        for _ in range(args.repeats):
            for name, rows in settings.items():
                results[name].append(throughput(engine, [(p, a, i) for i, (p, a) in
                                                         enumerate(zip(prompts, rows, strict=True))], config))
            alone["base"].append(throughput(engine, [(prompts[0], None, 0)], config))
            alone["adapter"].append(throughput(engine, [(prompts[0], names[0], 0)], config))
    med = {k: statistics.median(v) for k, v in results.items()}
    single = {k: statistics.median(v) for k, v in alone.items()}
    commit = git_commit()
    base = med["all on the base"]
    print(f"{args.preset}: {len(names)} rank-{args.rank} {args.targets} adapters, {c} requests at once, "
          f"{args.max_tokens} new tokens, {args.steps} steps/canvas, median of {args.repeats} rounds")
    print("| requests | tok/s | vs all on the base |\n|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} | {v / base:.2f}x |")
    print(f"\none request alone: {single['base']:.1f} tok/s on the base, {single['adapter']:.1f} on an adapter "
          f"({single['adapter'] / single['base']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({
            "preset": args.preset, "adapters": len(names), "rank": args.rank, "targets": args.targets,
            "concurrency": c, "max_tokens": args.max_tokens, "steps": args.steps, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "tokens_per_s": med, "all_rounds": results, "alone": single,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
            "commit": commit, "torch": torch.__version__}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
