"""`dgemma eval --model RUN [--baseline AR_RUN] [--judge AR_RUN] --data DIR --out REPORT_DIR`: held-out likelihoods
(NELBO bound, x0 cross-entropy, AR cross-entropy), decoding speed and cost over a grid of sampler settings and AR
temperatures, sample quality scored by a judge, learning curves of the runs, and the verdict (is the held-out NLL
within 5% of the AR baseline's?), written as report.md, report.json and plots (dgemma/eval/evaluate.py,
dgemma/eval/report.py, docs/evaluation.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from dgemma.cli.flags import MODEL_HELP, add_runtime_args, finite_float, int_value, seed, shown_path
from dgemma.cli.loading import set_threads


def _ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of ints (EvalSettings.check says which are in range)."""
    return tuple(int_value(x.strip()) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    """A comma-separated list of finite numbers (EvalSettings.check says which are in range)."""
    return tuple(finite_float(x.strip()) for x in text.split(",") if x.strip())


def register(sub: argparse._SubParsersAction) -> None:
    # The ranges of the settings are EvalSettings.check's (the library's rule); argparse parses the numbers.
    p = sub.add_parser("eval", help="evaluate a diffusion run against an AR baseline: likelihood, speed, quality",
                       description=__doc__)
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="the diffusion model: " + MODEL_HELP)
    p.add_argument("--baseline", type=Path, metavar="AR_RUN", help="autoregressive run (objective 'ar'), same data")
    p.add_argument("--judge", type=Path, metavar="AR_RUN", help="an independent AR run (objective 'ar', same "
                   "tokenizer) that scores both sides' samples in float64 (default: the baseline scores them)")
    p.add_argument("--data", type=Path, required=True, metavar="DIR", help="prepared data (its validation split)")
    p.add_argument("--out", type=Path, required=True, metavar="REPORT_DIR", help="folder for report.md/json, plots")
    add_runtime_args(p)
    p.add_argument("--prompts", type=int, default=8, metavar="N", help="prompts decoded per sampler setting")
    p.add_argument("--prompt-tokens", type=int, default=32, metavar="N", help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="new tokens per prompt (default: two canvases)")
    p.add_argument("--max-denoising-steps-grid", dest="steps", type=_ints, default=(4, 8, 16, 32), metavar="N,N,..",
                   help="max_denoising_steps values of the frontier (default 4,8,16,32)")
    p.add_argument("--entropy-bounds", type=_floats, default=(0.1, 1.0), metavar="X,X,..",
                   help="entropy_bound values of the frontier (default 0.1,1)")
    p.add_argument("--sampler-grid", dest="sampler_grids", action="append", default=[], metavar="SPEC",
                   help="more samplers on the frontier, repeatable: NAME[:FIELD=V1/V2/..[,FIELD=..]], a sampler and a "
                   "grid over generation settings (e.g. confidence:commit_threshold=0.9/0.7), at every "
                   "--max-denoising-steps-grid value unless it sets max_denoising_steps; 'all': every other sampler "
                   "at its defaults (docs/sampling.md; default: entropy-bound only)")
    p.add_argument("--ar-temperatures", type=_floats, default=(1.0,), metavar="X,X,..",
                   help="temperatures the AR baseline decodes at: its frontier (default 1)")
    p.add_argument("--sample-seeds", type=int, default=1, metavar="S",
                   help="quality samples per prompt of every sampler setting and AR temperature, each with its own "
                   "seed; per-prompt figures average over them first (timing stays one rotation; default 1)")
    p.add_argument("--seq-len", type=int, metavar="N", help="held-out window (default: the run's training seq_len)")
    p.add_argument("--nelbo-steps", dest="num_steps", type=int, metavar="T",
                   help="diffusion steps T of the NELBO (default: the run's training --num-steps)")
    p.add_argument("--t-samples", type=int, default=4, metavar="K",
                   help="stratified t samples per canvas (NELBO; default 4)")
    p.add_argument("--mc-replicates", type=int, default=2, metavar="R",
                   help="independent Monte Carlo passes of each NELBO, each from its own seed (a hash of the weights, "
                   "the bound, T and the pass): their spread is the Monte Carlo SE reported beside the between-window "
                   "SE (default 2; 1: no Monte Carlo SE)")
    p.add_argument("--iw-windows", type=int, default=8, metavar="N",
                   help="held-out windows of the importance-weighted bound at T (K = 1, 4, 16 whole trajectories, 16 T "
                   "forwards per window), which sizes the NELBO's gap to the NLL (0: none; default 8)")
    p.add_argument("--max-windows", type=int, default=64, metavar="N", help="held-out windows per likelihood "
                   "(0: the whole validation split; default 64)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="held-out windows per forward (default 8)")
    p.add_argument("--target-se", type=finite_float, default=0.01, metavar="X", help="the report says how many windows "
                   "give this standard error (nats/token; default 0.01)")
    p.add_argument("--quality-dtype", default="float64", choices=("float64", "float32"),
                   help="dtype of both models for the samples that are scored (default float64)")
    p.add_argument("--bootstrap", type=int, default=1000, metavar="N", help="bootstrap resamples of the "
                   "generative-perplexity intervals (seeded with --seed; default 1000)")
    p.add_argument("--seed", type=seed, default=0, metavar="SEED", help="seed of the prompts, the samples and the "
                   "bootstrap (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dgemma.eval.evaluate import EvalSettings, evaluate
    from dgemma.eval.report import write_report
    from dgemma.eval.viz import check_installed

    settings = EvalSettings(steps=args.steps, entropy_bounds=args.entropy_bounds,
                            sampler_grids=tuple(args.sampler_grids), num_prompts=args.prompts,
                            prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                            seq_len=args.seq_len, num_steps=args.num_steps, num_t_samples=args.t_samples,
                            mc_replicates=args.mc_replicates, iw_windows=args.iw_windows,
                            max_windows=args.max_windows or None, batch_size=args.batch_size,
                            target_se=args.target_se, seed=args.seed, quality_dtype=args.quality_dtype,
                            ar_temperatures=args.ar_temperatures, sample_seeds=args.sample_seeds,
                            bootstrap=args.bootstrap, progress=not args.quiet,
                            impl=args.impl)
    settings.check()
    set_threads(args.threads)
    try:  # before the long evaluation, not after it: the report needs its plots
        check_installed()
    except ImportError as e:
        print(f"dgemma eval: error: {e}", file=sys.stderr)
        return 2
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report, traces = evaluate(args.model, args.data, baseline_path=args.baseline, judge_path=args.judge,
                              settings=settings, log=log)
    command = "dgemma eval " + shlex.join(_argv(args))
    for path in write_report(report, args.out, command=command, traces=traces):
        log(f"wrote {path}")
    print(args.out / "report.md")
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    """The command line as it determines the report (paths and every setting), printed on every figure."""
    out = ["--model", shown_path(args.model)]
    if args.baseline is not None:
        out += ["--baseline", shown_path(args.baseline)]
    if args.judge is not None:
        out += ["--judge", shown_path(args.judge)]
    out += ["--data", shown_path(args.data), "--out", shown_path(args.out), "--prompts", str(args.prompts),
            "--max-denoising-steps-grid", ",".join(map(str, args.steps)),
            "--entropy-bounds", ",".join(f"{x:g}" for x in args.entropy_bounds)]
    for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--max-new-tokens", args.max_new_tokens),
                        ("--seq-len", args.seq_len), ("--nelbo-steps", args.num_steps), ("--t-samples", args.t_samples),
                        ("--max-windows", args.max_windows), ("--mc-replicates", args.mc_replicates),
                        ("--iw-windows", args.iw_windows), ("--seed", args.seed)):
        if value is not None:
            out += [flag, str(value)]
    for spec in args.sampler_grids:
        out += ["--sampler-grid", spec]
    if args.ar_temperatures != (1.0,):
        out += ["--ar-temperatures", ",".join(f"{x:g}" for x in args.ar_temperatures)]
    if args.sample_seeds != 1:
        out += ["--sample-seeds", str(args.sample_seeds)]
    if args.bootstrap != 1000:
        out += ["--bootstrap", str(args.bootstrap)]
    if args.impl != "fast":
        out += ["--impl", args.impl]
    if args.quality_dtype != "float64":
        out += ["--quality-dtype", args.quality_dtype]
    return out
