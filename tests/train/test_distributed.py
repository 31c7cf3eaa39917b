"""Training on several processes: torchrun launches 2 CPU ranks (gloo on 127.0.0.1, a free port), against one process.

- DDP with 2 ranks x batch 2 equals 1 process x batch 4 within fp32 rounding over 10 steps (losses, held-out losses,
  final weights); FSDP2 with 2 ranks equals DDP;
- a sharded checkpoint written by 2 ranks resumes bit-exactly on 2 ranks, and resumes on 1 process (the same
  command: the batch is rescaled to keep the windows per step), within rounding of the uninterrupted run;
- SIGKILL of one rank stops the whole job; the same command resumes from the last complete checkpoint;
- an error every rank meets is shown once; `dgemma export` consolidates a sharded checkpoint;
- the sampler and the noise: W ranks' rows of micro-batch k are one process's micro-batch k.

The equivalence runs use `lite-tiny` (dense): with routed experts (`tiny`) the first steps agree to 1e-7 too, but a
token whose top-k experts are nearly tied switches expert on a rounding difference, after which the runs differ by
more than rounding (a discrete choice, not an error of the distributed path). Each launch is a subprocess with a
timeout, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dgemma import cli
from dgemma.data.shards import TokenDataset
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.train.config import train_preset
from dgemma.train.diffusion import training_loss
from dgemma.train.loop import train
from dgemma.weights.checkpoint import CheckpointError, list_checkpoints
from dgemma.weights.loading import init_weights, load_model

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
FLAGS = ["--preset", "lite-tiny", "--vocab-size", "512", "--seq-len", "32", "--max-steps", str(STEPS),
         "--warmup-steps", "2", "--eval-every", "5", "--eval-batches", "2", "--save-every", "5", "--keep-last", "5",
         "--log-every", "100", "--device", "cpu"]
TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], nproc: int = 2, wait: bool = True, timeout: float = TIMEOUT):
    """`torchrun --nproc-per-node N -m dgemma ARGS` on 127.0.0.1 (CPU, gloo, one thread a rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "dgemma", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def train_ranks(data: Path, run: Path, *extra: str, nproc: int = 2):
    done = torchrun(["train", "--data", str(data), "--out", str(run), *FLAGS, *extra], nproc)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> tuple[list[float], list[float]]:
    ms = metrics(run)
    return [m["loss"] for m in ms if "loss" in m], [m["val_loss"] for m in ms if "val_loss" in m]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(list_checkpoints(run)[-1] / "model.safetensors")


def assert_close_runs(a: Path, b: Path, weights_atol: float = 1e-4) -> None:
    (la, va), (lb, vb) = losses(a), losses(b)
    assert len(la) == len(lb) == STEPS and len(va) == len(vb) == 3  # one record per step: one writer
    assert la == pytest.approx(lb, rel=1e-5) and va == pytest.approx(vb, rel=1e-5), (la, lb, va, vb)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < weights_atol, worst  # measured ~7e-6: AdamW's first steps are sign-like on rounding noise


@pytest.fixture(scope="module")
def data(tiny_data) -> Path:
    return tiny_data


@pytest.fixture(scope="module")
def ddp_run(data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ddp") / "run"
    train_ranks(data, run, "--batch-size", "2")
    return run


@pytest.fixture(scope="module")
def single_run(data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("single") / "run"
    assert cli.main(["train", "--data", str(data), "--out", str(run), *FLAGS, "--batch-size", "4"]) == 0
    return run


# --- equivalence ---------------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_ddp_two_ranks_equal_one_process_with_twice_the_batch(ddp_run, single_run):
    assert_close_runs(ddp_run, single_run)
    record = json.loads((ddp_run / "run.json").read_text())
    assert record["world_size"] == 2 and record["train_config"]["batch_size"] == 2
    assert [m["tokens"] for m in metrics(ddp_run) if "loss" in m][-1] == STEPS * 2 * 2 * 32
    ckpts = list_checkpoints(ddp_run)
    assert [p.name for p in ckpts] == ["step-0000005", "step-0000010"]
    assert (ckpts[0] / ".metadata").is_file() and not (ckpts[0] / "model.safetensors").exists()  # sharded only
    assert (ckpts[1] / "model.safetensors").is_file()  # the last one is consolidated too
    load_model(ddp_run)  # what `dgemma generate --model RUN` loads


@pytest.mark.integration
def test_fsdp_two_ranks_equal_ddp(data, ddp_run, tmp_path):
    run = tmp_path / "fsdp"
    train_ranks(data, run, "--batch-size", "2", "--parallel", "fsdp")
    assert_close_runs(run, ddp_run)


# --- sharded checkpoints -------------------------------------------------------------------------------------------

def cut_at_step_5(src: Path, dst: Path) -> Path:
    """A copy of run `src` as a kill right after its step-5 checkpoint would have left it."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step-0000010")
    (dst / "checkpoints" / "latest").write_text("step-0000005\n")
    return dst


@pytest.mark.integration
def test_sharded_checkpoint_resumes_bit_exactly_on_two_ranks(data, ddp_run, tmp_path):
    run = cut_at_step_5(ddp_run, tmp_path / "run")
    done = train_ranks(data, run, "--batch-size", "2", "--resume")
    assert "resuming" in done.stdout and "at step 5" in done.stdout
    a, b = final_weights(run), final_weights(ddp_run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(run) == losses(ddp_run)


@pytest.mark.integration
def test_sharded_checkpoint_resumes_on_one_process(data, ddp_run, tmp_path, capsys):
    run = cut_at_step_5(ddp_run, tmp_path / "run")
    # The same command without torchrun: the run's 2 ranks x batch 2 become 1 process x batch 4.
    assert cli.main(["train", "--data", str(data), "--out", str(run), "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out
    assert json.loads((run / "run.json").read_text())["train_config"]["batch_size"] == 4
    assert_close_runs(run, ddp_run)
    assert (list_checkpoints(run)[-1] / "trainer_state.pt").is_file()  # one process writes its own format


@pytest.mark.integration
def test_export_consolidates_a_sharded_checkpoint(ddp_run, tmp_path, capsys):
    step5, step10 = list_checkpoints(ddp_run)
    with pytest.raises(CheckpointError, match="dgemma export"):
        load_model(step5)
    assert cli.main(["export", str(step10), "--out", str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    consolidated = load_file(step10 / "model.safetensors")
    assert all(torch.equal(exported[k], consolidated[k]) for k in consolidated)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert cli.main(["export", str(step5), "--out", str(tmp_path / "hf5")]) == 0
    load_model(tmp_path / "hf5")
    assert cli.main(["export", str(ddp_run), "--out", str(tmp_path / "hf")]) == 2  # not empty
    assert "--out" in capsys.readouterr().err


@pytest.mark.integration
def test_fsdp_fine_tunes_a_checkpoint_from_rank_0s_copy(data, single_run, tmp_path):
    """--init-from under FSDP: the model is built on the meta device and each rank's shards are filled from the
    weights rank 0 alone reads; 3 steps match one process from the same checkpoint."""
    init = str(list_checkpoints(single_run)[-1])
    flags = ["--init-from", init, "--seq-len", "32", "--max-steps", "3", "--warmup-steps", "1", "--eval-every", "3",
             "--eval-batches", "2", "--save-every", "3", "--log-every", "100", "--device", "cpu"]
    sharded, one = tmp_path / "fsdp", tmp_path / "one"
    done = torchrun(["train", "--data", str(data), "--out", str(sharded), *flags, "--batch-size", "2",
                     "--parallel", "fsdp"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert cli.main(["train", "--data", str(data), "--out", str(one), *flags, "--batch-size", "4"]) == 0
    (la, va), (lb, vb) = losses(sharded), losses(one)
    assert la == pytest.approx(lb, rel=1e-5) and va == pytest.approx(vb, rel=1e-5)
    wa, wb = final_weights(sharded), final_weights(one)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4


# --- failures ------------------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_an_error_every_rank_meets_is_shown_once(data, ddp_run):
    done = torchrun(["train", "--data", str(data), "--out", str(ddp_run), *FLAGS])  # exists, no --resume
    assert done.returncode != 0
    assert done.stderr.count("dgemma train: error:") == 1, done.stderr[-3000:]
    assert "pass --resume" in done.stderr


def rank_pids(agent: int) -> dict[int, int]:
    """rank -> pid of torchrun's workers (children of the agent with RANK in their environment)."""
    found = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = dict(kv.split("=", 1) for kv in (p / "environ").read_bytes().decode().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent and "RANK" in env:
            found[int(env["RANK"])] = int(p.name)
    return found


@pytest.mark.integration
def test_sigkill_of_one_rank_stops_the_job_and_the_same_command_resumes(data, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(run), *FLAGS, "--batch-size", "2", "--max-steps", "60",
            "--save-every", "3", "--eval-every", "1000", "--resume"]
    proc = torchrun(args, wait=False)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not any(m.get("step", 0) >= 5 for m in (metrics(run) if (run / "metrics.jsonl").is_file() else [])):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job never reached step 5"
            time.sleep(0.05)
        pids = rank_pids(proc.pid)
        assert set(pids) == {0, 1}, pids
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)  # the agent stops rank 0 too and fails
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert not rank_pids(proc.pid)
    assert "[rank0]: Traceback" not in err, err[-3000:]  # rank 0 says one line at most, no trace
    assert err.count("dgemma train: error:") <= 1
    last = list_checkpoints(run)[-1]
    step = int(last.name[5:])
    assert step >= 3 and step % 3 == 0 and step < 60
    done = torchrun(args)  # the same command
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step {step}" in done.stdout
    steps = [m["step"] for m in metrics(run) if "loss" in m]
    assert steps == list(range(1, 61))  # each step logged once: the killed run's records after its checkpoint redone


# --- the sampler and the noise, in one process ---------------------------------------------------------------------

def test_ranks_read_disjoint_rows_of_the_single_process_batches(data):
    ds = TokenDataset(data, "train")
    whole = ds.batches(4, 32, seed=3, start_batch=2)
    halves = [ds.batches(2, 32, seed=3, start_batch=2, rank=r, world_size=2) for r in (0, 1)]
    accum = ds.batches(2, 32, seed=3, start_batch=4)  # batch 2 x grad_accum 2: micro-batches 4, 5 are step 2's
    for _ in range(3):
        expected = next(whole)
        assert torch.equal(torch.cat([next(h) for h in halves]), expected)
        assert torch.equal(torch.cat([next(accum), next(accum)]), expected)
    with pytest.raises(ValueError, match="rank"):
        ds.batches(2, 32, seed=3, rank=2, world_size=2)


def test_split_rows_draw_the_noise_of_the_whole_batch(data):
    model = init_weights(DiffusionGemma(train_preset("tiny").model_config), seed=0)
    x0 = next(TokenDataset(data, "train").batches(4, 32, seed=0))
    kw = dict(objective="clean-context", num_steps=16, self_conditioning_prob=0.5, chunk_rows=64)
    with torch.no_grad():
        whole = training_loss(model, x0, generator=torch.Generator().manual_seed(7), **kw)
        parts = [training_loss(model, x0[lo:lo + 2], generator=torch.Generator().manual_seed(7),
                               batch_rows=(lo, 4), **kw) for lo in (0, 2)]
    assert all(p.self_conditioned == whole.self_conditioned for p in parts)
    assert float(sum(p.cross_entropy for p in parts) / 2) == pytest.approx(float(whole.cross_entropy), rel=1e-6)


@pytest.mark.integration
def test_resume_on_another_world_size_keeps_the_windows_per_step(data, ddp_run, tmp_path):
    from dgemma.model.config import ConfigError
    from dgemma.train.config import TrainConfig
    from dgemma.train.distributed import rescale_for_world

    cfg = TrainConfig.from_json(json.loads((ddp_run / "run.json").read_text())["train_config"])
    assert rescale_for_world(cfg, 2, 1).batch_size == 4
    with pytest.raises(ConfigError, match="--batch-size and --grad-accum"):
        rescale_for_world(cfg.replace(batch_size=3), 2, 4)
    run = cut_at_step_5(ddp_run, tmp_path / "run")
    with pytest.raises(ConfigError, match="windows per step"):  # 1 process x batch 2 would halve the step
        train(cfg, data, run, resume=True, stream=io.StringIO())
