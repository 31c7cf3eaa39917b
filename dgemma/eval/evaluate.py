"""Evaluation: held-out likelihoods, decoding cost and speed, and sample quality (docs/evaluation.md).

Likelihood (nats per token, with bits per byte beside them), each a loop over the held-out windows:

    x0 cross-entropy     the training objective at t ~ U{1..T}, without self-conditioning (seed 003 section 7).
                         Not a likelihood: it is what the model is trained on, reported as the seed reports it.
    NELBO                an upper bound on the held-out NLL, canvas by canvas given the clean prefix; the maths
                         (reverse KLs, stratified t, the posteriors) is dgemma/diffusion/likelihood.py.
    AR cross-entropy     next-token loss of an autoregressive run (objective 'ar') on the same held-out tokens.

Cost, speed and sample quality: the frontier (dgemma/eval/frontier.py: the decode runs of dgemma/eval/decoding.py,
timed in rotation with the machine's load recorded, the AR baseline at each AR temperature, distinct-n, token
entropy), generative perplexity and prompt dependence under the judge on re-tokenized samples, with bootstrap
intervals and tokens/s with SEs across prompts (dgemma/eval/judging.py), and the fraction of accepted tokens re-noised
at the next step (from traces, `dgemma.eval.viz.renoised_fraction`). Learning curves come from the runs'
metrics.jsonl (dgemma/eval/curves.py).

`evaluate(...)` runs everything and returns the report as a dict; `dgemma.eval.report.write_report` writes it
(`dgemma eval`, dgemma/cli/eval.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dgemma.eval.curves import learning_curves
from dgemma.eval.frontier import decode_frontier, frontier_points
from dgemma.eval.judging import BASELINE_JUDGE, judge_description, judge_relation, schedule_position
from dgemma.eval.likelihoods import (
    heldout_ar_ce,
    heldout_iw,
    heldout_nelbo,
    heldout_x0_ce,
    model_posterior,
    model_sha,
    scored_digest,
    unigram_posterior,
    unigram_reference,
)
from dgemma.eval.matched import frontier_verdict
from dgemma.model.attention import IMPLS
from dgemma.sampling.trace import Trace
from dgemma.train.config import posterior_objective
from dgemma.train.heldout import EvalError

REPORT_FORMAT = "dgemma-eval-1"
PARITY_TOLERANCE = 0.05  # seed 003's verdict: held-out NLL within +5% of the AR baseline's


# --- held-out likelihoods -------------------------------------------------------------------------------------------

# --- runs and prompts -----------------------------------------------------------------------------------------------

@dataclass
class RunInfo:
    """What evaluation needs to know about a model directory or a training run directory."""

    path: Path  # as given
    model_dir: Path  # the checkpoint evaluated
    train_config: dict[str, Any] | None  # train_config.json, when the checkpoint came from `dgemma train`
    tokenizer_path: Path | None

    @property
    def objective(self) -> str | None:
        return None if self.train_config is None else self.train_config.get("objective")

    def get(self, key: str, default: Any = None) -> Any:
        return default if self.train_config is None else self.train_config.get(key, default)


def run_info(path: str | Path) -> RunInfo:
    """Resolve a run (RUN/checkpoints/step-*, the newest) or a model directory, with its train config and tokenizer."""
    from dgemma.train.config import CONFIG_JSON
    from dgemma.weights.checkpoint import resolve_model_dir

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model or run directory")
    model_dir = resolve_model_dir(path)
    cfg_path = model_dir / CONFIG_JSON
    train_config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
    tok = next((p for p in (model_dir / "tokenizer.json", path / "tokenizer.json") if p.is_file()), None)
    return RunInfo(path, model_dir, train_config, tok)


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_same_tokenizer(a: RunInfo, b: RunInfo, vocab_a: int, vocab_b: int, role: str = "baseline") -> None:
    """Likelihoods and perplexities compare only over the same token stream: the two runs must share a tokenizer.
    `role` names `b` in the error (the baseline, the judge)."""
    if a.tokenizer_path is not None and b.tokenizer_path is not None:
        if file_sha256(a.tokenizer_path) != file_sha256(b.tokenizer_path):
            raise EvalError(f"{role} {b.path} uses another tokenizer than {a.path} ({b.tokenizer_path} differs "
                            f"from {a.tokenizer_path}): per-token likelihoods of different tokenizations do not "
                            f"compare; train the {role} on the same prepared data")
    elif vocab_a != vocab_b:
        raise EvalError(f"{role} {b.path} has vocab_size {vocab_b:,} but {a.path} has {vocab_a:,}: another "
                        "tokenizer, so the likelihoods do not compare")


def pick_prompts(dataset: Any, num_prompts: int, prompt_tokens: int) -> list[Tensor]:
    """Prompts from the validation split: the first `prompt_tokens` of documents (after each separator) that have
    at least that many, in order; evenly spaced windows if too few documents are long enough."""
    n = dataset.num_tokens
    if n < prompt_tokens + 1:
        raise EvalError(f"{dataset.dir}: the {dataset.split} split has {n:,} tokens, too few for a prompt of "
                        f"{prompt_tokens}: an empty validation set cannot be evaluated")
    stream = dataset.read(0, n)
    starts = np.concatenate([[0], np.flatnonzero(stream == dataset.eot_id) + 1])
    ends = np.concatenate([starts[1:] - 1, [n]])
    chosen = [int(s) for s, e in zip(starts, ends, strict=True) if e - s >= prompt_tokens][:num_prompts]
    if len(chosen) < num_prompts:
        step = max((n - prompt_tokens) // num_prompts, 1)
        chosen = [i * step for i in range(num_prompts)]
    return [torch.from_numpy(stream[s:s + prompt_tokens].copy()) for s in chosen]


# --- the whole evaluation -------------------------------------------------------------------------------------------

@dataclass
class EvalSettings:
    steps: tuple[int, ...] = (4, 8, 16, 32)  # max_denoising_steps of the frontier
    entropy_bounds: tuple[float, ...] = (0.1, 1.0)  # entropy_bound values of the frontier
    sampler_grids: tuple[str, ...] = ()  # more samplers on the frontier (frontier.parse_sampler_grid: --sampler-grid)
    num_prompts: int = 8
    prompt_tokens: int = 32
    max_new_tokens: int | None = None  # default: two canvases
    seq_len: int | None = None  # held-out window; default: the run's training seq_len
    num_steps: int | None = None  # T of the NELBO; default: the run's training num_steps
    num_t_samples: int = 4  # stratified t per canvas for the NELBO
    mc_replicates: int = 2  # independent Monte Carlo passes of each NELBO: their spread is its Monte Carlo SE
    iw_windows: int = 8  # windows of the importance-weighted bound (K = 1, 4, 16 trajectories; 0: none)
    max_windows: int | None = 64  # held-out windows per likelihood (None: the whole split)
    batch_size: int = 8
    target_se: float = 0.01  # nats/token: the report says how many windows this needs
    seed: int = 0
    quality_dtype: str = "float64"  # dtype of both models when drawing the samples that are scored
    ar_temperatures: tuple[float, ...] = (1.0,)  # the AR baseline's frontier
    sample_seeds: int = 1  # quality draws per prompt, each with its own seed (timing stays one rotation)
    bootstrap: int = 1000  # resamples of the gen-PPL interval
    progress: bool = True
    impl: str = "reference"  # the kernels of every model (dgemma/model/attention.py): diffusion and AR alike

    def check(self) -> None:
        """Each bad setting is an EvalError naming its flag."""
        problems = []
        if not self.steps or min(self.steps) < 1:
            problems.append(f"--max-denoising-steps-grid must be positive integers, got {self.steps}")
        if not self.entropy_bounds or min(self.entropy_bounds) <= 0:
            problems.append(f"--entropy-bounds must be numbers > 0, got {self.entropy_bounds}")
        for flag, value in (("--prompts", self.num_prompts), ("--prompt-tokens", self.prompt_tokens),
                            ("--t-samples", self.num_t_samples), ("--batch-size", self.batch_size),
                            ("--max-new-tokens", self.max_new_tokens), ("--seq-len", self.seq_len),
                            ("--nelbo-steps", self.num_steps), ("--max-windows", self.max_windows),
                            ("--mc-replicates", self.mc_replicates)):
            if value is not None and value < 1:
                problems.append(f"{flag} must be >= 1, got {value}")
        if self.num_prompts < 2:
            problems.append(f"--prompts must be >= 2 (half select the verdict's setting, half report it), got "
                            f"{self.num_prompts}")
        if not self.ar_temperatures or min(self.ar_temperatures) <= 0:
            problems.append(f"--ar-temperatures must be numbers > 0, got {self.ar_temperatures}")
        if self.iw_windows < 0:
            problems.append(f"--iw-windows must be >= 0 (0: no importance-weighted bound), got {self.iw_windows}")
        if self.sample_seeds < 1:
            problems.append(f"--sample-seeds must be >= 1, got {self.sample_seeds}")
        if self.bootstrap < 1:
            problems.append(f"--bootstrap must be >= 1, got {self.bootstrap}")
        if self.target_se <= 0:
            problems.append(f"--target-se must be > 0, got {self.target_se}")
        if self.quality_dtype not in ("float64", "float32"):
            problems.append(f"--quality-dtype must be float64 or float32, got {self.quality_dtype!r}")
        if self.impl not in IMPLS:
            problems.append(f"--impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
        if problems:
            raise EvalError("; ".join(problems))
        frontier_points(self.steps, self.entropy_bounds, self.sampler_grids)  # EvalError naming a bad spec


def evaluate(model_path: str | Path, data_dir: str | Path, *, baseline_path: str | Path | None = None,
             judge_path: str | Path | None = None, settings: EvalSettings | None = None,
             log: Callable[[str], None] | None = None) -> tuple[dict[str, Any], dict[str, Trace]]:
    """Every metric for a diffusion run (and an AR baseline, if given) on the validation split of `data_dir`: the
    report as a JSON-able dict, and the trace of the first prompt of each sampler setting (`write_report` writes
    both). Generative perplexity is scored by the judge (`judge_path`, an AR run, in float64) when given, else by the
    baseline."""
    from dgemma.data.shards import TokenDataset, check_token_range, unigram_log_probs, verify
    from dgemma.data.tokenizer import check_vocab, load_tokenizer
    from dgemma.train.config import CONFIG_JSON
    from dgemma.weights.loading import load_generation_config, load_model

    s = settings or EvalSettings()
    s.check()
    log = log or (lambda msg: None)
    info = run_info(model_path)
    base = run_info(baseline_path) if baseline_path is not None else None
    judge_info = run_info(judge_path) if judge_path is not None else None
    if info.objective == "ar":
        raise EvalError(f"--model {model_path} was trained with objective 'ar': pass the diffusion run as --model and "
                        "the AR run as --baseline")
    for flag, path, run in (("--baseline", baseline_path, base), ("--judge", judge_path, judge_info)):
        # Only a run's train_config.json says a checkpoint is autoregressive (the architecture is the same): one
        # without it, a diffusion checkpoint included, would score samples with the wrong factorisation.
        if run is not None and run.objective != "ar":
            how = (f"was trained with objective {run.objective!r}" if run.objective is not None else
                   f"has no {run.model_dir / CONFIG_JSON} to show it was trained autoregressively")
            raise EvalError(f"{flag} {path} {how}; the {flag[2:]} must be an autoregressive run (objective 'ar': "
                            "dgemma train --objective ar), or a checkpoint of one")
    # Diffusion and AR decode on the same kernels (s.impl, default the readable reference path).
    model = load_model(info.model_dir, dtype=torch.float32, impl=s.impl).eval()
    baseline = load_model(base.model_dir, dtype=torch.float32, impl=s.impl).eval() if base is not None else None
    if base is not None and baseline is not None:
        check_same_tokenizer(info, base, model.config.vocab_size, baseline.config.vocab_size)
    judge = None
    if judge_info is not None:
        judge = load_model(judge_info.model_dir, dtype=torch.float32, impl=s.impl).eval()
        check_same_tokenizer(info, judge_info, model.config.vocab_size, judge.config.vocab_size, role="judge")
        judge = judge.to(torch.float64)
    val = TokenDataset(data_dir, "val")
    if val.num_tokens == 0:
        raise EvalError(f"{data_dir}: the validation split is empty (0 tokens); prepare the data with "
                        "--val-fraction > 0")
    check_vocab(val.tokenizer(), model.config)
    # What training checks of its data, for the split evaluation reads: a damaged shard is one error naming it.
    verify(data_dir, val.meta, splits=("val",))
    check_token_range(data_dir, model.config.vocab_size, val.meta, splits=("val",))
    if info.tokenizer_path is not None and file_sha256(info.tokenizer_path) != file_sha256(val.tokenizer_path):
        raise EvalError(f"{data_dir} was tokenized with another tokenizer than {model_path} "
                        f"({val.tokenizer_path} differs from {info.tokenizer_path})")
    tokenizer = load_tokenizer(val.tokenizer_path)
    L = model.config.canvas_length
    seq_len = s.seq_len or info.get("seq_len") or 4 * L
    if seq_len % L:
        raise EvalError(f"--seq-len {seq_len} is not a whole number of canvases of {L}")
    T = s.num_steps or info.get("num_steps", 16)
    if s.num_t_samples > T:
        raise EvalError(f"--t-samples {s.num_t_samples} exceeds T = {T} (the NELBO has T terms; K = T visits each "
                        "once)")
    objective = posterior_objective(info.objective)  # a student's or chat fine-tune's: clean-context
    common = dict(batch_size=s.batch_size, max_windows=s.max_windows, tokenizer=tokenizer, progress=s.progress)

    time = info.get("diffusion_time", "discrete")
    log(f"likelihoods on {val} (windows of {seq_len} scored after one context token, T={T}"
        f"{' and continuous time' if model.config.time_embedding else ''}, {s.mc_replicates} Monte Carlo replicates)")
    x0_ce = heldout_x0_ce(model, val, seq_len=seq_len, num_steps=T, time=time, objective=objective, seed=s.seed,
                          **common)
    V = model.config.vocab_size
    geometry = dict(canvas_length=L, vocab_size=V, seq_len=seq_len)
    mc = dict(num_t_samples=s.num_t_samples, replicates=s.mc_replicates, seed=s.seed, **common)
    sha = model_sha(model)
    posterior = model_posterior(model)
    nelbo = heldout_nelbo(posterior, val, num_steps=T, model_sha=sha, device=model.device, **geometry, **mc)
    # The continuous-time bound is finite only for a model told its level (docs/evaluation.md section 1.3).
    nelbo_continuous = heldout_nelbo(posterior, val, num_steps=None, model_sha=sha, device=model.device, **geometry,
                                     **mc) if model.config.time_embedding else None
    iw_windows = min(s.iw_windows, s.max_windows or s.iw_windows)  # the first of the scored windows
    iw = heldout_iw(posterior, val, num_steps=T, windows=iw_windows, model_sha=sha, seed=s.seed,
                    batch_size=s.batch_size, device=model.device, progress=s.progress, **geometry
                    ) if s.iw_windows else None
    ar_ce = heldout_ar_ce(baseline, val, seq_len=seq_len, **common) if baseline is not None else None
    # The exact reference: the training unigram, whose NELBO is its NLL at every T, through the same code.
    log_p = unigram_log_probs(data_dir, V)
    unigram = unigram_reference(log_p, val, seq_len=seq_len, max_windows=s.max_windows)
    reference = heldout_nelbo(lambda ctx: unigram_posterior(torch.from_numpy(log_p), L), val, num_steps=T,
                              model_sha="unigram:" + val.meta.get("tokenizer_sha256", str(data_dir)), **geometry,
                              **mc)

    prompts = pick_prompts(val, s.num_prompts, s.prompt_tokens)
    max_new = s.max_new_tokens or 2 * L
    eos = (val.eot_id,)
    gcfg = load_generation_config(info.model_dir).replace(
        max_new_tokens=max_new, eos_token_id=eos, pad_token_id=None, truncate=False)
    scorer, judged_by = (judge, judge_info) if judge is not None else (baseline, base)
    frontier, ar_frontier, traces, timing, protocol = decode_frontier(model, baseline, scorer, tokenizer, prompts,
                                                                      gcfg, s, log, data_dir=data_dir)
    report = {
        "format": REPORT_FORMAT,
        "model": {"path": str(info.path), "checkpoint": str(info.model_dir), "objective": objective,
                  "train_config": info.train_config},
        "baseline": None if base is None else {"path": str(base.path), "checkpoint": str(base.model_dir),
                                               "train_config": base.train_config,
                                               **schedule_position(base.path, base.model_dir, base.train_config)},
        "judge": None if judged_by is None else judge_description(
            BASELINE_JUDGE if judge is None else judge_relation(
                judged_by.model_dir, [d.model_dir for d in (info, base) if d is not None],
                (info.train_config or {}).get("init_from")),
            judged_by.path, judged_by.model_dir, judged_by.train_config, "float64" if judge is not None else "float32"),
        "data": {"path": str(data_dir), "split": "val", "tokens": val.num_tokens, "documents": val.num_documents},
        "settings": asdict(s) | {"seq_len": seq_len, "num_steps": T, "max_new_tokens": max_new},
        "likelihood": {name: None if r is None else r | {"estimate": r["estimate"].to_dict(s.target_se)}
                       for name, r in (("x0_ce", x0_ce), ("nelbo", nelbo), ("nelbo_continuous", nelbo_continuous),
                                       ("ar_ce", ar_ce), ("reference_nelbo", reference))}
        | {"scored": scored_digest(val, seq_len, s.max_windows), "iw": iw,
           "unigram": unigram.to_dict(s.target_se), "model_sha256": sha},
        "headline_bound": headline_bound({"nelbo": nelbo, "nelbo_continuous": nelbo_continuous}),
        "prompts": {"count": len(prompts), "tokens": s.prompt_tokens, "selection": "even (0, 2, 4, ...)",
                    "report": "odd (1, 3, 5, ...)"},
        "frontier": frontier,
        "ar_frontier": ar_frontier,
        "quality_protocol": protocol,
        "timing": timing,
    }
    curves = learning_curves(info.path, base.path if base is not None else None, data_dir)
    if curves is not None:
        report["curves"] = curves
    report["verdict"] = verdict(report)
    # The AR point the verdict compares against (else the first): the frontier table's speedup reference.
    chosen = report["verdict"].get("ar_index", 0)
    report["ar_decode"] = ar_frontier[chosen] if ar_frontier else None
    return report, traces


def headline_bound(likelihood: dict[str, Any]) -> str:
    """Which likelihood the verdict reads: the tighter (lower) of the NELBO at T and the continuous-time NELBO. Each
    bounds the NLL of a chain with the same network (T steps; continuous time), so the lower is the better guarantee
    (docs/evaluation.md section 1.3: which is lower depends on how certain the model is at low noise)."""
    options = [k for k in ("nelbo", "nelbo_continuous") if likelihood.get(k) is not None]
    return min(options, key=lambda k: likelihood[k]["estimate"].mean)


def verdict(report: dict[str, Any], tolerance: float = PARITY_TOLERANCE) -> dict[str, Any]:
    """Seed 003's question: is the held-out NLL within +5% of the AR baseline's, and what is the speedup there?

    Likelihood parity compares the NELBO (an upper bound, so a pass is conservative); the seed's own x0 cross-entropy
    ratio is reported beside it. The speedup is useful tokens/s over the AR baseline's at matched quality
    (dgemma/eval/matched.py: judge NLL within one paired SE and per-sample distinct-2 at least 0.95x of the AR point,
    over the AR temperature grid), the setting and AR point chosen on the selection prompts and every number measured
    on the report prompts (`judging.split_prompts`), with paired 95% intervals; without a match, the closest pair,
    marked as not matched."""
    lk = report["likelihood"]
    if lk["ar_ce"] is None or not report["ar_frontier"]:
        return {"available": False, "reason": "no AR baseline (--baseline)"}
    ar_ce = lk["ar_ce"]["estimate"]["mean"]
    bound = report.get("headline_bound", "nelbo")
    nelbo, x0 = lk[bound]["estimate"], lk["x0_ce"]["estimate"]
    ratio = nelbo["mean"] / ar_ce
    unigram = (lk.get("unigram") or {}).get("mean")  # on the scored tokens
    share = (unigram - nelbo["mean"]) / (unigram - ar_ce) if unigram is not None and unigram != ar_ce else None
    return {
        "available": True, "tolerance": tolerance,
        "bound": bound, "unigram_ce": unigram, "share_of_ar_gain": share,
        "token_multiplier": (report.get("curves") or {}).get("token_multiplier"),
        "nelbo_over_ar": ratio, "nelbo_within_tolerance": ratio <= 1 + tolerance,
        "nelbo_upper_ratio": (nelbo["mean"] + 2 * nelbo["se"]) / ar_ce,
        "x0_ce_over_ar": x0["mean"] / ar_ce, "x0_ce_within_tolerance": x0["mean"] / ar_ce <= 1 + tolerance,
        **frontier_verdict(report["frontier"], report["ar_frontier"]),
    }


__all__ = [
    "EvalError",
    "EvalSettings",
    "RunInfo",
    "check_same_tokenizer",
    "evaluate",
    "heldout_x0_ce",
    "pick_prompts",
    "run_info",
    "verdict",
]
