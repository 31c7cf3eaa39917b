"""Prefix caching across requests (dgemma/serving/prefix_cache.py), measured on the engine `dgemma serve` runs:

1. time to first canvas of a request whose 1,024-token system prompt is cached, against the same request on an engine
   without a prefix cache (the prompt prefilled whole) and on one with a cold cache (prefilled in blocks: what the
   cache costs when it misses);
2. throughput of a multi-turn chat workload (conversations in parallel, each turn's prompt = the previous prompt + the
   reply + a new user message, as a chat client sends them), with the cache and without.

    python runs/bench_prefix_cache.py                        # cpu-small with random weights, fast kernels
    python runs/bench_prefix_cache.py --quick                # seconds: the tiny model the tests run
    python runs/bench_prefix_cache.py --json out.json

In-process (no HTTP: the engine is what changes); the engines are built once and the settings alternate within each
round, medians over `--repeats` rounds. A canvas runs exactly `--steps` denoising steps (the early stop is off), so
every setting does the same denoising work; each request has its own seed, the same in every setting, and the tokens
of every request are checked to be the same with the cache and without it (the prefill in blocks) - the number
printed as `identical`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

import dgemma
from dgemma.io.system import git_commit
from dgemma.serving.engine import CanvasEvent, DoneEvent, Engine
from dgemma.serving.prefix_cache import DEFAULT_BLOCK_SIZE

NO_STOP = 1e-38  # confidence_threshold: a canvas never counts as confident, so it runs all its steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu-small", help="model geometry, random weights (default cpu-small)")
    p.add_argument("--system-tokens", type=int, default=1024, help="tokens of the shared system prompt")
    p.add_argument("--user-tokens", type=int, default=24, help="tokens of each user message")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (whole canvases)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per canvas")
    p.add_argument("--conversations", type=int, default=8, help="chats served at once in the multi-turn workload")
    p.add_argument("--turns", type=int, default=4, help="turns per chat")
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK_SIZE, help="prefix-cache block size (tokens)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="the tiny model, small sizes: seconds")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.system_tokens, args.max_tokens, args.steps = "tiny", 96, 16, 2
        args.conversations, args.turns, args.block, args.repeats = 2, 2, 16, 1
    return args


def ttfc(engine: Engine, prompt: list[int], config: dgemma.GenerationConfig, seed: int) -> tuple[float, list[int]]:
    """Seconds from submission to the first finished canvas (on an idle engine), and the request's tokens."""
    first: list[float] = []
    tokens: list[int] = []
    done = threading.Event()
    started = time.perf_counter()

    def on_event(event: object) -> None:
        if isinstance(event, CanvasEvent):
            first.append(time.perf_counter() - started)
            tokens.extend(event.tokens)
        elif isinstance(event, DoneEvent):
            done.set()

    engine.submit(prompt, config, seed=seed, on_event=on_event)
    done.wait()
    return first[0], tokens


def multi_turn(engine: Engine, system: list[int], users: list[list[list[int]]],
               config: dgemma.GenerationConfig) -> tuple[float, int, list[list[int]]]:
    """Every conversation in its own thread, turn after turn; returns the wall time, the completion tokens and each
    request's tokens (conversation-major)."""
    replies: list[list[list[int]]] = [[] for _ in users]

    def chat(c: int) -> None:
        prompt = list(system)
        for t, user in enumerate(users[c]):
            prompt += user
            tokens, _ = engine.complete(prompt, config, seed=1000 * c + t)
            replies[c].append(tokens)
            prompt += tokens

    started = time.perf_counter()
    threads = [threading.Thread(target=chat, args=(c,)) for c in range(len(users))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return wall, sum(len(r) for rs in replies for r in rs), [r for rs in replies for r in rs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset(args.preset)), seed=0).eval()
    V = model.config.vocab_size
    config = dgemma.GenerationConfig.for_model(model.config).replace(
        max_new_tokens=args.max_tokens, max_denoising_steps=args.steps, eos_token_id=(), confidence_threshold=NO_STOP)
    rand = lambda n, seed: torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    system = rand(args.system_tokens, 1)
    context = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens) + model.config.canvas_length
    rows = max(2, args.conversations)
    engines = {"no cache": Engine(model, max_batch=rows, max_context=context, impl="fast").start(),
               "cache": Engine(model, max_batch=rows, max_context=context, impl="fast", prefix_block=args.block,
                               prefix_cache=4 * context).start()}
    try:
        ttfc(engines["no cache"], system + rand(args.user_tokens, 2), config, 0)  # warm-up: allocations, kernels
        times: dict[str, list[float]] = {"whole prefill (no cache)": [], "cold cache (prefill in blocks)": [],
                                         "cached system prompt": []}
        identical = total = 0
        for r in range(args.repeats):
            for i in range(2):  # two user messages a round; the cached request follows its cold twin
                prompt, seed = system + rand(args.user_tokens, 100 + 10 * r + i), 10 * r + i
                a, plain = ttfc(engines["no cache"], prompt, config, seed)
                engines["cache"].prefix.drop("")  # cold: nothing of the system prompt is cached
                b, cold = ttfc(engines["cache"], prompt, config, seed)
                c, warm = ttfc(engines["cache"], prompt[:args.system_tokens] + rand(args.user_tokens, 7 + r + i),
                               config, seed)
                del plain, warm
                times["whole prefill (no cache)"].append(a)
                times["cold cache (prefill in blocks)"].append(b)
                times["cached system prompt"].append(c)
                _, again = ttfc(engines["cache"], prompt, config, seed)  # now a hit: the same tokens as the miss
                identical, total = identical + (again == cold), total + 1
        users = [[rand(args.user_tokens, 5000 + 100 * c + t) for t in range(args.turns)]
                 for c in range(args.conversations)]
        throughput: dict[str, list[float]] = {"no cache": [], "cache": []}
        hits = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                if engine.prefix is not None:
                    engine.prefix.drop("")
                before = engine.stats()
                wall, n, _ = multi_turn(engine, system, users, config)
                after = engine.stats()
                throughput[name].append(n / wall)
                hits[name] = (after.prefix_hits - before.prefix_hits, after.prefix_queries - before.prefix_queries)
    finally:
        for engine in engines.values():
            engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    tput = {k: statistics.median(v) for k, v in throughput.items()}
    commit = git_commit()
    result = {"preset": args.preset, "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
              "max_tokens": args.max_tokens, "steps": args.steps, "block": args.block, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "ttfc_s": med, "ttfc_all": times,
              "identical_with_and_without_hit": f"{identical}/{total}",
              "multi_turn": {"conversations": args.conversations, "turns": args.turns, "tokens_per_s": tput,
                             "speedup": tput["cache"] / tput["no cache"],
                             "prefix_hit_rate": hits["cache"][0] / max(1, hits["cache"][1])},
              "machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
              "commit": commit, "torch": torch.__version__}
    base = med["whole prefill (no cache)"]
    print(f"{args.preset}: {args.system_tokens}-token system prompt + {args.user_tokens}-token user message, "
          f"{args.max_tokens} new tokens, {args.steps} steps/canvas, median of {args.repeats} rounds")
    print("| setting | time to first canvas | vs no cache |\n|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v * 1000:.0f} ms | {base / v:.2f}x |")
    print(f"\nidentical tokens, hit vs miss: {identical}/{total}")
    mt = result["multi_turn"]
    print(f"multi-turn: {args.conversations} chats x {args.turns} turns: {tput['no cache']:.1f} tok/s without the "
          f"cache, {tput['cache']:.1f} with it ({mt['speedup']:.2f}x; {mt['prefix_hit_rate']:.0%} of prompt tokens "
          f"from the cache)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if identical == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
