"""The memory pre-flight of a training step: `estimate_memory(cfg)` adds up parameters, gradients, AdamW state,
activations, the saved attention masks and the loss logits of one rank; `preflight` refuses, before anything is
written, a configuration that will not fit. `cfg` is a dgemma.train.config.TrainConfig (dgemma/train/loop.py re-exports
both)."""

from __future__ import annotations

from typing import Any

import torch

from dgemma.io.system import available_memory
from dgemma.model import costs

TrainConfig = Any  # dgemma.train.config.TrainConfig (imported from there it would make a cycle)


def estimate_memory(cfg: TrainConfig, device_type: str = "cpu", use_bf16: bool = False, shards: int = 1
                    ) -> dict[str, int]:
    """Peak bytes of one training step, by part. Activations: values autograd keeps per token and layer, fitted to
    measured eager fp32 CPU peaks (runs/train_memory.py: ~68 D-wide values per token and layer for cpu-small; this
    formula gives ~75) and assumed 3x fewer under per-block torch.compile, which fuses the fp32 norm and GELU
    intermediates away (not measured: no GPU here). Plus each layer's saved attention mask, the (chunk_rows, V) loss
    logits, and the runtime itself. Per rank: `batch_size` is a rank's micro-batch; with FSDP over `shards` ranks
    parameters, gradients and AdamW state are divided by `shards`, plus the blocks gathered whole at once (the root's
    embedding and two blocks, with their gradients). Activation checkpointing keeps one block's activations and
    each block's input."""
    mc, L = cfg.model_config, cfg.model_config.num_hidden_layers
    P = costs.parameter_counts(mc)["total"]
    S = cfg.seq_len * (2 if cfg.objective in ("clean-context", "sft") else 1)  # [x0 ; x_t]
    N, act = cfg.batch_size * S, 2 if use_bf16 else 4
    D, H, Dh = mc.hidden_size, mc.num_attention_heads, max(mc.head_dim, mc.global_head_dim)
    per_token = 44 * D + 6 * mc.intermediate_size + 4 * H * Dh
    if mc.is_moe:
        per_token += mc.top_k_experts * (6 * mc.moe_intermediate_size + 4 * D)
    if cfg.compile and device_type == "cuda":
        per_token //= 3
    scores = 2 * cfg.batch_size * H * S * S * 4 if cfg.impl == "reference" else 0  # the eager twin keeps them
    kept = 1 if cfg.activation_checkpointing else L  # layers whose activations are alive at once
    trained = 0 if cfg.lora_rank else P  # LoRA: gradients and AdamW state of the adapters only (negligible)
    parts = {"parameters": 4 * P // shards, "gradients": 4 * trained // shards, "adamw": 8 * trained // shards}
    if shards > 1:
        per_layer = (P - mc.vocab_size * D) // L
        parts["gathered"] = 2 * (mc.vocab_size * D + 2 * per_layer) * (2 if use_bf16 else 4)
    return {**parts,
            "activations": N * kept * per_token * act + L * (S * S * act + scores)
                           + (N * L * D * act if cfg.activation_checkpointing else 0),
            "loss_logits": 4 * min(cfg.chunk_rows, N) * mc.vocab_size * 4,
            "runtime": 500 * 2**20}


def preflight(cfg: TrainConfig, device: torch.device, use_bf16: bool, shards: int = 1) -> str:
    """Refuse (ValueError) a configuration whose estimated peak memory exceeds what is free; else a summary line."""
    parts = estimate_memory(cfg, device.type, use_bf16, shards)
    need, free = sum(parts.values()), available_memory(device)
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items())
    if free is not None and need > free:
        raise ValueError(f"estimated peak memory {gib(need)} ({detail}) exceeds the {gib(free)} available on "
                         f"{device.type}; lower --batch-size or --seq-len (raise --grad-accum to keep the tokens "
                         f"per step), lower --chunk-rows, or pick a smaller preset")
    return f"memory: estimated peak {gib(need)} of {gib(free) if free is not None else 'unknown'} available"
