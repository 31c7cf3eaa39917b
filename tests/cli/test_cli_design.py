"""The command line as one design: every subcommand's parser is walked and held to the rules a new user relies on
(every option explained, its default shown, the shared flags spelled, typed and offered alike on every command that
runs a model), and the shared runtime flags are checked to take effect (--impl and --threads reach the model's
forward passes of generate, chat and eval)."""

from __future__ import annotations

import argparse
import io
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dgemma import cli
from dgemma.model.attention import IMPLS

MODEL_RUNNING = ("generate", "chat", "serve", "eval", "bench")  # the commands that load a model and run it
RANDOM = ["--preset", "tiny", "--random-init"]
FAST = ["--max-denoising-steps", "2", "--max-new-tokens", "16", "--seed", "0"]


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its name ("data prepare" for a nested one)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    full = f"{prefix} {name}".strip()
                    if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                        found[full] = sub
                    walk(sub, full)

    walk(cli.build_parser(), "")
    return found


COMMANDS = commands()


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's entry as `--help` prints it."""
    return " ".join(parser._get_formatter()._format_action(action).split())


def test_the_walk_finds_every_command():
    assert {"generate", "chat", "serve", "eval", "bench", "train", "finetune", "export", "inspect", "viz", "demo",
            "data prepare", "data inspect"} <= set(COMMANDS)


@pytest.mark.parametrize("name", ["", *sorted(COMMANDS)])
def test_help_names_no_internal_reference(name):
    """--help speaks to a user: no issue numbers, no names of the design documents behind the code."""
    parser = COMMANDS[name] if name else cli.build_parser()
    text = parser.format_help()
    assert not re.search(r"issue [0-9]|seed 00[03]", text), f"dgemma {name} --help: " + \
        "; ".join(m.group(0) for m in re.finditer(r".{0,40}(issue [0-9]|seed 00[03]).{0,20}", text, re.S))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_explained_and_shows_its_default(name):
    parser = COMMANDS[name]
    assert parser.description, f"dgemma {name} -h has no description"
    for flag, action in options(parser).items():
        assert action.help, f"dgemma {name} {flag} has no help"
        if not any(action.default is v for v in (None, False, argparse.SUPPRESS)):  # 0 is a default too
            text = rendered(parser, action)
            assert re.search(r"\bdefault\b", text), f"dgemma {name} {flag}: --help hides its default: {text}"


@pytest.mark.parametrize("name", MODEL_RUNNING)
def test_the_runtime_flags_exist_on_every_model_running_command(name):
    opts = options(COMMANDS[name])
    assert set(opts["--impl"].choices) == set(IMPLS), f"dgemma {name} --impl"
    assert opts["--threads"].metavar == "N"
    assert "run directory" in opts["--model"].help, f"dgemma {name} --model does not say run directories work"


CONCEPTS = ("--model", "--preset", "--seed", "--dtype", "--device", "--impl", "--threads", "--quantize", "--tokenizer",
            "--max-new-tokens", "--max-denoising-steps", "--offload-experts", "--force")


# Flags whose values are a superset of the shared ones: export's --dtype is the dtype of the written file (there is
# no "auto" to resolve), data prepare's --tokenizer makes one (gpt2, bpe:VOCAB) or reads a PATH like the others.
OWN_FORM = {("export", "--dtype"), ("data prepare", "--tokenizer")}


@pytest.mark.parametrize("flag", CONCEPTS)
def test_a_shared_flag_is_the_same_on_every_command(flag):
    """The same spelling, metavar, choices and meaning wherever a flag appears (but the OWN_FORM ones)."""
    seen = {name: options(p)[flag] for name, p in COMMANDS.items() if flag in options(p)
            and (name, flag) not in OWN_FORM}
    assert len(seen) >= 2, f"{flag} appears on {sorted(seen)} only"
    forms = {(a.metavar, tuple(a.choices) if a.choices else None, a.nargs) for a in seen.values()}
    assert len(forms) == 1, f"{flag} differs between commands: " + "; ".join(
        f"{n}: metavar {a.metavar}, choices {a.choices}" for n, a in seen.items())


def test_one_metavar_per_concept_and_one_meaning_per_steps_flag():
    for name, parser in COMMANDS.items():
        for flag, action in options(parser).items():
            if action.dest in ("seed",):
                assert action.metavar == "SEED", f"dgemma {name} {flag}"
            if action.dest in ("preset", "train_preset"):
                assert action.metavar == "PRESET" or action.choices, f"dgemma {name} {flag}"
            assert flag not in ("--steps", "--num-steps") or name in ("train", "finetune"), \
                f"dgemma {name} {flag}: say which steps (--max-denoising-steps, --denoising-steps, --nelbo-steps)"
    helps = {options(p)["--max-denoising-steps"].help for p in COMMANDS.values()
             if "--max-denoising-steps" in options(p)}
    assert len(helps) == 1


def test_serve_has_no_seed_flag():
    assert "--seed" not in options(COMMANDS["serve"])
    assert "--seed" in options(COMMANDS["generate"]) and "--seed" in options(COMMANDS["chat"])


# --- --impl and --threads take effect -------------------------------------------------------------------------

class Recorder(TorchFunctionMode):
    """Records, for every fused attention call (the fast path's SDPA; the reference path never calls it), the torch
    thread count in force, and counts every matmul-like call (so a run that computed nothing fails)."""

    def __init__(self):
        super().__init__()
        self.sdpa_threads: list[int] = []
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if func is F.scaled_dot_product_attention:
            self.sdpa_threads.append(torch.get_num_threads())
        return func(*args, **(kwargs or {}))


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_recorded(capsys, argv: list[str], stdin: str | None = None) -> Recorder:
    recorder = Recorder()
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with recorder:
            code = cli.main(argv)
    finally:
        sys.stdin = saved
    err = capsys.readouterr().err
    assert code == 0, err
    assert recorder.calls > 0
    return recorder


@pytest.mark.parametrize("impl", IMPLS)
def test_generate_runs_on_impl_and_threads(capsys, threads_restored, impl):
    rec = run_recorded(capsys, ["generate", *RANDOM, "--prompt-ids", "2,45,300", *FAST, "--impl", impl,
                                "--threads", "1"])
    if impl == "fast":
        assert rec.sdpa_threads and set(rec.sdpa_threads) == {1}
    else:
        assert rec.sdpa_threads == []


@pytest.mark.parametrize("impl", IMPLS)
def test_chat_runs_on_impl_and_threads(capsys, threads_restored, tok_path, impl):
    rec = run_recorded(capsys, ["chat", *RANDOM, "--tokenizer", str(tok_path), *FAST, "--impl", impl,
                                "--threads", "1"], stdin="Hello there\n")
    assert bool(rec.sdpa_threads) == (impl == "fast") and set(rec.sdpa_threads) <= {1}


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_defaults_are_the_fast_kernels_on_the_usable_cores(capsys, threads_restored, monkeypatch, tok_path,
                                                               command):
    """Without --impl and --threads a command runs the fast kernels on the cores it may use (its affinity), however
    busy the machine is: the same thread count, so the same numerics, on a quiet and on a loaded machine."""
    torch.set_num_threads(1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))  # the machine's state, not dgemma's code
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    extra = ["--tokenizer", str(tok_path)] if command == "chat" else ["--prompt-ids", "2,45,300"]
    rec = run_recorded(capsys, [command, *RANDOM, *extra, *FAST], stdin="Hello there\n")
    assert rec.sdpa_threads and set(rec.sdpa_threads) == {3}


def test_omp_num_threads_is_left_to_torch(capsys, threads_restored, monkeypatch):
    """A user's (or torchrun's) OMP_NUM_THREADS wins over the free-core default; --threads over both."""
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))
    rec = run_recorded(capsys, ["generate", *RANDOM, "--prompt-ids", "2,45,300", *FAST])
    assert set(rec.sdpa_threads) == {2}
    rec = run_recorded(capsys, ["generate", *RANDOM, "--prompt-ids", "2,45,300", *FAST, "--threads", "1"])
    assert set(rec.sdpa_threads) == {1}


def test_a_bad_runtime_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", *RANDOM, "--prompt-ids", "2", "--threads", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"dgemma generate: error: argument --threads: must be a positive integer "
                                          r"\(>= 1\), got '0'", err[0])
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", *RANDOM, "--impl", "cuda-graph"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and re.search(r"--impl: invalid choice: 'cuda-graph'", err[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_eval_runs_on_impl_and_threads(capsys, threads_restored, tiny_run, tiny_data, tmp_path, impl):
    pytest.importorskip("matplotlib")
    rec = run_recorded(capsys, ["eval", "--model", str(tiny_run), "--data", str(tiny_data), "--out",
                                str(tmp_path / "report"), "--prompts", "2", "--prompt-tokens", "4",
                                "--max-new-tokens", "16", "--max-denoising-steps-grid", "2", "--entropy-bounds", "0.5",
                                "--max-windows", "2", "--t-samples", "1", "--bootstrap", "10", "--quiet",
                                "--impl", impl, "--threads", "1"])
    assert bool(rec.sdpa_threads) == (impl == "fast") and set(rec.sdpa_threads) <= {1}
    assert (tmp_path / "report" / "report.md").is_file()


@pytest.mark.parametrize("name", ["train", "finetune"])
def test_every_training_flag_shows_the_value_a_run_gets_without_it(name):
    """TrainConfig's flags default to None (= not given), so --help names the recipe's value instead."""
    import dataclasses

    from dgemma.train.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    parser = COMMANDS[name]
    for flag, action in options(parser).items():
        if action.dest in fields:
            assert re.search(r"\bdefault\b", rendered(parser, action)), f"dgemma {name} {flag}"
    assert re.search(r"default: 2e-5, or 2e-4 with --lora-rank", rendered(parser, options(parser)["--lr"])) \
        or name == "train"


def test_importing_peft_for_lora_is_quiet():
    """peft imports transformers and torchao, whose CPU build logs "Failed to load ..._C*.so" per CUDA extension and
    makes torch log an "Enum subclass" notice: dgemma.io.quiet drops exactly those (a fresh process: imports run
    once)."""
    import subprocess

    pytest.importorskip("peft")
    done = subprocess.run([sys.executable, "-c", "from dgemma.weights import lora; lora._peft(); print('ok')"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert not re.search(r"Failed to load|Enum subclass", done.stderr), done.stderr
