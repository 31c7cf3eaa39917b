"""Files, checkpoints and run directories (issue 21, docs/files.md): what dgemma reads (symlinks followed, only
regular files, plain names inside a directory), where each command may write (one directory-kind check), that
writes never go through a symlink, that a full disk is one line and leaves nothing behind, and that an adapter or
an export with a non-finite value is refused. Every CLI row asserts exit code 2, one stderr line naming the
problem and that nothing was damaged."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch

import dgemma
from dgemma import cli
from dgemma.weights.checkpoint import CheckpointError, NonFiniteError

TINY = dgemma.preset("tiny")
FAST = ["--max-denoising-steps", "2", "--max-new-tokens", "16"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("files") / "tiny"
    dgemma.save_pretrained(dgemma.init_weights(dgemma.DiffusionGemma(TINY)), path)
    return path


def fails(capsys, argv: list[str], message: str) -> str:
    """Run the CLI in-process; assert exit 2 and one stderr line `dgemma CMD: error: ...` matching `message`."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(rf"^dgemma {argv[0]}: error: .*{message}", err), err
    return err


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` (links as their targets' names) and its content: to assert nothing changed."""
    return {str(p.relative_to(path)): (b"->" + os.readlink(p).encode()) if p.is_symlink() else p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_symlink() or p.is_file()}


# --- reading: symlinks followed, only regular files ---------------------------------------------------------------

def test_the_hugging_face_cache_layout_loads(ckpt, tmp_path, capsys):
    """snapshots/REV/* are symlinks to ../../blobs/HASH: sharded or not, it loads as its `cp -rL` copy does."""
    staged = tmp_path / "staged"
    model = dgemma.load_model(ckpt)
    dgemma.save_pretrained(model, staged, max_shard_bytes=1 << 20)
    assert len(list(staged.glob("model-*-of-*.safetensors"))) >= 2
    snap = tmp_path / "hub" / "snapshots" / "r1"
    (tmp_path / "hub" / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in staged.iterdir():
        h = hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(tmp_path / "hub" / "blobs" / h)
        (snap / f.name).symlink_to(f"../../blobs/{h}")
    loaded = dgemma.load_model(snap)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(snap), "--prompt-ids", "2,3", *FAST]) == 0


@contextlib.contextmanager
def fifo(path: Path):
    """A FIFO at `path`. Were dgemma to open it blocking, a helper thread opens the write end and closes it (EOF),
    so that the unfixed code fails the assertion on its message instead of hanging the suite."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    release = threading.Thread(target=lambda: os.close(os.open(path, os.O_WRONLY)), daemon=True)
    release.start()
    try:
        yield path
    finally:
        if release.is_alive():  # nobody opened it (the fix): open the read end ourselves to free the thread
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        release.join(10)


def _shard_index(p: Path) -> Path:
    """Make `p` a one-shard checkpoint; returns the shard."""
    from safetensors import safe_open

    with safe_open(p / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    shard = p / "model-00001-of-00001.safetensors"
    (p / "model.safetensors").rename(shard)
    (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard.name for k in keys}}))
    return shard


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "shard", "tokenizer.json"])
def test_a_fifo_is_refused_not_read(ckpt, tmp_path, capsys, name):
    model = tmp_path / "ckpt"
    shutil.copytree(ckpt, model)
    argv = ["generate", "--model", str(model), "--prompt-ids", "2,3", *FAST]
    if name == "shard":
        target = _shard_index(model)
    elif name == "tokenizer.json":
        target = tmp_path / "tokenizer.json"
        argv = ["generate", "--model", str(model), "--tokenizer", str(target), "--prompt", "hi", *FAST]
    else:
        target = model / name
    with fifo(target):
        fails(capsys, argv, rf"{re.escape(target.name)}: a FIFO \(named pipe\), not a regular file")


def test_a_fifo_config_is_refused_by_the_api(ckpt, tmp_path):
    model = tmp_path / "ckpt"
    shutil.copytree(ckpt, model)
    with fifo(model / "generation_config.json"), pytest.raises(CheckpointError,
                                                               match=r"generation_config\.json: a FIFO"):
        dgemma.load_model(model)


def test_data_shard_names_must_be_plain_names_inside_the_directory(tiny_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    meta = json.loads((data / "meta.json").read_text())
    for bad, why in (("../../elsewhere.bin", r"climbs out of the directory \(\.\.\)"),
                     ("/etc/hostname", "is an absolute path")):
        meta["splits"]["train"]["shards"][0]["file"] = bad
        (data / "meta.json").write_text(json.dumps(meta))
        fails(capsys, ["data", "inspect", str(data)], rf"meta\.json: splits\.train\.shards\[0\]\.file: "
                                                      rf"'{re.escape(bad)}' {why}")


# --- where each command may write ----------------------------------------------------------------------------------

@pytest.fixture
def corpus(tmp_path) -> Path:
    f = tmp_path / "corpus.txt"
    f.write_text("the cat sat on the mat. " * 200)
    return f


def _run_dir(tiny_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    return run


def test_prepare_refuses_a_run_a_checkpoint_and_a_foreign_directory(tiny_run, ckpt, corpus, tmp_path, capsys):
    run = _run_dir(tiny_run, tmp_path)
    model = tmp_path / "hf"
    shutil.copytree(ckpt, model)
    (model / "tokenizer.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for out, kind in ((run, r"a training run directory \(run\.json\)"),
                      (model, r"a model checkpoint directory \(config\.json\)"),
                      (other, "a non-empty directory that is not dgemma's")):
        before = snapshot(out)
        fails(capsys, ["data", "prepare", "--out", str(out), "--corpus", str(corpus), "--tokenizer", "bpe:300"],
              rf"{re.escape(str(out))} is {kind}; --out must be a new or empty directory, or an existing data "
              "directory")
        assert snapshot(out) == before


def test_prepare_into_a_data_directory_takes_its_lock(tiny_data, corpus, tmp_path, capsys):
    from dgemma.io.lock import locked

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    with locked(data):  # another prepare writing it (its .lock is in the snapshot)
        before = snapshot(data)
        fails(capsys, ["data", "prepare", "--out", str(data), "--corpus", str(corpus), "--tokenizer", "bpe:300"],
              rf"{re.escape(str(data))} is being written by pid {os.getpid()}")
        assert snapshot(data) == before


def test_train_and_export_refuse_other_kinds_of_directory(tiny_data, tiny_run, ckpt, tmp_path, capsys):
    model = tmp_path / "hf"
    shutil.copytree(ckpt, model)
    before = snapshot(model)
    fails(capsys, ["train", "--data", str(tiny_data), "--out", str(model), "--preset", "tiny", "--max-steps", "1"],
          rf"{re.escape(str(model))} is a model checkpoint directory \(config\.json\); --out must be a new or "
          "empty directory, or an existing training run directory")
    fails(capsys, ["train", "--data", str(tiny_data), "--out", str(tiny_data), "--preset", "tiny", "--max-steps",
                   "1"], r"is a prepared data directory \(meta\.json\)")
    fails(capsys, ["export", str(tiny_run), "--out", str(model)],
          rf"{re.escape(str(model))} is a model checkpoint directory \(config\.json\); --out must be a new or empty "
          "directory")
    assert snapshot(model) == before


def test_trace_never_writes_into_a_checkpoint_nor_creates_directories(ckpt, tmp_path, capsys):
    model = tmp_path / "ckpt"
    shutil.copytree(ckpt, model)
    before = snapshot(model)
    base = ["generate", "--model", str(model), "--prompt-ids", "2,3", *FAST]
    fails(capsys, [*base, "--trace", str(model / "config")],
          rf"--trace {re.escape(str(model / 'config'))}: {re.escape(str(model))} is a model checkpoint directory")
    assert snapshot(model) == before
    fails(capsys, [*base, "--trace", str(tmp_path / "new" / "dir" / "t")], "its directory .*new/dir does not exist")
    assert not (tmp_path / "new").exists()
    (tmp_path / "notes.json").write_text("keep me")
    fails(capsys, [*base, "--trace", str(tmp_path / "notes")], r"notes\.json exists and is not a dgemma-trace-1 trace")
    assert (tmp_path / "notes.json").read_text() == "keep me"
    assert cli.main([*base, "--trace", str(tmp_path / "t")]) == 0
    assert cli.main([*base, "--trace", str(tmp_path / "t")]) == 0  # an earlier trace is replaced
    assert json.loads((tmp_path / "t.json").read_text())["format"] == "dgemma-trace-1"


# --- writes never go through a symlink -----------------------------------------------------------------------------

def test_a_symlinked_lock_is_refused_and_its_target_untouched(tiny_data, tiny_run, tmp_path, capsys):
    run = _run_dir(tiny_run, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(victim)
    fails(capsys, ["train", "--data", str(tiny_data), "--out", str(run), "--resume", "--max-steps", "3"],
          r"\.lock: a symbolic link; dgemma never writes through one")
    assert victim.read_text() == "precious"


def test_copies_and_saves_replace_a_symlink_instead_of_writing_its_target(tiny_data, tiny_run, ckpt, tmp_path,
                                                                          capsys):
    # A run killed before its first checkpoint, whose tokenizer.json is a symlink: resuming copies the data's
    # tokenizer over the link, not into VICTIM.
    run = _run_dir(tiny_run, tmp_path)
    shutil.rmtree(run / "checkpoints")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / "tokenizer.json").unlink()
    (run / "tokenizer.json").symlink_to(victim)
    capsys.readouterr()
    assert cli.main(["train", "--data", str(tiny_data), "--out", str(run), "--resume", "--max-steps", "1"]) == 0
    assert victim.read_text() == "precious"
    assert not (run / "tokenizer.json").is_symlink()
    assert (run / "tokenizer.json").read_bytes() == (tiny_data / "tokenizer.json").read_bytes()
    # save_pretrained over a checkpoint whose config.json is a symlink
    model = tmp_path / "ckpt"
    shutil.copytree(ckpt, model)
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(victim)
    dgemma.save_pretrained(dgemma.load_model(ckpt), model)
    assert victim.read_text() == "precious" and not (model / "config.json").is_symlink()


# --- non-finite exports and bad adapters ---------------------------------------------------------------------------

def test_save_pretrained_refuses_a_non_finite_tensor(ckpt, tmp_path):
    model = dgemma.load_model(ckpt)
    with torch.no_grad():
        model.norm.weight[0] = math.nan
    with pytest.raises(NonFiniteError, match=r"model\.decoder\.norm\.weight has non-finite values"):
        dgemma.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def adapter(ckpt, tmp_path_factory) -> Path:
    pytest.importorskip("peft")
    from dgemma.weights import lora

    model = dgemma.load_model(ckpt)
    config = lora.lora_config(4, 8, "attention", str(ckpt))
    lora.attach(model, config)
    path = tmp_path_factory.mktemp("adapter") / "adapter"
    lora.save_adapter(model, config, path)
    return path


ADAPTER_CASES = [
    ({"lora_alpha": math.nan}, r"'lora_alpha' must be a finite number > 0, got nan"),
    ({"lora_alpha": -1}, r"'lora_alpha' must be a finite number > 0, got -1"),
    ({"r": "4"}, r"'r' must be a positive integer \(the LoRA rank\), got '4'"),
    ({"r": 0}, r"'r' must be a positive integer"),
    ({"r": 40}, r"'r' = 40 is larger than layers\.0\.self_attn\.k_proj's width 32"),
    ({"target_modules": None}, r"'target_modules' must be a regex or a non-empty list of module names"),
    ({"target_modules": ["mlp"]}, r"'target_modules' must be .*got \['mlp'\]"),
    ({"target_parameters": "experts"}, r"'target_parameters' must be null or a list"),
]


@pytest.mark.parametrize("command", ["export", "generate"])
@pytest.mark.parametrize(("edit", "message"), ADAPTER_CASES, ids=[json.dumps(e) for e, _ in ADAPTER_CASES])
def test_a_bad_adapter_config_is_one_line_naming_the_key(adapter, tmp_path, capsys, command, edit, message):
    bad = tmp_path / "adapter"
    shutil.copytree(adapter, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg.update(edit)
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    argv = (["export", str(bad), "--out", str(out)] if command == "export"
            else ["generate", "--model", str(bad), "--prompt-ids", "2,3", *FAST])
    fails(capsys, argv, rf"adapter_config\.json: field {message}")
    assert not out.exists()


# --- a full disk ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (Linux, as root: CI runs so); skips the test where mount is refused."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_export_into_a_full_disk_is_one_line_and_leaves_nothing(tiny_run, tmp_path, capsys):
    with small_filesystem(tmp_path / "small", "512k") as small:
        out = small / "export"
        fails(capsys, ["export", str(tiny_run), "--out", str(out)],
              r"no space left on device writing .*small/export/model\.safetensors \(needed ~1\.\d MB")
        assert list(small.iterdir()) == []  # no output directory, no temporary file


def test_training_into_a_full_disk_is_one_line_and_leaves_no_temporary_checkpoint(tiny_data, tmp_path, capsys):
    with small_filesystem(tmp_path / "small", "3m") as small:
        run = small / "run"
        fails(capsys, ["train", "--data", str(tiny_data), "--out", str(run), "--preset", "tiny", "--batch-size", "2",
                       "--eval-batches", "1", "--max-steps", "1"],
              r"no space left on device writing .*checkpoints/step-0000001 \(needed ~\d")
        assert list((run / "checkpoints").iterdir()) == []  # the .tmp-step-* directory is gone
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        capsys.readouterr()
        assert cli.main(["train", "--data", str(tiny_data), "--out", str(run), "--resume", "--max-steps", "1"]) == 0
        assert (run / "checkpoints" / "step-0000001" / "trainer_state.pt").is_file()


def test_a_full_disk_under_any_writer_is_a_no_space_error(tmp_path):
    """/dev/full for a single-file write: the atomic writer maps ENOSPC, whatever library wrote."""
    from dgemma.io import fsio

    with pytest.raises(OSError) as raised, open("/dev/full", "wb") as f:
        f.write(b"x" * 65536)
        f.flush()
    err = fsio.no_space(raised.value, tmp_path / "x.bin", needed=3 * 2**20)
    assert isinstance(err, fsio.NoSpaceError) and re.search(r"writing .*x\.bin \(needed ~3\.0 MB", str(err))
    assert fsio.no_space(ValueError("bad"), tmp_path / "x.bin") is None


@pytest.mark.parametrize("kind", ["fifo", "dangling"])
def test_a_chat_template_file_that_cannot_be_read_is_an_error_not_the_default(tmp_path, kind):
    """A chat_template.jinja that is there but unreadable (a FIFO, a link to nothing) is refused naming it; it used
    to be skipped as if absent, so the server rendered chats with the built-in template instead."""
    from dgemma.data.templates import ChatTemplateError, load_chat_template

    jinja = tmp_path / "chat_template.jinja"
    os.mkfifo(jinja) if kind == "fifo" else jinja.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ChatTemplateError, match=rf"{re.escape(str(jinja))}: not a readable template"):
        load_chat_template(tmp_path)
