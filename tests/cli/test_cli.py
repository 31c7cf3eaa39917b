"""The `dgemma` commands run for real, in-process, on tiny random models and tiny real data: every subcommand's
minimal documented invocation, with its output checked against the library (same model, same seed: same tokens).
Nothing here stands in for a dgemma module."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import dgemma
from dgemma import cli
from dgemma.data.tokenizer import load_tokenizer
from dgemma.sampling.trace import load_trace
from dgemma.train.config import TRAIN_PRESETS
from dgemma.weights.checkpoint import latest_checkpoint
from tests.helpers import random_init_model

TINY = dgemma.preset("tiny")  # vocab 512, canvas 16, pad 0, eos 1, bos 2
L, V = TINY.canvas_length, TINY.vocab_size
RANDOM = ["--preset", "tiny", "--random-init"]
FAST = ["--max-denoising-steps", "3", "--max-new-tokens", "32"]  # two canvases of at most 3 denoising passes each


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([*argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- generate -------------------------------------------------------------------------------------------------

def test_generate_json_is_what_the_library_generates(capsys):
    code, out, err = run(capsys, "generate", *RANDOM, "--prompt-ids", "2,45,300", "--seed", "0", *FAST, "--json")
    assert code == 0
    (rec,) = [json.loads(line) for line in out.splitlines()]
    assert rec["prompt_ids"] == [2, 45, 300] and rec["text"] is None
    ids = rec["token_ids"]
    assert 0 < len(ids) <= 2 * L and all(0 <= i < V for i in ids)
    canvases = len(rec["steps_per_canvas"])  # 2, or 1 where the random model drew its EOS in the first
    assert canvases in (1, 2) and len(rec["stop_reasons"]) == canvases
    assert all(1 <= s <= 3 for s in rec["steps_per_canvas"])
    lib = dgemma.generate(random_init_model(), torch.tensor([[2, 45, 300]]), seed=0, max_new_tokens=32,
                          max_denoising_steps=3, eos_token_id=(1,), pad_token_id=0, impl="fast")  # --impl's default
    assert ids == lib.new_tokens()[0]
    assert rec["steps_per_canvas"] == [c[0] for c in lib.steps_per_canvas]
    assert rec["stop_reasons"] == [c[0] for c in lib.stop_reasons]
    assert rec["tokens_per_forward"] == pytest.approx(float(lib.tokens_per_forward[0]))
    assert f"{len(ids)} tokens generated for 1 prompt(s) in {canvases} canvas(es)" in err
    # Without --json: the same ids, streamed on one line.
    code, out, _ = run(capsys, "generate", *RANDOM, "--prompt-ids", "2,45,300", "--seed", "0", *FAST)
    assert code == 0 and [int(t) for t in out.split()] == ids


def test_generate_trace_is_written_and_loads(capsys, tmp_path):
    code, out, _ = run(capsys, "generate", *RANDOM, "--prompt-ids", "2,45,300", "--sampler", "lite", "--seed", "1",
                       *FAST, "--trace", str(tmp_path / "run"), "--json")
    assert code == 0
    rec = json.loads(out)
    trace = load_trace(tmp_path / "run")
    assert (tmp_path / "run.npz").is_file() and (tmp_path / "run.json").is_file()
    assert trace.batch_size == 1 and trace.canvas_length == L
    assert trace.canvases() == [0, 1]
    assert len(trace.arrays["step"]) == sum(rec["steps_per_canvas"])  # one record per denoising pass
    assert trace.arrays["argmax"].max() < V


def test_generate_batch_file_left_pads_like_the_unpadded_prompt(capsys, tok_path, tmp_path):
    """Row 0 ("Hello") is left-padded to row 1's length; its first denoising pass must see what the unpadded prompt
    alone gives: the trace's first argmax equals the model's on the unpadded prompt and the same input canvas."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n\nWhat is the capital of France?\n")
    code, out, err = run(capsys, "generate", *RANDOM, "--tokenizer", str(tok_path), "--batch-file", str(prompts),
                         "--seed", "0", *FAST, "--json", "--trace", str(tmp_path / "t"))
    assert code == 0 and "for 2 prompt(s)" in err
    recs = [json.loads(line) for line in out.splitlines()]
    tok = load_tokenizer(tok_path)
    assert [r["prompt"] for r in recs] == ["Hello", "What is the capital of France?"]
    assert [r["prompt_ids"] for r in recs] == [tok.encode("Hello"), tok.encode("What is the capital of France?")]
    assert all(r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True) for r in recs)
    trace = load_trace(tmp_path / "t")
    first = trace.arrays["input_canvas"][0]  # (B, L): the first pass's canvas, step 0 of canvas 0
    assert trace.arrays["canvas"][0] == 0 and trace.batch_size == 2
    model = random_init_model()
    for row, rec in enumerate(recs):
        logits = model(torch.tensor([rec["prompt_ids"]]), torch.from_numpy(first[row:row + 1]).long())
        assert torch.equal(logits.argmax(-1)[0], torch.from_numpy(trace.arrays["argmax"][0][row]).long()), row


def test_generate_from_a_training_run_with_its_tokenizer(capsys, tiny_run):
    code, out, _ = run(capsys, "generate", "--model", str(tiny_run), "--prompt", "The king", "--seed", "0", *FAST,
                       "--json")
    assert code == 0
    rec = json.loads(out)
    tok = load_tokenizer(tiny_run / "tokenizer.json")
    assert rec["prompt_ids"] == tok.encode("The king")
    assert rec["text"] == tok.decode(rec["token_ids"], skip_special_tokens=True)
    assert all(0 <= i < 512 for i in rec["token_ids"])


@pytest.fixture(scope="module")
def ar_run(tiny_data, tmp_path_factory):
    """An autoregressive run (objective 'ar', as `dgemma demo`'s baseline) of 2 steps on `tiny_data`."""
    from dgemma.train.config import TrainConfig
    from dgemma.train.loop import train

    run = tmp_path_factory.mktemp("ar-run") / "ar"
    cfg = TrainConfig(preset="tiny", objective="ar", seq_len=32, batch_size=2, max_steps=2, warmup_steps=1,
                      eval_every=100, eval_batches=1, save_every=100, log_every=100, device="cpu", seed=0)
    train(cfg, tiny_data, run, stream=io.StringIO())
    return run


def test_an_ar_run_is_decoded_token_by_token_as_eval_decodes_it(capsys, ar_run):
    """`dgemma generate --model AR_RUN` (the demo's footer invites it) once ran the diffusion sampler on the AR
    model: it decodes as `dgemma demo` / `dgemma eval` do (eval.decoding.run_ar), with the sampling controls."""
    from dgemma.eval.decoding import run_ar
    from dgemma.weights.loading import load_generation_config, load_model

    tok = load_tokenizer(ar_run / "tokenizer.json")
    model = load_model(latest_checkpoint(ar_run)).eval()
    prompt = [1, *tok.encode("The king", add_special_tokens=False)]
    ids = ",".join(map(str, prompt))
    code, out, err = run(capsys, "generate", "--model", str(ar_run), "--prompt-ids", ids, "--seed", "3",
                         "--max-new-tokens", "12", "--json")
    assert code == 0 and "autoregressively" in err
    rec = json.loads(out)
    settings = load_generation_config(ar_run)
    t, eos = settings.t_max, settings.eos_token_id
    assert rec["token_ids"] == run_ar(model, [torch.tensor(prompt)], max_new_tokens=12, eos=eos, seed=3,
                                      temperature=t, progress=False).samples[0]
    code, out, _ = run(capsys, "generate", "--model", str(ar_run), "--prompt-ids", ids, "--seed", "3",
                       "--max-new-tokens", "12")
    assert code == 0 and out == rec["text"] + "\n"  # streamed as it comes, one line
    # a sampling control applies: top_k 1 is the greedy continuation, whatever the seed
    greedy = [json.loads(run(capsys, "generate", "--model", str(ar_run), "--prompt-ids", ids, "--seed", str(s),
                                 "--max-new-tokens", "12", "--top-k", "1", "--json")[1])["token_ids"] for s in (0, 1)]
    assert greedy[0] == greedy[1]
    # the diffusion sampler's flags do not apply: one line naming the run
    code, _, err = run(capsys, "generate", "--model", str(ar_run), "--prompt-ids", ids, "--entropy-bound", "0.5")
    assert code == 2 and len(err.splitlines()) == 1 and "--entropy-bound" in err and "autoregressive run" in err


def test_chat_refuses_an_ar_run_in_one_line(ar_run):
    """It runs the diffusion sampler only: one line pointing at `dgemma generate` (a subprocess)."""
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.run([sys.executable, "-m", "dgemma", "chat", "--model", str(ar_run)], input="",
                       capture_output=True, text=True, env=env, timeout=120)
    err = p.stderr
    assert p.returncode == 2 and err.startswith("dgemma chat: error: ") and len(err.splitlines()) == 1, err
    assert "autoregressive run (objective 'ar')" in err and f"dgemma generate --model {ar_run}" in err


def test_serve_serves_an_ar_run_for_scoring_only(ar_run, tmp_path):
    """`dgemma serve --model AR_RUN` (which once refused it) scores with its exact log-probs (echo, as lm-eval's
    loglikelihood asks) and refuses generation with a 400 naming `model`; --lora with it is one line."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    import httpx

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    argv = [sys.executable, "-m", "dgemma", "serve", "--model", str(ar_run), "--port", "0", "--max-batch", "2",
            "--max-context", "64"]
    p = subprocess.run([*argv, "--lora", f"x={tmp_path}"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and "--lora" in p.stderr, p.stderr
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # the URL, once the port listens
        assert "scoring (echo) only" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].split()[0]
        r = httpx.post(url + "v1/completions", json={"prompt": [5, 9, 14, 20], "echo": True, "max_tokens": 1,
                                                     "logprobs": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["scoring"]["bound"] == "exact", r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == 5
        r = httpx.post(url + "v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "5,512"], "outside the model's vocabulary"),
    (["--model", "NOWHERE", "--prompt-ids", "5"], "does not exist"),
    (["--preset", "tiny", "--prompt-ids", "5"], "add --random-init"),
])
def test_generate_errors_are_one_line(capsys, tmp_path, argv, message):
    argv = [str(tmp_path / "none") if a == "NOWHERE" else a for a in argv]
    full = ["generate", *argv] if "--preset" in argv or "--model" in argv else ["generate", *RANDOM, *argv]
    code, _, err = run(capsys, *full)
    assert code == 2 and err.startswith("dgemma generate: error: ") and len(err.splitlines()) == 1
    assert message in err


# --- chat -----------------------------------------------------------------------------------------------------

def test_chat_turns_match_generate_and_reuse_the_cache(capsys, tok_path, monkeypatch):
    """The first turn answers as `dgemma generate --chat` does (same ids, same seed); later turns continue the
    conversation in the cache; /reset starts a fresh one that answers as the first turn did."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n\nWhy?\n/reset\nHello there\n"))
    # The reference kernels: this random model's answers on them hold no line break (one line per turn).
    code, out, err = run(capsys, "chat", *RANDOM, "--tokenizer", str(tok_path), "--seed", "7", *FAST, "--impl",
                         "reference")
    assert code == 0 and "(history cleared)" in err
    answers = out.splitlines()
    assert len(answers) == 3  # one line per answered turn; the blank line is skipped
    for answer, seed in ((answers[0], "7"), (answers[2], "9")):  # turns 0 and 2 (after /reset) start afresh
        code, single, _ = run(capsys, "generate", *RANDOM, "--tokenizer", str(tok_path), "--prompt", "Hello there",
                              "--chat", "--seed", seed, *FAST, "--impl", "reference")
        assert code == 0 and single.splitlines() == [answer]


# --- train, inspect -------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_train_without_preset_is_the_documented_cpu_small_recipe(capsys, tiny_data, tmp_path):
    """`dgemma train --data D --out R` (docs/training.md), stopped after one step: no --preset means cpu-small."""
    out_dir = tmp_path / "run"
    code, out, _ = run(capsys, "train", "--data", str(tiny_data), "--out", str(out_dir), "--print-config")
    assert code == 0 and json.loads(out) == TRAIN_PRESETS["cpu-small"].to_json()
    code, out, err = run(capsys, "train", "--data", str(tiny_data), "--out", str(out_dir), "--until-step", "1",
                         "--eval-batches", "1")
    assert code == 0, err
    assert "done: step 1" in out
    ckpt = latest_checkpoint(out_dir)
    assert json.loads((ckpt / "train_config.json").read_text())["preset"] == "cpu-small"
    assert dgemma.load_model(out_dir).config == TRAIN_PRESETS["cpu-small"].model_config  # time conditioning on


def test_inspect_accepts_a_training_run(capsys, tiny_run, tmp_path):
    code, from_run, _ = run(capsys, "inspect", str(tiny_run), "--json")
    assert code == 0
    code, from_ckpt, _ = run(capsys, "inspect", str(latest_checkpoint(tiny_run)), "--json")
    code2, from_preset, _ = run(capsys, "inspect", "--preset", "tiny", "--json")
    assert code == code2 == 0
    assert json.loads(from_run) == json.loads(from_ckpt) == json.loads(from_preset)
    code, text, _ = run(capsys, "inspect", str(tiny_run))
    assert code == 0 and text.startswith(f"model {tiny_run}: 4 layers, hidden 64, vocab 512, canvas 16")
    empty = tmp_path / "empty-run"
    (empty / "checkpoints").mkdir(parents=True)
    code, _, err = run(capsys, "inspect", str(empty))
    assert code == 2 and len(err.splitlines()) == 1 and "a training run with no complete checkpoint yet" in err
    code, _, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2 and len(err.splitlines()) == 1 and "no config.json" in err


@pytest.mark.parametrize("spec,per_device", [("ep=8", "12.81 GB"), ("tp=2", "50.60 GB"), ("ep+tp=4", "15.28 GB"),
                                              ("ep=4,tp=2", "16.34 GB")])
def test_inspect_parallel_prints_one_devices_memory(capsys, spec, per_device):
    """docs/parallel.md's figures for the 26B (bf16, batch 1, context 4096) against one device's 52.78 GB."""
    code, text, err = run(capsys, "inspect", "--preset", "diffusiongemma-26b-a4b", "--parallel", spec)
    assert code == 0, err
    lines = text.splitlines()
    assert lines[1].startswith(f"layout {spec}: ") and lines[2].endswith(f"one device  per device ({spec})")
    total = next(line for line in lines if line.startswith("total")).split()
    assert total[-4:] == ["52.78", "GB", *per_device.split()]
    fits = lines[-2] if spec == "ep=4,tp=2" else lines[-1]  # a 2-D mesh: one more line, planning only
    assert fits.startswith("fits per device") and "24 GB" in fits and "141 GB" in fits
    assert (lines[-1] == "planning only: dgemma generate --parallel runs ep, tp or ep+tp over the same ranks, with "
            "plain weights") == (spec == "ep=4,tp=2")
    code, out, _ = run(capsys, "inspect", "--preset", "diffusiongemma-26b-a4b", "--parallel", spec, "--json")
    p = json.loads(out)["parallel"]
    assert code == 0 and f"{p['per_device']['total'] / 1e9:.2f} GB" == per_device and p["layout"] == spec


def test_docs_parallel_tables_are_what_inspect_prints(capsys):
    """docs/parallel.md, its Memory planning section: the block after "The first command prints:" is `--parallel
    ep=8`'s output, and each row of the 26B table (weights bf16, totals bf16 / int8 / int4) is what --json says, to
    the hundredth of a GB."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "parallel.md").read_text(encoding="utf-8")
    doc = text.split("\n## Memory planning\n", 1)[1].split("\n## ", 1)[0]
    shown = doc.split("The first command prints:\n\n```\n", 1)[1].split("```", 1)[0]
    code, text, _ = run(capsys, "inspect", "--preset", "diffusiongemma-26b-a4b", "--parallel", "ep=8")
    assert code == 0 and text == shown
    number = r" \| ([\d.]+)"
    rows = re.findall(r"^\| [^|`]*`([^`]+)`[^|]*\| \d+" + number * 4 + r" \|", doc, re.MULTILINE)
    assert len(rows) == 10, rows
    for spec, *figures in rows:
        got = []
        for i, quantize in enumerate((None, "int8", "int4")):
            extra = ["--quantize", quantize] if quantize else []
            code, out, _ = run(capsys, "inspect", "--preset", "diffusiongemma-26b-a4b", "--parallel", spec, "--json",
                               *extra)
            p = json.loads(out)["parallel"]["per_device"]
            if i == 0:
                got.append(f"{p['weights']['total'] / 1e9:.2f}")
            got.append(f"{p['total'] / 1e9:.2f}")
        assert got == figures, spec


def test_inspect_batch_sizes_the_preflight_and_the_plan(capsys):
    from dgemma.model import costs, plan

    code, out, _ = run(capsys, "inspect", "--preset", "tiny", "--batch", "3", "--context", "100", "--parallel", "ep=2",
                       "--json")
    r, cfg = json.loads(out), dgemma.preset("tiny")
    assert code == 0 and r["preflight_bytes"]["bf16"] == costs.memory_needed(cfg, torch.bfloat16, weights=True,
                                                                              batch_size=3, cache_length=100)
    assert r["parallel"] == plan.plan(cfg, plan.ParallelLayout(ep=2), batch=3, context=100)


def test_inspect_parallel_refuses_a_layout_the_model_does_not_divide(capsys):
    code, _, err = run(capsys, "inspect", "--preset", "diffusiongemma-26b-a4b", "--parallel", "tp=3")
    assert code == 2 and err == ("dgemma inspect: error: --parallel tp=3: tp=3 does not divide "
                                 "num_attention_heads=16 (diffusiongemma-26b-a4b)\n")
    code, _, err = run(capsys, "inspect", "--preset", "tiny", "--parallel", "ep=3", "--json")
    assert code == 2 and "ep=3 does not divide num_experts=8" in err and len(err.splitlines()) == 1
