"""A training run directory under concurrency and faults (dgemma/train/run_dir.py): the writer's lock (two writers, a
writer and a resume, a writer killed by SIGKILL while it holds the lock, each with real `dgemma train` processes),
restart semantics (the same --resume command starts and restarts a run; fallback to the newest intact checkpoint;
a torn metrics line; another data directory), damaged shards, and non-finite numbers."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dgemma.train.config as C
import dgemma.train.loop as T
from dgemma import cli
from dgemma.data.shards import DataError
from dgemma.io import lock
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.train import run_dir
from dgemma.weights.checkpoint import latest_checkpoint, list_checkpoints
from dgemma.weights.loading import init_weights
from tests.helpers import after_each_training_step

ROOT = Path(__file__).resolve().parents[2]
BASE = C.train_preset("tiny").replace(batch_size=2, max_steps=4, warmup_steps=2, eval_every=100, eval_batches=1,
                                      save_every=1, keep_last=10, log_every=100)
FLAGS = ["--preset", "tiny", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "2", "--eval-every", "100",
         "--save-every", "1", "--keep-last", "10", "--max-steps", "6"]


def quiet_train(cfg, data, run, **kw) -> tuple[T.TrainResult, str]:
    out = io.StringIO()
    return T.train(cfg, data, run, stream=out, **kw), out.getvalue()


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_steps(run: Path) -> list[int]:
    return [m["step"] for m in metrics(run) if "loss" in m]


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


def copy_data(src: Path, dst: Path, damage: bytes | None = None, update_meta: bool = False) -> Path:
    """A copy of a prepared directory; `damage` overwrites the start of its first train shard (and, with
    `update_meta`, meta.json records the new checksum, as if the damage had happened before prepare)."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    shard = meta["splits"]["train"]["shards"][0]
    if damage is not None:
        path = dst / shard["file"]
        data = bytearray(path.read_bytes())
        data[:len(damage)] = damage
        path.write_bytes(bytes(data))
        if update_meta:
            shard["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
            (dst / "meta.json").write_text(json.dumps(meta))
    return dst / shard["file"]


# --- restart semantics ---------------------------------------------------------------------------------------------

def test_resume_starts_a_new_run_and_records_its_data(tiny_data, tmp_path):
    run = tmp_path / "run"
    result, _ = quiet_train(BASE.replace(max_steps=2), tiny_data, run, resume=True)
    assert result.step == 2 and train_steps(run) == [1, 2]
    record = json.loads((run / "run.json").read_text())
    assert record["train_config"]["max_steps"] == 2
    meta = json.loads((tiny_data / "meta.json").read_text())
    assert record["data"]["tokenizer_sha256"] == meta["tokenizer"]["sha256"]
    assert len(record["data"]["shards"]) == sum(len(s["shards"]) for s in meta["splits"].values())


@pytest.mark.parametrize("resume", [True, False])
def test_a_run_killed_before_its_first_checkpoint_continues(tiny_data, tmp_path, resume):
    run = tmp_path / "run"
    quiet_train(BASE.replace(max_steps=2), tiny_data, run)
    shutil.rmtree(run / "checkpoints")  # what a kill before the first save leaves: run.json, metrics, tokenizer
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.')  # and a torn line
    result, out = quiet_train(BASE.replace(max_steps=2), tiny_data, run, resume=resume)
    assert result.step == 2 and train_steps(run) == [1, 2]  # started over at step 0, each step logged once
    assert "dropping its last line" in out


def test_resume_falls_back_to_the_newest_intact_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "run"
    quiet_train(BASE.replace(max_steps=4), tiny_data, run)
    state = run / "checkpoints" / "step-0000004" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    weights = run / "checkpoints" / "step-0000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # truncated
    result, out = quiet_train(BASE.replace(max_steps=5), tiny_data, run, resume=True)
    assert re.search(r"skipping checkpoint \S*step-0000004.*trainer_state", out), out
    assert re.search(r"skipping checkpoint \S*step-0000003", out), out
    assert "resuming" in out and "step-0000002 at step 2" in out
    assert result.step == 5 and train_steps(run) == [1, 2, 3, 4, 5]
    assert [p.name for p in list_checkpoints(run)][-3:] == ["step-0000003", "step-0000004", "step-0000005"]
    T.load_model(latest_checkpoint(run))


def test_no_intact_checkpoint_is_one_error(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    quiet_train(BASE.replace(max_steps=1), tiny_data, run)
    (run / "checkpoints" / "step-0000001" / "trainer_state.pt").write_bytes(b"garbage")
    code = cli.main(["train", "--data", str(tiny_data), "--out", str(run), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no intact checkpoint to resume from" in err, err


def test_torn_metrics_line_is_dropped_on_resume(tiny_data, tmp_path):
    run = tmp_path / "run"
    quiet_train(BASE.replace(max_steps=2), tiny_data, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    result, out = quiet_train(BASE.replace(max_steps=3), tiny_data, run, resume=True)
    assert "metrics.jsonl: dropping its last line" in out
    assert result.step == 3 and train_steps(run) == [1, 2, 3]


def test_other_data_is_refused_unless_allowed(tiny_data, tmp_path, capsys):
    run, other = tmp_path / "run", tmp_path / "other"
    quiet_train(BASE.replace(max_steps=1), tiny_data, run)
    shard = copy_data(tiny_data, other, damage=bytes([5, 0, 6, 0]), update_meta=True)  # same vocabulary, other ids
    before = tree(run)
    code = cli.main(["train", "--data", str(other), "--out", str(run), "--resume", "--max-steps", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "trained on other data (1 changed shard(s), e.g. " + shard.name in err and "--allow-new-data" in err
    assert tree(run) == before
    code = cli.main(["train", "--data", str(other), "--out", str(run), "--resume", "--max-steps", "2",
                     "--allow-new-data"])
    assert code == 0 and "continues on other data" in capsys.readouterr().out
    assert train_steps(run) == [1, 2]


# --- damaged data ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("update_meta, expected", [(False, "checksum mismatch"),
                                                   (True, "token id 65,535 at position 0 is out of range")])
def test_a_damaged_shard_is_one_error_and_the_run_stays_continuable(tiny_data, tmp_path, capsys, update_meta,
                                                                    expected):
    data, run = tmp_path / "data", tmp_path / "run"
    quiet_train(BASE.replace(max_steps=1), tiny_data, run)
    shard = copy_data(tiny_data, data, damage=b"\xff" * 64, update_meta=update_meta)
    before = tree(run)
    argv = ["train", "--data", str(data), "--out", str(run), "--resume", "--max-steps", "2"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(shard) in err and expected in err, err
    assert tree(run) == before
    with pytest.raises(DataError, match=re.escape(str(shard))):
        T.train(BASE.replace(max_steps=2), data, tmp_path / "fresh", stream=io.StringIO())
    assert not (tmp_path / "fresh").exists()
    shutil.rmtree(data)
    shutil.copytree(tiny_data, data)  # the data fixed: the same command continues
    assert cli.main(argv) == 0 and train_steps(run) == [1, 2]


# --- non-finite numbers ---------------------------------------------------------------------------------------------

def test_a_nonfinite_loss_on_the_first_steps_stops_the_run(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    code = cli.main(["train", "--data", str(tiny_data), "--out", str(run), "--preset", "tiny", "--batch-size", "2",
                     "--eval-batches", "1", "--max-steps", "5", "--save-every", "1", "--lr", "1e30", "--min-lr", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"step [1-3]: loss .*, gradient norm .*: not finite \(one of the first 3 steps\); "
                     r"training stopped.*--lr 1e\+30", err), err
    for ckpt in list_checkpoints(run):  # whatever was saved is finite
        model = T.load_model(ckpt)
        assert run_dir.nonfinite_tensor(iter(model.state_dict().items())) is None
    assert [m["event"] for m in metrics(run) if "event" in m][-1] == "stopped_nonfinite"


def test_nonfinite_steps_in_a_row_stop_the_run(tiny_data, tmp_path):
    def poisoned(kwargs, out):
        if kwargs["generator"].initial_seed() >= 4:  # micro-steps 4.. (steps 5..)
            out.loss = out.loss * float("nan")

    run = tmp_path / "run"
    with after_each_training_step(poisoned), \
            pytest.raises(run_dir.NonFiniteError, match=f"{T.NONFINITE_STREAK} steps in a row"):
        quiet_train(BASE.replace(max_steps=20), tiny_data, run)
    assert latest_checkpoint(run).name == f"step-{3 + T.NONFINITE_STREAK:07d}"  # skipped steps change nothing
    skipped = [m["step"] for m in metrics(run) if m.get("event") == "skipped_nonfinite"]
    assert skipped == list(range(5, 5 + T.NONFINITE_STREAK))


def test_no_checkpoint_with_a_nonfinite_tensor_is_written(tmp_path):
    model = init_weights(DiffusionGemma(C.PRESETS["tiny"]))
    with torch.no_grad():
        next(iter(model.parameters()))[0].fill_(float("nan"))
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(run_dir.NonFiniteError, match="non-finite values; no checkpoint written"):
        run_dir.save_checkpoint(tmp_path, model, optimizer, {}, 2, {"step": 1})
    assert not list_checkpoints(tmp_path) and not list((tmp_path / "checkpoints").glob("*"))


# --- the lock --------------------------------------------------------------------------------------------------------

def test_the_lock_refuses_a_second_writer_in_process(tiny_data, tmp_path):
    run = tmp_path / "run"
    with lock.locked(run), pytest.raises(lock.BusyError, match=f"being written by pid {os.getpid()} on "):
        quiet_train(BASE, tiny_data, run, resume=True)
    assert [p.name for p in run.iterdir()] == [".lock"]
    quiet_train(BASE.replace(max_steps=1), tiny_data, run)  # released: a run holding only its lock file is new


# A real `dgemma train` that blocks inside step 3 (steps 1 and 2 checkpointed) until the file argv[1] exists, after
# creating argv[2]: a writer holding its run's lock for as long as the test needs.
GATED = """
import os, sys, time
from dgemma import cli
from tests.helpers import after_each_training_step
gate, flag = sys.argv[1], sys.argv[2]
calls = [0]
def gated(kwargs, out):
    calls[0] += 1
    if calls[0] == 3:
        open(flag, "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
with after_each_training_step(gated):
    sys.exit(cli.main(sys.argv[3:]))
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start_gated_writer(data: Path, run: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    gate, flag = tmp_path / "gate", tmp_path / "in-step-3"
    proc = subprocess.Popen([sys.executable, "-c", GATED, str(gate), str(flag), "train", "--data", str(data), "--out",
                             str(run), *FLAGS], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not flag.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the writer exited {proc.returncode}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, "the writer never reached step 3"
        time.sleep(0.05)
    return proc, gate


def dgemma_train(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgemma", "train", *argv], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.integration
def test_a_second_writer_and_a_resume_are_refused_and_the_first_loses_nothing(tiny_data, tmp_path):
    run = tmp_path / "run"
    writer, gate = start_gated_writer(tiny_data, run, tmp_path)
    try:
        for extra in ([], ["--resume"]):  # the same command again, and a resume of the run
            second = dgemma_train("--data", str(tiny_data), "--out", str(run), *FLAGS, "--max-steps", "8", *extra)
            assert second.returncode == 2, second.stderr
            assert second.stderr.count("\n") == 1, second.stderr
            assert f"is being written by pid {writer.pid} on host " in second.stderr, second.stderr
            assert "wait for it to finish or stop it" in second.stderr
        gate.touch()
        _, err = writer.communicate(timeout=300)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 0, err
    assert train_steps(run) == [1, 2, 3, 4, 5, 6]  # every record of the first writer, once
    assert [p.name for p in list_checkpoints(run)] == [f"step-{s:07d}" for s in range(1, 7)]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000006"
    assert json.loads((run / "run.json").read_text())["train_config"]["max_steps"] == 6


@pytest.mark.integration
def test_a_writer_killed_while_holding_the_lock_releases_it(tiny_data, tmp_path):
    run = tmp_path / "run"
    writer, _ = start_gated_writer(tiny_data, run, tmp_path)
    try:
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    assert f'"pid": {writer.pid}' in (run / ".lock").read_text()  # the dead holder's record stays; its lock does not
    resumed = dgemma_train("--data", str(tiny_data), "--out", str(run), *FLAGS, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"resuming \S*step-0000002 at step 2", resumed.stdout), resumed.stdout
    assert train_steps(run) == [1, 2, 3, 4, 5, 6]
