"""How dgemma's CPU threads wait and how many there are (dgemma/io/threads.py): OpenMP's spin is bounded before torch
loads, a user's own setting wins, and the default thread count is the cores the process may use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgemma.io.threads import BOUNDED_SPIN, USER_SETTINGS, usable_cores

ROOT = Path(__file__).resolve().parents[2]


# In the child: GOMP_SPINCOUNT at the moment `import torch` first runs (when OpenMP reads it), seen by a finder that
# looks on and finds nothing.
WHEN_TORCH_LOADS = """
import os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
sys.meta_path.insert(0, Watch())
import dgemma
print(seen[0])
"""


def spin_setting_when_torch_loads(**env: str) -> str:
    """GOMP_SPINCOUNT as `import dgemma` in a fresh process has it when torch loads."""
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS} | {"PYTHONPATH": str(ROOT)} | env
    out = subprocess.run([sys.executable, "-c", WHEN_TORCH_LOADS], env=clean, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_dgemma_bounds_the_openmp_spin_before_torch_loads():
    # dgemma/__init__ sets it before its first torch import; a child process (the demo's trainers, `python -m
    # dgemma` from a test) inherits it.
    assert spin_setting_when_torch_loads() == str(BOUNDED_SPIN)


@pytest.mark.parametrize("setting", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "123"),
                                     ("KMP_BLOCKTIME", "0")])
def test_a_users_own_wait_setting_wins(setting):
    name, value = setting
    expected = value if name == "GOMP_SPINCOUNT" else "None"
    assert spin_setting_when_torch_loads(**{name: value}) == expected


def test_the_default_thread_count_is_the_usable_cores_whatever_the_load(monkeypatch):
    """The same count on a quiet and on a busy machine (a load-dependent count changed the numerics run to run)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for load in ((0.0, 0.0, 0.0), (64.0, 64.0, 64.0)):
        monkeypatch.setattr("os.getloadavg", lambda load=load: load)
        assert usable_cores() == cores

