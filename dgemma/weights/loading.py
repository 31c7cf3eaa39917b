"""The model loader of the library and of every subcommand: a checkpoint, a training run or a LoRA adapter (merged
into its base), or a preset with random weights, optionally quantized (dgemma/weights/quantize.py) or with its experts
offloaded (dgemma/weights/offload.py), and the generation settings that travel beside it (`load_generation_config`).
`dgemma.load_model`, `dgemma.load_generation_config` and `dgemma.build_model` are these functions; the CLI calls
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
from dgemma.model.costs import check_memory
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.weights import checkpoint, lora, offload
from dgemma.weights.offload import check_combination, offload_experts
from dgemma.weights.quantize import check_supported, quantize_model, streaming_loader

# The dtype names every command takes (--dtype), and what they load as.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(path: str | os.PathLike[str], dtype: torch.dtype | None = None,
               device: torch.device | str | None = None, impl: Impl = "reference", force: bool = False,
               quantize: str | None = None, offload_experts: bool = False,
               base: str | os.PathLike[str] | None = None) -> DiffusionGemma:
    """A model from `path`: a checkpoint directory in the Hugging Face layout, a training run (its newest complete
    checkpoint), or a LoRA adapter or LoRA run, merged into its base (`base`, default adapter_config.json's
    base_model_name_or_path), then quantized or offloaded. Its generation settings: `load_generation_config(path)`.
    Problems raise `CheckpointError` (AdapterError for an adapter); weights that do not fit in free memory raise
    `MemoryPreflightError` (before anything is allocated) unless `force`. `dtype` defaults to the checkpoint's.
    `quantize="int8"|"int4"`: weight-only quantization with torchao (`pip install 'dgemma[quant]'`, each tensor
    quantized as it is read: dgemma/weights/quantize.py); `offload_experts=True`: the routed experts stay in the
    checkpoint's file (CPU, memory-mapped) or pinned host memory (CUDA), read per layer (dgemma/weights/offload.py).
    The two do not combine."""
    check_combination(quantize, offload_experts)
    path = checkpoint.resolve_model_dir(path)
    if lora.is_adapter(path):
        model = _load_checkpoint(lora.base_of(path, lora.read_config(path), base), dtype, device, impl, force)
        lora.load_adapter(model, path)
        model = lora.merge(model).eval()
        return _offload_to_temp_file(quantize_model(model, quantize), offload_experts)
    return _load_checkpoint(path, dtype, device, impl, force, quantize, offload_experts)


def _load_checkpoint(path: Path, dtype: torch.dtype | None, device: torch.device | str | None, impl: Impl,
                     force: bool, quantize: str | None = None, offload_experts: bool = False) -> DiffusionGemma:
    """A whole checkpoint directory, with the memory pre-flight once its config and dtype are known; quantized or
    offloaded as each tensor is read."""
    dev = torch.device(device or "cpu")

    def preflight(config: ModelConfig, dt: torch.dtype) -> None:
        if quantize is not None:
            check_supported(quantize, dev, dt)
        check_memory(config, dt, dev, weights=True, force=force, quantize=quantize, offload_experts=offload_experts)

    stream = streaming_loader(quantize) if quantize else offload.streaming_loader() if offload_experts else None
    return checkpoint.load(path, lambda config: DiffusionGemma(config, impl=impl), dtype=dtype, device=device,
                           preflight=preflight, stream=stream)


def load_generation_config(path: str | os.PathLike[str], base: str | os.PathLike[str] | None = None
                           ) -> GenerationConfig:
    """The generation settings of what `load_model(path, base=base)` loads: the checkpoint's generation_config.json
    (a training run: its newest checkpoint's); for a LoRA adapter, the adapter's own (a fine-tuning run writes one:
    it stops at the chat template's end-of-turn token), else its base's. Without one, transformers' defaults with the
    model's special tokens (`GenerationConfig.for_model`). The settings travel beside the model: pass them to
    `generate(..., generation_config=)`, the engine, the server."""
    path = checkpoint.resolve_model_dir(path)
    if lora.is_adapter(path):
        base_dir = lora.base_of(path, lora.read_config(path), base)
        config = checkpoint.read_model_config(base_dir)
        found = checkpoint.read_generation_config(path, config) or checkpoint.read_generation_config(base_dir, config)
    else:
        config = checkpoint.read_model_config(path)
        found = checkpoint.read_generation_config(path, config)
    return found or GenerationConfig.for_model(config)


def build_model(config: ModelConfig | str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                impl: Impl = "reference", force: bool = False, quantize: str | None = None,
                offload_experts: bool = False) -> DiffusionGemma:
    """A model with random weights (`init_weights`) of `config` or of the preset it names, in eval mode (its
    generation settings: `GenerationConfig.for_model(model.config)`). The memory pre-flight runs before anything is
    built (weights and one canvas's sampler buffers); `quantize` / `offload_experts` as `load_model` (the experts go
    to a temporary file, removed at exit)."""
    check_combination(quantize, offload_experts)
    config = preset(config) if isinstance(config, str) else config
    dtype = dtype or torch.float32
    if quantize is not None:
        check_supported(quantize, device, dtype)
    check_memory(config, dtype, device, weights=True, batch_size=1, force=force, quantize=quantize)
    model = init_weights(DiffusionGemma(config, impl=impl))
    model = quantize_model(model.to(dtype=dtype, device=device).eval(), quantize)
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
