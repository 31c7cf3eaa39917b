"""The model loader of the library and of every subcommand: a checkpoint, a training run or a LoRA adapter (merged
into its base), or a preset with random weights, optionally quantized (dgemma/weights/quantize.py) or with its experts
offloaded (dgemma/weights/offload.py). `dgemma.load_model` and `dgemma.build_model` are these functions; the CLI calls
them in one line (dgemma/cli/loading.py:load), so what `--model`, `--preset --random-init`, `--quantize` and
`--offload-experts` do is reachable from Python too."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dgemma.model.attention import Impl
from dgemma.model.config import ModelConfig, preset
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.model.memory import check_memory
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.weights import lora
from dgemma.weights.checkpoint import resolve_model_dir
from dgemma.weights.offload import check_offload_combination, offload_experts
from dgemma.weights.quantize import check_supported, quantize_model

# The dtype names every command takes (--dtype), and what they load as.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(path: str | os.PathLike[str], dtype: torch.dtype | None = None,
               device: torch.device | str | None = None, impl: Impl = "reference", force: bool = False,
               quantize: str | None = None, offload_experts: bool = False) -> DiffusionGemma:
    """A model from `path`: a checkpoint directory in the Hugging Face layout, a training run (its newest complete
    checkpoint), or a LoRA adapter or LoRA run (merged into its base, then quantized or offloaded), with its
    generation_config attached. Problems raise `CheckpointError` (AdapterError for an adapter); weights that do not
    fit in free memory raise `MemoryPreflightError` (before anything is allocated) unless `force`.
    `quantize="int8"|"int4"`: weight-only quantization with torchao (`pip install 'dgemma[quant]'`);
    `offload_experts=True`: experts kept out of device memory, read per layer. The two do not combine."""
    check_offload_combination(quantize, offload_experts)
    if not lora.is_adapter(resolve_model_dir(path)):
        return DiffusionGemma.from_pretrained(path, dtype=dtype, device=device, impl=impl, force=force,
                                              quantize=quantize, offload_experts=offload_experts)
    model = lora.load_merged(resolve_model_dir(path), dtype=dtype, device=device, impl=impl, force=force)
    return _offload_to_temp_file(quantize_model(model, quantize), offload_experts)


def build_model(config: ModelConfig | str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                impl: Impl = "reference", force: bool = False, quantize: str | None = None,
                offload_experts: bool = False) -> DiffusionGemma:
    """A model with random weights (`init_weights`) of `config` or of the preset it names, in eval mode, with the
    default generation_config of its geometry. The memory pre-flight runs before anything is built (weights and
    one canvas's sampler buffers); `quantize` / `offload_experts` as `load_model` (the experts go to a temporary
    file, removed at exit)."""
    check_offload_combination(quantize, offload_experts)
    config = preset(config) if isinstance(config, str) else config
    dtype = dtype or torch.float32
    if quantize is not None:
        check_supported(quantize, device, dtype)
    check_memory(config, dtype, device, weights=True, batch_size=1, force=force, quantize=quantize)
    model = init_weights(DiffusionGemma(config, impl=impl))
    model = quantize_model(model.to(dtype=dtype, device=device).eval(), quantize)
    model.generation_config = GenerationConfig.for_model(model.config)
    return _offload_to_temp_file(model, offload_experts)


def _offload_to_temp_file(model: DiffusionGemma, offload: bool) -> DiffusionGemma:
    """`offload_experts` for a model built in memory: its experts written to a temporary file (removed at exit) and
    memory-mapped from there."""
    if offload:
        folder = tempfile.mkdtemp(prefix="dgemma-experts-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        offload_experts(model, Path(folder) / "experts.safetensors")
    return model


def init_weights(model: DiffusionGemma, seed: int = 0, std: float = 0.02) -> DiffusionGemma:
    """Random initialisation for from-scratch models and tests: normal(0, std) linears and embeddings, unit norms,
    experts scaled by fan-in. Deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("gate_up_proj", "down_proj")) and p.ndim == 3:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
