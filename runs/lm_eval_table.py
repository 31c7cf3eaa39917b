"""The lm-evaluation-harness table of docs/evaluation.md section 8: dgemma's two local tasks on the demo's AR baseline
and diffusion model, natively (`dgemma.eval.lm_eval_model`, the default bound), and the multiple-choice task through
`dgemma serve` with stock lm-eval `local-completions` beside the native model's bound=prompt (the server's bound: the
two must agree item by item). Accuracies with lm-eval's standard error over items.

    python runs/lm_eval_table.py --demo dgemma-demo --out runs/out/lm-eval    # after dgemma demo: all 150 items
    python runs/lm_eval_table.py --smoke                                      # two 2-step tiny runs, 4 items: seconds

Prints the markdown table and writes OUT/lm_eval_table.json (every figure and the settings behind it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import Server

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("dgemma_shakespeare_next_line", "dgemma_shakespeare_speaker")
# the server's bound, T and t-samples, local-completions' seed, and no context cut short of the model's positions
SERVER_BOUND = "bound=prompt,nelbo_steps=16,t_samples=4,seed=1234,max_length=1048576"


def evaluate(model: str, model_args: str, tasks: list[str], limit: int | None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import dgemma.eval.lm_eval_model  # noqa: F401  (registers `dgemma`)

    r = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, limit=limit,
                                task_manager=TaskManager(include_path=str(ROOT / "dgemma" / "eval" / "lm_eval_tasks")))
    return r["results"]


def figures(run: Path, limit: int | None, server: bool) -> dict:
    out = {"native": evaluate("dgemma", f"pretrained={run}", list(TASKS), limit)}
    if server:
        out["native_prompt_bound"] = evaluate("dgemma", f"pretrained={run},{SERVER_BOUND}", [TASKS[0]], limit)
        srv = Server(model=str(run), threads=1)
        try:
            url = srv.wait_ready()
            os.environ.setdefault("OPENAI_API_KEY", "unused")
            args = (f"base_url={url}/v1/completions,model={run.name},tokenizer_backend=remote,tokenized_requests=True,"
                    "max_length=4096,num_concurrent=1,max_retries=1")
            out["server"] = evaluate("local-completions", args, [TASKS[0]], limit)
        finally:
            srv.stop()
    return out


def pm(results: dict, task: str, metric: str) -> str:
    r = results.get(task, {})
    value, se = r.get(f"{metric}"), r.get(f"{metric.split(',')[0]}_stderr,{metric.split(',')[1]}")
    if value is None:
        return "–"
    return f"{value:.3f} ± {se:.3f}" if isinstance(se, float) else f"{value:.3f}"


def table(rows: dict[str, dict]) -> list[str]:
    lines = ["| model | next_line acc | next_line acc_norm | speaker exact_match | through the server: acc (native "
             "bound=prompt) |", "|---|---:|---:|---:|---:|"]
    for name, f in rows.items():
        n = f["native"]
        served = "–" if "server" not in f else (f"{pm(f['server'], TASKS[0], 'acc,none')} "
                                               f"({pm(f['native_prompt_bound'], TASKS[0], 'acc,none')})")
        lines.append(f"| {name} | {pm(n, TASKS[0], 'acc,none')} | {pm(n, TASKS[0], 'acc_norm,none')} | "
                     f"{pm(n, TASKS[1], 'exact_match,strip')} | {served} |")
    return lines


def smoke_runs(root: Path) -> tuple[Path, Path]:
    """Two runs of the tiny preset trained for 2 steps on the toy corpus: an AR run and a diffusion run."""
    from dgemma.data.tokenizer import write_toy_corpus

    corpus = write_toy_corpus(root / "corpus")
    dgemma = [sys.executable, "-m", "dgemma"]
    subprocess.run([*dgemma, "data", "prepare", "--corpus", str(corpus), "--out", str(root / "data"), "--tokenizer",
                    "bpe:512", "-q"], check=True)
    common = ["--data", str(root / "data"), "--preset", "tiny", "--max-steps", "2", "--batch-size", "2",
              "--eval-batches", "1"]
    for name, extra in (("ar", ["--objective", "ar"]), ("diffusion", [])):
        subprocess.run([*dgemma, "train", *common, *extra, "--out", str(root / name)], check=True,
                       stdout=subprocess.DEVNULL)
    return root / "ar", root / "diffusion"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", type=Path, default=Path("dgemma-demo"), help="dgemma demo's folder (its ar/ and "
                   "diffusion/ runs; default dgemma-demo)")
    p.add_argument("--out", type=Path, default=Path("runs/out/lm-eval"), help="where the JSON goes")
    p.add_argument("--limit", type=int, help="items per task (default: all 150)")
    p.add_argument("--no-server", action="store_true", help="the native figures only")
    p.add_argument("--smoke", action="store_true", help="two 2-step tiny runs on a toy corpus, 4 items (tests)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            ar, diffusion = smoke_runs(Path(tmp))
            args.limit, args.out = 4, Path(tmp) / "out"
        else:
            ar, diffusion = args.demo / "ar", args.demo / "diffusion"
        rows = {"AR baseline (exact)": figures(ar, args.limit, not args.no_server),
                "diffusion (NELBO bound)": figures(diffusion, args.limit, not args.no_server)}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lm_eval_table.json").write_text(json.dumps({"limit": args.limit, "server_bound": SERVER_BOUND,
                                                                 "rows": rows}, indent=1, default=str) + "\n")
        print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
