"""`torchrun --standalone --nproc-per-node 2|4 -m dgemma generate --parallel ep|tp|ep+tp` on a saved tiny MoE (CPU,
gloo, fp32, one thread a rank) prints the tokens of one `dgemma generate` process with the same seed; a layout the
shapes do not divide is refused in one line; `--parallel` without torchrun is refused in one line (default tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dgemma
from dgemma import cli
from dgemma.model.config import preset

ROOT = Path(__file__).resolve().parents[2]
GENERATE = ["generate", "--prompt-ids", "2,45,300,7,19", "--max-new-tokens", "32", "--max-denoising-steps", "12",
            "--json", "--device", "cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
TIMEOUT = 300


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A saved tiny MoE (8 experts top-2; kv heads 2 on sliding layers, 1 on full ones)."""
    path = tmp_path_factory.mktemp("parallel-cli") / "tiny-moe"
    dgemma.save_pretrained(dgemma.init_weights(dgemma.DiffusionGemma(preset("tiny")), seed=3), path)
    return path


def tokens(stdout: str) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in stdout.splitlines() if line.startswith("{")]


def one_process(model: Path, seed: int) -> list[list[int]]:
    done = subprocess.run([sys.executable, "-m", "dgemma", *GENERATE, "--model", str(model), "--seed", str(seed),
                           "--threads", "1"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return tokens(done.stdout)


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "dgemma", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.integration
@pytest.mark.parametrize("nproc, layout", [(2, "ep"), (4, "ep"), (2, "tp"), (4, "tp"), (2, "ep+tp")])
def test_torchrun_generate_parallel_gives_the_tokens_of_one_process(saved, nproc, layout):
    for seed in (0, 5):
        done = torchrun(nproc, *GENERATE, "--model", str(saved), "--seed", str(seed), "--parallel", layout)
        assert done.returncode == 0, done.stderr[-3000:]
        got = tokens(done.stdout)
        assert len(got) == 1, done.stdout  # only rank 0 prints
        assert got == one_process(saved, seed), (nproc, layout, seed)


@pytest.mark.integration
def test_a_layout_the_shapes_do_not_divide_is_refused_in_one_line(saved):
    done = torchrun(3, *GENERATE, "--model", str(saved), "--seed", "0", "--parallel", "ep")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("dgemma generate: error:")]
    assert lines == ["dgemma generate: error: --parallel ep: ep=3 does not divide num_experts=8"]


def test_parallel_without_torchrun_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = cli.main(["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "2,45", "--parallel", "tp"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "dgemma generate: error: --parallel tp runs one process per rank under torchrun (WORLD_SIZE is not set): "
        "torchrun --nproc-per-node K -m dgemma generate --parallel tp ...")


@pytest.mark.parametrize("flag", [["--quantize", "int8"], ["--offload-experts"]])
def test_parallel_refuses_quantized_or_offloaded_weights(monkeypatch, capsys, flag):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: the refusal comes before the process group
    code = cli.main(["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "2,45", "--parallel", "ep",
                     *flag])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"dgemma generate: error: {flag[0]} does not combine with --parallel (each rank holds a plain shard)")
