"""Training with the routed experts split over the ranks (`torchrun ... dgemma train --parallel ep`): 2 CPU ranks
(gloo) against one process on the same batch, and its DCP checkpoints resumed on another world size and layout."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from dgemma import cli
from dgemma.weights.checkpoint import list_checkpoints
from tests.parallel.workers import train_grads
from tests.train.test_distributed import final_weights, free_port, losses, metrics, torchrun

STEPS = 4
FLAGS = ["--preset", "tiny", "--vocab-size", "512", "--seq-len", "32", "--max-steps", str(STEPS),
         "--warmup-steps", "1", "--eval-every", "2", "--eval-batches", "1", "--save-every", "2", "--keep-last", "5",
         "--log-every", "100", "--device", "cpu", "--batch-size", "4"]


def assert_close(a: Path, b: Path, atol: float = 5e-3, val_rel: float = 1e-5) -> None:
    """Losses to fp32 rounding; weights within about one step of the learning rate (3e-3): AdamW's first steps are
    sign-like, so a near-zero gradient whose rounding differs moves a weight by up to lr either way (measured 2.6e-3,
    in the self-conditioning MLP; test_ep_gradients_on_two_ranks_are_one_processs checks the gradients themselves)."""
    (la, va), (lb, vb) = losses(a), losses(b)
    assert len(la) == len(lb) == STEPS
    assert la == pytest.approx(lb, rel=1e-5) and va == pytest.approx(vb, rel=val_rel), (la, lb, va, vb)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < atol, worst


@pytest.fixture(scope="module")
def ep_run(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ep") / "run"
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(run), *FLAGS, "--parallel", "ep"])
    assert done.returncode == 0, done.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def single_run(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("single") / "run"
    assert cli.main(["train", "--data", str(tiny_data), "--out", str(run), *FLAGS]) == 0
    return run


@pytest.mark.integration
def test_ep_on_two_ranks_trains_as_one_process_on_the_same_batch(ep_run, single_run):
    # each rank holds 4 of the tiny preset's 8 experts and reads the whole batch: one process's steps, to fp32
    # rounding (the gradient norm sums the experts' squares over the ranks in another order)
    assert_close(ep_run, single_run)
    record = json.loads((ep_run / "run.json").read_text())
    assert record["world_size"] == 2 and record["data_world"] == 1
    assert [m["tokens"] for m in metrics(ep_run) if "loss" in m][-1] == STEPS * 4 * 32
    last = list_checkpoints(ep_run)[-1]
    assert (last / ".metadata").is_file()
    whole = [v for k, v in final_weights(ep_run).items() if k.endswith("experts.gate_up_proj")]
    assert whole and all(v.shape[0] == 8 for v in whole)  # consolidated: every expert, gathered


def cut_at_step_2(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / f"step-{STEPS:07d}")
    (dst / "checkpoints" / "latest").write_text("step-0000002\n")
    return dst


@pytest.mark.integration
def test_an_ep_checkpoint_resumes_on_one_process(tiny_data, ep_run, single_run, tmp_path, capsys):
    run = cut_at_step_2(ep_run, tmp_path / "run")
    assert cli.main(["train", "--data", str(tiny_data), "--out", str(run), "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out
    assert_close(run, single_run)


@pytest.mark.integration
def test_an_ep_checkpoint_resumes_under_ddp(tiny_data, ep_run, single_run, tmp_path):
    run = cut_at_step_2(ep_run, tmp_path / "run")
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(run), "--resume", "--parallel", "ddp"])
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((run / "run.json").read_text())["train_config"]["batch_size"] == 2  # 2 ranks x 2 rows
    assert_close(run, single_run)


@pytest.mark.integration
def test_an_ep_checkpoint_resumes_under_ep_on_4_ranks(tiny_data, ep_run, single_run, tmp_path):
    run = cut_at_step_2(ep_run, tmp_path / "run")  # 4 experts a rank -> 2: DCP reshards the experts and AdamW
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(run), "--resume"], nproc=4)
    assert done.returncode == 0, done.stderr[-4000:]
    assert_close(run, single_run)


@pytest.mark.integration
def test_a_single_process_checkpoint_resumes_under_ep(tiny_data, single_run, tmp_path):
    run = cut_at_step_2(single_run, tmp_path / "run")
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(run), "--resume", "--parallel", "ep"])
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resuming" in done.stdout
    assert_close(run, single_run)


@pytest.mark.integration
def test_ep_refuses_a_dense_model_and_experts_that_do_not_divide(tiny_data, tmp_path):
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(tmp_path / "dense"), *FLAGS,
                     "--preset", "lite-tiny", "--parallel", "ep"])
    assert done.returncode != 0
    line = ("dgemma train: error: --parallel ep on 2 ranks: ep=2 needs a mixture-of-experts model; this one is dense "
            "(num_experts=0)")
    assert (done.stdout + done.stderr).count(line) == 1  # shown once, by rank 0
    assert not (tmp_path / "dense").exists()  # refused before the run directory is written
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(tmp_path / "three"), *FLAGS, "--parallel", "ep"],
                    nproc=3)
    assert done.returncode != 0
    assert "--parallel ep on 3 ranks: ep=3 does not divide num_experts=8" in done.stdout + done.stderr


def test_ep_gradients_on_two_ranks_are_one_processs(tmp_path):
    """The loss and every parameter's gradient (the experts' gathered whole) of one step under ep on 2 ranks are one
    process's on the same batch, to fp32 rounding (the experts' input gradient is summed over the ranks)."""
    got, alone = spawned_grads(tmp_path, 2, "ep"), train_grads()
    assert got["loss"] == alone["loss"]  # the forward is bit-identical (dgemma/parallel/experts.py)
    assert_same_gradients(got, alone)


@pytest.mark.parametrize("parallel", ["fsdp+ep", "ddp+ep"])
def test_gradients_on_a_2x2_mesh_are_one_processs(tmp_path, parallel):
    """fsdp+ep (ddp+ep) on 4 ranks, --ep-size 2: two data replicas, each an expert-parallel pair reading its half of
    the batch; the rest of the model FSDP-sharded over all 4 (whole on every rank). The loss (the mean over the
    replicas) and every gradient (experts averaged over the replicas, the rest over the world) are one process's on
    the whole batch."""
    got, alone = spawned_grads(tmp_path, 4, parallel, 2), train_grads()
    assert got["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    assert_same_gradients(got, alone)


def spawned_grads(tmp_path: Path, world: int, parallel: str, ep_size: int | None = None) -> dict:
    import torch.multiprocessing as mp

    from tests.parallel.workers import train_rank_main

    out = tmp_path / "grads.pt"
    mp.spawn(train_rank_main, args=(world, free_port(), str(out), parallel, ep_size), nprocs=world)
    return torch.load(out)


def assert_same_gradients(got: dict, alone: dict) -> None:
    assert got["norm"] == pytest.approx(alone["norm"], rel=1e-5)
    assert got["grads"].keys() == alone["grads"].keys()
    for name, g in alone["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_the_expert_gather_has_this_ranks_slice_as_its_backward():
    from dgemma.parallel.experts import GatherRows

    class One:  # a group of one: the gather is the identity, the backward the whole gradient
        rank, world_size = 0, 1

        @staticmethod
        def gather_rows(rows, sizes):
            return rows

    x = torch.randn(3, 2, requires_grad=True)
    GatherRows.apply(x, One, [3]).sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 2))


# --- fsdp+ep: a (data, ep) mesh -----------------------------------------------------------------------------------

# 4 ranks: 2 data replicas of an expert-parallel pair, 2 windows a rank: the 4 windows a step of `single_run`
MESH_FLAGS = [*FLAGS, "--batch-size", "2", "--parallel", "fsdp+ep", "--ep-size", "2"]


@pytest.fixture(scope="module")
def mesh_run(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fsdp-ep") / "run"
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(run), *MESH_FLAGS], nproc=4)
    assert done.returncode == 0, done.stderr[-4000:]
    return run


@pytest.mark.integration
def test_fsdp_ep_on_a_2x2_mesh_trains_as_one_process_on_the_same_batch(mesh_run, single_run):
    assert_close(mesh_run, single_run)
    record = json.loads((mesh_run / "run.json").read_text())
    assert record["world_size"] == 4 and record["data_world"] == 2
    assert record["train_config"]["parallel"] == "fsdp+ep" and record["train_config"]["ep_size"] == 2
    whole = [v for k, v in final_weights(mesh_run).items() if k.endswith("experts.gate_up_proj")]
    assert whole and all(v.shape[0] == 8 for v in whole)  # consolidated: every expert, gathered


@pytest.fixture(scope="module")
def single_accumulating_run(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("single-accumulating") / "run"
    assert cli.main(["train", "--data", str(tiny_data), "--out", str(run), *FLAGS, "--batch-size", "2",
                     "--grad-accum", "2"]) == 0
    return run


@pytest.mark.integration
@pytest.mark.parametrize("parallel", ["ddp+ep", "fsdp+ep"])
def test_a_2x2_mesh_accumulating_micro_batches_trains_as_one_process(tiny_data, single_accumulating_run, tmp_path,
                                                                     parallel):
    # 1 window a rank x 2 replicas x 2 micro-batches = one process's 2 windows x 2 micro-batches: the experts'
    # gradients (and ddp+ep's replicated ones) are reduced once, after the step's last micro-batch; FSDP's
    # reduce-scatter waits for it too
    run = tmp_path / "run"
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(run), *FLAGS, "--batch-size", "1",
                     "--grad-accum", "2", "--parallel", parallel, "--ep-size", "2"], nproc=4)
    assert done.returncode == 0, done.stderr[-4000:]
    # the training losses to 1e-5; the held-out loss after the last step to 1e-3 (measured 4.5e-4 fsdp+ep, 7.9e-5
    # ddp+ep): the micro-batches' gradients are summed in another order, and AdamW's sign-like first steps turn that
    # rounding into moves of up to 1.1e-3 (the tied embedding's near-zero rows), within `atol`; plain ddp on 2 ranks
    # with the same micro-batches is as far (5.94580 against 5.94309)
    assert_close(run, single_accumulating_run, val_rel=1e-3)


@pytest.mark.integration
@pytest.mark.parametrize("layout", [[], ["--parallel", "ep"], ["--parallel", "fsdp"]],
                         ids=["fsdp+ep-1x2", "ep", "fsdp"])
def test_a_fsdp_ep_checkpoint_of_4_ranks_resumes_on_2(tiny_data, mesh_run, single_run, tmp_path, layout):
    # no --parallel: the run's fsdp+ep with its ep size 2, one data replica now (4 windows a rank); ep: every rank
    # splits the experts; fsdp: the experts whole again, FSDP-sharded (DCP reshards each from the 2x2 mesh's shards)
    run = cut_at_step_2(mesh_run, tmp_path / "run")
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(run), "--resume", *layout])
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resuming" in done.stdout
    assert_close(run, single_run)


@pytest.mark.integration
def test_a_fsdp_ep_checkpoint_of_4_ranks_resumes_on_one_process(tiny_data, mesh_run, single_run, tmp_path):
    run = cut_at_step_2(mesh_run, tmp_path / "run")
    assert cli.main(["train", "--data", str(tiny_data), "--out", str(run), "--resume"]) == 0
    assert json.loads((run / "run.json").read_text())["train_config"]["batch_size"] == 4
    assert_close(run, single_run)


@pytest.mark.integration
def test_fsdp_ep_refuses_a_mesh_that_does_not_split(tiny_data, tmp_path):
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(tmp_path / "three"), *FLAGS,
                     "--parallel", "fsdp+ep", "--ep-size", "3"], nproc=3)
    assert done.returncode != 0
    line = "--parallel fsdp+ep on 3 ranks: ep=3 does not divide num_experts=8"
    assert (done.stdout + done.stderr).count(line) == 1  # shown once, by rank 0
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(tmp_path / "odd"), *FLAGS,
                     "--parallel", "ddp+ep", "--ep-size", "2"], nproc=3)
    assert "--parallel ddp+ep on 3 ranks: --ep-size 2 does not divide the world size 3" in done.stdout + done.stderr
    assert not (tmp_path / "three").exists() and not (tmp_path / "odd").exists()


def test_the_training_mesh_and_its_refusals():
    from dgemma.model.config import ConfigError, preset
    from dgemma.model.plan import TrainMesh, check_train_mesh, train_mesh
    from dgemma.train.config import TrainConfig

    assert train_mesh("fsdp+ep", 4, 2) == TrainMesh(data=2, ep=2) and train_mesh("ep", 4, None) == TrainMesh(ep=4)
    assert train_mesh("ddp", 4, None) == TrainMesh(data=4) and train_mesh("fsdp+ep", 1, 2) == TrainMesh()
    assert [train_mesh("ddp+ep", 6, 2).data_rank(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    for args, message in [(("fsdp+ep", 4, None), "--parallel fsdp+ep needs --ep-size K"),
                          (("ddp+ep", 3, 2), "--ep-size 2 does not divide the world size 3")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            train_mesh(*args)
    with pytest.raises(ValueError, match="ep=4 does not divide num_experts=6"):
        check_train_mesh(dataclasses.replace(preset("tiny"), num_experts=6), "fsdp+ep", 8, 4)
    for parallel in ("fsdp", "ep"):
        with pytest.raises(ConfigError, match=re.escape("TrainConfig.ep_size: goes with parallel ddp+ep or fsdp+ep")):
            TrainConfig(parallel=parallel, ep_size=2)


@pytest.mark.integration
@pytest.mark.parametrize("layout", [["fsdp+ep", "--ep-size", "2"], ["fsdp"]], ids=["fsdp+ep", "fsdp"])
def test_a_single_process_checkpoint_resumes_under_fsdp_ep(tiny_data, single_run, tmp_path, layout):
    run = cut_at_step_2(single_run, tmp_path / "run")  # each rank keeps its experts; FSDP scatters the rest
    done = torchrun(["train", "--data", str(tiny_data), "--out", str(run), "--resume", "--parallel", *layout])
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resuming" in done.stdout
    assert_close(run, single_run)


@pytest.mark.parametrize("shards, ep, held, gathered, total", [
    (8, 1, 47.0, 8.8, 62.7), (8, 8, 47.0, 3.2, 57.0), (16, 1, 23.5, 8.8, 39.2), (16, 8, 44.8, 3.2, 54.8),
    (16, 16, 23.5, 3.2, 33.5)])
def test_the_pre_flight_counts_a_ranks_experts(shards, ep, held, gathered, total):
    """docs/parallel.md's memory table (the 26B-A4B fine-tuning rows of docs/training.md under fsdp+ep): a rank holds
    E / ep experts with their gradients and AdamW state, FSDP shards the rest over every rank and gathers no expert."""
    from dgemma.model import costs
    from dgemma.model.config import preset

    parts = costs.training_step_bytes(preset("diffusiongemma-26b-a4b"), batch_size=1, seq_len=2048, paired=True,
                                      chunk_rows=1024, use_bf16=True, compiled=True, activation_checkpointing=True,
                                      shards=shards, ep=ep)
    gib = lambda b: round(b / 2**30, 1)
    assert gib(parts["parameters"] + parts["gradients"] + parts["adamw"]) == held
    assert (gib(parts["gathered"]), gib(sum(parts.values()))) == (gathered, total)
    row = f"| {held} GiB | {gathered} GiB | {total} GiB |"
    assert row in (Path(__file__).resolve().parents[2] / "docs" / "parallel.md").read_text()
