"""Fuzz every `dgemma` subcommand's command line as an adversary would, and count how each case ended.

Each case starts from a command that works (on tiny fixtures built once per module: a checkpoint, a data directory, a
training run, a chat data file, a trace) and replaces one or two of its flags with a hostile value: non-finite,
negative, huge or malformed numbers, and paths that are FIFOs, devices, directories, symlinks to a file that must
not change, missing parents, a directory of someone else's files (standing in for `/` or a home directory, which
no case ever writes to), or another command's directory. Every case runs `python -m dgemma` in a fresh process
under a memory and time limit and is classified:

    ok         exit 0, no traceback
    refused    exit 2, the last stderr line `dgemma CMD: error: ...` and no other error line (progress may precede)
    unclear    exit 2 without that one error line
    traceback  a Python traceback, or an exit code other than 0 and 2
    killed     a signal (the memory limit, an abort in native code)
    timeout    still running at the time limit (a hang)
    long       still running, having been asked for more than an hour (`--minutes 1e32`): accepted by design
    damage     a file outside the case's own output changed (the victim of a symlink, a fixture's files)

Every case that is not ok, refused or long is a finding, and fails its subcommand's test with each finding's command.
Case i of a subcommand draws from its own seed (`fuzz_case`), so a finding comes back whatever ran before it.

    python -m pytest tests/cli/test_fuzz_cli.py -m integration   # QUICK cases per subcommand (the integration tier)
    python -m pytest tests/cli/test_fuzz_cli.py --runslow        # FULL cases per subcommand: about 20 minutes
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

QUICK, FULL = 3, 20  # cases per subcommand: the integration tier's, and --runslow's (the first QUICK of them included)
MEMORY_LIMIT = 6 * 2**30  # bytes of address space per case: a runaway allocation is killed, not the machine
NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e308", "4e38", "-4e38", "1e-320", "5e-324", "1e-300", "0.01", "1",
           "18446744073709551615", "18446744073709551616",
           "99999999999999999999999999999999", "1000000000", "abc", "", "0x10", "1_0", " 3", "1e3", "-0"]
TEXT = ["", " ", "\t", "x" * 5000, "../../etc", "-", "--", "nan", "\u202e", "\U0001f600", "bpe:1000000000",
        "bpe:-1", "bpe:0", "bpe:", "default:nope", "a,b,,c", "1,,2", "2,3,-1", "999999999", "ids:1,2",
        # regular expressions (--regex): empty, an empty language past llguidance's limits, unclosed, catastrophic
        "^(x{1000}){1000}$", "(unclosed", "(a*)*b", "[^\\s\\S]", "1=-100,2=1e999"]
PATH_KINDS = ["fifo", "dev_zero", "dev_null", "dev_full", "dir", "symlink_victim", "missing_parent", "foreign",
              "checkpoint", "run", "data", "file", "empty_file", "binary_file", "dangling_symlink", "self_loop",
              "hostile_schema", "hostile_grammar", "hostile_template"]
# JSON Schemas and Lark grammars a grammar engine must fail on honestly (--json-schema, --grammar): an empty language,
# sizes past llguidance's limits, a keyword it cannot enforce
HOSTILE_SCHEMAS = [{"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
                   {"const": "x" * 30000}, {"anyOf": [{"const": f"v{i}"} for i in range(3000)]},
                   {"type": "array", "prefixItems": [{"type": "integer"}] * 500}, [], "not a schema",
                   {"type": "object", "additionalProperties": {"type": "object"}, "minProperties": 3}]
HOSTILE_GRAMMARS = ['start: start "a"', "start: ", 'start: "a"{1000}' * 3, "%import nothing", "\x00"]
# chat templates a checkpoint may carry (--model of generate/chat): huge output, an error, endless recursion
HOSTILE_TEMPLATES = ["{{ 'x' * 100000000 }}", "{{ raise_exception('no') }}", "{% macro m() %}{{ m() }}{% endmacro %}"
                     "{{ m() }}", "{% for i in range(10**9) %}x{% endfor %}", "{{ messages[0].content.__class__ }}"]


@dataclass
class World:
    """The fixtures every case may point at, and the files no case may change."""
    root: Path
    ckpt: Path = field(init=False)
    data: Path = field(init=False)
    run: Path = field(init=False)
    chats: Path = field(init=False)
    trace: Path = field(init=False)
    victim: Path = field(init=False)
    foreign: Path = field(init=False)
    corpus: Path = field(init=False)

    def protected(self) -> dict[str, str | None]:
        """sha256 of every file that no case may change (None: gone): the victim, the checkpoint's and the data
        directory's files, and the run's tokenizer and checkpoint files (a resumed run may add files, not change
        these)."""
        files = [self.victim, *sorted(self.foreign.rglob("*")), *sorted(self.ckpt.rglob("*")),
                 *sorted(self.data.rglob("*")), self.run / "tokenizer.json",
                 *sorted((self.run / "checkpoints").glob("step-*/*"))]
        return {str(p): _digest(p) for p in files if not p.is_dir()}


def _digest(p: Path) -> str | None:
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError:
        return None


def dgemma(*argv: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgemma", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def build_world(root: Path) -> World:
    """Tiny real fixtures, made by dgemma's own commands."""
    w = World(root)
    rng = random.Random(0)
    words = ["the", "king", "queen", "love", "sword", "night", "day", "crown", "fool", "heart", "blood", "rose"]
    w.corpus = root / "corpus"
    w.corpus.mkdir()
    for d in range(20):  # documents: the validation split takes whole ones
        (w.corpus / f"doc{d:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(600)))
    w.data, w.run, w.ckpt = root / "data", root / "run", root / "ckpt"
    for argv in (["data", "prepare", "--out", str(w.data), "--corpus", str(w.corpus), "--tokenizer", "bpe:300",
                  "--val-fraction", "0.1", "-q"],
                 ["train", "--data", str(w.data), "--out", str(w.run), "--preset", "tiny", "--until-step", "2",
                  "--save-every", "2", "--eval-every", "2", "--log-every", "1"],
                 ["export", str(w.run), "--out", str(w.ckpt)]):
        done = dgemma(*argv, cwd=root)
        if done.returncode != 0:
            raise AssertionError(f"fixture command failed: dgemma {' '.join(argv)}\n{done.stderr}")
    w.chats = root / "chats.jsonl"
    w.chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "the king"},
                                                        {"role": "assistant", "content": "love the queen"}]}) + "\n"
                               for _ in range(40)))
    w.trace = root / "trace.npz"
    done = dgemma("generate", "--model", str(w.ckpt), "--prompt", "the king", "--max-denoising-steps", "2",
                  "--max-new-tokens",
                  "16", "--seed", "0", "--trace", str(w.trace), cwd=root)
    if done.returncode != 0:
        raise AssertionError(f"fixture trace failed:\n{done.stderr}")
    w.victim = root / "victim.txt"
    w.victim.write_text("this file must never change\n")
    w.foreign = root / "home"
    (w.foreign / "notes").mkdir(parents=True)
    for name in ("notes/todo.txt", "config.json", "tokenizer.json", "meta.json", "run.json"):
        (w.foreign / name).write_text(f"{name}: someone's file\n")
    return w


def hostile_path(kind: str, case_dir: Path, w: World) -> str:
    p = case_dir / f"p-{kind}"
    n = 1
    while os.path.lexists(p):  # the same kind twice in one case
        p, n = case_dir / f"p-{kind}-{n}", n + 1
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        p.mkdir()
    elif kind == "foreign":  # a directory of someone's files (a home directory, `/`): none may change
        return str(w.foreign)
    elif kind == "symlink_victim":
        p.symlink_to(w.victim)
    elif kind == "dangling_symlink":
        p.symlink_to(case_dir / "nowhere")
    elif kind == "self_loop":
        p.symlink_to(p)
    elif kind == "file":
        p.write_text("hello\n")
    elif kind == "empty_file":
        p.touch()
    elif kind == "binary_file":
        p.write_bytes(bytes(range(256)) * 64)
    elif kind == "missing_parent":
        return str(case_dir / "no" / "such" / "dir" / "x")
    elif kind == "hostile_schema":
        p.write_text(json.dumps(random.Random(str(p.relative_to(w.root))).choice(HOSTILE_SCHEMAS)))
    elif kind == "hostile_grammar":
        p.write_text(random.Random(str(p.relative_to(w.root))).choice(HOSTILE_GRAMMARS))
    elif kind == "hostile_template":  # a copy of the checkpoint whose chat template is hostile
        shutil.copytree(w.ckpt, p)
        (p / "chat_template.jinja").write_text(random.Random(str(p.relative_to(w.root))).choice(HOSTILE_TEMPLATES))
    else:
        return {"dev_zero": "/dev/zero", "dev_null": "/dev/null", "dev_full": "/dev/full",
                "checkpoint": str(w.ckpt), "run": str(w.run), "data": str(w.data)}[kind]
    return str(p)


def base_commands(w: World, out: Path) -> dict[str, list[str]]:
    """One working command per subcommand; `out` is the case's own output path."""
    ck, small = str(w.ckpt), ["--max-denoising-steps", "2", "--max-new-tokens", "16", "--seed", "0"]
    return {
        "generate": ["generate", "--model", ck, "--prompt", "the king", *small],
        # the grammars beside the sampling controls (temperature 0, top-k 1, ...: the mutations pick those flags)
        "generate grammar": ["generate", "--model", ck, "--prompt", "the king", "--json-object", *small],
        "generate chat": ["generate", "--model", ck, "--prompt", "the king", "--chat", *small],
        "chat": ["chat", "--model", ck, *small],
        "inspect": ["inspect", ck],
        "data prepare": ["data", "prepare", "--out", str(out), "--corpus", str(w.corpus), "--tokenizer", "bpe:300",
                         "-q"],
        "data inspect": ["data", "inspect", str(w.data)],
        "train": ["train", "--data", str(w.data), "--out", str(out), "--preset", "tiny", "--until-step", "1",
                  "--eval-every", "1", "--save-every", "1"],
        "finetune": ["finetune", "--model", ck, "--data", str(w.chats), "--out", str(out), "--until-step", "1",
                     "--seq-len", "32", "--batch-size", "2", "--eval-every", "1", "--save-every", "1"],
        "distill": ["distill", "--data", str(w.data), "--out", str(out), "--teacher", str(w.run), "--student-steps",
                    "2", "--until-step", "1", "--seq-len", "32", "--batch-size", "2", "--eval-every", "1",
                    "--save-every", "1"],
        "export": ["export", str(w.run), "--out", str(out)],
        "eval": ["eval", "--model", str(w.run), "--data", str(w.data), "--out", str(out), "--prompts", "2",
                 "--prompt-tokens", "4", "--max-new-tokens", "16", "--max-denoising-steps-grid", "2", "--seq-len", "32",
                 "--max-windows", "4", "--t-samples", "1", "--bootstrap", "10", "--quiet"],
        "viz": ["viz", str(w.trace), "--out", str(out), "--model", ck],
        "bench": ["bench", "--preset", "tiny", "--denoising-steps", "1", "--canvases", "1", "--repeats", "1",
                  "--no-train"],
        "demo": ["demo", "--out", str(out), "--minutes", "0.05"],
        # every flag is lm-eval's (the parser has none to mutate): its own command line refuses bad ones in one line
        "lm-eval": ["lm-eval", "--model_args", f"pretrained={w.run},max_gen_toks=4", "--tasks",
                    "dgemma_shakespeare_speaker", "--limit", "1", "--gen_kwargs", "max_denoising_steps=2"],
    }


# `dgemma lm-eval` passes every flag to lm-eval's command line: the ones the fuzz mutates there
LM_EVAL_FLAGS = {"--model_args": "text", "--tasks": "text", "--limit": "number", "--gen_kwargs": "text",
                 "--num_fewshot": "number", "--batch_size": "text", "--include_path": "path"}


@functools.cache
def flags(command: str) -> dict[str, str]:
    """The subcommand's options and what kind of value each takes: number, path, text or switch."""
    from dgemma.cli import build_parser

    if command == "lm-eval":
        return LM_EVAL_FLAGS

    parser = build_parser()
    for name in command.split():
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or name not in subs[0].choices:  # a variant of the command before it ("generate grammar")
            break
        parser = subs[0].choices[name]
    kinds = {}
    for a in parser._actions:
        if not a.option_strings or a.dest in {"help"}:
            continue
        opt = max(a.option_strings, key=len)
        if a.nargs == 0:
            kinds[opt] = "switch"
        elif getattr(a.type, "__name__", "") in {"int", "float", "_ints", "_floats"}:
            kinds[opt] = "number"
        elif getattr(a.type, "__name__", "") == "Path" or opt in {"--model", "--tokenizer", "--out", "--data"}:
            kinds[opt] = "path"
        else:
            kinds[opt] = "text"
    return kinds


POSITIONAL = {"inspect": 1, "data inspect": 2, "export": 1, "viz": 1}  # argv index of a positional path


def mutate(command: str, argv: list[str], kinds: dict[str, str], rng: random.Random, case_dir: Path,
           w: World) -> list[str]:
    """One or two hostile values; paths are drawn half the time (where the bugs that lose data live)."""
    argv = list(argv)
    paths = sorted(o for o, k in kinds.items() if k == "path")
    for _ in range(rng.choice([1, 1, 2])):
        if command in POSITIONAL and rng.random() < 0.2:
            argv[POSITIONAL[command]] = hostile_path(rng.choice(PATH_KINDS), case_dir, w)
            continue
        opt = rng.choice(paths) if paths and rng.random() < 0.5 else rng.choice(sorted(kinds))
        kind = kinds[opt]
        if kind == "switch":
            value = None
        elif kind == "number":
            value = rng.choice(NUMBERS)
        elif kind == "path":
            value = hostile_path(rng.choice(PATH_KINDS), case_dir, w)
        else:
            value = rng.choice(TEXT + NUMBERS)
        if opt in argv:
            if value is not None:
                argv[argv.index(opt) + 1] = value
        else:
            argv += [opt] if value is None else [opt, value]
    return argv


def classify(argv: list[str], done: subprocess.CompletedProcess | None, damaged: bool) -> str:
    if damaged:
        return "damage"
    if done is None:  # a budget of more than an hour, accepted, is long work by request, not a hang
        return "long" if _budget_minutes(argv) > 60 else "timeout"
    if done.returncode < 0:
        return "killed"
    if "Traceback (most recent call last)" in done.stderr or done.returncode not in (0, 2):
        return "traceback"
    if done.returncode == 0:
        return "ok"
    # progress lines may come first (on stderr, as they should); the error is the last line, and only one
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    return "refused" if len(errors) == 1 and lines[-1] == errors[0] and lines[-1].startswith("dgemma ") else "unclear"


def _budget_minutes(argv: list[str]) -> float:
    try:
        return float(argv[argv.index("--minutes") + 1])
    except (ValueError, IndexError):
        return 0.0


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_case(argv: list[str], cwd: Path, timeout: float, stdin: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run([sys.executable, "-m", "dgemma", *argv], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, env=_env(), input=stdin, preexec_fn=_limit, errors="replace")
    except subprocess.TimeoutExpired:
        return None


def fuzz_case(command: str, case: int, w: World) -> dict:
    """Case `case` of `command` (its draws seeded by both), run in its own directory, which is removed after."""
    rng = random.Random(f"{command}:{case}")
    case_dir = w.root / f"case-{command.replace(' ', '-')}-{case:02d}"
    case_dir.mkdir()
    try:
        argv = mutate(command, base_commands(w, case_dir / "out")[command], flags(command), rng, case_dir, w)
        timeout = 600 if command == "demo" else 120  # the demo trains for minutes
        before = w.protected()
        done = run_case(argv, case_dir, timeout, stdin="the king\n")
        damaged = {f: _digest(Path(f)) for f in before} != before  # files added since (a resumed run's) are no damage
    finally:
        shutil.rmtree(case_dir, ignore_errors=True)
    tail = "" if done is None else (done.stderr.strip().splitlines() or [""])[-1][:300]
    return {"case": case, "argv": argv, "outcome": classify(argv, done, damaged), "stderr_tail": tail}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return build_world(tmp_path_factory.mktemp("fuzz-cli"))


COMMANDS = ("bench", "chat", "data inspect", "data prepare", "demo", "distill", "eval", "export", "finetune",
            "generate", "generate chat", "generate grammar", "inspect", "lm-eval", "train", "viz")


def check_fuzzed(command: str, cases: range, w: World) -> None:
    results = [fuzz_case(command, case, w) for case in cases]
    counts: dict[str, int] = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(f"dgemma {command}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    findings = [r for r in results if r["outcome"] not in {"ok", "refused", "long"}]
    assert not findings, "\n".join(f"{r['outcome']} (case {r['case']}): dgemma {' '.join(r['argv'])}\n    "
                                   f"{r['stderr_tail']}" for r in findings)


@pytest.mark.integration
@pytest.mark.parametrize("command", COMMANDS)
def test_hostile_command_lines_end_ok_or_refused(command, world):
    check_fuzzed(command, range(QUICK), world)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_hostile_command_lines_end_ok_or_refused_full_round(command, world):
    check_fuzzed(command, range(QUICK, FULL), world)


def test_every_subcommand_is_fuzzed():
    """COMMANDS are the working commands base_commands builds: every subcommand but `serve`, whose HTTP surface has
    its own fuzz (tests/serving/test_serve_hardening.py)."""
    from dgemma.cli import build_parser

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    w = World(Path("w"))
    w.ckpt = w.data = w.run = w.chats = w.trace = w.corpus = Path("x")
    assert set(base_commands(w, Path("out"))) == set(COMMANDS)
    assert {c.split()[0] for c in COMMANDS} == set(subs.choices) - {"serve"}


def test_each_ending_is_classified():
    def ended(code: int, err: str = "") -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], code, "", err)

    refusal = "step 1 ...\ndgemma train: error: --lr: must be finite, got nan\n"
    assert classify(["train"], ended(0), damaged=False) == "ok"
    assert classify(["train"], ended(2, refusal), damaged=False) == "refused"
    assert classify(["train"], ended(2, "usage: ...\nerror: no\n"), damaged=False) == "unclear"
    assert classify(["train"], ended(2, refusal + "dgemma train: error: again\n"), damaged=False) == "unclear"
    assert classify(["train"], ended(1, "Traceback (most recent call last):\n"), damaged=False) == "traceback"
    assert classify(["train"], ended(3), damaged=False) == "traceback"
    assert classify(["train"], ended(-9), damaged=False) == "killed"
    assert classify(["train"], None, damaged=False) == "timeout"
    assert classify(["demo", "--minutes", "1e32"], None, damaged=False) == "long"
    assert classify(["train"], ended(0), damaged=True) == "damage"
