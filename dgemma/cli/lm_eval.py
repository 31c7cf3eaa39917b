"""`dgemma lm-eval --model_args pretrained=RUN --tasks TASK[,TASK] [--limit N] [lm-eval's other flags]`: EleutherAI's
lm-evaluation-harness (`pip install 'dgemma[eval]'`) with dgemma's `dgemma` model registered (lm-eval's own command
line cannot find a model defined outside it). Every flag after `lm-eval` is lm-eval's (`lm-eval run --help` lists
them); `--model` defaults to dgemma, `--device` to auto (CUDA where there is one, else the CPU) and `--include_path`
to dgemma's own tasks (dgemma_shakespeare_next_line, a
multiple choice, and dgemma_shakespeare_speaker, a generate_until). The model's arguments: pretrained (a run or
checkpoint directory), device, dtype, batch_size, mc_replicates, nelbo_steps, t_samples, seed, max_gen_toks,
max_length, impl; sampler settings go through --gen_kwargs. For a diffusion run a loglikelihood is minus the NELBO,
a lower bound on the log-probability (docs/evaluation.md, "lm-evaluation-harness")."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from dgemma.cli.flags import UsageError

TASKS_DIR = Path(__file__).resolve().parents[1] / "eval" / "lm_eval_tasks"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("lm-eval", help="run lm-evaluation-harness tasks on a dgemma run (AR or diffusion)",
                              description=__doc__, allow_abbrev=False)
    p.set_defaults(func=run, passthrough=True)


def harness_argv(given: list[str]) -> list[str]:
    """lm-eval's `run` arguments: `given`, with `--model dgemma` and `--include_path` dgemma's tasks unless given."""
    names = {a.split("=", 1)[0] for a in given if a.startswith("--")}
    argv = ["run", *given]
    if "--model" not in names:
        argv += ["--model", "dgemma"]
    if "--device" not in names:  # lm-eval's default is cuda:0; dgemma's "auto" is CUDA where there is one
        argv += ["--device", "auto"]
    if "--include_path" not in names:
        argv += ["--include_path", str(TASKS_DIR)]
    return argv


def _one_line(message: str) -> NoReturn:
    raise UsageError(f"lm-eval: {' '.join(message.split())}")


def run(args: argparse.Namespace) -> int:
    try:
        from lm_eval._cli.harness import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError:
        raise UsageError("lm-eval is not installed: pip install 'dgemma[eval]'") from None
    import dgemma.eval.lm_eval_model  # noqa: F401  (registers the `dgemma` model)
    from dgemma.cli.loading import set_threads

    set_threads(None)  # torch's threads: the cores this process may use, unless OMP_NUM_THREADS says

    given = list(args.harness_args)
    if not given:
        raise UsageError("give lm-eval's flags: --model_args pretrained=RUN --tasks TASK (dgemma lm-eval --help)")
    setup_logging()
    harness = HarnessCLI()
    for parser in (harness._parser, *harness._subparsers.choices.values()):  # a bad flag: one line, exit 2
        parser.error = _one_line  # type: ignore[method-assign]
    parsed = harness._parser.parse_args(harness_argv(given))
    try:
        harness.execute(parsed)
    except (ValueError, OSError):
        raise  # dgemma's own errors and lm-eval's (an unknown task, a bad argument): `dgemma` prints them on one line
    except Exception as e:  # lm-eval's others, from inputs it does not check (a malformed --gen_kwargs, ...)
        if args.debug:
            raise
        raise UsageError(f"lm-eval: {type(e).__name__}: {e} (`dgemma --debug lm-eval ...` shows the traceback)"
                         ) from None
    return 0
