"""Random transformers DiffusionGemma checkpoints: the numerical reference of the parity tests and of
`dgemma bench --compare-transformers`. The one module of dgemma that uses transformers (`pip install 'dgemma[dev]'`),
imported lazily: importing this module does not import transformers; its first use does.

Builds `DiffusionGemmaForBlockDiffusion` from `transformers==5.23.0` with the tiny geometry of the spec
(shared/reference/hf-diffusiongemma-spec.md, section 5) or a variant of it (`build_hf_model`), or with the geometry of
a dgemma `ModelConfig` (`build_hf_checkpoint`), and randomises every tensor a checkpoint holds (vision tower
included) so that no parity bug can hide behind an init value of 0 or 1 (`randomize_`, which works on dgemma's
models too):

- matrices and expert stacks: N(0, 1) / sqrt(fan_in); the router projection N(0, 1) so that routing is decisive;
- the token embedding (tied to the LM head): N(0, 0.3), which gives logits of a few units;
- RMSNorm weights, `router.scale` and `router.per_expert_scale`: 1 + 0.2 N(0, 1);
- the `layer_scalar` buffers: U(0.5, 1.5), drawn separately for the decoder and the encoder (they are not tied).

Encoder text parameters are the same tensors as the decoder's (HF ties them); only the buffers differ.
`EntropyBoundSamplerConfig`, `DiffusionGemmaConfig` and `DiffusionGemmaForBlockDiffusion` are transformers' classes,
re-exported (lazily) for the tests.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

    from dgemma.model.config import ModelConfig

_LAZY = {"DiffusionGemmaConfig": "transformers", "DiffusionGemmaForBlockDiffusion": "transformers",
         "EntropyBoundSamplerConfig": "transformers.models.diffusion_gemma.generation_diffusion_gemma"}


def _transformers() -> SimpleNamespace:
    """transformers' DiffusionGemma classes, imported on first use (offline: no hub access from tests or bench)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return SimpleNamespace(**{name: getattr(importlib.import_module(module), name) for name, module in _LAZY.items()})


def __getattr__(name: str) -> Any:  # the lazy re-exports
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


S, F = "sliding_attention", "full_attention"

# fmt: off
TINY_TEXT: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=48, num_global_key_value_heads=1, sliding_window=8,
    layer_types=[S, F, S, F], num_experts=8, top_k_experts=2, moe_intermediate_size=32,
    max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
TINY_VISION: dict[str, Any] = dict(
    model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4, pooling_kernel_size=2,
)
# Generation settings of spec section 5 (plus sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1)).
GENERATION: dict[str, Any] = dict(
    max_new_tokens=48, max_denoising_steps=12, t_min=0.4, t_max=0.8, stability_threshold=1,
    confidence_threshold=0.005, eos_token_id=1, pad_token_id=0,
)

GEOMETRIES: dict[str, dict[str, Any]] = {
    # Spec section 5: sliding window 8 < the 11-token test prompt, head_dim 16 / 48, kv heads 2 / 1, 8 experts top-2.
    "tiny": {},
    # No num_global_key_value_heads: full layers fall back to num_key_value_heads, which equals the head count (MHA).
    "mha-default-kv": dict(num_key_value_heads=4, num_global_key_value_heads=None),
    # Top-1 routing; a window wider than the test prompt (crossed in generate after the first commit); S, S, F.
    "top1-wide-window": dict(top_k_experts=1, sliding_window=24, num_hidden_layers=3, layer_types=[S, S, F]),
    # 16 experts top-8, six layers with the default 5:1 layer pattern, custom RoPE thetas, full-layer partial 0.5.
    "k8-of-16": dict(
        num_experts=16, top_k_experts=8, num_hidden_layers=6, layer_types=None,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 5_000.0},
            F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 200_000.0},
        },
    ),
    # Full layers keep head_dim 16, so per_layer_config only overrides their kv-head count.
    "same-head-dim": dict(global_head_dim=16),
}
# fmt: on


def randomize_(model: nn.Module, seed: int = 0, *, embedding_std: float = 0.3, strict: bool = False) -> nn.Module:
    """Overwrite every parameter and the `layer_scalar` buffers in place, deterministically in `seed` (tied parameters
    once, through the shared tensor), drawn in fp32 on the weights' device and rounded to their dtype by copy_. Works
    on dgemma's and transformers' parameter names alike. `strict`: any other persistent buffer is an error (the HF
    reference must leave nothing at its init value)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where the weights live (26B on a GPU: seconds)

    def normal(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=g, dtype=torch.float32, device=device)

    with torch.no_grad():
        for name, p in model.named_parameters():  # deduplicated: each tied tensor appears once
            if p.ndim == 1:  # RMSNorm weights, router.scale, router.per_expert_scale
                value = 1 + 0.2 * normal(p)
            elif name.endswith("embed_tokens.weight"):
                value = embedding_std * normal(p)
            elif name.endswith("router.proj.weight"):
                value = normal(p)
            else:  # nn.Linear (out, in) and expert stacks (E, out, in)
                value = normal(p) / math.sqrt(p.shape[-1])
            p.copy_(value)
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        for name, b in model.state_dict(keep_vars=True).items():
            if name in params:
                continue
            if not name.endswith("layer_scalar"):
                if strict:
                    raise AssertionError(f"no randomisation rule for buffer {name} {tuple(b.shape)}")
                continue
            b.copy_(0.5 + torch.rand(b.shape, generator=g, dtype=torch.float32, device=device))
    return model


def _check_ties(model: DiffusionGemmaForBlockDiffusion) -> None:
    """The encoder's text parameters and the LM head must be the decoder's tensors; the layer scalars must not."""
    text = model.model.encoder.language_model
    decoder = dict(model.model.decoder.named_parameters())
    for name, p in text.named_parameters():
        assert p is decoder[name], f"encoder parameter {name} is not tied to the decoder"
    assert model.lm_head.weight is decoder["embed_tokens.weight"], "lm_head is not tied to the embedding"
    for enc, dec in zip(text.layers, model.model.decoder.layers, strict=True):
        assert enc.layer_scalar.data_ptr() != dec.layer_scalar.data_ptr(), "layer_scalar buffers are shared"


def build_hf_model(
    geometry: str = "tiny",
    *,
    seed: int = 0,
    canvas_length: int = 16,
    dtype: torch.dtype = torch.float32,
    text_overrides: dict[str, Any] | None = None,
    embedding_std: float = 0.3,
) -> DiffusionGemmaForBlockDiffusion:
    """A randomised HF model of the named geometry (plus `text_overrides`), in eval mode, deterministic in `seed`.
    `embedding_std` scales the tied embedding and so the logits: larger values give peaked, low-entropy posteriors.
    Image-token ids are the last three of the vocabulary.

    It runs HF's default kernels (sdpa, grouped_mm). `model.set_attn_implementation("eager")` plus
    `model.set_experts_implementation("eager")` make it compute bit for bit what `load_hf_model(eager=True)` does.
    """
    hf = _transformers()
    text = copy.deepcopy({**TINY_TEXT, **GEOMETRIES[geometry], **(text_overrides or {})})
    vision = copy.deepcopy(TINY_VISION)
    V = text["vocab_size"]
    config = hf.DiffusionGemmaConfig(
        text_config=text, vision_config=vision, canvas_length=canvas_length,
        image_token_id=V - 3, boi_token_id=V - 2, eoi_token_id=V - 1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG; keep the caller's stream
        # Constructed like from_pretrained(dtype=...): RoPE inv_freq stays fp32 (model.to(bf16) would round it).
        model = hf.DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype)
    randomize_(model, seed, embedding_std=embedding_std, strict=True)  # drawn in fp32, rounded to dtype by copy_
    _check_ties(model)
    model.generation_config.update(sampler_config=hf.EntropyBoundSamplerConfig(entropy_bound=0.1), **GENERATION)
    return model.eval()


def save_hf_model(model: DiffusionGemmaForBlockDiffusion, path: str | os.PathLike) -> None:
    """Write config.json (with `per_layer_config`), generation_config.json and model.safetensors to `path`."""
    model.save_pretrained(path)  # also writes model.generation_config


def load_hf_model(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, eager: bool = True, device: str | None = None
) -> DiffusionGemmaForBlockDiffusion:
    """Load a saved model in eval mode; `eager=True` selects the bit-exact eager attention and experts kernels, and
    `eager=False` transformers' defaults (SDPA attention, grouped-mm experts: what `dgemma bench` compares against).

    The loaded tensors are views into the safetensors buffer, at whatever 4-byte offsets the file layout gives them.
    CPU matmuls depend on the weights' address alignment (an expert slice `gate_up_proj[e]` at a 4-byte offset gives
    logits ~4e-6 off the same weights 64-byte aligned), so every tensor is copied into fresh, aligned storage (as
    `dgemma.load_model` does). The loaded model then computes exactly what the built one does. Ties survive: each
    shared tensor is copied once. `device` moves it afterwards.
    """
    kernels = dict(attn_implementation="eager", experts_implementation="eager") if eager else {}
    model = _transformers().DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, **kernels)
    for tensor in (*model.parameters(), *model.buffers()):
        tensor.data = tensor.data.clone()
    _check_ties(model)
    if device is not None:
        model = model.to(device)
    return model.eval()


@torch.no_grad()
def hf_logits(
    model: DiffusionGemmaForBlockDiffusion,
    input_ids: torch.Tensor | None,
    decoder_input_ids: torch.Tensor,
    *,
    self_conditioning_logits: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    decoder_attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
) -> tuple[torch.Tensor, Any]:
    """One HF forward: encode `input_ids` into the cache (if given), denoise the canvas; fp32 logits and the cache."""
    out = model(
        input_ids=input_ids,
        decoder_input_ids=decoder_input_ids,
        self_conditioning_logits=self_conditioning_logits,
        attention_mask=attention_mask,
        decoder_attention_mask=decoder_attention_mask,
        past_key_values=past_key_values,
    )
    return out.logits.float(), out.past_key_values


def build_hf_checkpoint(cfg: ModelConfig, path: str | os.PathLike[str], *, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> None:
    """Write a random transformers `DiffusionGemmaForBlockDiffusion` of geometry `cfg` to `path` (config.json,
    generation_config.json, model.safetensors), which both transformers and `dgemma.load_model` read."""
    hf = _transformers()
    spec = cfg.to_hf()
    V = cfg.vocab_size
    config = hf.DiffusionGemmaConfig(text_config={k: v for k, v in spec["text_config"].items() if k != "model_type"},
                                     vision_config=spec["vision_config"], canvas_length=cfg.canvas_length,
                                     image_token_id=V - 3, boi_token_id=V - 2, eoi_token_id=V - 1)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global generator
        model = hf.DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype)
    randomize_(model, seed)
    model.generation_config.update(eos_token_id=None, pad_token_id=None)
    model.save_pretrained(path)


__all__ = ["GENERATION", "GEOMETRIES", "TINY_TEXT", "TINY_VISION", "build_hf_checkpoint", "build_hf_model", "hf_logits",
           "load_hf_model", "randomize_", "save_hf_model"]  # and, lazily, the three transformers classes of _LAZY
