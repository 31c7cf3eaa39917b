"""What one device holds when a model is split by expert parallelism (EP) and tensor parallelism (TP): the memory plan
`dgemma inspect --parallel` prints, from a config alone (nothing is built). Every size comes from model/costs.py's
rules (`weight_bytes`, `kv_cache_bytes_per_token`, `memory_needed`, `attention_scores_bytes`), applied to one device's
share of the geometry (`tp_shard_config`); this module only says how each part divides across a layout. It is apart
from costs.py because it is a second concept (a layout and its refusals) that costs.py's single-device callers never
need.

The splits are those of `dgemma generate --parallel` (dgemma/parallel/): EP gives each device num_experts/ep of the
routed experts, whole; everything else is replicated across EP (every rank routes every token and runs attention for
the whole batch). TP splits attention by heads (q_proj and k/v_proj column-parallel by query and KV heads, o_proj
row-parallel; where a layer has fewer KV heads than TP ranks, each rank holds the one KV head its query heads read)
and the dense MLP by its hidden units (gate/up column-parallel, down row-parallel); the KV cache and the attention
scores go with the heads. The embedding (the tied lm_head), the self-conditioning MLP, the router, the norms, the
Lite time projection, the sampler's full-vocabulary buffers and the runtime slack are replicated, as are the
experts across TP.

Layouts: `ep=K`, `tp=K` and `ep+tp=K` (both over the same K ranks) are what `generate --parallel ep|tp|ep+tp` runs on K
ranks; `ep=A,tp=B` is a 2-D mesh of A·B devices (EP across, TP within), for planning only: dgemma runs no such mesh.
Training (`dgemma train --parallel`) runs a 2-D mesh of its own: `ddp+ep` / `fsdp+ep` with `ep_size` K put W = D x K
ranks in D data replicas of K expert-parallel ranks (`train_mesh`; `ep` is D = 1, ddp and fsdp K = 1).
Quantized weights are counted shard by shard (int4 pads each shard's widths, int8 keeps a scale per output row), for
planning too: `generate --parallel` loads plain weights."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from dgemma.model import costs
from dgemma.model.config import ModelConfig

DEVICE_SIZES_GB = (24, 48, 80, 141)  # common accelerator memories: RTX 4090 / L40S / A100-H100 80GB / H200
_SPEC = re.compile(r"^\s*(\w+(?:\s*\+\s*\w+)?)\s*=\s*(-?\d{1,18})\s*$", re.ASCII)

# How each part of the weights (the costs.parameter_counts breakdown) and of a step's memory divides.
SPLITS = {"embedding": "replicated (the tied lm_head)", "attention": "tp: heads (q/k/v column, o row)",
          "dense_mlp": "tp: hidden units (gate/up column, down row)", "experts": "ep: whole experts",
          "router": "replicated", "norms": "replicated", "self_conditioning": "replicated",
          "time_embedding": "replicated", "kv_cache": "tp: KV heads", "activations": "tp: heads",
          "sampler": "replicated (full-vocabulary logits)", "runtime": "replicated"}


@dataclass(frozen=True)
class ParallelLayout:
    """Experts split `ep` ways, attention and the dense MLP `tp` ways: over ep·tp devices (a 2-D mesh), or over the
    same ranks when `same_ranks` (ep == tp: `generate --parallel ep+tp`). ep=1, tp=1: one device."""

    ep: int = 1
    tp: int = 1
    same_ranks: bool = False

    @classmethod
    def over_ranks(cls, layout: str, world_size: int) -> ParallelLayout:
        """`generate --parallel ep|tp|ep+tp` on `world_size` ranks as a layout (what check_layout and the plan take)."""
        parts = layout.split("+")
        if not parts or any(p not in ("ep", "tp") for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"{layout!r}: expected ep, tp or ep+tp")
        return cls(world_size if "ep" in parts else 1, world_size if "tp" in parts else 1,
                   same_ranks=len(parts) == 2)

    @property
    def devices(self) -> int:
        return self.ep if self.same_ranks else self.ep * self.tp

    def __str__(self) -> str:
        if self.same_ranks:
            return f"ep+tp={self.ep}"
        return ",".join(f"{k}={v}" for k, v in (("ep", self.ep), ("tp", self.tp)) if v > 1) or "ep=1,tp=1"


def parse_layout(spec: str) -> ParallelLayout:
    """"ep=8", "tp=2", "ep+tp=4" (both over the same 4 ranks) or "ep=4,tp=2" (a 4 x 2 mesh) -> ParallelLayout;
    ValueError naming the spec otherwise (the CLI adds the flag)."""
    sizes: dict[str, int] = {}
    for item in spec.split(","):
        m = _SPEC.match(item)
        if m is None:
            raise ValueError(f"{spec!r}: expected ep=K, tp=K, ep+tp=K (the same K ranks) or ep=K,tp=K (a mesh)")
        key, value = re.sub(r"\s", "", m.group(1)), int(m.group(2))
        if key not in ("ep", "tp", "ep+tp"):
            raise ValueError(f"{spec!r}: unknown key {key!r}; use ep (expert parallel), tp (tensor parallel) or "
                             "ep+tp")
        if key in sizes or (key == "ep+tp" and sizes) or "ep+tp" in sizes:
            raise ValueError(f"{spec!r}: {key} given twice" if key in sizes else
                             f"{spec!r}: ep+tp=K goes alone (ep=A,tp=B is a mesh of A x B devices)")
        if value < 1:
            raise ValueError(f"{spec!r}: {key} must be an integer >= 1, got {value}")
        sizes[key] = value
    if "ep+tp" in sizes:
        return ParallelLayout(sizes["ep+tp"], sizes["ep+tp"], same_ranks=True)
    return ParallelLayout(**sizes)


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """One TP rank's KV heads: K / tp, or one (held by tp / K ranks alike) where there are fewer KV heads than
    ranks."""
    return max(num_kv_heads // tp, 1)


def check_layout(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """ValueError (naming the value and what it must divide) unless `layout` splits `cfg` as dgemma splits it: ep
    divides the experts; tp divides the attention heads and the dense MLP's width, and each layer type's KV heads
    either divide by tp or divide tp."""
    ep, tp = layout.ep, layout.tp
    if ep > 1 and not cfg.is_moe:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model; this one is dense (num_experts=0)")
    if cfg.is_moe and cfg.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={cfg.num_experts}")
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("intermediate_size", cfg.intermediate_size)):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {name}={n}")
    for name in ("num_key_value_heads", "num_global_key_value_heads"):
        kv = getattr(cfg, name)
        if kv % tp and tp % kv:
            raise ValueError(f"tp={tp} neither divides {name}={kv} nor is a multiple of it")


TRAIN_LAYOUTS = ("ddp", "fsdp", "ep", "ddp+ep", "fsdp+ep")


@dataclass(frozen=True)
class TrainMesh:
    """`dgemma train`'s ranks as a (data, ep) mesh: rank r is data replica r // ep and holds expert slice r % ep
    (the ranks of one replica are neighbours, a node's when ep divides its GPUs)."""

    data: int = 1
    ep: int = 1

    def data_rank(self, rank: int) -> int:
        return rank // self.ep


def train_mesh(parallel: str, world_size: int, ep_size: int | None) -> TrainMesh:
    """The mesh of `dgemma train --parallel PARALLEL [--ep-size K]` on `world_size` ranks; ValueError in one line
    (naming the flag and the value) unless it splits: ep is every rank (ep_size absent or the world), ddp+ep and
    fsdp+ep need ep_size, which divides the world (TrainConfig refuses an ep_size with the other layouts). One
    process (world 1) is a mesh of one whatever the flags."""
    if parallel not in TRAIN_LAYOUTS:
        raise ValueError(f"--parallel: must be one of {', '.join(TRAIN_LAYOUTS)}, got {parallel!r}")
    if "ep" not in parallel.split("+"):
        return TrainMesh(data=world_size)
    if world_size == 1:
        return TrainMesh()
    if parallel == "ep":
        return TrainMesh(ep=world_size)
    if ep_size is None:
        raise ValueError(f"--parallel {parallel} needs --ep-size K: the ranks that split the experts (the world's "
                         f"{world_size} ranks are {world_size} / K data replicas of K)")
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(f"--ep-size {ep_size} does not divide the world size {world_size} (torchrun's ranks)")
    return TrainMesh(data=world_size // ep_size, ep=ep_size)


def check_train_mesh(cfg: ModelConfig, parallel: str, world_size: int, ep_size: int | None) -> TrainMesh:
    """`train_mesh`, whose ep also splits `cfg`'s experts (`check_layout`)."""
    mesh = train_mesh(parallel, world_size, ep_size)
    if mesh.ep > 1:
        check_layout(cfg, ParallelLayout(ep=mesh.ep))
    return mesh


def tp_shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """One TP rank's share of the geometry: heads / tp, KV heads `local_kv_heads`, the dense MLP's width / tp (its
    attention, dense-MLP, KV-cache and score sizes are the rank's; the other parts are read from `cfg`)."""
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp, intermediate_size=cfg.intermediate_size // tp,
        num_key_value_heads=local_kv_heads(cfg.num_key_value_heads, tp),
        num_global_key_value_heads=local_kv_heads(cfg.num_global_key_value_heads, tp))  # type: ignore[arg-type]


def device_weight_bytes(cfg: ModelConfig, layout: ParallelLayout, dtype_bytes: int = 2,
                        quantize: str | None = None) -> dict[str, int]:
    """One device's weight bytes by part (`costs.weight_bytes`'s parts and `total`), under `layout`: the experts
    divided by ep (every expert is the same size, quantized or not), attention and the dense MLP those of
    `tp_shard_config`, the rest whole. At ep=1, tp=1 this is `costs.weight_bytes(cfg, dtype_bytes, quantize)`."""
    check_layout(cfg, layout)
    parts = {k: v for k, v in costs.weight_bytes(cfg, dtype_bytes, quantize).items() if k != "total"}
    local = costs.weight_bytes(tp_shard_config(cfg, layout.tp), dtype_bytes, quantize)
    parts["attention"], parts["dense_mlp"] = local["attention"], local["dense_mlp"]
    parts["experts"] //= layout.ep
    return {**parts, "total": sum(parts.values())}


def device_memory(cfg: ModelConfig, layout: ParallelLayout, *, batch: int = 1, context: int = 4096,
                  dtype: torch.dtype = torch.bfloat16, quantize: str | None = None) -> dict[str, int]:
    """One device's bytes by part for a denoising step of `batch` rows after `context` committed tokens: the weights
    (`device_weight_bytes`), the KV cache (`costs.memory_needed`'s for the TP rank's KV heads), the step's attention
    scores (`costs.attention_scores_bytes` of a canvas over context + canvas keys, the rank's heads), and the
    sampler's buffers and runtime slack as `costs.memory_needed` counts them (replicated)."""
    check_layout(cfg, layout)
    nbytes = torch.empty((), dtype=dtype).element_size()
    one = costs.memory_needed(cfg, dtype, batch_size=batch, cache_length=context)
    local = tp_shard_config(cfg, layout.tp)
    L = cfg.canvas_length
    return {"weights": device_weight_bytes(cfg, layout, nbytes, quantize)["total"],
            "kv_cache": costs.memory_needed(local, dtype, batch_size=batch, cache_length=context).get("kv_cache", 0),
            "activations": costs.attention_scores_bytes(local, batch, L, context + L),
            "sampler": one.get("sampler", 0), "runtime": one.get("runtime", 0)}


def plan(cfg: ModelConfig, layout: ParallelLayout, *, batch: int = 1, context: int = 4096,
         quantize: str | None = None) -> dict[str, Any]:
    """The plan `dgemma inspect --parallel` prints: for one device alone and for one device of `layout`, the weights
    by part and the step's memory by part (bytes), how each part splits, which of DEVICE_SIZES_GB the per-device
    total fits (weights in bf16, or `quantize`d with the embedding and router in bf16; KV cache in bf16), and whether
    `dgemma generate --parallel` runs this layout (not a 2-D mesh, not quantized)."""
    single = ParallelLayout()
    mesh = layout.ep > 1 and layout.tp > 1 and not layout.same_ranks
    out: dict[str, Any] = {"layout": str(layout), "ep": layout.ep, "tp": layout.tp, "same_ranks": layout.same_ranks,
                           "devices": layout.devices, "batch": batch, "context": context,
                           "weights_dtype": quantize or "bf16", "splits": dict(SPLITS),
                           "runs_in_dgemma": not mesh and quantize is None}
    if cfg.is_moe and layout.ep > 1:
        out["splits"]["experts"] = f"ep: {cfg.num_experts // layout.ep} of {cfg.num_experts} experts each"
    elif cfg.is_moe:
        out["splits"]["experts"] = f"replicated: all {cfg.num_experts} experts (ep=1)"
    for name, lay in (("single_device", single), ("per_device", layout)):
        memory = device_memory(cfg, lay, batch=batch, context=context, quantize=quantize)
        weights = device_weight_bytes(cfg, lay, 2, quantize)
        out[name] = {"weights": weights, "memory": memory, "total": sum(memory.values())}
    total = out["per_device"]["total"]
    out["fits_gb"] = {str(gb): total <= gb * 10**9 for gb in DEVICE_SIZES_GB}
    return out


__all__ = ["DEVICE_SIZES_GB", "SPLITS", "TRAIN_LAYOUTS", "ParallelLayout", "TrainMesh", "check_layout",
           "check_train_mesh", "device_memory", "device_weight_bytes",
           "local_kv_heads", "parse_layout", "plan", "tp_shard_config", "train_mesh"]
