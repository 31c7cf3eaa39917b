"""Serving benchmark: generated tokens/s, latency and time to first canvas of `dgemma serve` at several
concurrency levels, against the sequential baseline (one request at a time: concurrency 1).

    python runs/bench_serve.py                         # tiny random model; concurrency 1, 4, 16, 32
    python runs/bench_serve.py --model runs/small      # a run of `dgemma train` / `dgemma demo`, or a checkpoint
    python runs/bench_serve.py --quick                 # seconds: the tiny mode the tests run
    python runs/bench_serve.py --threads 1 --repeats 3 # one torch thread in the server; median of 3 rounds

It starts `python -m dgemma serve --port 0` as a subprocess (localhost only), waits for /health, sends a warm-up
request, then at each concurrency c keeps c streaming POST /v1/completions in flight (httpx, asyncio) until the
level's requests are done. Every level sends the same requests: request i has the same prompt, `max_tokens`,
`max_denoising_steps` and seed i at every level, and `confidence_threshold` 1e-38 switches off the early stop, so
each canvas runs exactly `--steps` denoising steps (as `dgemma bench`) and every level does the same work; only an
EOS token the model draws ends a request early (the same one at every level, since seeds fix the draws).

Columns: tok/s = completion tokens of the level / its wall time; speedup = tok/s over concurrency 1's; latency =
request start to its last byte; first canvas = request start to the first chunk with text; occupancy = mean rows per
batched denoising forward during the level (from /metrics). Writes a markdown table to stdout and JSON to --json;
the server stops at the end (and on any error).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

import httpx
from harness import Server

from dgemma.io.system import git_commit

PROMPT_WORDS = ["the", "lighthouse", "keeper", "climbed", "the", "stairs", "at", "dusk", "and", "lit", "the", "lamp",
                "while", "the", "sea", "turned", "grey", "and", "a", "small", "boat", "rowed", "home", "past"]
NO_STOP = 1e-38  # confidence_threshold: a canvas never counts as confident, so it runs all its steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a checkpoint or run directory (default: --preset with random weights)")
    p.add_argument("--preset", default="tiny", help="preset for a random model when --model is not given")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels; 1 is the sequential baseline")
    p.add_argument("--requests", type=int, default=64, help="requests per level (at least the level's concurrency)")
    p.add_argument("--prompt-words", type=int, default=24, help="words in the (fixed) prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--steps", type=int, default=16, help="max_denoising_steps; each canvas runs exactly this many")
    p.add_argument("--max-batch", type=int, default=32, help="the server's --max-batch (engine rows)")
    p.add_argument("--impl", default=None, help="the server's --impl (default: the server's default)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the server (OMP_NUM_THREADS)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over the levels (interleaved); the table shows each level's median round")
    p.add_argument("--json", default="bench_serve.json", help="where to write the results")
    p.add_argument("--quick", action="store_true", help="tiny mode for tests: concurrency 1,4; 4 requests; 2 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.prompt_words, args.max_tokens, args.steps = "1,4", 4, 6, 16, 2
        args.max_batch = 4
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1:
        p.error(f"--concurrency: positive integers, got {args.concurrency!r}")
    return args


# --- the server's metrics (the server: harness.Server) ----------------------------------------------------------------

def metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of /metrics (name -> value)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*) ([-+.\deEinfNa]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


# --- the client ------------------------------------------------------------------------------------------------------

def request_body(args: argparse.Namespace, seed: int) -> dict:
    words = [PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(args.prompt_words)]
    return {"prompt": " ".join(words), "max_tokens": args.max_tokens, "max_denoising_steps": args.steps,
            "confidence_threshold": NO_STOP, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    """One streaming completion: latency, time to first text, tokens (from the usage chunk)."""
    start = time.perf_counter()
    first = None
    usage = None
    finish = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("text") and first is None:
                    first = time.perf_counter() - start
                finish = choice.get("finish_reason") or finish
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return {"latency": time.perf_counter() - start, "first_canvas": first, "tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"], "finish_reason": finish, "seed": body["seed"]}


async def run_level(url: str, args: argparse.Namespace, concurrency: int) -> tuple[list[dict], float]:
    n = max(args.requests, concurrency)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def gated(i: int) -> dict:
            async with gate:
                return await one_request(client, request_body(args, seed=i))

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(i) for i in range(n)))
        return list(results), time.perf_counter() - start


async def warm_up(url: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        await one_request(client, request_body(args, seed=10**6))


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarise(concurrency: int, results: list[dict], wall: float, before: dict, after: dict) -> dict:
    tokens = sum(r["tokens"] for r in results)
    lat = [r["latency"] for r in results]
    ttfc = [r["first_canvas"] for r in results if r["first_canvas"] is not None]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("dgemma_engine_denoise_forwards_total",
                                                                 "dgemma_engine_denoise_rows_total")}
    forwards, rows = delta["dgemma_engine_denoise_forwards_total"], delta["dgemma_engine_denoise_rows_total"]
    return {"concurrency": concurrency, "requests": len(results), "completion_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "first_canvas_p50_s": percentile(ttfc, 50), "first_canvas_p99_s": percentile(ttfc, 99),
            "denoise_forwards": forwards, "batch_occupancy": rows / forwards if forwards else None,
            "finish_reasons": {k: sum(r["finish_reason"] == k for r in results)
                               for k in sorted({str(r["finish_reason"]) for r in results})},
            "tokens_by_seed": {r["seed"]: r["tokens"] for r in results}}


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(levels: list[dict]) -> str:
    base = next((lv for lv in levels if lv["concurrency"] == 1), None)
    lines = ["| concurrency | requests | tokens | wall s | tok/s | vs sequential | latency p50 / p99 s | "
             "first canvas p50 / p99 s | occupancy |", "|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        speedup = lv["tokens_per_s"] / base["tokens_per_s"] if base else None
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['completion_tokens']} | {lv['wall_s']:.2f} | "
                     f"{lv['tokens_per_s']:.1f} | {fmt(speedup, '.2f')}x | {fmt(lv['latency_p50_s'])} / "
                     f"{fmt(lv['latency_p99_s'])} | {fmt(lv['first_canvas_p50_s'])} / "
                     f"{fmt(lv['first_canvas_p99_s'])} | {fmt(lv['batch_occupancy'], '.1f')} |")
    return "\n".join(lines)


def machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "commit": git_commit()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    server = Server(model=args.model, preset=args.preset, max_batch=args.max_batch, impl=args.impl,
                    threads=args.threads)
    try:
        url = server.wait_ready()
        asyncio.run(warm_up(url, args))
        rounds: dict[int, list[dict]] = {c: [] for c in args.levels}
        for r in range(args.repeats):
            for c in args.levels:
                before = metrics(url)
                results, wall = asyncio.run(run_level(url, args, c))
                rounds[c].append(summarise(c, results, wall, before, metrics(url)))
                print(f"round {r + 1}, concurrency {c}: {rounds[c][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr,
                      flush=True)
        levels = [sorted(rs, key=lambda lv: lv["tokens_per_s"])[(len(rs) - 1) // 2] for rs in rounds.values()]
    finally:
        server.stop()
    load_after = os.getloadavg()[0]
    # the same request gives the same tokens at every level (seeded draws, batch-independent)
    by_seed = [lv["tokens_by_seed"] for rs in rounds.values() for lv in rs]
    same_tokens = all(all(bs.get(s) == t for s, t in by_seed[0].items() if s in bs) for bs in by_seed[1:])
    out = {"command": "python runs/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "server": " ".join(server.command[1:]), "machine": machine(),
           "load_1min": {"before": load_before, "after": load_after},
           "settings": {"model": args.model or f"{args.preset} (random)", "requests": args.requests,
                        "prompt_words": args.prompt_words, "max_tokens": args.max_tokens, "steps": args.steps,
                        "max_batch": args.max_batch, "threads": args.threads, "repeats": args.repeats},
           "levels": levels, "rounds": {str(c): [lv["tokens_per_s"] for lv in rs] for c, rs in rounds.items()},
           "same_tokens_at_every_level": same_tokens}
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(table(levels))
    m = out["machine"]
    rounds_note = f"; median of {args.repeats} interleaved rounds" if args.repeats > 1 else ""
    print(f"\n{out['settings']['model']}, {args.prompt_words}-word prompt, max_tokens {args.max_tokens}, "
          f"{args.steps} steps per canvas, --max-batch {args.max_batch}, server threads {args.threads or 'default'}"
          f"{rounds_note}; {m['cpu']} ({m['cores']} cores), "
          f"torch {m['torch']}, commit {m['commit']}; load {load_before:.2f} -> {load_after:.2f}; "
          f"same tokens per request at every level: {same_tokens}; JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
