"""DiffusionGemma: a uniform-state block-diffusion LM on a Gemma 4 (MoE) backbone, in one readable file.

One set of weights runs two ways over a shared KV cache:

    commit(ids, cache)         causal *encoder* pass over clean tokens (a prompt, or a finished canvas);
                               writes their K/V into the cache. The cache is the only thing it produces.
    denoise(canvas, cache)     bidirectional *decoder* pass over a noisy canvas of `canvas_length` tokens that
                               attends to the committed prefix; returns fp32 logits (B, L, V). Never writes.

The code is in forward order: norms, RoPE, attention, feed-forward (dense MLP + routed experts), block,
self-conditioning, model. Every departure from a vanilla Llama-style block is marked `# Gemma:`.
The op order mirrors `transformers` 5.23 (`DiffusionGemmaForBlockDiffusion`) so that the reference path is
bit-identical to it, in fp32 and in bf16, when transformers runs eager attention and eager experts.

Precision policy: weights and activations in the model dtype (fp32 or bf16). In fp32: RMSNorm, the attention
softmax, the router softmax and its top-k weights, each expert output times its weight (cast back before the sum),
the self-conditioning softmax, and the logit softcap. RoPE angles in fp32, cos/sin cast to the model dtype.

Shapes: B batch, S new tokens, T visible keys, L canvas, D hidden, H query heads, K kv heads, Dh head dim,
V vocabulary, E experts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dgemma.model import attention, kernels
from dgemma.model.adapter_rows import AdapterRows, LayerRows, project
from dgemma.model.attention import Impl, Mask, Past, check_impl
from dgemma.model.config import ModelConfig, RopeConfig
from dgemma.model.inputs import check_token_ids, one_row_caches
from dgemma.model.kv_cache import KVCache
from dgemma.model.memory import check_memory
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.weights import checkpoint

TIME_FEATURES = 256  # width of the sinusoidal noise-level features (Lite)
Role = Literal["encoder", "decoder"]  # commit (causal, encoder layer scalars) or denoise (bidirectional, decoder)
PastKV = Callable[[int], Past | list[Past]]  # layer -> the visible cached keys and values (per row: a list)


# --- norms ------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back. `with_scale=False` is the weightless variant."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        # torch.pow(., -0.5), not rsqrt: the reference does this to match JAX's rounding.
        y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()  # Gemma: x * w (Gemma 4), not x * (1 + w) as in Gemma 1-3
        return y.type_as(x)


# --- rotary embeddings ------------------------------------------------------------------------------------------

def rope_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | None = None) -> Tensor:
    """Inverse frequencies, (Dh/2,) fp32."""
    if rope.rope_type == "default":
        return 1.0 / (rope.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    # Gemma: proportional (partial) RoPE on full layers. The exponent divides by the FULL head_dim, so these are the
    # first frequencies of an ordinary head_dim RoPE; the remaining pairs get frequency 0 (cos=1, sin=0).
    num_rotated = int(rope.partial_rotary_factor * head_dim // 2)
    exponent = torch.arange(0, 2 * num_rotated, 2, dtype=torch.int64, device=device).float() / head_dim
    inv = 1.0 / (rope.rope_theta ** exponent)
    inv = torch.cat([inv, torch.zeros(head_dim // 2 - num_rotated, dtype=torch.float32, device=device)])
    return inv / rope.factor


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (B or 1, S, Dh) for integer positions (B or 1, S); angles in fp32."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, S, heads, Dh). Rotate-half (NeoX) layout: dim i pairs with i + Dh/2."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


# --- attention (the kernels and masks: dgemma/model/attention.py) ----------------------------------------------------

class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.head_dim = Dh = config.layer_head_dim(layer_idx)
        K = config.layer_num_kv_heads(layer_idx)
        self.q_proj = nn.Linear(D, H * Dh, bias=False)
        self.k_proj = nn.Linear(D, K * Dh, bias=False)
        # Gemma: K=V on full-attention layers: no v_proj, the value is the raw k_proj output.
        self.v_proj = None if config.shares_kv(layer_idx) else nn.Linear(D, K * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=False)
        self.q_norm = RMSNorm(Dh, config.rms_norm_eps)  # Gemma: QK norm, a learned per-dim scale shared by heads
        self.k_norm = RMSNorm(Dh, config.rms_norm_eps)
        self.v_norm = RMSNorm(Dh, config.rms_norm_eps, with_scale=False)  # Gemma: weightless V norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: Past | list[Past], mask: Mask | list[Mask],
                impl: Impl, lora: LayerRows | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x: (B, S, D); past: the visible cached keys and values (B, K, T0, Dh), or None, or one such per row
        (`attention.attend`); `lora`: the rows' LoRA deltas (dgemma/model/adapter_rows.py). Returns the output (B, S, D)
        and this pass's new k, v (B, K, S, Dh), which `commit` writes to the cache."""
        B, S, _ = x.shape
        q = project("q_proj", self.q_proj, x, lora).view(B, S, -1, self.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(1, 2)  # (B, H, S, Dh)
        k = project("k_proj", self.k_proj, x, lora).view(B, S, -1, self.head_dim)
        v = project("v_proj", self.v_proj, x, lora).view(B, S, -1, self.head_dim) if self.v_proj is not None else k
        k = apply_rope(self.k_norm(k), cos, sin).transpose(1, 2)  # (B, K, S, Dh): normed, then rotated
        v = self.v_norm(v).transpose(1, 2)  # (B, K, S, Dh): normed, never rotated
        out = attention.attend(q, k, v, past, mask, impl).reshape(B, S, -1)  # fast: SDPA
        return project("o_proj", self.o_proj, out, lora), k, v


# --- feed-forward: a dense MLP beside routed experts --------------------------------------------------------------

class MLP(nn.Module):
    """Gated MLP: down(gelu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))  # Gemma: GELU, not SiLU


class Router(nn.Module):
    """Top-k routing: softmax over all experts in fp32, keep the top k, renormalise, then per-expert scale."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        D, E = config.hidden_size, config.num_experts
        self.top_k = config.top_k_experts
        self.norm = RMSNorm(D, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(D, E, bias=False)
        self.scale = nn.Parameter(torch.ones(D))
        self.per_expert_scale = nn.Parameter(torch.ones(E))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: (N, D), the un-normed residual stream. Returns weights (N, k) fp32 and expert ids (N, k)."""
        x = self.norm(x) * self.scale * x.shape[-1] ** -0.5  # Gemma: weightless norm, learned scale, 1/sqrt(D)
        probs = F.softmax(self.proj(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts  # Gemma: per-expert scale after renormalising


class Experts(nn.Module):
    """E gated-GELU experts stored as 3-D tensors (the checkpoint layout): gate_up_proj (E, 2*Ie, D) with the gate
    in the first half, down_proj (E, D, Ie)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        D, E, Ie = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * Ie, D))
        self.down_proj = nn.Parameter(torch.zeros(E, D, Ie))

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor, impl: Impl = "reference") -> Tensor:
        """x: (N, D); weights, experts: (N, k). Loops over experts in ascending id and accumulates in the model
        dtype, token rows in (slot, token) order: exactly transformers' eager experts."""
        if impl == "fast":  # fast: sort slots by expert once, contiguous/grouped matmuls (dgemma/model/kernels.py)
            return kernels.moe_experts(x, weights, experts, self.gate_up_proj, self.down_proj)
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            slot, token = torch.where(experts.T == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def per_row(self, x: Tensor, weights: Tensor, experts: Tensor, row_length: int, impl: Impl = "reference"
                ) -> Tensor:
        """`forward` where each row of `row_length` tokens gets exactly what it would in a batch of its own, whatever
        the other rows: the reference runs row by row (matmul rounding depends on how many tokens share them), the
        fast kernels run all rows at once in whole blocks of rows (kernels.moe_experts, backend "padded")."""
        if impl == "fast":
            return kernels.moe_experts(x, weights, experts, self.gate_up_proj, self.down_proj, backend="padded")
        return torch.cat([self.forward(x[r:r + row_length], weights[r:r + row_length], experts[r:r + row_length])
                          for r in range(0, x.shape[0], row_length)])


# --- the block ----------------------------------------------------------------------------------------------------

class Block(nn.Module):
    """One transformer layer. Encoder (commit) and decoder (denoise) share its weights but not `layer_scalar`."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.is_sliding(layer_idx)
        self.self_attn = Attention(config, layer_idx)
        # Gemma: "sandwich" norms: every sub-block's input is normed, and so is its output before the residual add.
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.pre_feedforward_layernorm = RMSNorm(D, eps)
        self.post_feedforward_layernorm = RMSNorm(D, eps)
        self.mlp = MLP(D, config.intermediate_size)
        self.is_moe = config.is_moe
        if self.is_moe:  # Gemma: routed experts run beside the dense MLP, each with its own pre/post norms
            self.router = Router(config)
            self.experts = Experts(config)
            self.pre_feedforward_layernorm_2 = RMSNorm(D, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(D, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(D, eps)
        # Gemma: a learned scalar multiplies the whole residual stream after the block; DiffusionGemma keeps one
        # for the decoder (checkpoint: model.decoder.layers.N.layer_scalar) and one for the encoder
        # (model.encoder.language_model.layers.N.layer_scalar). Buffers, untied, possibly different.
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: Past | list[Past], mask: Mask | list[Mask],
                scalar: Tensor, impl: Impl, lora: LayerRows | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """`scalar`: `encoder_layer_scalar` (commit), `layer_scalar` (denoise), or a per-token mix (1, S, 1) when
        one training sequence holds both roles. `lora`: the rows' LoRA deltas (dgemma/model/adapter_rows.py)."""
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, past, mask, impl, lora)
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.is_moe:
            h = self.post_feedforward_layernorm_1(h)
            flat = x.reshape(-1, x.shape[-1])  # (B*S, D)
            weights, experts = self.router(flat)  # Gemma: the router reads the residual stream before any norm
            normed = self.pre_feedforward_layernorm_2(flat)
            if isinstance(past, list):  # rows on their own (continuous batching): a row's experts must not round
                moe = self.experts.per_row(normed, weights, experts, x.shape[1], impl)  # with the other rows'
            else:
                moe = self.experts(normed, weights, experts, impl)
            moe = moe if lora is None else lora.experts(self.experts, normed, weights, experts, moe, x.shape[1])
            moe = moe.reshape(x.shape)
            h = h + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)
        return x * scalar, k, v


# --- self-conditioning --------------------------------------------------------------------------------------------

class MLPSelfConditioning(nn.Module):
    """DiffusionGemma's self-conditioning: the previous step's beliefs come back as the soft embedding p @ E (B, L, D);
    a gated MLP of it is added to the canvas embedding, then a weightless RMSNorm of the sum (the decoder stream
    starts at unit RMS)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        D = config.hidden_size
        self.pre_norm = RMSNorm(D, config.rms_norm_eps)
        self.gate_proj = nn.Linear(D, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(D, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, D, bias=False)
        self.post_norm = RMSNorm(D, config.rms_norm_eps, with_scale=False)

    def forward(self, x: Tensor, soft: Tensor | None) -> Tensor:
        """The canvas input: x, canvas embeddings (B, L, D); soft, or None on a canvas's first step."""
        if soft is None:  # the MLP maps a zero signal to exactly zero (the reference adds it;
            return self.post_norm(x + 0.0)  # `+ 0.0` turns any -0.0 into +0.0 just as that addition does)
        s = self.pre_norm(soft)
        return self.post_norm(x + self.down_proj(F.gelu(self.gate_proj(s), approximate="tanh") * self.up_proj(s)))

    def output(self, normed: Tensor, soft: Tensor | None) -> Tensor:
        """The final hidden state, unchanged: this variant acts on the input side only."""
        return normed


class LinearSelfConditioning(nn.Module):
    """Seed 003's (Lite) self-conditioning: a zero-initialised projection of the soft embedding is added to the
    final normed hidden state, so a fresh model computes exactly what it would without it. The canvas input only
    gets the weightless RMSNorm that DiffusionGemma's decoder applies."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        D = config.hidden_size
        self.proj = nn.Linear(D, D, bias=False)
        nn.init.zeros_(self.proj.weight)
        self.post_norm = RMSNorm(D, config.rms_norm_eps, with_scale=False)

    def forward(self, x: Tensor, soft: Tensor | None) -> Tensor:
        return self.post_norm(x + 0.0)

    def output(self, normed: Tensor, soft: Tensor | None) -> Tensor:
        return normed if soft is None else normed + self.proj(soft)


SELF_CONDITIONING: dict[str, type[nn.Module]] = {"mlp": MLPSelfConditioning, "linear": LinearSelfConditioning}


def time_features(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of the noise level t in [0, 1] (0 = clean): (...) -> (..., dim) fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = 1000.0 * t.float()[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


# --- the model ----------------------------------------------------------------------------------------------------

class DiffusionGemma(nn.Module):
    """The text model. Parameter names mirror the checkpoint under `model.decoder.` (see
    dgemma/weights/checkpoint.py)."""

    def __init__(self, config: ModelConfig, impl: Impl = "reference"):
        super().__init__()
        self.config = config
        self.impl: Impl = impl
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SELF_CONDITIONING[config.self_conditioning](config)
        # Lite (seed 003): each canvas is told its noise level; clean tokens get t = 0.
        self.time_proj = nn.Linear(TIME_FEATURES, config.hidden_size) if config.time_embedding else None
        self.quantization: str | None = None  # "int8" / "int4" once quantized (weights/quantize.py): saving refuses it
        self.offloaded: str | None = None  # where the routed experts live once offloaded (dgemma/weights/offload.py)
        self.generation_config: GenerationConfig | None = None  # the checkpoint's generation_config.json, if any
        # RoPE inverse frequencies per layer type, fp32, computed once (plain tensors, not buffers: `.to(bf16)` must
        # never round them, a pitfall transformers' own `.to` has).
        # On the CPU even when the model is built on the meta device (load_model), then moved where positions live.
        self.inv_freq = {kind: rope_inv_freq(config.layer_rope(i), config.layer_head_dim(i), torch.device("cpu"))
                         for kind, i in config.first_layer_of_each_type().items()}

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    # --- Hugging Face-style persistence: methods beside dgemma.save_pretrained / dgemma.load_model -------------
    def save_pretrained(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """`dgemma.save_pretrained(self, path, **kwargs)`: the transformers layout (config.json,
        generation_config.json, model.safetensors); keyword arguments as that function's."""
        checkpoint.save_pretrained(self, path, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None, impl: Impl = "reference",
                        force: bool = False, quantize: str | None = None, offload_experts: bool = False
                        ) -> DiffusionGemma:
        """`dgemma.load_model(path, dtype=, device=, impl=, force=, quantize=)`: a checkpoint directory in the Hugging
        Face layout, or a training run (its newest complete checkpoint), with its generation_config attached. Refuses
        (MemoryPreflightError) weights larger than the free memory unless `force`. `quantize`: "int8" or "int4"
        weight-only (dgemma/weights/quantize.py), each tensor quantized as it is read. `offload_experts`: the routed
        experts stay in the checkpoint's file (CPU, memory-mapped) or pinned host memory (CUDA)
        (dgemma/weights/offload.py)."""
        from dgemma.weights import offload
        from dgemma.weights import quantize as q  # torchao, imported only when asked for

        offload.check_offload_combination(quantize, offload_experts)
        dev = torch.device(device or "cpu")

        def preflight(config: ModelConfig, dt: torch.dtype) -> None:
            if quantize is not None:
                q.check_supported(quantize, dev, dt)
            check_memory(config, dt, dev, weights=True, force=force, quantize=quantize, offload_experts=offload_experts)

        stream = q.streaming_loader(quantize) if quantize else offload.streaming_loader() if offload_experts else None
        model = checkpoint.load(path, lambda config: cls(config, impl=impl), dtype=dtype, device=device,
                                preflight=preflight, stream=stream)
        model.quantization = quantize
        return model

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """A preallocated cache for `max_length` committed tokens, in the model's dtype and device."""
        return KVCache(self.config, batch_size, max_length, dtype=self.dtype, device=self.device)

    def embed(self, ids: Tensor, t: Tensor | None = None) -> Tensor:
        """Token embeddings (B, S, D); with a time embedding, plus that of the noise level t (B, S) (None: 0)."""
        # Gemma: embeddings scaled by sqrt(D), the scale rounded to the weight dtype first (53.0, not 53.07, in bf16)
        x = self.embed_tokens(ids) * torch.tensor(self.config.hidden_size**0.5).to(self.dtype)
        if self.time_proj is not None:
            t = torch.zeros(ids.shape, device=ids.device) if t is None else t.expand(ids.shape)
            x = x + self.time_proj(time_features(t, TIME_FEATURES).to(x.dtype))
        return x

    def soft_embedding(self, logits: Tensor, mask: Tensor | None = None) -> Tensor:
        """Self-conditioning input from logits (B, L, V): softmax (fp32) @ E * sqrt(D), in the model dtype; `mask`
        (B,) bool zeroes rows."""
        E = self.embed_tokens.weight
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(E.dtype)
        soft = (probs @ E) * torch.tensor(self.config.hidden_size**0.5).to(E.dtype)  # same scale as embed()
        return soft if mask is None else soft * mask.to(soft.dtype)[:, None, None]

    def final_hidden(self, hidden: Tensor, soft: Tensor | None = None) -> Tensor:
        """The final norm (and, for "linear" self-conditioning, its output-side add): what the head reads."""
        return self.self_conditioning.output(self.norm(hidden), soft)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        """cos, sin per layer type for integer positions (B or 1, S)."""
        return {kind: rope_cos_sin(inv.to(positions.device), positions, dtype) for kind, inv in self.inv_freq.items()}

    def run_layers(self, x: Tensor, positions: Tensor, role: Role | Tensor, masks: dict[str, Mask], impl: Impl, *,
                   past: PastKV | None = None, write: Callable[[int, Tensor, Tensor], None] | None = None,
                   adapters: AdapterRows | None = None) -> Tensor:
        """The one loop over the layers, which every pass runs: x (B, S, D) at integer `positions` (B or 1, S).
        `role` picks the layer scalars: "encoder" (commit), "decoder" (denoise), or a (1, S, 1) bool tensor, True
        for decoder tokens, when one training sequence holds both roles. `masks[layer_type]`: who attends to whom
        (dgemma/model/attention.py). `past(i)`: layer i's visible cached keys and values (None: no cache); `write(i, k,
        v)`: stores layer i's new keys and values (commit). `adapters`: each row's LoRA adapter (None: the base)."""
        cos_sin = self.rope(positions, x.dtype)
        for i, block in enumerate(self.layers):
            kind = self.config.layer_types[i]
            if isinstance(role, Tensor):
                scalar = torch.where(role, block.layer_scalar, block.encoder_layer_scalar)
            else:
                scalar = block.encoder_layer_scalar if role == "encoder" else block.layer_scalar
            x, k, v = block(x, *cos_sin[kind], past(i) if past is not None else None, masks[kind], scalar, impl,
                            adapters.layer(i) if adapters is not None else None)
            if write is not None:
                write(i, k, v)
        return x

    def sequence_hidden(self, tokens: Tensor, positions: Tensor, masks: dict[str, Tensor], *, num_clean: int,
                        soft: Tensor | None = None, t: Tensor | None = None, impl: Impl | None = None,
                        adapters: AdapterRows | None = None) -> Tensor:
        """The training forward: one pass over a whole sequence (B, S) without a cache. Tokens [0, num_clean) run in
        the encoder role (as `commit`: plain embedding, encoder scalars); the rest are canvas tokens in the decoder
        role (self-conditioning on `soft` (B, S - num_clean, D), post-norm, decoder scalars). `masks[layer_type]`
        (B or 1, 1, S, S) bool: who attends to whom (the bounds build them); `t` (B, S): noise levels for a
        time-embedding model; `adapters`: each row's LoRA adapter. Returns the final hidden states (B, S, D)."""
        S = tokens.shape[1]
        x = self.embed(tokens, t)
        if num_clean < S:
            x = torch.cat([x[:, :num_clean], self.self_conditioning(x[:, num_clean:], soft)], dim=1)
        is_canvas = (torch.arange(S, device=x.device) >= num_clean)[None, :, None]  # (1, S, 1)
        x = self.norm(self.run_layers(x, positions, is_canvas, masks, self._impl(impl), adapters=adapters))
        if soft is not None and num_clean < S:
            x = torch.cat([x[:, :num_clean], self.self_conditioning.output(x[:, num_clean:], soft)], dim=1)
        return x

    def _impl(self, impl: Impl | None) -> Impl:
        if impl is None:
            return self.impl
        check_impl(impl)
        return impl

    @torch.no_grad()
    def commit(self, input_ids: Tensor, cache: KVCache | Sequence[KVCache], *, adapters: AdapterRows | None = None,
               start: int | None = None, attention_mask: Tensor | None = None, impl: Impl | None = None) -> None:
        """Causal encoder pass over `input_ids` (B, S): writes their K/V to the cache at `start` (default: the end of
        what is committed). Committing at an earlier `start` overwrites that span and discards everything after it.
        `attention_mask` (B, S), 1 = token, 0 = left padding; padded positions are never attended to. `impl` (default:
        the model's): "reference" or "fast" kernels. `cache` may also be a list of B one-row caches, as for `denoise`:
        each row appends at its own length, as it would alone. `adapters`: each row's LoRA
        (dgemma/weights/adapters.py)."""
        rows = one_row_caches(cache, input_ids, "input_ids")
        if rows is None:
            self._encode(input_ids, cache, start, attention_mask, self._impl(impl), adapters)  # type: ignore[arg-type]
            return
        if start is not None or attention_mask is not None:
            raise ValueError("a commit over one-row caches appends at each row's end: no start or attention_mask")
        check_token_ids(input_ids, self.config.vocab_size)
        impl = self._impl(impl)
        S = input_ids.shape[1]
        starts = [c.prepare_write(input_ids[r:r + 1], None, None) for r, c in enumerate(rows)]
        row_masks = [attention.commit_masks(c, p, S, c.is_token[:, p:p + S], impl, self.dtype)
                     for c, p in zip(rows, starts, strict=True)]
        seen = attention.visible_prefixes(self.config.sliding_window, "encoder")
        kinds = self.config.layer_types

        def write(i: int, k: Tensor, v: Tensor) -> None:
            for r, (c, p) in enumerate(zip(rows, starts, strict=True)):
                c.write(i, p, k[r:r + 1], v[r:r + 1])

        device = input_ids.device
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(S, device=device)
        self.run_layers(self.embed(input_ids), positions, "encoder", {k: [m[k] for m in row_masks] for k in seen},
                        impl, write=write, adapters=adapters,
                        past=lambda i: [c.visible(i, p, seen[kinds[i]]) for c, p in zip(rows, starts, strict=True)])
        for c, p in zip(rows, starts, strict=True):
            c.finish_write(p + S)

    @torch.no_grad()
    def next_token_logits(self, input_ids: Tensor, cache: KVCache, *, start: int | None = None,
                          attention_mask: Tensor | None = None, impl: Impl | None = None) -> Tensor:
        """`commit`, and also the encoder's fp32 logits (B, S, V) at those positions, i.e. next-token predictions:
        what an autoregressive model (objective `ar`) decodes with."""
        hidden = self._encode(input_ids, cache, start, attention_mask, self._impl(impl))
        return self.logits(self.final_hidden(hidden))

    def _encode(self, input_ids: Tensor, cache: KVCache, start: int | None, attention_mask: Tensor | None,
                impl: Impl, adapters: AdapterRows | None = None) -> Tensor:
        check_token_ids(input_ids, self.config.vocab_size)
        start = cache.prepare_write(input_ids, start, attention_mask)
        B, S = input_ids.shape
        if S == 0:  # nothing to encode; still truncates at `start`
            return self.embed_tokens.weight.new_zeros(B, 0, self.config.hidden_size)
        masks = attention.commit_masks(cache, start, S, cache.is_token[:, start:start + S], impl, self.dtype)
        seen = attention.visible_prefixes(self.config.sliding_window, "encoder")
        kinds = self.config.layer_types
        positions = torch.arange(start, start + S, device=input_ids.device)[None]
        hidden = self.run_layers(self.embed(input_ids), positions, "encoder", masks, impl,
                                 past=lambda i: cache.visible(i, start, seen[kinds[i]]),
                                 write=lambda i, k, v: cache.write(i, start, k, v), adapters=adapters)
        cache.finish_write(start + S)
        return hidden

    @torch.no_grad()
    def denoise(self, canvas: Tensor, cache: KVCache | Sequence[KVCache], *, adapters: AdapterRows | None = None,
                self_conditioning_logits: Tensor | None = None, self_conditioning_mask: Tensor | None = None,
                sliding_prefix: int | None = None, t: Tensor | float | None = None, impl: Impl | None = None) -> Tensor:
        """Bidirectional decoder pass over `canvas` (B, L) against everything committed; returns fp32 logits
        (B, L, V). Never writes the cache, so several canvases can be tried at the same position.
        `self_conditioning_logits` (B, L, V): the previous step's logits (temperature-scaled, as transformers'
        sampler passes them); None on the first step of a canvas; their softmax runs in fp32 whatever their dtype
        (transformers passes them in the model dtype, so cast them to reproduce it in bf16).
        `self_conditioning_mask` (B,) bool zeroes the signal per row. `sliding_prefix`: how many committed tokens
        sliding layers see; default `sliding_window - 1` (transformers); the JAX reference uses `sliding_window`.
        `t`: the canvas's noise level in [0, 1], a float or (B,), for a time-embedding model. `cache` may also be a
        list of B one-row caches, each at its own committed length (continuous batching: `KVCache.rows` views of a
        pool); each row then computes what it would in a batch of its own. `impl` (default: the model's):
        "reference" or "fast" kernels. `adapters`: each row's LoRA adapter or the base, as for `commit`."""
        check_token_ids(canvas, self.config.vocab_size, "canvas")
        soft = None
        if self_conditioning_logits is not None:
            expected = (*canvas.shape, self.config.vocab_size)
            if tuple(self_conditioning_logits.shape) != expected:
                raise ValueError(f"self_conditioning_logits has shape {tuple(self_conditioning_logits.shape)}, "
                                 f"expected {expected}")
            soft = self.soft_embedding(self_conditioning_logits, self_conditioning_mask)
        return self.logits(self.denoise_hidden(canvas, cache, soft=soft, sliding_prefix=sliding_prefix, t=t,
                                               impl=impl, adapters=adapters))

    @torch.no_grad()
    def denoise_hidden(self, canvas: Tensor, cache: KVCache | Sequence[KVCache], *, soft: Tensor | None = None,
                       sliding_prefix: int | None = None, t: Tensor | float | None = None,
                       impl: Impl | None = None, adapters: AdapterRows | None = None) -> Tensor:
        """`denoise` up to the final hidden state (B, L, D) that the head reads, with the self-conditioning signal
        given as the soft embedding (B, L, D) (`soft_embedding`), or None."""
        rows = one_row_caches(cache, canvas, "canvas")
        impl = self._impl(impl)
        if t is not None:
            t = torch.as_tensor(t, dtype=torch.float32, device=canvas.device).reshape(-1, 1)
        x = self.self_conditioning(self.embed(canvas, t), soft)  # Gemma: SC MLP + weightless post-norm on the input
        L = canvas.shape[1]
        seen = attention.visible_prefixes(self.config.sliding_window, "decoder", sliding_prefix)
        kinds = self.config.layer_types
        offsets = torch.arange(L, device=x.device)
        if rows is None:
            end = cache.length  # type: ignore[union-attr]
            masks = attention.denoise_masks(cache, end, L, seen, impl)  # type: ignore[arg-type]
            hidden = self.run_layers(x, end + offsets[None], "decoder", masks, impl, adapters=adapters,
                                     past=lambda i: cache.visible(i, end, seen[kinds[i]]))  # type: ignore[union-attr]
        else:  # one row per cache, each at its own length: the masks and cached keys of each row's lone pass
            row_masks = [attention.denoise_masks(c, c.length, L, seen, impl) for c in rows]
            masks = {kind: [m[kind] for m in row_masks] for kind in seen}
            positions = torch.tensor([c.length for c in rows], device=x.device)[:, None] + offsets
            hidden = self.run_layers(x, positions, "decoder", masks, impl, adapters=adapters,
                                     past=lambda i: [c.visible(i, c.length, seen[kinds[i]]) for c in rows])
        return self.final_hidden(hidden, soft)

    def logits(self, final: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Tied head and softcap on the final hidden states (`final_hidden`): (..., D) -> (..., V) in `dtype` (fp32;
        float64 for a float64 judge's scores)."""
        logits = F.linear(final, self.embed_tokens.weight).to(dtype)  # Gemma: tied input/output embedding
        cap = self.config.final_logit_softcapping
        if cap is not None:
            if torch.is_grad_enabled() and logits.requires_grad:  # training keeps tanh's input for backward
                logits = torch.tanh(logits / cap) * cap  # Gemma: logit softcap, 30 * tanh(x / 30), in fp32
            else:  # sampling: in place, so no second (B, L, V) fp32 tensor
                logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    @torch.no_grad()
    def forward(self, input_ids: Tensor, decoder_input_ids: Tensor | None = None,
                self_conditioning_logits: Tensor | None = None, attention_mask: Tensor | None = None,
                self_conditioning_mask: Tensor | None = None, impl: Impl | None = None) -> Tensor:
        """The transformers-compatible forward: commit `input_ids` (B, T) into a fresh cache, denoise
        `decoder_input_ids` (B, L) against it, return fp32 logits (B, L, V), which equal
        `DiffusionGemmaForBlockDiffusion(...).logits` for the same inputs. With `attention_mask`, padded prompt
        positions are hidden from the canvas too (transformers needs `decoder_attention_mask` for that)."""
        check_token_ids(input_ids, self.config.vocab_size)
        if decoder_input_ids is not None:
            check_token_ids(decoder_input_ids, self.config.vocab_size, "decoder_input_ids")
            if decoder_input_ids.ndim != 2 or decoder_input_ids.shape[0] != input_ids.shape[0]:
                raise ValueError(f"decoder_input_ids must have shape (batch={input_ids.shape[0]}, canvas length), "
                                 f"got {tuple(decoder_input_ids.shape)}")
        if decoder_input_ids is None:  # as transformers: a uniformly random canvas from the global generator
            decoder_input_ids = torch.randint(0, self.config.vocab_size, (input_ids.shape[0],
                                              self.config.canvas_length), device=input_ids.device)
        cache = self.new_cache(input_ids.shape[0], max(1, input_ids.shape[1]))
        self.commit(input_ids, cache, attention_mask=attention_mask, impl=impl)
        return self.denoise(decoder_input_ids, cache, self_conditioning_logits=self_conditioning_logits,
                            self_conditioning_mask=self_conditioning_mask, impl=impl)
