"""Many LoRA adapters on one base model, chosen per batch row: `AdapterSet` loads peft adapter directories (the
`dgemma finetune` format, dgemma/weights/lora.py) for a base model without touching its weights, and stacks their
factors per adapted weight; `AdapterSet.rows(names)` says which adapter each row of one pass runs:

    adapters = AdapterSet(model, {"support": "runs/support-lora", "legal": "runs/legal-lora"})
    rows = adapters.rows(["support", None, "legal", "support"])     # None: the base model for that row
    model.commit(ids, caches, adapters=rows)
    logits = model.denoise(canvas, caches, adapters=rows)

Each adapter is read with peft's own reading of its config (its scale alpha / r, or alpha / sqrt(r) with
`use_rslora`, and its `rank_pattern` / `alpha_pattern`): peft wraps a model built on the meta device (no memory), and
the file's tensors are checked against that model's (`lora.read_weights`: the key, the file and the shapes of
anything that does not fit). The deltas are computed per row (dgemma/model/adapter_rows.py); a row without an adapter
computes exactly what the base does.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dgemma.model.adapter_rows import AdapterRows, Factors
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.weights import lora
from dgemma.weights.lora import AdapterError
from dgemma.weights.offload import offloaded_to
from dgemma.weights.quantize import quantization_of

Pair = tuple[Tensor, Tensor]  # one adapter's (A, B) of one weight, the scale folded into B

__all__ = ["AdapterError", "AdapterNameError", "AdapterRows", "AdapterSet", "check_name", "read_factors"]


class AdapterNameError(AdapterError):
    """An adapter name that is not a safe name (`check_name`) or is already taken."""


def read_factors(model: DiffusionGemma, path: str | os.PathLike[str]) -> dict[tuple[int, str], Pair]:
    """The LoRA factors of the adapter directory `path` for `model`, by (layer, weight): a projection's A (r, in)
    and B (out, r), an expert parameter's A (E, r, in) and B (E, out, r), B times peft's scale, in the model's dtype
    and device. AdapterError naming the file, key and shapes for an adapter that does not fit the model."""
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory; a LoRA adapter is a directory with {lora.CONFIG} and "
                           f"{lora.WEIGHTS}")
    config = lora.read_config(path)
    with torch.device("meta"):
        meta = DiffusionGemma(model.config)
    lora._check_rank(meta, config, path / lora.CONFIG)
    if config.target_parameters and (quantization_of(model) or offloaded_to(model)):
        raise AdapterError(f"{path / lora.CONFIG}: field 'target_parameters' = {config.target_parameters!r}: an "
                           "adapter on the routed experts needs plain expert weights, not quantized or offloaded ones")
    lora.attach(meta, config)
    tensors = lora.read_weights(meta, path)
    factors = {}
    for name, module in meta.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        A, B = (tensors[f"{name}.lora_{x}.default.weight"] for x in "AB")
        layer = int(name.split(".")[1])  # layers.<i>.self_attn.q_proj, layers.<i>.experts(.base_layer)
        if isinstance(module, ParamWrapper):  # peft's layout of a 3-D (E, out, in) parameter's factors
            E = module.num_experts
            target = "experts." + module.parameter_name
            A, B = A.reshape(E, -1, A.shape[-1]), B.reshape(B.shape[0], -1, E).permute(2, 0, 1)
        else:
            target = name.rsplit(".", 1)[1]
        scale = module.scaling["default"]
        scaled = (B.to(torch.float32) * scale).to(model.dtype)
        if not bool(torch.isfinite(scaled).all()):  # the tensors are finite (read_weights): the scale is too large
            field = "lora_alpha" if scale == _scale(config, config.r, config.lora_alpha) else "alpha_pattern"
            raise AdapterError(f"{path / lora.CONFIG}: field {field!r}: the scale {scale:g} of {name} (alpha / r) "
                               f"makes its LoRA update non-finite in {str(model.dtype).removeprefix('torch.')}")
        factors[(layer, target)] = (A.to(model.dtype).to(model.device).contiguous(),
                                    scaled.to(model.device).contiguous())
    return factors


def _scale(config: Any, r: int, alpha: float) -> float:
    """peft's scale of a LoRA update: alpha / r, or alpha / sqrt(r) with use_rslora."""
    return alpha / math.sqrt(r) if config.use_rslora else alpha / r


NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")  # an adapter's name: what clients send as "model"


def check_name(name: object) -> str:
    """`name` if it is a safe adapter name (1 to 64 of A-Z a-z 0-9 . _ -, not starting with '.'), else
    AdapterNameError naming it."""
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else f"{name[:40]!r}... ({len(name)} chars)"
        raise AdapterNameError(f"adapter name must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-', not "
                               f"starting with '.', got {shown}")
    return name


class AdapterSet:
    """Named LoRA adapters of one base `model`, stacked for per-row passes (`rows`). `adapters`: name -> adapter
    directory (or (name, directory) pairs), loaded in order. `add` and `remove` may run on any thread while passes
    run on another: a pass's `rows` reads one consistent snapshot of the set (swapped whole on a change), and an
    adapter's file is read before the set is locked."""

    def __init__(self, model: DiffusionGemma, adapters: Mapping[str, str | os.PathLike[str]] |
                 Iterable[tuple[str, str | os.PathLike[str]]] = ()):
        self.model = model
        self._factors: dict[str, dict[tuple[int, str], Pair]] = {}
        self._paths: dict[str, Path] = {}
        self._lock = threading.Lock()
        self._snapshot: tuple[dict[str, int], dict[tuple[int, str], Factors]] = ({}, {})  # name -> index, stacks
        for name, path in adapters.items() if isinstance(adapters, Mapping) else adapters:
            self.add(name, path)

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters' names, in the order of their index in `AdapterRows`."""
        return tuple(self._snapshot[0])

    def path(self, name: str) -> Path:
        return self._paths[self._known(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._snapshot[0]

    def __len__(self) -> int:
        return len(self._snapshot[0])

    def add(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the adapter in directory `path` under `name` (`check_name`: a safe name, not already in the set)."""
        check_name(name)
        self._free(name, path)
        factors = read_factors(self.model, path)  # the slow part, outside the lock
        with self._lock:
            self._free(name, path)
            self._factors[name], self._paths[name] = factors, Path(path)
            self._publish()

    def remove(self, name: str) -> None:
        """Drop adapter `name`; rows built before (`rows`) keep the factors they were built with."""
        with self._lock:
            self._known(name)
            del self._factors[name], self._paths[name]
            self._publish()

    def _free(self, name: str, path: str | os.PathLike[str]) -> None:
        if name in self._factors:
            raise AdapterNameError(f"adapter name {name!r} is already taken (by {self._paths[name]}); give {path} "
                               "another name")

    def _publish(self) -> None:
        """A new snapshot of the set for `rows` (one assignment: a reader sees the old one or the new one)."""
        self._snapshot = ({n: i for i, n in enumerate(self._factors)}, self._stack())

    def rows(self, names: Sequence[str | None]) -> AdapterRows | None:
        """Which adapter each row of a pass runs, by name (None: the base model); None when no row has one, which
        makes the pass the base model's own."""
        if all(n is None for n in names):
            return None
        order, stacks = self._snapshot
        return AdapterRows(stacks, [-1 if n is None else order[self._known(n, order)] for n in names])

    def _known(self, name: str, names: Iterable[str] | None = None) -> str:
        names = self._factors if names is None else names
        if name not in names:
            have = ", ".join(repr(n) for n in names) or "none"
            raise AdapterError(f"no adapter named {name!r} (loaded: {have})")
        return name

    def _stack(self) -> dict[tuple[int, str], Factors]:
        """Each adapted weight's factors over all adapters (`Factors`): zero-padded to the largest rank, zeros for
        an adapter that leaves the weight alone."""
        stacks = {}
        per_adapter = list(self._factors.values())
        for key in sorted({k for f in per_adapter for k in f}):
            pairs = [f.get(key) for f in per_adapter]
            A0, B0 = next(p for p in pairs if p is not None)
            r = max(p[0].shape[-2] for p in pairs if p is not None)
            n = len(pairs)
            A = A0.new_zeros(n, *A0.shape[:-2], r, A0.shape[-1])
            B = B0.new_zeros(n, *B0.shape[:-1], r)
            for a, p in enumerate(pairs):
                if p is not None:
                    A[a, ..., :p[0].shape[-2], :] = p[0]
                    B[a, ..., :p[1].shape[-1]] = p[1]
            stacks[key] = Factors(A, B, tuple(p is not None for p in pairs))
        return stacks
