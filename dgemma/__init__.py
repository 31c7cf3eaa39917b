"""dgemma: uniform-state block-diffusion language models (DiffusionGemma) in pure PyTorch."""
# ruff: noqa: E402 (the imports after bound_spin() load torch)

# Before anything imports torch: OpenMP reads how its idle threads wait once, when torch's runtime loads
# (dgemma/io/threads.py; a user's own OMP_WAIT_POLICY / GOMP_SPINCOUNT / KMP_BLOCKTIME wins).
from dgemma.io.threads import bound_spin

bound_spin()

from dgemma.model.config import PRESETS, ConfigError, ModelConfig, RopeConfig, preset
from dgemma.model.costs import MemoryPreflightError
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.model.kv_cache import KVCache
from dgemma.sampling.generate import GenerationResult, generate
from dgemma.sampling.generation_config import GenerationConfig, GenerationError
from dgemma.weights.checkpoint import CheckpointError, save_pretrained
from dgemma.weights.loading import build_model, init_weights, load_generation_config, load_model

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CheckpointError",
    "ConfigError",
    "DiffusionGemma",
    "GenerationConfig",
    "GenerationError",
    "GenerationResult",
    "KVCache",
    "MemoryPreflightError",
    "ModelConfig",
    "RopeConfig",
    "build_model",
    "generate",
    "init_weights",
    "load_generation_config",
    "load_model",
    "preset",
    "save_pretrained",
]
