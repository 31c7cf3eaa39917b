"""The memory pre-flight of loading and generating: what a model, its cache and its sampler buffers need
(model/costs.py's accounting, from a config alone), against what `system.available_memory` says is free. The training
step's own pre-flight is train/preflight.py."""

from __future__ import annotations

import torch

from dgemma.io.system import available_memory
from dgemma.model import costs
from dgemma.model.config import ModelConfig


class MemoryPreflightError(ValueError):
    """A load or a generation would need more memory than is free; the message gives the numbers."""


RUNTIME_BYTES = 256 * 2**20  # allocator slack, the interpreter, small temporaries


def memory_needed(config: ModelConfig, dtype: torch.dtype, *, weights: bool = False, batch_size: int = 0,
                  cache_length: int = 0, prompt_length: int = 0, quantize: str | None = None,
                  offload_experts: bool = False, prefix_tokens: int = 0) -> dict[str, int]:
    """Bytes by part (model/costs.py's accounting, nothing is built): the weights in `dtype` (or `quantize`d; without
    the experts if they are offloaded), a KVCache of
    `cache_length` slots for `batch_size` rows (every layer is preallocated at full length), the sampler's
    (batch, canvas, vocab) buffers (fp32 logits and probabilities, the self-conditioning logits, the entropy's
    temporary), the prefill's attention scores for a `prompt_length`-token prompt, and a serving prefix cache of
    `prefix_tokens` slots."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    B, L, V = batch_size, config.canvas_length, config.vocab_size
    w = costs.weight_bytes(config, nbytes, quantize)
    parts = {"weights": w["total"] - (w["experts"] if offload_experts else 0) if weights else 0,
             "kv_cache": B * cache_length * costs.kv_cache_bytes_per_token(config, nbytes),
             "prefix_cache": prefix_tokens * costs.kv_cache_bytes_per_token(config, nbytes),
             "sampler": B * L * V * (3 * 4 + nbytes),
             "activations": 2 * B * config.num_attention_heads * prompt_length * max(prompt_length, L) * 4,
             "runtime": RUNTIME_BYTES}
    return {k: v for k, v in parts.items() if v}


def check_memory(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                 weights: bool = False, batch_size: int = 0, cache_length: int = 0, prompt_length: int = 0,
                 force: bool = False, quantize: str | None = None, offload_experts: bool = False,
                 prefix_tokens: int = 0) -> dict[str, int]:
    """The memory pre-flight: refuse (MemoryPreflightError, with the numbers) when `memory_needed` exceeds what
    `system.available_memory` says is free (RAM, or free device memory on CUDA), unless `force`. Returns the parts."""
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
