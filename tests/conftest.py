"""Shared by the test modules: the test tiers, and tiny real data and a tiny real training run (built once per
session with the package's own code, so the CLI tests run the real thing end to end).

The tiers (markers registered in pyproject.toml):
- `pytest`: the unit and fast integration tests (under 3 minutes on 2 cores: keep it so);
- `pytest -m integration`: the heavy tests -- torchrun jobs, the documented commands, serving load, browsers,
  learning runs, process kills, and any other test that takes more than ~5 s on 2 cores (mark it
  `@pytest.mark.integration`) -- `.ci/run` runs both of these;
- `pytest --runslow`: everything, including the tests marked `slow` that CI never runs (the full parity sweep,
  long trainings, the `[long]`/`[GPU]` doc commands); `-m integration --runslow` is the heavy tier with them."""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

import pytest

# Before any test module imports torch: importing dgemma bounds how long OpenMP's idle threads spin
# (dgemma/io/threads.py), the same setting as the CLI's, the server's and the demo's; the `python -m dgemma` children
# inherit it.
import dgemma  # noqa: F401

# Tests never touch the network: a stray hub call fails at once instead of retrying for ~25 s.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Every test model is tiny: its ops are microseconds of work, thread hand-offs dominate, and on a busy 2-core
    machine torch's spinning threads make a step 5-10x slower. Comparisons are always between runs under the same
    setting (timings belong to `dgemma bench`, not to tests)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _back_to_one_thread():
    """A dgemma command run in-process (`cli.main`) sets the process's thread count (dgemma/io/threads.py); the next
    test starts from one thread again, so a module's fixtures and a test's runs compare under the same setting (a resume
    on one thread against an uninterrupted run on two is not bit-identical)."""
    yield
    import torch

    torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False,
                     help="run every tier: the integration tests too, and the tests marked slow (long trainings, the "
                          "full parity sweep, long doc commands)")


def _tier_filter_off(config: pytest.Config) -> bool:
    """The default tier leaves the integration tests out unless a marker expression (`-m ...`) or --runslow asks."""
    return bool(config.getoption("markexpr")) or config.getoption("--runslow")


def pytest_report_header(config: pytest.Config) -> str | None:
    if _tier_filter_off(config):
        return None
    return "tier: unit + fast integration (the heavy tier: pytest -m integration; everything: pytest --runslow)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _tier_filter_off(config):
        heavy = [item for item in items if item.get_closest_marker("integration")]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if not item.get_closest_marker("integration")]
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tok_path(tmp_path_factory) -> Path:
    """A toy chat tokenizer.json (`build_test_tokenizer(512)`: the Gemma special tokens at ids 0..4)."""
    from dgemma.data.tokenizer import build_test_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_test_tokenizer(512, path)
    return path


@pytest.fixture(scope="session")
def tok(tok_path):
    """The toy chat tokenizer of `tok_path`, loaded as a checkpoint's is (`load_tokenizer`)."""
    from dgemma.data.tokenizer import load_tokenizer

    return load_tokenizer(tok_path)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared data directory (`dgemma.data.prepare.prepare`, a 512-id BPE): 200 documents, each 12 sentences drawn
    from 26 toy sentences, so held-out documents share the training text's sentences and a model that learns the corpus
    has a held-out loss far below log(V)."""
    from dgemma.data import prepare
    from dgemma.data.tokenizer import toy_corpus

    root = tmp_path_factory.mktemp("train-corpus")
    sentences = toy_corpus(12)[14:]
    rng = random.Random(0)
    (root / "text").mkdir()
    for i in range(200):
        (root / "text" / f"d{i:03d}.txt").write_text(" ".join(rng.choice(sentences) for _ in range(12)))
    prepare.prepare(root / "data", [str(root / "text")], tokenizer="bpe:512", val_fraction=0.1, quiet=True,
                 cache_dir=root / "cache")
    return root / "data"


@pytest.fixture(scope="session")
def tiny_run(tiny_data, tmp_path_factory) -> Path:
    """A real training run directory: the `tiny` preset trained for 2 steps on `tiny_data` (checkpoints/step-0000002
    with config.json, weights, tokenizer.json)."""

    from dgemma.train.config import train_preset
    from dgemma.train.loop import train

    run = tmp_path_factory.mktemp("tiny-run") / "run"
    cfg = train_preset("tiny").replace(batch_size=2, max_steps=2, warmup_steps=1, eval_every=100,
                                       eval_batches=1, save_every=100, log_every=100)
    train(cfg, tiny_data, run, stream=io.StringIO())
    return run
