"""The parts of a DiffusionGemma layer, in forward order: norms, RoPE, attention, feed-forward (dense MLP + routed
experts), the block, then the canvas's self-conditioning and noise-level features. dgemma/model/diffusiongemma.py
stacks them into the model and runs its passes. Every departure from a vanilla Llama-style block is marked
`# Gemma:`. The op order mirrors `transformers` 5.23 (`DiffusionGemmaForBlockDiffusion`) so that the reference path
is bit-identical to it, in fp32 and in bf16, when transformers runs eager attention and eager experts.

Precision policy: weights and activations in the model dtype (fp32 or bf16). In fp32: RMSNorm, the attention
softmax, the router softmax and its top-k weights, each expert output times its weight (cast back before the sum),
the self-conditioning softmax, and the logit softcap (diffusiongemma.py). RoPE angles in fp32, cos/sin cast to the
model dtype.

Shapes: B batch, S new tokens, T visible keys, L canvas, D hidden, H query heads, K kv heads, Dh head dim,
V vocabulary, E experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dgemma.model import kernels
from dgemma.model.adapter_rows import LayerRows, project
from dgemma.model.attention import Impl, LayerPast
from dgemma.model.config import ModelConfig, RopeConfig

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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: LayerPast, impl: Impl, lora: LayerRows | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """x: (B, S, D); past: the visible cached keys and values and the mask (`attention.Past`, or one per row:
        `attention.RowPasts`); `lora`: the rows' LoRA deltas (dgemma/model/adapter_rows.py). Returns the output
        (B, S, D) and this pass's new k, v (B, K, S, Dh), which `commit` writes to the cache."""
        B, S, _ = x.shape
        q = project("q_proj", self.q_proj, x, lora).view(B, S, -1, self.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(1, 2)  # (B, H, S, Dh)
        k = project("k_proj", self.k_proj, x, lora).view(B, S, -1, self.head_dim)
        v = project("v_proj", self.v_proj, x, lora).view(B, S, -1, self.head_dim) if self.v_proj is not None else k
        k = apply_rope(self.k_norm(k), cos, sin).transpose(1, 2)  # (B, K, S, Dh): normed, then rotated
        v = self.v_norm(v).transpose(1, 2)  # (B, K, S, Dh): normed, never rotated
        out = past.attend(q, k, v, impl).reshape(B, S, -1)  # fast: SDPA
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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: LayerPast, scalar: Tensor, impl: Impl,
                lora: LayerRows | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """`scalar`: `encoder_layer_scalar` (commit), `layer_scalar` (denoise), or a per-token mix (1, S, 1) when
        one training sequence holds both roles. `lora`: the rows' LoRA deltas (dgemma/model/adapter_rows.py)."""
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, past, impl, lora)
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.is_moe:
            h = self.post_feedforward_layernorm_1(h)
            flat = x.reshape(-1, x.shape[-1])  # (B*S, D)
            weights, experts = self.router(flat)  # Gemma: the router reads the residual stream before any norm
            normed = self.pre_feedforward_layernorm_2(flat)
            if past.rows_apart:  # rows on their own (continuous batching): a row's experts must not round
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
