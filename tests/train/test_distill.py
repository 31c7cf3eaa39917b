"""`dgemma distill` (dgemma/train/distill.py, dgemma/cli/distill.py): the loss's properties (a KL that is >= 0, and 0
with zero gradient where the student matches its target, a proper target, a draw that follows the teacher's step, row
chunks that change nothing, a student that learns its target), a tiny distillation from a tiny teacher through the
CLI whose student generates at its N steps, one-line errors for every bad input, and (integration tier) a bit-exact
resume. The teacher is tests/conftest.py's `tiny_run` (the `tiny` preset trained 2 steps; 48 denoising steps)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dgemma.train.config as C
from dgemma import cli
from dgemma.cli.loading import load
from dgemma.diffusion.likelihood import posterior_logits
from dgemma.model.config import ConfigError
from dgemma.sampling.rules import ancestral_step
from dgemma.train.distill import distill_loss, inverse_cdf_draw, mean_posterior, soft_kl
from dgemma.train.loop import train
from dgemma.weights.checkpoint import latest_checkpoint
from dgemma.weights.loading import load_generation_config, load_model
from tests.train.test_train import ROOT, assert_bit_identical, sigkill_inside_step, tree, weights

N = 4  # the student's steps (the teacher's: 48)


@pytest.fixture(scope="module")
def teacher(tiny_run) -> Path:
    return tiny_run


@pytest.fixture(scope="module")
def models(teacher):
    torch.manual_seed(0)
    return load_model(teacher, dtype=torch.float32).eval(), load_model(teacher, dtype=torch.float32)


def windows(seed: int = 0, batch: int = 2, length: int = 32) -> torch.Tensor:
    return torch.randint(3, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- the loss ------------------------------------------------------------------------------------------------------

def test_soft_kl_is_zero_with_zero_gradient_exactly_where_the_student_matches():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(64, 50, generator=g) * 3
    other = (torch.randn(64, 50, generator=g) * 3).requires_grad_()
    kl = soft_kl(target, other)
    assert (kl > 0).all()
    same = target.clone().requires_grad_()
    zero = soft_kl(target, same + 7.0)  # a shift of the logits is the same distribution
    assert zero.abs().max() < 1e-5
    zero.sum().backward()
    assert same.grad.abs().max() < 1e-6
    kl.sum().backward()
    assert other.grad.abs().max() > 1e-3


def test_the_teachers_step_is_a_proper_distribution_and_the_draw_follows_it():
    g = torch.Generator().manual_seed(1)
    V, N = 40, 4
    z = torch.randn(1, 8, V, generator=g) * 2
    x = torch.randint(0, V, (1, 8), generator=g)
    for t in range(1, N + 1):
        probs = ancestral_step(z, x, t / N, t / N - 1 / (2 * N))
        assert torch.allclose(probs.sum(-1), torch.ones(1, 8), atol=1e-5) and (probs >= 0).all()
    p = probs[0, 0]
    u = torch.rand(200_000, generator=g)
    draws = inverse_cdf_draw(p.expand(u.shape[0], V), u)
    freq = torch.bincount(draws, minlength=V).double() / u.shape[0]
    assert (freq - p.double()).abs().max() < 0.01  # 200k draws: the SE of a frequency is <= 0.0012


def test_row_chunks_change_nothing(models):
    teacher, student = models
    x0 = windows()
    out = {}
    for rows in (None, 7):
        student.zero_grad()
        loss = distill_loss(student, x0, teacher=teacher, num_steps=N, self_conditioning_prob=1.0, chunk_rows=rows,
                            generator=torch.Generator().manual_seed(3))
        loss.loss.backward()
        out[rows] = (loss.loss.detach(), student.embed_tokens.weight.grad.clone(), loss.cross_entropy)
    assert torch.allclose(out[None][0], out[7][0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(out[None][1], out[7][1], rtol=1e-4, atol=1e-7)
    assert torch.allclose(out[None][2], out[7][2], rtol=1e-5)
    student.zero_grad()


def test_rows_split_across_ranks_compute_the_whole_batchs_loss(models):
    """With `batch_rows`, each rank's rows get the draws the whole micro-batch gets (torchrun's split)."""
    teacher, student = models
    x0 = windows(2, batch=4)
    kw = dict(teacher=teacher, num_steps=N, self_conditioning_prob=1.0, chunk_rows=64)
    with torch.no_grad():
        whole = distill_loss(student, x0, generator=torch.Generator().manual_seed(9), **kw)
        halves = [distill_loss(student, x0[lo:lo + 2], generator=torch.Generator().manual_seed(9),
                               batch_rows=(lo, 4), **kw) for lo in (0, 2)]
    assert torch.allclose(whole.loss, (halves[0].loss + halves[1].loss) / 2, rtol=1e-5)
    assert whole.self_conditioned == halves[0].self_conditioned == halves[1].self_conditioned


def test_the_loss_is_a_kl_and_the_student_learns_its_target(teacher):
    """A copy of the teacher starts above zero (two half steps are not one step) and the loss falls as the student
    trains on one fixed batch and fixed noise."""
    tch = load_model(teacher, dtype=torch.float32).eval().requires_grad_(False)
    student = load_model(teacher, dtype=torch.float32)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    x0 = windows(1)
    losses = []
    for _ in range(8):
        out = distill_loss(student, x0, teacher=tch, num_steps=N, self_conditioning_prob=0.0, chunk_rows=64,
                           generator=torch.Generator().manual_seed(5))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[0] > 0 and all(v >= 0 for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses


def test_the_k_draw_target_is_the_mean_of_the_teachers_posteriors(models):
    """mean_posterior: exp of the target is the average of the K posteriors' softmaxes (each read at its own canvas),
    and K copies of one canvas give that canvas's posterior."""
    teacher, _ = models
    g = torch.Generator().manual_seed(4)
    M, K, D, V = 6, 3, teacher.config.hidden_size, teacher.config.vocab_size
    h = torch.randn(M, K, D, generator=g)
    x = torch.randint(0, V, (M, K), generator=g)
    level = torch.full((M,), 0.375)
    with torch.no_grad():
        target = mean_posterior(teacher, h, x, level)
        each = [torch.softmax(posterior_logits(teacher, h[:, k], x[:, k], level).float(), -1) for k in range(K)]
        copies = mean_posterior(teacher, h[:, :1].expand(M, K, D), x[:, :1].expand(M, K), level)
    assert torch.allclose(target.exp(), sum(each) / K, atol=1e-6)
    assert torch.allclose(copies.exp(), each[0], atol=1e-6)
    assert not torch.allclose(each[0], each[1], atol=1e-3)  # the draws differ: the mean is not any one of them


def test_the_student_learns_a_k_draw_target_and_k_1_is_the_one_draw_loss(teacher):
    tch = load_model(teacher, dtype=torch.float32).eval().requires_grad_(False)
    student = load_model(teacher, dtype=torch.float32)
    x0 = windows(6)
    kw = dict(teacher=tch, num_steps=N, self_conditioning_prob=0.0, chunk_rows=64)
    with torch.no_grad():
        one = distill_loss(student, x0, generator=torch.Generator().manual_seed(2), **kw)
        same = distill_loss(student, x0, generator=torch.Generator().manual_seed(2), teacher_draws=1, **kw)
    assert torch.equal(one.loss, same.loss)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        out = distill_loss(student, x0, generator=torch.Generator().manual_seed(5), teacher_draws=3, **kw)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[0] > 0
    assert losses[-1] < 0.7 * losses[0], losses


def distill_config(teacher: Path, **changes) -> C.TrainConfig:
    return C.TrainConfig(objective="distill", teacher=str(teacher), student_steps=N, init_from=str(teacher),
                         preset="tiny", seq_len=32, batch_size=2, max_steps=4, warmup_steps=1, lr=3e-3, min_lr=3e-4,
                         eval_every=100, eval_batches=1, save_every=100, keep_last=10, log_every=100, chunk_rows=64
                         ).replace(**changes)


# --- the command ---------------------------------------------------------------------------------------------------

FAST = ("--batch-size", "2", "--eval-batches", "1", "--seq-len", "32")


def distill_cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["distill", *argv])
    return code, capsys.readouterr().err


def test_a_tiny_distillation_writes_a_student_that_generates_at_its_steps(teacher, tiny_data, tmp_path, capsys):
    run = tmp_path / "student"
    code, err = distill_cli(capsys, "--data", str(tiny_data), "--out", str(run), "--teacher", str(teacher),
                            "--student-steps", str(N), "--max-steps", "2", *FAST)
    assert code == 0, err
    ckpt = latest_checkpoint(run)
    assert ckpt.name == "step-0000002"
    assert json.loads((ckpt / "generation_config.json").read_text())["max_denoising_steps"] == N
    assert load_generation_config(run).max_denoising_steps == N
    saved = json.loads((ckpt / "train_config.json").read_text())
    assert (saved["objective"], saved["teacher"], saved["student_steps"], saved["init_from"]) == \
        ("distill", str(teacher), N, str(teacher))
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [e["step"] for e in evals] == [0, 2] and all(e["val_loss"] >= 0 and "val_nelbo" in e for e in evals)
    # generate samples it at its N steps (the ancestral chain runs every one), and serve loads it with them
    code = cli.main(["generate", "--model", str(run), "--prompt-ids", "2,45,300", "--max-new-tokens", "16",
                     "--seed", "0", "--json", "--sampler", "ancestral"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["token_ids"]) == 16 and out["steps_per_canvas"] == [N]
    model, gcfg, tok = load(cli.build_parser().parse_args(["serve", "--model", str(run)]))
    assert gcfg.max_denoising_steps == N and tok is not None and model.config.canvas_length == 16


def test_eval_scores_a_student_with_the_clean_context_posterior(teacher, tiny_data, tmp_path, capsys):
    """`dgemma eval --model STUDENT`: a distillation run's bounds read the clean-context forward it was trained on
    (train/config.py:posterior_objective), the NELBO code of its teacher; the report keeps the run's objective."""
    assert [C.posterior_objective(o) for o in ("distill", "sft", None, "noisy-context", "clean-context")] == \
        ["clean-context", "clean-context", "clean-context", "noisy-context", "clean-context"]
    run = tmp_path / "student"
    code, err = distill_cli(capsys, "--data", str(tiny_data), "--out", str(run), "--teacher", str(teacher),
                            "--student-steps", str(N), "--max-steps", "1", *FAST)
    assert code == 0, err
    out = tmp_path / "report"
    code = cli.main(["eval", "--model", str(run), "--data", str(tiny_data), "--out", str(out), "--prompts", "2",
                     "--max-denoising-steps-grid", str(N), "--entropy-bounds", "1", "--max-windows", "2",
                     "--t-samples", "1", "--mc-replicates", "1", "--iw-windows", "0", "--nelbo-steps", "8", "--quiet"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["model"]["objective"] == "clean-context"
    assert report["model"]["train_config"]["objective"] == "distill"
    nelbo = report["likelihood"]["nelbo"]
    assert nelbo["num_steps"] == 8 and 0 < nelbo["estimate"]["mean"] < 50
    assert [row["max_denoising_steps"] for row in report["frontier"]] == [N]


def test_the_recipe_is_the_teachers_at_a_tenth_of_its_rate_and_train_runs_the_same_objective(teacher, tiny_data,
                                                                                             tmp_path, capsys):
    own = json.loads((latest_checkpoint(teacher) / "train_config.json").read_text())
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--teacher", str(teacher), "--student-steps",
            str(N), "--print-config"]
    assert cli.main(["distill", *argv]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["lr"] == pytest.approx(own["lr"] / 10) and cfg["min_lr"] == pytest.approx(own["lr"] / 100)
    assert (cfg["seq_len"], cfg["batch_size"], cfg["max_steps"], cfg["init_from"]) == \
        (own["seq_len"], own["batch_size"], 500, str(teacher))
    assert cli.main(["train", *argv, "--objective", "distill", "--init-from", str(teacher)]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["objective"], cfg["student_steps"], cfg["diffusion_time"]) == ("distill", N, "discrete")


def test_a_resume_names_a_teacher_that_moved(tiny_run, tiny_data, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_run, teacher)
    cfg = distill_config(teacher, max_steps=2)
    run = tmp_path / "student"
    train(cfg, tiny_data, run, until_step=1, stream=io.StringIO())
    first = latest_checkpoint(teacher)
    assert json.loads((run / "run.json").read_text())["teacher_checkpoint"] == str(first)
    train(C.train_preset("tiny").replace(batch_size=2, max_steps=3, warmup_steps=1, eval_every=100, eval_batches=1,
                                         save_every=100, log_every=100), tiny_data, teacher, resume=True,
          stream=io.StringIO())  # the teacher run goes on: its newest checkpoint is another one
    log = io.StringIO()
    train(cfg, tiny_data, run, resume=True, stream=log)
    assert f"the teacher {teacher} is now {latest_checkpoint(teacher)}, not {first}" in log.getvalue()
    assert json.loads((run / "run.json").read_text())["teacher_checkpoint"] == str(first)


@pytest.fixture(scope="module")
def ar_and_other(tiny_data, tmp_path_factory) -> tuple[Path, Path]:
    """An AR run and a run of another architecture (canvas 8), one step each."""
    root = tmp_path_factory.mktemp("distill-bad")
    cfg = C.train_preset("tiny").replace(batch_size=2, max_steps=1, warmup_steps=1, eval_every=100, eval_batches=1,
                                         save_every=100, log_every=100)
    train(cfg.with_objective("ar"), tiny_data, root / "ar", stream=io.StringIO())
    train(cfg.replace(canvas_length=8), tiny_data, root / "other", stream=io.StringIO())
    return root / "ar", root / "other"


@pytest.mark.parametrize("case, message", [
    ("ar teacher", r"TrainConfig\.teacher: is an AR run \(objective 'ar'\)"),
    ("architecture", r"TrainConfig\.teacher: its architecture differs from the student's in canvas_length: "
                     r"teacher 16, student 8"),
    ("zero steps", r"TrainConfig\.student_steps: must be an int >= 1"),
    ("zero draws", r"TrainConfig\.teacher_draws: must be an int >= 1"),
    ("not fewer", r"TrainConfig\.student_steps: must be fewer than the teacher's max_denoising_steps=48, got 48"),
    ("missing", r"TrainConfig\.teacher: no such checkpoint or run directory, got '.*nowhere'"),
])
def test_bad_inputs_are_one_line_and_write_nothing(case, message, teacher, ar_and_other, tiny_data, tmp_path,
                                                   capsys):
    ar, other = ar_and_other
    argv = {"ar teacher": ["--teacher", str(ar), "--student-steps", "4"],
            "architecture": ["--teacher", str(teacher), "--student-steps", "4", "--init-from", str(other)],
            "zero steps": ["--teacher", str(teacher), "--student-steps", "0"],
            "zero draws": ["--teacher", str(teacher), "--student-steps", "4", "--teacher-draws", "0"],
            "not fewer": ["--teacher", str(teacher), "--student-steps", "48"],
            "missing": ["--teacher", str(tmp_path / "nowhere"), "--student-steps", "4"]}[case]
    run = tmp_path / "run"
    before = tree(teacher)
    code, err = distill_cli(capsys, "--data", str(tiny_data), "--out", str(run), *argv, *FAST)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not run.exists() and tree(teacher) == before


# --- resume (integration tier) ---------------------------------------------------------------------------------------

@pytest.mark.integration
def test_distillation_resumes_bit_exactly_after_a_stop_and_after_sigkill(teacher, tiny_data, tmp_path):
    cfg = distill_config(teacher)
    whole, parts, killed, flag = tmp_path / "whole", tmp_path / "parts", tmp_path / "killed", tmp_path / "in-step"
    train(cfg, tiny_data, whole, stream=io.StringIO())
    assert any(not torch.equal(v, weights(teacher)[k]) for k, v in weights(whole).items())  # the student moved
    first = train(cfg, tiny_data, parts, until_step=2, stream=io.StringIO())
    assert (first.step, first.stopped) == (2, "until_step")
    assert train(cfg, tiny_data, parts, resume=True, stream=io.StringIO()).step == 4
    assert_bit_identical(weights(parts), weights(whole))
    # SIGKILL inside step 3 (test_train.py's harness), then the same call resumes from step 2's checkpoint
    every = cfg.replace(save_every=1)
    sigkill_inside_step(every, tiny_data, killed, 3, flag, timeout=120)
    assert latest_checkpoint(killed).name == "step-0000002"
    assert train(every, tiny_data, killed, resume=True, stream=io.StringIO()).step == 4
    assert_bit_identical(weights(killed), weights(whole))


@pytest.mark.integration
def test_serve_runs_the_student(teacher, tiny_data, tmp_path):
    """`dgemma serve --model STUDENT` answers a chat (its N steps from its generation_config.json)."""
    from openai import OpenAI

    run = tmp_path / "student"
    train(distill_config(teacher, max_steps=1), tiny_data, run, stream=io.StringIO())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "--model", str(run), "--port", "0",
                             "--max-batch", "2", "--max-context", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # the URL, once the port listens
        assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        client = OpenAI(base_url=line.split(" at ")[1].split()[0] + "v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="student", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=8, seed=0)
        assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("stop", "length")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_teacher_draws_belongs_to_distillation():
    with pytest.raises(ConfigError, match=r"TrainConfig\.teacher_draws: must be an int >= 1, and 1 without "
                                          r"--objective distill, got 2"):
        C.TrainConfig(preset="tiny", teacher_draws=2)
