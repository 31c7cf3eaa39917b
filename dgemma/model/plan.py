"""What one device holds when a model is split by expert parallelism (EP) and tensor parallelism (TP): the memory plan
`dgemma inspect --parallel ep=K,tp=K` prints, from a config alone (nothing is built). Every size comes from
model/costs.py's rules (`weight_bytes`, `quantized_matrices`, `quantized_matrix_bytes`, `kv_cache_bytes_per_token`,
`memory_needed`, `attention_scores_bytes`); this module only says how each part divides across a layout. It is apart
from costs.py because it is a second concept (a layout and its refusals) that costs.py's single-device callers never
need.

The layout is an ep x tp mesh of ep·tp devices. EP gives each device num_experts/ep of the routed experts, whole;
everything else is replicated across the EP group (each EP rank runs attention for the whole batch). TP splits
attention by heads (q_proj and k/v_proj column-parallel by query and KV heads, o_proj row-parallel), the dense MLP and
the self-conditioning MLP by their intermediate width (gate/up column-parallel, down row-parallel), the tied
embedding / lm_head by vocabulary rows (the last shard padded), and the KV cache and the attention scores with the
heads. The routed experts are not split by TP (replicated across the TP group), nor are the router, the norms, the
Lite time projection, the sampler's full-vocabulary buffers (the logits are gathered) or the runtime slack.
Quantized matrices are counted shard by shard (int4 pads each shard's widths, int8 keeps a scale per output row)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from dgemma.model import costs
from dgemma.model.config import ModelConfig

DEVICE_SIZES_GB = (24, 48, 80, 141)  # common accelerator memories: RTX 4090 / L40S / A100-H100 80GB / H200
_SPEC = re.compile(r"^\s*(\w+)\s*=\s*(-?\d{1,18})\s*$", re.ASCII)

# How each part of the weights (the costs.parameter_counts breakdown) and of a step's memory divides.
SPLITS = {"embedding": "tp: vocabulary rows (tied lm_head)", "attention": "tp: heads (q/k/v column, o row)",
          "dense_mlp": "tp: width (gate/up column, down row)", "experts": "ep: whole experts",
          "router": "replicated", "norms": "replicated", "self_conditioning": "tp: width, like the dense MLP",
          "time_embedding": "replicated", "kv_cache": "tp: KV heads", "activations": "tp: heads",
          "sampler": "replicated (full-vocabulary logits)", "runtime": "replicated"}


@dataclass(frozen=True)
class ParallelLayout:
    """An ep x tp device mesh (ep=1, tp=1: one device)."""

    ep: int = 1
    tp: int = 1

    @property
    def devices(self) -> int:
        return self.ep * self.tp

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in (("ep", self.ep), ("tp", self.tp)) if v > 1) or "ep=1,tp=1"


def parse_layout(spec: str) -> ParallelLayout:
    """"ep=8", "tp=2", "ep=4,tp=2" (also "ep=4+tp=2") -> ParallelLayout; ValueError naming the spec otherwise (the
    CLI adds the flag)."""
    sizes: dict[str, int] = {}
    for item in re.split(r"[,+]", spec):
        m = _SPEC.match(item)
        if m is None:
            raise ValueError(f"{spec!r}: expected ep=K, tp=K or both, comma-separated (e.g. ep=4,tp=2)")
        key, value = m.group(1), int(m.group(2))
        if key not in ("ep", "tp"):
            raise ValueError(f"{spec!r}: unknown key {key!r}; use ep (expert parallel) and/or tp (tensor "
                             "parallel)")
        if key in sizes:
            raise ValueError(f"{spec!r}: {key} given twice")
        if value < 1:
            raise ValueError(f"{spec!r}: {key} must be an integer >= 1, got {value}")
        sizes[key] = value
    return ParallelLayout(**sizes)


def check_layout(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """ValueError (naming the value and what it must divide) unless `layout` splits `cfg` evenly: ep divides the
    experts; tp divides the attention heads, both layer types' KV heads and the MLP widths TP splits."""
    ep, tp = layout.ep, layout.tp
    if ep > 1 and not cfg.is_moe:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model; this one is dense")
    if cfg.is_moe and cfg.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={cfg.num_experts}")
    widths = [("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
              ("num_global_key_value_heads", cfg.num_global_key_value_heads), ("intermediate_size",
                                                                              cfg.intermediate_size)]
    if cfg.self_conditioning == "linear":  # its (D, D) projection is column-parallel
        widths.append(("hidden_size", cfg.hidden_size))
    for name, n in widths:
        if n is not None and n % tp:
            raise ValueError(f"tp={tp} does not divide {name}={n}")


def _shard(kind: str, out_features: int, in_features: int, count: int, cfg: ModelConfig,
           layout: ParallelLayout) -> tuple[int, int, int]:
    """One device's (out, in, how many) of a `costs.quantized_matrices` row: experts divide in number by ep; under tp a
    matrix that writes the hidden width (o_proj, down_proj) is row-parallel (its input split), the others
    column-parallel (their output split)."""
    if kind == "experts":
        return out_features, in_features, count // layout.ep
    if out_features == cfg.hidden_size:
        return out_features, in_features // layout.tp, count
    return out_features // layout.tp, in_features, count


def device_weight_bytes(cfg: ModelConfig, layout: ParallelLayout, dtype_bytes: int = 2,
                        quantize: str | None = None) -> dict[str, int]:
    """One device's weight bytes by part (`costs.weight_bytes`'s parts and `total`), under `layout`. At ep=1, tp=1
    this is `costs.weight_bytes(cfg, dtype_bytes, quantize)` exactly."""
    check_layout(cfg, layout)
    parts = {k: v for k, v in costs.weight_bytes(cfg, dtype_bytes).items() if k != "total"}
    vocab_rows = -(-cfg.vocab_size // layout.tp)  # the last shard padded to the others' size
    parts["embedding"] = vocab_rows * cfg.hidden_size * dtype_bytes
    for kind, o, i, n in costs.quantized_matrices(cfg):
        lo, li, ln = _shard(kind, o, i, n, cfg, layout)
        local = costs.quantized_matrix_bytes(lo, li, quantize) if quantize else lo * li * dtype_bytes
        parts[kind] += ln * local - n * o * i * dtype_bytes
    return {**parts, "total": sum(parts.values())}


def device_memory(cfg: ModelConfig, layout: ParallelLayout, *, batch: int = 1, context: int = 4096,
                  dtype: torch.dtype = torch.bfloat16, quantize: str | None = None) -> dict[str, int]:
    """One device's bytes by part for a denoising step of `batch` rows after `context` committed tokens: the weights
    (`device_weight_bytes`), the KV cache (`costs.memory_needed`'s, divided by tp with the KV heads), the step's
    attention scores (`costs.attention_scores_bytes` of a canvas over context + canvas keys, divided by tp with the
    heads), and the sampler's buffers and runtime slack as `costs.memory_needed` counts them (replicated)."""
    check_layout(cfg, layout)
    nbytes = torch.empty((), dtype=dtype).element_size()
    one = costs.memory_needed(cfg, dtype, batch_size=batch, cache_length=context)
    L = cfg.canvas_length
    return {"weights": device_weight_bytes(cfg, layout, nbytes, quantize)["total"],
            "kv_cache": one.get("kv_cache", 0) // layout.tp,
            "activations": costs.attention_scores_bytes(cfg, batch, L, context + L) // layout.tp,
            "sampler": one.get("sampler", 0), "runtime": one.get("runtime", 0)}


def plan(cfg: ModelConfig, layout: ParallelLayout, *, batch: int = 1, context: int = 4096,
         quantize: str | None = None) -> dict[str, Any]:
    """The plan `dgemma inspect --parallel` prints: for one device alone and for one device of `layout`, the weights
    by part and the step's memory by part (bytes), how each part splits, and which of DEVICE_SIZES_GB the per-device
    total fits (weights in bf16, or `quantize`d with the embedding and router in bf16; KV cache in bf16)."""
    single = ParallelLayout()
    out: dict[str, Any] = {"layout": str(layout), "ep": layout.ep, "tp": layout.tp, "devices": layout.devices,
                           "batch": batch, "context": context, "weights_dtype": quantize or "bf16",
                           "splits": dict(SPLITS)}
    if cfg.is_moe:
        out["splits"]["experts"] = f"ep: {cfg.num_experts // layout.ep} of {cfg.num_experts} experts each"
    for name, lay in (("single_device", single), ("per_device", layout)):
        memory = device_memory(cfg, lay, batch=batch, context=context, quantize=quantize)
        weights = device_weight_bytes(cfg, lay, 2, quantize)
        out[name] = {"weights": weights, "memory": memory, "total": sum(memory.values())}
    total = out["per_device"]["total"]
    out["fits_gb"] = {str(gb): total <= gb * 10**9 for gb in DEVICE_SIZES_GB}
    return out


__all__ = ["DEVICE_SIZES_GB", "SPLITS", "ParallelLayout", "check_layout", "device_memory", "device_weight_bytes",
           "parse_layout", "plan"]
