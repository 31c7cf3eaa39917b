"""What a model costs, in one place: parameter, KV-cache, FLOP and weight-byte counts as pure functions of a
`ModelConfig` (no model is built, so they are instant even for the 26B geometry), the bytes a load, a generation or a
training step needs from them, and the memory pre-flight that compares those bytes with what is free. The pre-flight
lives here rather than in a module of its own because it is this accounting plus one comparison: loading, `generate`,
the serving engine, `dgemma inspect` and the training step (train/config.py) all count with the same functions.

Notation: D = hidden_size, V = vocab_size, H = num_attention_heads, I = intermediate_size, Ie = moe_intermediate_size,
E = num_experts, k = top_k_experts, L = canvas_length, and per layer i: Dh(i) = layer_head_dim(i),
K(i) = layer_num_kv_heads(i). Counts follow the checkpoint tensors (spec section 2): full-attention layers have no
v_proj (K=V), `v_norm`, `router.norm` and `self_conditioning.post_norm` carry no weight, and the lm_head is the
embedding (counted once; the encoder and decoder share every parameter).
"""

from __future__ import annotations

from typing import Any

import torch

from dgemma.io.system import available_memory
from dgemma.model.config import TIME_FEATURES, ModelConfig


def _attention_params(cfg: ModelConfig, i: int) -> int:
    """q_proj + k_proj (+ v_proj unless K=V) + o_proj: (2·H·Dh + (1 or 2)·K·Dh)·D."""
    hd, nkv = cfg.layer_head_dim(i), cfg.layer_num_kv_heads(i)
    kv_projs = 1 if cfg.shares_kv(i) else 2  # K=V layers reuse the raw k_proj output as V
    return (2 * cfg.num_attention_heads * hd + kv_projs * nkv * hd) * cfg.hidden_size


def _norm_params(cfg: ModelConfig, i: int) -> int:
    """q_norm and k_norm (Dh each) plus the layer's RMSNorm weights of size D: 7 with MoE, 4 when dense."""
    return 2 * cfg.layer_head_dim(i) + (7 if cfg.is_moe else 4) * cfg.hidden_size


def _expert_params(cfg: ModelConfig) -> int:
    """One expert: gate_up_proj (2·Ie, D) + down_proj (D, Ie) = 3·Ie·D."""
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size if cfg.is_moe else 0


def _router_params(cfg: ModelConfig) -> int:
    """proj (E, D) + scale (D,) + per_expert_scale (E,)."""
    return cfg.num_experts * cfg.hidden_size + cfg.hidden_size + cfg.num_experts if cfg.is_moe else 0


def _layer_params(cfg: ModelConfig, i: int, active: bool) -> dict[str, int]:
    n_experts = cfg.top_k_experts if active else cfg.num_experts
    return {
        "attention": _attention_params(cfg, i),
        "dense_mlp": 3 * cfg.intermediate_size * cfg.hidden_size,
        "experts": n_experts * _expert_params(cfg) if cfg.is_moe else 0,
        "router": _router_params(cfg),
        "norms": _norm_params(cfg, i),
    }


def _breakdown(cfg: ModelConfig, active: bool) -> dict[str, int]:
    out = {"embedding": cfg.vocab_size * cfg.hidden_size, "attention": 0, "dense_mlp": 0, "experts": 0, "router": 0,
           "norms": cfg.hidden_size}  # the final norm
    for i in range(cfg.num_hidden_layers):
        for k, v in _layer_params(cfg, i, active).items():
            out[k] += v
    out["self_conditioning"] = _self_conditioning_params(cfg)
    if cfg.time_embedding:  # Lite: Linear(TIME_FEATURES -> D) with bias
        out["time_embedding"] = TIME_FEATURES * cfg.hidden_size + cfg.hidden_size
    return out


def _self_conditioning_params(cfg: ModelConfig) -> int:
    """"mlp": pre_norm (D,) + gate_proj, up_proj (I, D) + down_proj (D, I); "linear": proj (D, D). Decoder only,
    runs on every denoise step."""
    if cfg.self_conditioning == "linear":
        return cfg.hidden_size * cfg.hidden_size
    return cfg.hidden_size + 3 * cfg.intermediate_size * cfg.hidden_size


def parameter_counts(cfg: ModelConfig) -> dict[str, Any]:
    """Text parameters as the checkpoint stores them.

    `total` = sum of `breakdown`; `active` = the same with only k of E experts (per token). Norms hold every RMSNorm
    weight except self-conditioning's pre_norm; the router holds proj, scale and per_expert_scale. The two
    `layer_scalar` buffers per layer (encoder and decoder, not tied) are counted in `buffers`, not in `total`.
    """
    total, active = _breakdown(cfg, active=False), _breakdown(cfg, active=True)
    return {"total": sum(total.values()), "active": sum(active.values()), "breakdown": total,
            "active_breakdown": active, "buffers": {"layer_scalars": 2 * cfg.num_hidden_layers}}


def per_layer_table(cfg: ModelConfig) -> list[dict[str, Any]]:
    """One row per layer: geometry and parameters (excluding the layer_scalar buffers)."""
    rows = []
    for i in range(cfg.num_hidden_layers):
        sliding = cfg.is_sliding(i)
        rows.append({
            "layer": i, "type": "sliding" if sliding else "full", "heads": cfg.num_attention_heads,
            "head_dim": cfg.layer_head_dim(i), "kv_heads": cfg.layer_num_kv_heads(i), "rotary_dims": cfg.rotary_dims(i),
            "window": cfg.sliding_window if sliding else None, "k_eq_v": cfg.shares_kv(i),
            "params": sum(_layer_params(cfg, i, active=False).values()),
            "active_params": sum(_layer_params(cfg, i, active=True).values()),
        })
    return rows


def kv_cache_bytes_breakdown(cfg: ModelConfig, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes per cached token, split by layer type: sum over layers of 2·K(i)·Dh(i)·dtype_bytes.

    K and V are stored separately even on K=V layers (K is k_norm'd and rotated, V only v_norm'd). Sliding layers
    only ever need the last `sliding_window - 1` tokens, so their share stops growing past that many tokens.
    """
    out = {"sliding": 0, "full": 0}
    for i in range(cfg.num_hidden_layers):
        out["sliding" if cfg.is_sliding(i) else "full"] += 2 * cfg.layer_num_kv_heads(i) * cfg.layer_head_dim(i)
    out = {k: v * dtype_bytes for k, v in out.items()}
    return {"total": out["sliding"] + out["full"], **out}


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Sum over layers of 2·K(i)·Dh(i)·dtype_bytes (see `kv_cache_bytes_breakdown` for the sliding share)."""
    return kv_cache_bytes_breakdown(cfg, dtype_bytes)["total"]


def kv_cache_bytes(cfg: ModelConfig, context_len: int, dtype_bytes: int = 2) -> int:
    """Cache size after `context_len` committed tokens: full·T + sliding·min(T, sliding_window - 1)."""
    b = kv_cache_bytes_breakdown(cfg, dtype_bytes)
    return b["full"] * context_len + b["sliding"] * min(context_len, cfg.sliding_window - 1)


def _matmul_params(cfg: ModelConfig, self_conditioning: bool) -> int:
    """Weights each token multiplies through: attention projections, dense MLP, router proj, k experts, and (denoise
    only) the self-conditioning MLP. Norms, scales and the embedding gather cost no matmul FLOPs."""
    n = sum(_attention_params(cfg, i) for i in range(cfg.num_hidden_layers))
    n += cfg.num_hidden_layers * (3 * cfg.intermediate_size * cfg.hidden_size + cfg.num_experts * cfg.hidden_size
                                  + cfg.top_k_experts * _expert_params(cfg))
    if self_conditioning:
        n += _self_conditioning_params(cfg) - (cfg.hidden_size if cfg.self_conditioning == "mlp" else 0)
    return n


def _attention_flops(cfg: ModelConfig, i: int, keys: int) -> int:
    """Per query: 2·H·Dh·keys for the scores plus 2·H·Dh·keys for the weighted sum of values."""
    return 4 * cfg.num_attention_heads * cfg.layer_head_dim(i) * keys


def flops_per_denoise_step(cfg: ModelConfig, context_len: int, batch: int = 1) -> int:
    """One decoder pass over the canvas of L tokens with T = `context_len` committed tokens in the cache:

        B·L·(2·matmul_params + 2·V·D (lm_head) + 2·V·D (self-conditioning p@E)
             + Σ_i 4·H·Dh(i)·keys(i)),   keys(i) = T + L (full) or min(T, sliding_window - 1) + L (sliding)

    matmul_params includes the self-conditioning MLP. The first step of each canvas skips self-conditioning (its input
    is 0); this counts the general step.
    """
    per_token = 2 * _matmul_params(cfg, self_conditioning=True) + 4 * cfg.vocab_size * cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        prefix = min(context_len, cfg.sliding_window - 1) if cfg.is_sliding(i) else context_len
        per_token += _attention_flops(cfg, i, prefix + cfg.canvas_length)
    return batch * cfg.canvas_length * per_token


def flops_per_committed_token(cfg: ModelConfig, context_len: int) -> int:
    """A causal encoder pass for one token at position T = `context_len` (it only writes the KV cache: no lm_head, no
    self-conditioning):

        2·matmul_params + Σ_i 4·H·Dh(i)·keys(i),   keys(i) = T + 1 (full) or min(T + 1, sliding_window) (sliding)
    """
    flops = 2 * _matmul_params(cfg, self_conditioning=False)
    for i in range(cfg.num_hidden_layers):
        keys = min(context_len + 1, cfg.sliding_window) if cfg.is_sliding(i) else context_len + 1
        flops += _attention_flops(cfg, i, keys)
    return flops


# --- weight memory, quantized or not ----------------------------------------------------------------------------

QUANTIZE_MODES = ("int8", "int4")
INT4_GROUP = 128  # int4: one scale and zero per 128 input weights (torchao's tinygemm layout)
INT4_PAD_IN, INT4_PAD_OUT = 1024, 8  # tinygemm pads a matrix's input width to a multiple of 1024, outputs to 8


def quantized_matrices(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """The weight matrices `--quantize` replaces (dgemma/weights/quantize.py): (kind, out, in, how many), counting each
    expert matrix once. Every linear projection is quantized except the router's (routing is discrete: a rounding can
    swap an expert) and the Lite time projection; the embedding (the tied head) stays in the model dtype."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    out: list[tuple[str, int, int, int]] = []
    for i in range(cfg.num_hidden_layers):
        H, K, Dh = cfg.num_attention_heads, cfg.layer_num_kv_heads(i), cfg.layer_head_dim(i)
        out += [("attention", H * Dh, D, 1), ("attention", K * Dh, D, 1 if cfg.shares_kv(i) else 2),
                ("attention", D, H * Dh, 1), ("dense_mlp", F, D, 2), ("dense_mlp", D, F, 1)]
        if cfg.is_moe:
            Ie, E = cfg.moe_intermediate_size, cfg.num_experts
            out += [("experts", 2 * Ie, D, E), ("experts", D, Ie, E)]
    if cfg.self_conditioning == "linear":
        out.append(("self_conditioning", D, D, 1))
    else:
        out += [("self_conditioning", F, D, 2), ("self_conditioning", D, F, 1)]
    return out


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def quantized_matrix_bytes(out_features: int, in_features: int, mode: str) -> int:
    """Bytes of one quantized (out, in) matrix as torchao stores it. int8 (weight-only, per output row): one byte per
    weight and one fp32 scale per row. int4 (tinygemm, `Int4TilePackedTo4dTensor`): both widths padded
    (INT4_PAD_IN, INT4_PAD_OUT), half a byte per weight, a bf16 scale and zero per group of INT4_GROUP inputs."""
    if mode == "int8":
        return out_features * in_features + 4 * out_features
    if mode == "int4":
        o, i = _ceil_to(out_features, INT4_PAD_OUT), _ceil_to(in_features, INT4_PAD_IN)
        return o * i // 2 + o * (i // INT4_GROUP) * 2 * 2
    raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)} or None, got {mode!r}")


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 2, quantize: str | None = None) -> dict[str, int]:
    """Bytes of the weights by part (the `parameter_counts` breakdown) in the model dtype, or with `quantize`
    ("int8" or "int4") applied to the matrices `quantized_matrices` lists; `total` is their sum. The layer_scalar
    buffers are not counted (as in `parameter_counts`)."""
    parts = {k: v * dtype_bytes for k, v in parameter_counts(cfg)["breakdown"].items()}
    if quantize is not None:
        for kind, o, i, n in quantized_matrices(cfg):
            parts[kind] += n * (quantized_matrix_bytes(o, i, quantize) - o * i * dtype_bytes)
    return {**parts, "total": sum(parts.values())}


# --- the memory pre-flight ------------------------------------------------------------------------------------------

class MemoryPreflightError(ValueError):
    """A load or a generation would need more memory than is free; the message gives the numbers."""


RUNTIME_BYTES = 256 * 2**20  # allocator slack, the interpreter, small temporaries


def attention_scores_bytes(config: ModelConfig, batch: int, queries: int, keys: int) -> int:
    """The reference attention's live fp32 tensors for one layer: scores and probabilities, 2·B·H·queries·keys·4
    (a prefill: the prompt over itself; a denoising step: the canvas over context + canvas)."""
    return 2 * batch * config.num_attention_heads * queries * keys * 4


def memory_needed(config: ModelConfig, dtype: torch.dtype, *, weights: bool = False, batch_size: int = 0,
                  cache_length: int = 0, prompt_length: int = 0, quantize: str | None = None,
                  offload_experts: bool = False, prefix_tokens: int = 0) -> dict[str, int]:
    """Bytes by part (nothing is built): the weights in `dtype` (or `quantize`d; without the experts if they are
    offloaded), a KVCache of `cache_length` slots for `batch_size` rows (every layer is preallocated at full length),
    the sampler's (batch, canvas, vocab) buffers (fp32 logits and probabilities, the self-conditioning logits, the
    entropy's temporary), the prefill's attention scores for a `prompt_length`-token prompt, and a serving prefix
    cache of `prefix_tokens` slots."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    B, L, V = batch_size, config.canvas_length, config.vocab_size
    w = weight_bytes(config, nbytes, quantize)
    parts = {"weights": w["total"] - (w["experts"] if offload_experts else 0) if weights else 0,
             "kv_cache": B * cache_length * kv_cache_bytes_per_token(config, nbytes),
             "prefix_cache": prefix_tokens * kv_cache_bytes_per_token(config, nbytes),
             "sampler": B * L * V * (3 * 4 + nbytes),
             "activations": attention_scores_bytes(config, B, prompt_length, max(prompt_length, L)),
             "runtime": RUNTIME_BYTES}
    return {k: v for k, v in parts.items() if v}


def check_memory(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                 weights: bool = False, batch_size: int = 0, cache_length: int = 0, prompt_length: int = 0,
                 force: bool = False, quantize: str | None = None, offload_experts: bool = False,
                 prefix_tokens: int = 0) -> dict[str, int]:
    """The memory pre-flight of loading and generating: refuse (MemoryPreflightError, with the numbers) when
    `memory_needed` exceeds what `system.available_memory` says is free (RAM, or free device memory on CUDA), unless
    `force`. Returns the parts."""
    parts = memory_needed(config, dtype, weights=weights, batch_size=batch_size, cache_length=cache_length,
                          prompt_length=prompt_length, quantize=quantize, offload_experts=offload_experts,
                          prefix_tokens=prefix_tokens)
    device = torch.device(device)
    free = available_memory(device) if device.type in ("cpu", "cuda") else None
    need = sum(parts.values())
    if not force and free is not None and need > free:
        gb = lambda b: f"{b / 1e9:.2f} GB"
        detail = ", ".join(f"{k} {gb(v)}" for k, v in parts.items())
        raise MemoryPreflightError(f"needs about {gb(need)} ({detail}) but only {gb(free)} is free on {device.type}; "
                                   "use a smaller model, dtype (or --quantize), batch or max_new_tokens, or --force / "
                                   "force=True to try anyway")
    return parts


def training_step_bytes(cfg: ModelConfig, *, batch_size: int, seq_len: int, paired: bool, chunk_rows: int,
                        use_bf16: bool = False, compiled: bool = False, eager_scores: bool = False,
                        activation_checkpointing: bool = False, lora: bool = False, shards: int = 1,
                        ep: int = 1) -> dict[str, int]:
    """Peak bytes of one training step of one rank, by part (train/config.py:estimate_memory says it of a
    TrainConfig). `paired`: each window is fed as [x0 ; x_t] (clean-context and sft objectives). Activations: values
    autograd keeps per token and layer, fitted to measured eager fp32 CPU peaks (runs/train_memory.py: ~68 D-wide
    values per token and layer for cpu-small; this formula gives ~75) and assumed 3x fewer when each block is
    `compiled` (torch.compile fuses the fp32 norm and GELU intermediates away; not measured: no GPU here). Plus each
    layer's saved attention mask (and its scores with `eager_scores`: the reference attention keeps them), the
    (chunk_rows, V) loss logits, and the runtime itself. `batch_size` is a rank's micro-batch; with FSDP over `shards`
    ranks parameters, gradients and AdamW state are divided by `shards`, plus the blocks gathered whole at once (the
    root's embedding and two blocks, with their gradients); with the routed experts split over `ep` ranks (dgemma
    train --parallel ep|ddp+ep|fsdp+ep) a rank holds E / ep of them (and FSDP neither shards nor gathers them).
    Activation checkpointing keeps one block's activations and each block's input; `lora`: gradients and AdamW state
    of the adapters only (negligible)."""
    L = cfg.num_hidden_layers
    counts = parameter_counts(cfg)
    experts = counts["breakdown"]["experts"] if ep > 1 else 0  # split, not FSDP-sharded
    P = counts["total"]
    S = seq_len * (2 if paired else 1)
    N, act = batch_size * S, 2 if use_bf16 else 4
    D, H, Dh = cfg.hidden_size, cfg.num_attention_heads, max(cfg.head_dim, cfg.global_head_dim)
    per_token = 44 * D + 6 * cfg.intermediate_size + 4 * H * Dh
    if cfg.is_moe:
        per_token += cfg.top_k_experts * (6 * cfg.moe_intermediate_size + 4 * D)
    if compiled:
        per_token //= 3
    scores = 2 * batch_size * H * S * S * 4 if eager_scores else 0
    kept = 1 if activation_checkpointing else L  # layers whose activations are alive at once
    held = (P - experts) // shards + experts // ep  # this rank's parameters
    trained = 0 if lora else held
    parts = {"parameters": 4 * held, "gradients": 4 * trained, "adamw": 8 * trained}
    if shards > 1:
        per_layer = (P - experts - cfg.vocab_size * D) // L
        parts["gathered"] = 2 * (cfg.vocab_size * D + 2 * per_layer) * (2 if use_bf16 else 4)
    return {**parts,
            "activations": N * kept * per_token * act + L * (S * S * act + scores)
                           + (N * L * D * act if activation_checkpointing else 0),
            "loss_logits": 4 * min(chunk_rows, N) * cfg.vocab_size * 4,
            "runtime": 500 * 2**20}


__all__ = ["MemoryPreflightError", "attention_scores_bytes", "check_memory", "flops_per_committed_token",
           "flops_per_denoise_step", "kv_cache_bytes", "kv_cache_bytes_breakdown", "kv_cache_bytes_per_token",
           "memory_needed", "parameter_counts", "per_layer_table", "quantized_matrices", "training_step_bytes",
           "weight_bytes"]
