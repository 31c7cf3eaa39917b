"""How many CPU threads a run uses, and how they wait: the one choice for the CLI, the server, the demo and the tests.

Two mechanisms, because a busy machine breaks torch's defaults in two ways:

- **How idle threads wait.** torch's CPU wheels use GNU OpenMP (libgomp), whose threads spin for ~300,000 rounds
  waiting for each other before they sleep. Beside other work a spinning thread holds a core that the thread it waits
  for needs: on a 2-core machine with two busy processes a matmul loop took 18-30 s on two threads against 2 s on one.
  `bound_spin()` caps the spin (GOMP_SPINCOUNT=BOUNDED_SPIN): long enough to catch the next op of a busy step (the
  quiet speed), short enough to yield the core soon on a loaded machine. OpenMP reads it once, when torch's runtime
  loads, so `dgemma/__init__.py` calls it before anything imports torch (and child processes inherit it). A user's own
  OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME wins: then nothing is set.
- **How many threads.** `usable_cores()`: the cores this process may run on (its affinity: a container's or taskset's
  share), the same count whatever else runs, unless `--threads N` says otherwise; the server keeps one of them for
  its HTTP loop. A count read from the load average was tried and dropped: the same command then computed with
  another thread count from one run to the next (so other numerics: a resume on one thread is not bit-identical to
  a run on two), and the 1-minute average lags, so a command started just after another ran on one thread on a
  quiet machine (cpu-tiny training at 770 instead of 1,295 tokens/s). The bounded spin is what keeps two threads
  from collapsing beside other work (docs/benchmarks.md, "Threads on a busy machine").

This module imports no torch (it must run before torch loads)."""

from __future__ import annotations

import os

# libgomp's rounds of spinning before an idle thread sleeps; its default is 300,000 (OMP_WAIT_POLICY=PASSIVE: 0,
# which made the quiet demo 1.7x slower; ACTIVE: 30 billion). runs/bench_threads.py measures the choice.
BOUNDED_SPIN = 10_000
USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def bound_spin(environ: dict[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT=BOUNDED_SPIN in `environ` (os.environ) unless the user set any of USER_SETTINGS; whether it
    was set. Effective only before torch is first imported in this process (and in every child started after)."""
    env = os.environ if environ is None else environ
    if any(name in env for name in USER_SETTINGS):
        return False
    env["GOMP_SPINCOUNT"] = str(BOUNDED_SPIN)
    return True


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share), else cpu_count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


__all__ = ["BOUNDED_SPIN", "USER_SETTINGS", "bound_spin", "usable_cores"]
