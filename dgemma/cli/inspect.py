"""`dgemma inspect`: a model's geometry, parameter counts, KV-cache size and FLOPs, from a config alone (no weights);
with --parallel, one device's memory under expert / tensor parallelism instead (model/plan.py). PATH is a checkpoint
directory, its config.json, or a training run (its newest complete checkpoint)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from dgemma.cli.flags import add_quantize_arg, nonnegative_int, positive_int
from dgemma.model import costs, plan
from dgemma.model.config import ModelConfig, preset, read_json
from dgemma.model.costs import memory_needed
from dgemma.weights.checkpoint import resolve_model_dir


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="geometry, parameter counts, KV-cache bytes and FLOPs of a model",
                              description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("path", nargs="?", type=Path, help="checkpoint directory, config.json, or training run directory "
                     "(its newest complete checkpoint); reads config.json only")
    src.add_argument("--preset", metavar="PRESET", help="a named preset from dgemma.model.config.PRESETS")
    p.add_argument("--context", type=nonnegative_int, default=4096, metavar="N",
                   help="committed tokens in the cache, for FLOPs (default 4096)")
    add_quantize_arg(p, "also report the weights' memory with --quantize int8 / int4 (torchao's layouts)")
    p.add_argument("--parallel", type=layout_arg, metavar="SPEC",
                   help="print one device's memory under expert / tensor parallelism instead of the per-layer report: "
                   "ep=K (each device holds 1/K of the experts), tp=K (attention heads, dense MLP and KV cache split "
                   "K ways), ep+tp=K (both over the same K devices), as `generate --parallel` runs them, or ep=A,tp=B "
                   "(an A x B mesh, for planning); ep=1,tp=1 is one device")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B",
                   help="prompts generated at once, for the memory pre-flight and --parallel's KV cache and step "
                   "memory (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def layout_arg(text: str) -> plan.ParallelLayout:
    try:
        return plan.parse_layout(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def load_config(path: Path | None, preset_name: str | None) -> ModelConfig:
    if preset_name is not None:
        return preset(preset_name)
    assert path is not None
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    # A training run resolves to its newest complete checkpoint, as for `dgemma generate --model RUN`.
    config_path = path if path.is_file() else resolve_model_dir(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no config.json in the checkpoint directory (nor a training run's "
                                "checkpoints/ next to it)")
    return ModelConfig.from_hf(read_json(config_path), source=str(config_path))


def report(cfg: ModelConfig, context: int, quantize: str | None = None, batch: int = 1) -> dict[str, Any]:
    modes = {name: mode for name, mode in (("bf16", None), (quantize, quantize)) if name}
    preflight = {name: memory_needed(cfg, torch.bfloat16, weights=True, batch_size=batch, cache_length=context,
                                     quantize=mode) for name, mode in modes.items()}
    return {"weight_bytes": {name: costs.weight_bytes(cfg, 2, mode) for name, mode in modes.items()},
            "preflight_bytes": preflight, "quantize": quantize,
            "config": cfg.to_hf()["text_config"] | {"canvas_length": cfg.canvas_length},
            "parameters": costs.parameter_counts(cfg), "layers": costs.per_layer_table(cfg),
            "kv_cache_bytes_per_token_bf16": costs.kv_cache_bytes_breakdown(cfg, 2), "context": context,
            "kv_cache_bytes_at_context_bf16": costs.kv_cache_bytes(cfg, context, 2),
            "kv_cache_bytes_at_context_bf16_dgemma": costs.kv_cache_bytes_per_token(cfg, 2) * context,
            "flops_per_denoise_step": costs.flops_per_denoise_step(cfg, context),
            "flops_per_committed_token": costs.flops_per_committed_token(cfg, context)}


def human(n: float, units: str = "KMBT") -> str:
    """1234567 -> '1.23M' (two decimals, powers of 1000; units name each power)."""
    for power in range(len(units), 0, -1):
        if abs(n) >= 1000**power:
            return f"{n / 1000**power:.2f}{units[power - 1]}"
    return f"{n:g}"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cols = list(rows[0])
    cells = [cols] + [["-" if r[c] is None else f"{r[c]:,}" if c.endswith("params") else str(r[c]) for c in cols]
                      for r in rows]
    widths = [max(len(line[j]) for line in cells) for j in range(len(cols))]
    return ["  ".join(s.rjust(w) for s, w in zip(line, widths, strict=True)) for line in cells]


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.path, args.preset)
    r = report(cfg, args.context, args.quantize, args.batch)
    if args.parallel is not None:
        try:
            plan.check_layout(cfg, args.parallel)
        except ValueError as e:
            raise ValueError(f"--parallel {args.parallel}: {e} ({args.preset or args.path})") from None
        r["parallel"] = plan.plan(cfg, args.parallel, batch=args.batch, context=args.context, quantize=args.quantize)
    if args.json:
        print(json.dumps(r, indent=None))
        return 0
    if args.parallel is not None:
        print_plan(cfg, r["parallel"], args.preset or args.path)
        return 0
    c, p, kv = cfg, r["parameters"], r["kv_cache_bytes_per_token_bf16"]
    moe = f"{c.num_experts} experts, top-{c.top_k_experts}, width {c.moe_intermediate_size}" if c.is_moe else "dense"
    print(f"model {args.preset or args.path}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
          f"vocab {c.vocab_size:,}, canvas {c.canvas_length}, sliding window {c.sliding_window}")
    print(f"  MLP width {c.intermediate_size}; MoE: {moe}; softcap {c.final_logit_softcapping}")
    print(*_table(r["layers"]), sep="\n")
    for name in ("total", "active"):
        print(f"{name + ' parameters:':19}{p[name]:>16,}  ({human(p[name])})")
    print("  breakdown: " + ", ".join(f"{k} {v:,}" for k, v in p["breakdown"].items()))
    print(f"  buffers: {p['buffers']['layer_scalars']} layer_scalars (encoder + decoder)")
    print(f"KV cache per token (bf16): {kv['total']:,} bytes (sliding layers {kv['sliding']:,}, full {kv['full']:,})")
    print(f"  at context {args.context:,}: {r['kv_cache_bytes_at_context_bf16_dgemma']:,} bytes in dgemma's KVCache "
          f"(every position kept); {r['kv_cache_bytes_at_context_bf16']:,} if sliding layers kept only their last "
          f"{c.sliding_window - 1} tokens")
    prompts = "one prompt" if args.batch == 1 else f"{args.batch} prompts"
    for name, w in r["weight_bytes"].items():
        label = "bf16" if name == "bf16" else f"{name} (embedding and router in bf16)"
        need = r["preflight_bytes"][name]
        print(f"weights, {label}: {w['total']:,} bytes ({w['total'] / 1e9:.2f} GB; experts {w['experts'] / 1e9:.2f} "
              f"GB); memory pre-flight for {prompts} at context {args.context:,}: {sum(need.values()) / 1e9:.2f} GB "
              f"({', '.join(f'{k} {v / 1e9:.2f}' for k, v in need.items())})")
    print(f"FLOPs per denoise step at context {args.context:,}: {r['flops_per_denoise_step']:,} "
          f"({human(r['flops_per_denoise_step'], 'KMGTP')})")
    print(f"FLOPs per committed token at context {args.context:,}: {r['flops_per_committed_token']:,} "
          f"({human(r['flops_per_committed_token'], 'KMGTP')})")
    return 0


def print_plan(cfg: ModelConfig, p: dict[str, Any], name: str | Path) -> None:
    """The memory plan as a table: each part, how it splits, its bytes on one device alone and on one device of the
    layout (GB, 10^9 bytes), then which common device sizes the per-device total fits."""
    experts = f"{cfg.num_experts} experts (top-{cfg.top_k_experts})" if cfg.is_moe else "dense"
    print(f"model {name}: {cfg.num_hidden_layers} layers, {experts}, {cfg.num_attention_heads} heads, KV heads "
          f"{cfg.num_key_value_heads} sliding / {cfg.num_global_key_value_heads} full")
    shape = f"ep={p['ep']} and tp={p['tp']} over the same ranks" if p["same_ranks"] else \
        f"ep={p['ep']} x tp={p['tp']}"
    print(f"layout {p['layout']}: {p['devices']} device{'s' * (p['devices'] > 1)} ({shape}); a denoising step of "
          f"batch {p['batch']} at context {p['context']:,}; weights {p['weights_dtype']}, KV cache bf16")
    one, dev = p["single_device"], p["per_device"]
    gb = lambda b: f"{b / 1e9:.2f} GB"
    rows = [{"part": "", "split": "", "one device": "", "per device": ""}]
    rows += [{"part": f"  {k}", "split": p["splits"][k], "one device": gb(v), "per device": gb(dev["weights"][k])}
             for k, v in one["weights"].items() if k != "total"]
    rows.insert(1, {"part": "weights", "split": "", "one device": gb(one["weights"]["total"]),
                    "per device": gb(dev["weights"]["total"])})
    rows += [{"part": k, "split": p["splits"][k], "one device": gb(v), "per device": gb(dev["memory"][k])}
             for k, v in one["memory"].items() if k != "weights"]
    rows.append({"part": "total", "split": "", "one device": gb(one["total"]), "per device": gb(dev["total"])})
    rows[0] = {"part": "part", "split": "split", "one device": "one device",
               "per device": f"per device ({p['layout']})"}
    widths = {c: max(len(r[c]) for r in rows) for c in rows[0]}
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) if c in ("part", "split") else r[c].rjust(widths[c]) for c in r))
    fits = [f"{size} GB {'yes' if ok else 'no'}" for size, ok in p["fits_gb"].items()]
    print(f"fits per device (nominal GB, before the CUDA context): {', '.join(fits)}")
    if not p["runs_in_dgemma"]:
        print("planning only: dgemma generate --parallel runs ep, tp or ep+tp over the same ranks, with plain weights")
