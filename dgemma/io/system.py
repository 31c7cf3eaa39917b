"""The machine a run is on: free and peak memory (Linux /proc, or CUDA's counters), and a description of the host
for benchmark reports. One reader of /proc's `Key: value kB` files for the trainer's pre-flight and `dgemma bench`."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def proc_bytes(path: str, key: str) -> int | None:
    """The `key:` line of a /proc file whose values are in kB (/proc/meminfo, /proc/self/status), in bytes; None
    where the file or the key is missing (not Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a run: CUDA's free memory, or MemAvailable of /proc/meminfo; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return proc_bytes("/proc/meminfo", "MemAvailable")


def reset_peak_memory(device: str) -> None:
    """Start a new peak: CUDA's allocator statistics, or the process's resident-set high-water mark (Linux)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:  # Linux: resets VmHWM
        f.write("5")


def peak_memory(device: str) -> int | None:
    """Bytes: CUDA's peak allocated, or the peak resident set since `reset_peak_memory` (VmHWM)."""
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    peak = proc_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    import resource  # not Linux: the process's lifetime peak (an upper bound)

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "threads": torch.get_num_threads(),
                            "cpu": cpu_model(), "cores": os.cpu_count()}
    with contextlib.suppress(OSError):
        info["load_average"] = list(os.getloadavg())
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # without the seconds an import takes
        info["transformers"] = importlib.metadata.version("transformers")
    return info


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_commit() -> str:
    """The commit of the dgemma checkout that runs (with +dirty for uncommitted changes), or "unknown"."""
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


__all__ = ["available_memory", "cpu_model", "git_commit", "machine_info", "peak_memory", "proc_bytes",
           "reset_peak_memory"]
