"""Expert offload: the routed experts' weights (22.8B of the 26B-A4B's 25.3B parameters) stay out of the compute
device's memory and are brought in layer by layer, only the experts a canvas touches.

    CPU    the experts stay in a safetensors file, memory-mapped: an expert's pages are read from the file (or the
           page cache) when its matmul first touches them, and the OS may evict them again under memory pressure,
           so a model larger than RAM still runs (what llama.cpp's mmap does).
    CUDA   the experts stay in pinned host memory; when a layer's router has picked its experts, `fetch` copies the
           touched ones to the GPU on a side stream, one event per expert, and the expert loop waits only for the
           expert it is about to multiply, so copies overlap the matmuls of the experts before it. The next layer's
           experts are not prefetched: they are known only once its router has run.

`OffloadedExperts` stands in for a 3-D expert tensor (E, out, in), as `quantize.ExpertMatrices` does: `w[e]` and
`w.shape` are all the expert loops read (`model.Experts.forward`, `kernels.moe_experts` "loop" and "padded"), and
the kernels call `fetch(touched)` first when it exists. Results are bit-identical to the in-memory model (same
tensors, same kernels): tests/weights/test_quantize.py checks it. Whether and where a model's experts are offloaded is
read off its modules (`offloaded_to`); `check_combination` is the one rule of what combines with offload,
quantization and torch.compile.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from dgemma.io import fsio
from dgemma.weights.quantize import quantization_of

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class OffloadedExperts(nn.Module):
    """E expert matrices kept in host storage (`host`, (E, out, in): a memory-mapped file on CPU, pinned memory for
    CUDA), handed to the expert loop one expert at a time on `device`."""

    def __init__(self, host: Tensor, device: torch.device | str, mapping: np.memmap | None = None,
                 file: str | os.PathLike[str] | None = None):
        super().__init__()
        self.host, self.device, self._mapping = host, torch.device(device), mapping
        # where the experts live: the mapped file, else host memory (pinned for CUDA)
        self.location = str(file) if mapping is not None else "pinned host memory" if host.is_pinned() \
            else "host memory"
        self.shape = host.shape
        self.dtype = host.dtype
        self._fetched: dict[int, tuple[Tensor, torch.cuda.Event]] = {}

    def __len__(self) -> int:
        return self.shape[0]

    def fetch(self, experts: list[int]) -> None:
        """Start copying these experts to the device (CUDA; on CPU the mapping is read in place)."""
        if self.device.type != "cuda":
            return
        self._fetched.clear()
        copy_stream = _copy_stream(self.device)
        copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(copy_stream):
            for e in experts:
                w = self.host[e].to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(copy_stream)
                self._fetched[e] = (w, event)

    def __getitem__(self, e: int) -> Tensor:
        if self.device.type != "cuda":
            return self.host[e]  # a view into the mapping: the OS pages it in
        if e not in self._fetched:  # the readable loop, which does not fetch ahead: a plain copy
            return self.host[e].to(self.device)
        w, event = self._fetched.pop(e)
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        w.record_stream(stream)  # allocated on the copy stream, used (and freed) on this one
        return w

    def evict(self) -> None:
        """Drop this tensor's pages from the process and the page cache (CPU mapping): the next read comes from the
        file. What `dgemma bench --offload-experts` uses to measure a cold read."""
        if self._mapping is None:
            return
        mm = self._mapping._mmap  # numpy keeps the mmap object here
        if mm is not None and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED)
        fd = os.open(self._mapping.filename, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def map_safetensors(path: str | os.PathLike[str], key: str) -> tuple[Tensor, np.memmap]:
    """Tensor `key` of a safetensors file as a read-only-in-practice view into a copy-on-write memory mapping (no
    byte is read until used). Raises ValueError if the key is missing or its bytes are not aligned to its dtype."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    if key not in header:
        raise ValueError(f"{path}: no tensor {key!r}")
    info = header[key]
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: tensor {key!r} is {info['dtype']}, not one of {', '.join(_DTYPES)}")
    start, end = (8 + n + o for o in info["data_offsets"])
    if start % torch.empty((), dtype=dtype).element_size():
        raise ValueError(f"{path}: tensor {key!r} is not aligned to its dtype in the file")
    mapping = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(end - start,))
    flat = torch.from_numpy(mapping)  # shares the mapping
    return flat.view(dtype).view(info["shape"]), mapping


def check_combination(quantize: str | None, offload_experts: bool, compile: bool = False) -> None:
    """The one rule of what combines, checked wherever a combination is asked for (loading, `dgemma bench`): quantized
    weights and offloaded experts do not (torchao's tensors cannot be memory-mapped from the checkpoint's file), and
    torch.compile takes neither (the compiled step's expert op reads plain tensors). ValueError naming both."""
    if quantize is not None and offload_experts:
        raise ValueError(f"quantize={quantize!r} (--quantize) and offload_experts (--offload-experts) do not "
                         "combine: pick one")
    if compile and (quantize is not None or offload_experts):
        what, flag = (f"a model quantized to {quantize}", "--quantize") if quantize else ("offloaded experts",
                                                                                       "--offload-experts")
        raise ValueError(f"compile=True (--compile) does not take {what}: the compiled step's expert op reads plain "
                         f"tensors; drop one of --compile and {flag}")


def offloaded_to(model: nn.Module) -> str | None:
    """Where `model`'s routed experts live when they are offloaded (the mapped file, or host memory), else None."""
    return next((m.location for m in model.modules() if isinstance(m, OffloadedExperts)), None)


def expert_names(model: nn.Module) -> list[str]:
    return [f"{name}.{p}" for name, m in model.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), Tensor) for p in ("gate_up_proj", "down_proj")]


def offload_experts(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Move every routed expert tensor of `model` out of its memory: written once to the safetensors file `path` (in
    the model dtype) and memory-mapped (CPU), or kept in pinned host memory (CUDA). Returns the model."""
    names = expert_names(model)
    if not names:
        raise ValueError("--offload-experts: this model has no routed experts (a dense model)")
    check_combination(quantization_of(model), True)
    device = model.embed_tokens.weight.device
    path = Path(path)
    if device.type == "cpu":
        tensors = {n: model.get_parameter(n).detach().contiguous() for n in names}
        fsio.atomic_write(path, lambda tmp, _f: save_file(tensors, str(tmp)))
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        w = module._parameters.pop(attr)
        if device.type == "cpu":
            host, mapping = map_safetensors(path, name)
        else:
            host, mapping = w.detach().to("cpu").pin_memory(), None
        setattr(module, attr, OffloadedExperts(host, device, mapping, path))
        del w
    return model


def streaming_loader() -> tuple[Callable[[nn.Module], set[str]], Callable[..., None]]:
    """`checkpoint.load`'s hooks for `load_model(..., offload_experts=True)`: the expert tensors are never allocated.
    On CPU, a tensor stored in the model dtype is mapped straight from the checkpoint's file (nothing is read, and the
    finiteness check of loading is skipped for it); otherwise it is read and kept in host memory (pinned for CUDA)."""

    def names(model: nn.Module) -> set[str]:
        return set(expert_names(model))

    def place(model: nn.Module, name: str, read: Callable[[], Tensor], file: Path, key: str) -> None:
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        module._parameters.pop(attr)
        host, mapping = None, None
        if device.type == "cpu":
            with contextlib.suppress(ValueError):
                host, mapping = map_safetensors(file, key)
            if host is not None and host.dtype != dtype:
                host, mapping = None, None
        if host is None:
            host = read().to(dtype)
            host = host.pin_memory() if device.type == "cuda" else host
        setattr(module, attr, OffloadedExperts(host, device, mapping, file))

    return names, place


def evict(model: nn.Module) -> None:
    """`OffloadedExperts.evict` for every offloaded tensor of `model`."""
    for m in model.modules():
        if isinstance(m, OffloadedExperts):
            m.evict()
