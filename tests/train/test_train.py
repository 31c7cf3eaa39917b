"""The trainer: bit-exact resume (also after SIGKILL mid-step), checkpoint pruning, the NaN guard, learning, the
AR baseline, Hugging Face compatibility of what it saves, and every bad input of `dgemma train`.

Everything runs on the `tiny` preset with a 512-id BPE corpus built here, on one thread: tiny steps are a few
milliseconds of math, and with two threads on a busy 2-core machine OpenMP's waiting dominates them."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dgemma.train.config as C
import dgemma.train.loop as T
from dgemma import cli
from dgemma.model.config import ConfigError
from dgemma.train.config import TrainConfig, learning_rate
from dgemma.train.loop import train
from dgemma.weights.checkpoint import latest_checkpoint, list_checkpoints, resolve_model_dir
from dgemma.weights.loading import load_model
from tests.helpers import after_each_training_step

ROOT = Path(__file__).resolve().parents[2]
N = 3  # steps before the interruption; the uninterrupted run does 2N
BASE = C.train_preset("tiny").replace(batch_size=2, max_steps=2 * N, warmup_steps=2, eval_every=100, eval_batches=1,
                                      save_every=100, keep_last=10, log_every=100)


@pytest.fixture(scope="module")
def corpus(tiny_data) -> Path:
    """tests/conftest.py's tiny_data: 200 toy documents, a 512-id BPE."""
    return tiny_data


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(latest_checkpoint(run) / "model.safetensors")


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def quiet_train(cfg: TrainConfig, data_dir: Path, run: Path, **kw):
    return train(cfg, data_dir, run, stream=io.StringIO(), **kw)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    quiet_train(BASE, corpus, run)
    return run


# --- resume ------------------------------------------------------------------------------------------------------

def test_resume_equals_uninterrupted(corpus, uninterrupted, tmp_path):
    run = tmp_path / "run"
    first = quiet_train(BASE, corpus, run, until_step=N)
    assert (first.step, first.stopped) == (N, "until_step")
    second = quiet_train(BASE, corpus, run, resume=True)
    assert (second.step, second.stopped) == (2 * N, "max_steps")
    assert_bit_identical(weights(run), weights(uninterrupted))
    steps = [m["step"] for m in metrics(run) if "loss" in m]
    assert steps == list(range(1, 2 * N + 1))  # each step logged once
    assert latest_checkpoint(run).name == f"step-{2 * N:07d}"
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{2 * N:07d}"


KILLED_RUN = """
import sys, time, json, torch
torch.set_num_threads(1)
import dgemma.train.config as C
import dgemma.train.loop as T
from tests.helpers import after_each_training_step
cfg = C.TrainConfig.from_json(json.loads(sys.argv[1]))
calls = [0]
def slow(kwargs, out):
    calls[0] += 1
    if calls[0] == int(sys.argv[4]):
        open(sys.argv[5], "w").close()  # inside the step: the forward is done, backward and update are not
        time.sleep(600)
with after_each_training_step(slow):
    T.train(cfg, sys.argv[2], sys.argv[3])
"""


def sigkill_inside_step(cfg: TrainConfig, data: Path, run: Path, step: int, flag: Path, *, timeout: float
                        ) -> subprocess.Popen:
    """`train(cfg, data, run)` in a child (KILLED_RUN) killed with SIGKILL inside step `step` (its forward done, its
    backward and update not); the finished process."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, json.dumps(cfg.to_json()), str(data), str(run),
                             str(step), str(flag)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout
        while not flag.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, f"the run never reached step {step}"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    return proc


def test_sigkill_mid_step_keeps_the_last_checkpoint_and_resumes_exactly(corpus, uninterrupted, tmp_path):
    run = tmp_path / "run"
    cfg = BASE.replace(save_every=1)
    proc = sigkill_inside_step(cfg, corpus, run, N + 1, tmp_path / "in-step", timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # The last complete checkpoint is step N, and it loads.
    assert [p.name for p in list_checkpoints(run)][-1] == f"step-{N:07d}"
    load_model(resolve_model_dir(run))
    (run / "checkpoints" / f".tmp-step-{N + 1:07d}-12345").mkdir()  # as a save killed half-way leaves it
    (run / "checkpoints" / f".tmp-step-{N + 1:07d}-12345" / "model.safetensors").write_bytes(b"partial")
    assert resolve_model_dir(run).name == f"step-{N:07d}"
    result = quiet_train(cfg, corpus, run, resume=True)
    assert result.step == 2 * N
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert_bit_identical(weights(run), weights(uninterrupted))


def test_keep_last_prunes_old_checkpoints(corpus, tmp_path):
    run = tmp_path / "run"
    quiet_train(BASE.replace(max_steps=4, save_every=1, keep_last=2), corpus, run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-0000003", "step-0000004"]
    for ckpt in list_checkpoints(run):
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "train_config.json",
                "trainer_state.pt"} <= {p.name for p in ckpt.iterdir()}


def test_nan_guard_skips_the_step_and_logs_it(corpus, tmp_path):
    calls = []

    def poisoned(kwargs, out):
        calls.append(1)
        if len(calls) == 5:  # step 5's loss (after the first NONFINITE_FIRST_STEPS, which stop the run)
            out.loss = out.loss * float("nan")

    assert T.NONFINITE_FIRST_STEPS < 5 and T.NONFINITE_STREAK > 1
    run = tmp_path / "run"
    with after_each_training_step(poisoned):
        quiet_train(BASE.replace(max_steps=6, save_every=1), corpus, run)
    ckpts = {p.name: load_file(p / "model.safetensors") for p in list_checkpoints(run)}
    assert_bit_identical(ckpts["step-0000004"], ckpts["step-0000005"])  # step 5 changed nothing
    assert not torch.equal(ckpts["step-0000005"]["model.decoder.embed_tokens.weight"],
                           ckpts["step-0000006"]["model.decoder.embed_tokens.weight"])  # step 6 trained
    skipped = [m for m in metrics(run) if m.get("event") == "skipped_nonfinite"]
    assert [m["step"] for m in skipped] == [5]
    state = torch.load(latest_checkpoint(run) / "trainer_state.pt", weights_only=True)
    assert max(int(s["step"]) for s in state["optimizer"]["state"].values()) == 5  # AdamW stepped 5 times, not 6


# --- learning ------------------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_tiny_learns(corpus, tmp_path):
    run = tmp_path / "run"
    cfg = C.train_preset("tiny").replace(max_steps=100, eval_every=100, eval_batches=2, save_every=1000)
    result = quiet_train(cfg, corpus, run)
    start = next(m["val_loss"] for m in metrics(run) if "val_loss" in m)
    assert start > 5.5  # about log(512) = 6.24: nothing learned yet
    assert result.val_loss < 0.7 * start, (start, result.val_loss)  # measured: 6.08 -> 3.5 at step 100


def test_ar_objective_trains(corpus, tmp_path):
    run = tmp_path / "run"
    cfg = C.train_preset("tiny").replace(objective="ar", max_steps=40, eval_every=40, eval_batches=2,
                                         save_every=1000)
    result = quiet_train(cfg, corpus, run)
    start = next(m["val_loss"] for m in metrics(run) if "val_loss" in m)
    assert result.val_loss < 0.8 * start, (start, result.val_loss)
    assert json.loads((latest_checkpoint(run) / "train_config.json").read_text())["objective"] == "ar"


def test_trained_dg_checkpoint_loads_in_transformers(corpus, uninterrupted):
    from dgemma.testing.hf import hf_logits, load_hf_model

    ckpt = resolve_model_dir(uninterrupted)
    assert ckpt == latest_checkpoint(uninterrupted)
    ours = load_model(ckpt)
    theirs = load_hf_model(ckpt)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 512, (2, 11), generator=g)
    canvas = torch.randint(0, 512, (2, ours.config.canvas_length), generator=g)
    expected, _ = hf_logits(theirs, prompt, canvas)
    assert (ours(prompt, canvas) - expected).abs().max() < 1e-4


# --- schedule and config ----------------------------------------------------------------------------------------

def test_learning_rate_schedule():
    cfg = TrainConfig(preset="tiny", lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    assert learning_rate(cfg, 0) == pytest.approx(1e-4)
    assert learning_rate(cfg, 9) == pytest.approx(1e-3)
    assert learning_rate(cfg, 60) == pytest.approx(5.5e-4)
    assert learning_rate(cfg, 110) == pytest.approx(1e-4)


@pytest.mark.parametrize("change, field", [({"batch_size": 0}, "batch_size"), ({"objective": "mlm"}, "objective"),
                                           ({"seq_len": 40}, "seq_len"), ({"min_lr": 1.0}, "min_lr"),
                                           ({"preset": "nope"}, "preset"), ({"ar_weight": 0.5, "objective": "ar"},
                                                                            "ar_weight")])
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ConfigError, match=f"TrainConfig.{field}:"):
        TrainConfig(**({"preset": "tiny"} | change))


# --- bad input through the CLI -----------------------------------------------------------------------------------

def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["train", *argv])
    return code, capsys.readouterr().err


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))} if path.exists() else {}


TINY_FLAGS = ("--preset", "tiny", "--batch-size", "2", "--eval-batches", "1")


def test_cli_trains_and_resumes(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    code, _ = run_cli(capsys, "--data", str(corpus), "--out", str(run), *TINY_FLAGS, "--max-steps", "2")
    assert code == 0 and latest_checkpoint(run).name == "step-0000002"
    code, _ = run_cli(capsys, "--data", str(corpus), "--out", str(run), "--resume", "--max-steps", "3")
    assert code == 0 and latest_checkpoint(run).name == "step-0000003"


@pytest.mark.parametrize("case", ["missing data", "vocab", "incompatible resume", "resume a foreign directory",
                                  "non-empty run", "memory", "lr inf", "weight decay inf", "new data without resume"])
def test_cli_bad_input(case, corpus, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    args = ["--data", str(corpus), "--out", str(run), *TINY_FLAGS, "--max-steps", "1"]
    if case in ("incompatible resume", "non-empty run"):
        assert run_cli(capsys, *args)[0] == 0
    if case == "missing data":
        args[1], expected = str(tmp_path / "nowhere"), "no such data directory"
    elif case == "vocab":
        args += ["--vocab-size", "300"]
        expected = "tokenizer.json has 512 ids but the model.s vocab_size is 300"
    elif case == "incompatible resume":
        args += ["--resume", "--lr", "0.5"]
        expected = "cannot resume .*lr 0.003 -> 0.5"
    elif case == "resume a foreign directory":
        run.mkdir()
        (run / "notes.txt").write_text("mine")
        args += ["--resume"]
        expected = "has no checkpoint to resume from and is not a dgemma run"
    elif case == "lr inf":
        args += ["--lr", "inf"]
        expected = "TrainConfig.lr: must be a finite number, got inf"
    elif case == "weight decay inf":
        args += ["--weight-decay", "inf"]
        expected = "TrainConfig.weight_decay: must be a finite number, got inf"
    elif case == "new data without resume":
        args += ["--allow-new-data"]
        expected = "--allow-new-data goes with --resume"
    elif case == "non-empty run":
        expected = "exists and is not an empty directory: pass --resume"
    else:
        monkeypatch.setattr("dgemma.train.config.available_memory", lambda device: 10 * 2**20)
        expected = r"estimated peak memory .* GiB .* exceeds the 0.01 GiB available on cpu"
    before = tree(run)
    code, err = run_cli(capsys, *args)
    assert code == 2
    assert err.startswith("dgemma train: error:") and err.count("\n") == 1, err
    assert re.search(expected, err), err
    assert tree(run) == before  # nothing written, nothing removed


def test_recipe_overrides_reach_the_model_and_the_eval_logs_a_nelbo_curve(corpus, tmp_path):
    cfg = BASE.replace(time_embedding=True, canvas_length=8, t_sampling="stratified", loss_weighting="elbo",
                       max_steps=2, eval_every=1, eval_batches=2, eval_t_samples=2)
    assert cfg.model_config.time_embedding and cfg.model_config.canvas_length == 8
    run = tmp_path / "run"
    quiet_train(cfg, corpus, run)
    model = load_model(resolve_model_dir(run))
    assert model.config.time_embedding and model.config.canvas_length == 8 and model.time_proj is not None
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [e["step"] for e in evals] == [0, 1, 2]
    for e in evals:  # the learning curve: NELBO at the training T with its SE, against tokens seen
        assert e["val_nelbo"] > 0 and e["val_nelbo_se"] > 0 and e["val_loss_se"] >= 0
    assert [e["tokens"] for e in evals] == [0, 2 * 32, 4 * 32]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert all(s["cpu_s"] > 0 for s in steps)
    ar = tmp_path / "ar"
    quiet_train(BASE.replace(objective="ar", max_steps=1, eval_every=1, eval_batches=2), corpus, ar)
    ar_evals = [json.loads(line) for line in (ar / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert ar_evals and all("val_nelbo" not in e and e["val_loss_se"] >= 0 for e in ar_evals)


@pytest.mark.parametrize("change, message", [
    (dict(objective="ar", t_sampling="stratified"), "t_sampling: is a diffusion recipe switch"),
    (dict(objective="ar", loss_weighting="elbo"), "loss_weighting: is a diffusion recipe switch"),
    (dict(canvas_length=0), "canvas_length: must be a positive int"),
    (dict(eval_nelbo_steps=-1), "eval_nelbo_steps: must be None or an int >= 0"),
])
def test_bad_recipe_switches_are_refused(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        BASE.replace(**change)
