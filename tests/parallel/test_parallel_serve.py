"""`torchrun --standalone --nproc-per-node 2 -m dgemma serve --parallel ep|tp` on the tiny MoE: rank 0 answers the
OpenAI API and the other rank replays its model calls (dgemma/serving/ranks.py); the openai client gets the text of a
one-process `dgemma serve` for the same seeds (completions, chat) and the same prompt scores (echo) (integration
tier). The flags it does not support yet are refused in one line (default tier)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dgemma import cli

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore",
       "HF_HUB_OFFLINE": "1"}
SERVE = ["serve", "--preset", "tiny", "--random-init", "--port", "0", "--max-batch", "4", "--max-context", "256"]


def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    line = proc.stdout.readline()  # the URL, once the port listens (rank 0 alone prints it)
    assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split(" at ")[1].split()[0].rstrip("/")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C of the whole job
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def answers(url: str) -> list:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
    model = client.models.list().data[0].id
    out: list = [client.completions.create(model=model, prompt="Hello there", max_tokens=32, seed=seed,
                                           extra_body={"max_denoising_steps": 8}).choices[0].text for seed in (0, 1)]
    out.append(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                                              seed=3, extra_body={"max_denoising_steps": 8}).choices[0].message.content)
    scored = client.completions.create(model=model, prompt="Hello there, friend", max_tokens=0, echo=True, logprobs=1)
    out.append(scored.choices[0].logprobs.token_logprobs)
    return out


@pytest.fixture(scope="module")
def alone() -> list:
    proc, url = start([sys.executable, "-m", "dgemma", *SERVE, "--threads", "1"])
    try:
        return answers(url)
    finally:
        stop(proc)


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_torchrun_serve_parallel_answers_as_one_process(alone, layout):
    proc, url = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                       "dgemma", *SERVE, "--parallel", layout])
    try:
        got = answers(url)
    finally:
        stop(proc)
    assert got[:3] == alone[:3]  # the text of every request
    if layout == "ep":
        assert got[3] == alone[3]  # prompt scores bit for bit
    else:
        assert got[3] == pytest.approx(alone[3], abs=1e-4)  # within fp32 rounding


@pytest.mark.parametrize("flag", [["--lora", "a=dir"], ["--allow-runtime-lora"], ["--prefix-cache", "4096"]])
def test_serve_parallel_refuses_what_it_does_not_support_yet(capsys, flag):
    assert cli.main([*SERVE, "--parallel", "ep", *flag]) == 2
    assert capsys.readouterr().err.strip() == (
        f"dgemma serve: error: {flag[0]} is not supported with --parallel yet (docs/parallel.md)")
