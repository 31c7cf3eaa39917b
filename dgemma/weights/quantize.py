"""Weight-only int8 / int4 quantization with torchao (the `quant` extra), chosen when a model is loaded:
`dgemma.load_model(path, quantize="int8")`, `--quantize int8` on the commands that load a model.

What is quantized (`model/costs.py:quantized_matrices` counts the same set, so the memory pre-flight and
`dgemma inspect --quantize` agree with what is built):

    every linear projection     attention q/k/v/o, the dense MLP, the self-conditioning MLP (or Lite's projection)
    the routed experts          the 3-D `gate_up_proj` (E, 2*Ie, D) and `down_proj` (E, D, Ie)
    kept in the model dtype     the embedding, which is also the tied, softcapped head and the self-conditioning
                                product p @ E (one table serves all three; it is 2.9% of the 26B-A4B's weights and
                                decides every draw and entropy); the router (a discrete top-k: a rounding can swap
                                an expert); norms, scalars, the Lite time projection

    int8   torchao `Int8Tensor`, symmetric, one scale per output row (per expert and row for the 3-D experts, which
           torchao quantizes whole; `w[e]` is a 2-D `Int8Tensor`). Any device, fp32 or bf16 activations.
    int4   torchao `Int4TilePackedTo4dTensor` (tinygemm: CUDA, bf16, compute capability >= 8.0), asymmetric, a scale
           and zero per group of `costs.INT4_GROUP` inputs. Its tensors are 2-D only, so each expert matrix is
           quantized on its own and `ExpertMatrices` holds them (indexable like the 3-D tensor). Refused with a
           `QuantizationError` where torchao has no int4 kernel (the CPU, in torchao 0.18).

The forward code does not change: `F.linear(x, w)` and `w[e]` dispatch to torchao's kernels, so the readable
expert loop (`model.Experts.forward`) and the fast path's sorted-expert dispatch (`kernels.moe_experts`, its "loop"
and "padded" backends) run the quantized weights as they are; only the grouped matmul needs plain tensors.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from dgemma.io import quiet
from dgemma.model.costs import INT4_GROUP, QUANTIZE_MODES

INSTALL_HINT = "pip install 'dgemma[quant]'"
QUANTIZED_TENSORS = {"Int8Tensor": "int8", "Int4TilePackedTo4dTensor": "int4"}  # torchao's tensor type -> mode


class QuantizationError(ValueError):
    """A quantization mode this install or device cannot run; the message says why and what to do instead."""


def check_mode(mode: str | None, flag: str = "quantize") -> None:
    if mode is not None and mode not in QUANTIZE_MODES:
        raise QuantizationError(f"{flag} must be one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")


def torchao_version() -> str | None:
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def _torchao() -> Any:
    """torchao.quantization, imported on first use, without the import-time noise of torchao and torch that does not
    concern weight-only quantization (dgemma/io/quiet.py)."""
    if torchao_version() is None:
        raise QuantizationError(f"quantization needs torchao, the quant extra: {INSTALL_HINT}")
    try:
        with quiet.optional_imports():
            import torchao.quantization as tq  # optional dependency, imported when used
    except Exception as e:  # an install that does not match torch
        raise QuantizationError(f"torchao {torchao_version()} does not import with torch {torch.__version__} ({e}); "
                                f"install the pinned version: {INSTALL_HINT}") from None
    return tq


def check_supported(mode: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """Refuse (QuantizationError) a mode torchao has no kernel for on `device` in `dtype`, before any weight is
    loaded. int4 runs torchao's tinygemm kernel: CUDA, bfloat16, compute capability 8.0 or newer."""
    check_mode(mode)
    device = torch.device(device)
    if mode == "int8":
        _torchao()
        return
    where = f"{device.type}" + (f" (compute capability {torch.cuda.get_device_capability(device)})"
                                if device.type == "cuda" else "")
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        raise QuantizationError(
            f"--quantize int4: torchao {torchao_version()} has no int4 weight-only kernel for {where} (its int4 "
            "layout, tinygemm, runs on CUDA GPUs of compute capability 8.0 or newer); use --quantize int8 here")
    if dtype != torch.bfloat16:
        raise QuantizationError(f"--quantize int4 runs in bfloat16 (torchao's tinygemm kernel), not "
                                f"{str(dtype).removeprefix('torch.')}: add --dtype bfloat16")
    _torchao()


class ExpertMatrices(nn.Module):
    """E quantized 2-D matrices standing in for a 3-D expert tensor (E, out, in): `m[e]` is expert e's matrix and
    `m.shape` the 3-D shape, which is all the expert loops read."""

    def __init__(self, matrices: list[Tensor], shape: tuple[int, int, int]):
        super().__init__()
        self.matrices = nn.ParameterList([nn.Parameter(m, requires_grad=False) for m in matrices])
        self.shape = torch.Size(shape)

    def __getitem__(self, e: int) -> Tensor:
        return self.matrices[e]

    def __len__(self) -> int:
        return self.shape[0]


def quantize_weight(w: Tensor, mode: str) -> Tensor | ExpertMatrices:
    """A 2-D linear weight (out, in) or a 3-D expert tensor (E, out, in), quantized on its device."""
    tq = _torchao()
    w = w.detach()
    if mode == "int8":  # 2-D and 3-D alike: one scale per (expert and) output row
        return tq.Int8Tensor.from_hp(w, granularity=tq.PerRow())
    if mode == "int4":
        one = lambda m: tq.Int4TilePackedTo4dTensor.from_hp(m.contiguous(), block_size=[1, INT4_GROUP])
        if w.ndim == 3:
            return ExpertMatrices([one(w[e]) for e in range(w.shape[0])], tuple(w.shape))
        return one(w)
    check_mode(mode)
    raise AssertionError(mode)


def quantized_names(model: nn.Module) -> Iterator[str]:
    """State-dict names of the tensors `quantize_model` replaces (see the module docstring): the weight of every
    nn.Linear but the router's and the time projection, and the experts' two 3-D tensors."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if not name.endswith(("router.proj", "time_proj")):
                yield f"{name}.weight"
        elif isinstance(getattr(module, "gate_up_proj", None), (Tensor, ExpertMatrices)):  # model.Experts
            yield f"{name}.gate_up_proj"
            yield f"{name}.down_proj"


def _set(model: nn.Module, name: str, value: Tensor | ExpertMatrices) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    module._parameters.pop(attr, None)
    if isinstance(value, nn.Module):
        setattr(module, attr, value)
    else:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)


def replace(module: nn.Module, name: str, mode: str) -> None:
    """Quantize the parameter `name` of `module` in place (its float tensor is dropped)."""
    _set(module, name, quantize_weight(module.get_parameter(name), mode))


def quantization_of(model: nn.Module) -> str | None:
    """"int8" or "int4" when `model`'s weights are quantized (what its parameters are: torchao's tensor types), else
    None. A fact about the module tree, so nothing needs to remember it."""
    for p in model.parameters():
        for cls in type(p).__mro__:
            if cls.__name__ in QUANTIZED_TENSORS:
                return QUANTIZED_TENSORS[cls.__name__]
    return None


def quantize_model(model: nn.Module, mode: str | None) -> nn.Module:
    """Quantize a built model in place (random weights, a model already in memory); returns it. Loading with
    `load_model(..., quantize=)` instead quantizes each tensor as it is read (`streaming_loader`), so the model
    never exists whole in its float dtype."""
    if mode is None:
        return model
    check_supported(mode, model.embed_tokens.weight.device, model.embed_tokens.weight.dtype)
    for name in list(quantized_names(model)):
        replace(model, name, mode)
    return model


def streaming_loader(mode: str) -> tuple[Callable[[nn.Module], set[str]], Callable[..., None]]:
    """The two hooks of `checkpoint.load` for a quantized load: which state-dict names to stream (left unallocated),
    and how to place one of them: cast the checkpoint tensor to the model's dtype and device, quantize it there,
    put it in the model (its float copy is then dropped). Peak memory: the quantized model plus one float tensor."""

    def names(model: nn.Module) -> set[str]:
        return set(quantized_names(model))

    def place(model: nn.Module, name: str, read: Callable[[], Tensor], *_: Any) -> None:
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
        _set(model, name, quantize_weight(read().to(device=device, dtype=dtype), mode))

    return names, place


def storage_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers occupy, a quantized tensor counted by the tensors it holds (its
    data, scales and zeros), each storage once."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: Tensor) -> None:
        nonlocal total
        inner = getattr(type(t), "tensor_data_names", None) if type(t) not in (Tensor, nn.Parameter) else None
        if inner:
            for n in inner:
                add(getattr(t, n))
            return
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for t in (*model.parameters(), *model.buffers()):
        add(t)
    return total

