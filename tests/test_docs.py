"""The docs stay true to the code: every `file.py:Dotted.Path` pointer in docs/*.md and README.md resolves to a real
attribute of the dgemma package, and docs/architecture.md covers the `# Gemma:` quirks of dgemma/model/layers.py and
dgemma/model/diffusiongemma.py."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dgemma"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
POINTER = re.compile(r"\b([\w/]+\.py):([A-Za-z_][\w.]*)")
MIN_ARCHITECTURE_POINTERS = 10
QUIRK_KEYWORDS = ("K=V", "layer_scalar", "softcap", "self-conditioning", "proportional", "sliding_window - 1")


def markdown_files() -> list[Path]:
    files = sorted((ROOT / "docs").rglob("*.md"))
    readme = ROOT / "README.md"
    return [*files, readme] if readme.is_file() else files


def pointers(text: str) -> list[tuple[str, str]]:
    """(file, dotted path) pairs; a sentence-ending dot is not part of the path."""
    return [(file, path.rstrip(".")) for file, path in POINTER.findall(text)]


def resolve(file: str, dotted: str) -> str | None:
    """None if `file:dotted` names a real attribute, else why not. `file` is relative to dgemma/ (a leading
    `dgemma/` is tolerated), e.g. `model/diffusiongemma.py` or `cli/inspect.py`."""
    rel = file.removeprefix("dgemma/")
    if not (PACKAGE / rel).is_file():
        return f"no file dgemma/{rel}"
    module_name = "dgemma." + rel.removesuffix(".py").replace("/", ".")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # any import failure is a broken pointer, reported rather than raised
        return f"cannot import {module_name}: {type(e).__name__}: {e}"
    walked = module_name
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return f"{walked} has no attribute {part!r}"
        obj, walked = getattr(obj, part), f"{walked}.{part}"
    return None


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_pointers_resolve(doc: Path) -> None:
    found = pointers(doc.read_text(encoding="utf-8"))
    broken = [f"{file}:{path}: {why}" for file, path in dict.fromkeys(found) if (why := resolve(file, path))]
    assert not broken, f"{doc.relative_to(ROOT)} has {len(broken)} broken code pointer(s):\n" + "\n".join(broken)
    if doc == ARCHITECTURE:
        assert len(set(found)) >= MIN_ARCHITECTURE_POINTERS, (
            f"docs/architecture.md has only {len(set(found))} distinct code pointers; expected at least "
            f"{MIN_ARCHITECTURE_POINTERS}"
        )


def test_architecture_doc_covers_the_gemma_quirks() -> None:
    assert ARCHITECTURE.is_file(), "docs/architecture.md is missing"
    for module in ("model/layers.py", "model/diffusiongemma.py"):
        lines = (PACKAGE / module).read_text(encoding="utf-8").splitlines()
        marks = [(n, line.split("# Gemma:", 1)[1].strip()) for n, line in enumerate(lines, 1) if "# Gemma:" in line]
        assert marks, f"dgemma/{module} has no `# Gemma:` comments"
        empty = [n for n, text in marks if not text]
        assert not empty, f"empty `# Gemma:` comments in dgemma/{module} at lines {empty}"
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    missing = [k for k in QUIRK_KEYWORDS if k not in doc]
    assert not missing, f"docs/architecture.md does not mention {missing}"


# --- every command quoted in the docs runs ---------------------------------------------------------------------
# A command is a line of a ```bash block (or of any block whose lines start with `dgemma `), with `\` continuations
# joined. A trailing comment may carry one marker:
#   [long]       runs only under `pytest --runslow` (minutes, or the network)
#   [GPU]        runs only under `pytest --runslow`, on a machine with CUDA
#   [CI]         run as written by .ci/run (the README's install and test commands); checked to be there
# The other commands run for real in the integration tier (`pytest -m integration`, as .ci/run does), in a fresh
# directory per block, in order (a block's later commands use what the earlier ones wrote), and OUTPUT_CHECKS checks
# what each wrote or printed. To keep them fast, TINY_ARGS appends flags to some (argparse: the last value of a flag
# wins), and a data prepare without --corpus reads a toy corpus instead of fetching the default one.
# The measurement scripts under runs/ (`python runs/X.py`, `bash runs/X.sh`) run the same way, from the repository's
# runs/ folder, in their tiny mode (TINY_ARGS); test_every_runs_script_is_quoted_and_exercised keeps that true.
# A command ending in ` &` starts a server (`dgemma serve ... --port 8000 &`): it runs in the background, on a free
# port that replaces 8000 in it and in the block's later commands, which run once its /health answers; `curl`
# commands (to localhost only) run as written. At the end of the block the server gets SIGINT (Ctrl-C) and must exit 0.
# `torchrun ... -m dgemma ...` commands run as subprocesses (`python -m torch.distributed.run`, one thread a rank, a
# timeout), TINY_ARGS appended to dgemma's flags; every --rdzv-endpoint / --master-port gets a free port (the same
# one for the same endpoint within a block), and one ending in ` &` (a node of a multi-node job) runs in the
# background and must exit 0 by the end of its block. A [GPU] torchrun starts at most one rank per CUDA device; one
# whose --model directory is not there (a released checkpoint) is skipped.

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

MARKERS = ("[long]", "[GPU]", "[CI]")
TINY_ARGS: dict[str, list[str]] = {
    # README: generate at 3 denoising steps (the model is random; the flags' parsing is what is shown)
    "dgemma generate --preset tiny --random-init --prompt-ids 2,45,300 --seed 0 --max-new-tokens 32":
        ["--max-denoising-steps", "3"],
    "dgemma generate --preset tiny --random-init --prompt-ids 2,45,300 --sampler lite --max-denoising-steps 8 "
    "--trace run --json": ["--max-denoising-steps", "3"],
    'echo "Hello there" | dgemma chat --preset tiny --random-init --tokenizer tok --seed 0':
        ["--max-denoising-steps", "3", "--max-new-tokens", "16"],
    # docs/training.md: the recipe without --preset (cpu-small), stopped after one step
    "dgemma train --data data --out runs/small": ["--until-step", "1", "--eval-batches", "1"],
    "dgemma train --data data --out runs/small --resume": ["--until-step", "2", "--eval-batches", "1"],
    "dgemma train --data data --out runs/ar --objective ar": ["--until-step", "1", "--eval-batches", "1"],
    "dgemma train --data data --out runs/from-ar --init-from runs/ar --time-embedding --observed-likelihood":
        ["--until-step", "1", "--eval-batches", "1"],
    # docs/training.md, Few-step samplers by distillation: the teacher and each round stopped after a step or two
    "dgemma train --data data --out runs/teacher": ["--until-step", "1", "--eval-batches", "1"],
    "dgemma distill --data data --out runs/student-24 --teacher runs/teacher --student-steps 24":
        ["--until-step", "1", "--eval-batches", "1"],
    "dgemma distill --data data --out runs/student-24 --teacher runs/teacher --student-steps 24 --resume":
        ["--until-step", "2", "--eval-batches", "1"],
    "dgemma distill --data data --out runs/student-12 --teacher runs/student-24 --student-steps 12":
        ["--until-step", "1", "--eval-batches", "1"],
    'dgemma generate --model runs/student-12 --prompt "The cat" --seed 0': ["--max-new-tokens", "32"],
    "torchrun --standalone --nproc-per-node 2 -m dgemma distill --data data --out runs/student-ddp --teacher "
    "runs/teacher --student-steps 24 --device cpu --batch-size 2": ["--until-step", "1", "--eval-batches", "1"],
    # docs/training.md, Scaling out: torchrun on 2 CPU ranks, stopped after a step or two
    "torchrun --standalone --nproc-per-node 2 -m dgemma train --data data --out runs/ddp --device cpu --batch-size 2":
        ["--until-step", "1", "--eval-batches", "1"],
    "torchrun --standalone --nproc-per-node 2 -m dgemma train --data data --out runs/ddp --device cpu --resume":
        ["--until-step", "2", "--eval-batches", "1"],
    "dgemma train --data data --out runs/ddp --resume": ["--until-step", "3", "--eval-batches", "1"],
    "torchrun --standalone --nproc-per-node 2 -m dgemma train --data data --out runs/fsdp --device cpu --batch-size 2 "
    "--parallel fsdp": ["--until-step", "1", "--eval-batches", "1"],
    **{f"torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 --rdzv-id demo -m "
       f"dgemma train --data data --out runs/nodes --device cpu --batch-size 2{bg}": ["--until-step", "1",
                                                                                   "--eval-batches", "1"]
       for bg in ("", " &")},
    "torchrun --standalone --nproc-per-node 8 -m dgemma train --data data-gpt2 --out runs/dg-380m --preset dg-380m "
    "--grad-accum 1 --resume": ["--until-step", "2", "--seq-len", "256", "--batch-size", "1", "--eval-batches", "1"],
    "torchrun --standalone --nproc-per-node 8 -m dgemma finetune --model diffusiongemma-26B-A4B-it --data chats.jsonl "
    "--out runs/sft-26b --parallel fsdp --activation-checkpointing --batch-size 1 --resume": ["--until-step", "2"],
    "python runs/bench_dist.py data": ["--steps", "3", "--seq-len", "32", "--only", "0,2"],
    # docs/training.md, Fine-tuning: a few steps, a short answer
    "dgemma finetune --model base --data examples/conversations.jsonl --out runs/sft --lr 5e-3 --max-steps 200":
        ["--max-steps", "2", "--eval-batches", "1"],
    "dgemma finetune --model base --data examples/conversations.jsonl --out runs/lora --lora-rank 8 "
    "--lora-targets attention+experts --lr 1e-2 --max-steps 60 --eval-every 20":
        ["--max-steps", "2", "--eval-every", "1", "--eval-batches", "1"],
    'echo "What is the capital of France?" | dgemma chat --model runs/sft --seed 0': ["--max-denoising-steps", "3",
                                                                                    "--max-new-tokens", "16"],
    # runs/: each measurement script in its tiny mode (seconds), so every script a doc names runs in the default suite
    "bash runs/cpu_small_results.sh 4800": ["--smoke"],
    "bash runs/distill_results.sh": ["--smoke"],
    "bash runs/distill_draws.sh": ["--smoke"],
    "python runs/recipe_ablations.py": ["--smoke"],
    "python runs/sampler_levels.py": ["--smoke"],
    "python runs/demo_seeds.py --seeds 0,1,2 --out runs/out/demo-seeds": ["--smoke", "--seeds", "0", "--out", "out"],
    "python runs/demo_samplers.py --runs runs/out/demo-seeds --seeds 0,1,2 --draws 4":  # on demo_seeds' smoke run
        ["--runs", "out", "--seeds", "0", "--draws", "1"],
    "python runs/frontier_table.py": [],  # the committed report's table: seconds
    "python runs/time_ablations.py --setting demo": ["--smoke"],
    # README: seed 003's GPU recipes, two steps each where a GPU is there
    "dgemma train --data data-gpt2 --out runs/lite-380m --preset lite-380m --resume": ["--until-step", "2"],
    "dgemma train --data data-gpt2 --out runs/lite-380m-ar --preset lite-380m --objective ar --resume":
        ["--until-step", "2"],
    "dgemma train --data data-gpt2 --out runs/dg-380m --preset dg-380m --resume": ["--until-step", "2"],
    "python runs/bench_train.py --preset cpu-small --batch-size 4 --seq-len 128 --steps 12 --threads 2":
        ["--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--threads", "1"],
    "python runs/bench_ce_memory.py": ["--rows", "64", "--vocab", "1000"],
    "python runs/bench_threads.py --preset cpu-tiny --train-steps 10 --new-tokens 64 --loads 0,4 --settle 20":
        ["--preset", "tiny", "--train-steps", "1", "--batch-size", "2", "--seq-len", "32", "--new-tokens", "8",
         "--loads", "0,1", "--settle", "0"],
    "python runs/bench_threads.py --preset cpu-tiny --train-steps 4 --loads 2 --settle 5 --works train --settings "
    "before,after,no-spin,after-1-thread": ["--preset", "tiny", "--train-steps", "1", "--batch-size", "2",
                                            "--seq-len", "32", "--loads", "0", "--settle", "0"],
    "python runs/bench_demo.py --loads 0,2 --out runs/out/bench-demo": ["--smoke", "--loads", "0", "--settle", "0",
                                                                        "--out", "out"],
    "python runs/train_memory.py data": ["--steps", "1", "--only", "1"],
    "python runs/profile_fast_step.py --preset bench-small": ["--preset", "tiny", "--repeats", "1"],
    "python runs/quant_quality.py": ["--smoke"],
    "python runs/build_lm_eval_tasks.py": ["--smoke"],
    "python runs/exact_reference.py --data dgemma-demo/data --seq-len 128 --windows 128 --canvas 16": ["--smoke"],
    "python -m pytest tests/cli/test_fuzz_cli.py -m integration": ["-k", "inspect or export"],  # 9 of its 42 cases
    "bash runs/gpu_check.sh --dry-run": [],  # already the CPU smoke mode of the GPU script
    "python runs/step_variants.py --preset bench-small --threads 1": ["--preset", "tiny", "--rounds", "1"],
    # README: quantized and offloaded generation at 3 denoising steps
    "dgemma generate --preset tiny --random-init --prompt-ids 2,45,300 --seed 0 --max-new-tokens 32 --quantize int8":
        ["--max-denoising-steps", "3"],
    "dgemma generate --preset tiny --random-init --prompt-ids 2,45,300 --seed 0 --max-new-tokens 32 "
    "--offload-experts": ["--max-denoising-steps", "3"],
    # docs/parallel.md: torchrun generate --parallel on the tiny preset, 3 denoising steps; the bench in its tiny mode
    **{f"torchrun --standalone --nproc-per-node {n} -m dgemma generate --preset tiny --random-init --prompt-ids "
       f"2,45,300 --seed 0 --max-new-tokens 32 --parallel {layout}": ["--max-denoising-steps", "3"]
       for n, layout in ((2, "ep"), (4, "tp"), (2, "ep+tp"))},
    # docs/parallel.md, Training: ep on 2 CPU ranks stopped after a step, then resumed in one process
    "torchrun --standalone --nproc-per-node 2 -m dgemma train --data data --out runs/ep --preset tiny "
    "--vocab-size 8192 --device cpu --parallel ep": ["--until-step", "1", "--eval-batches", "1", "--batch-size", "2",
                                                     "--save-every", "1"],
    "dgemma train --data data --out runs/ep --resume": ["--until-step", "2", "--eval-batches", "1"],
    # docs/parallel.md, the (data, ep) mesh: fsdp+ep on 4 CPU ranks (2 x 2) for a step, then on 2 ranks, then 1 process
    "torchrun --standalone --nproc-per-node 4 -m dgemma train --data data --out runs/fsdp-ep --preset tiny "
    "--vocab-size 8192 --device cpu --batch-size 2 --parallel fsdp+ep --ep-size 2":
        ["--until-step", "1", "--eval-batches", "1", "--save-every", "1"],
    "torchrun --standalone --nproc-per-node 2 -m dgemma train --data data --out runs/fsdp-ep --resume":
        ["--until-step", "2", "--eval-batches", "1", "--save-every", "1"],
    "dgemma train --data data --out runs/fsdp-ep --resume": ["--until-step", "3", "--eval-batches", "1"],
    "python runs/bench_parallel.py": ["--smoke"],
    "python runs/bench_serve.py": ["--quick"],
    "python runs/bench_prefix_cache.py --threads 1 --repeats 3": ["--quick"],
    "python runs/bench_multi_lora.py --threads 1 --repeats 3": ["--quick"],
    "python runs/profile_train_step.py --preset cpu-small --threads 1": ["--preset", "tiny", "--steps", "1"],
    "python runs/profile_train_step.py --preset cpu-small --threads 1 --steps 20 --compile-blocks":
        ["--preset", "tiny", "--steps", "1"],
    "python runs/profile_train_step.py --preset lite-380m --batch-size 1 --seq-len 1024 --steps 3 --no-variants":
        ["--preset", "tiny", "--seq-len", "32", "--steps", "1"],
    "python runs/structured_output.py --model runs/out/cpu-small/diffusion-s0": ["--smoke", "--out", "out"],
    "dgemma generate --preset tiny --random-init --tokenizer tok --prompt \"A person:\" --json-schema "
    "examples/person.schema.json --seed 0 --max-new-tokens 64": ["--max-denoising-steps", "3"],
}
# Files the docs' commands read from the current directory (docs/data.md: your own corpus).
DOC_FILES = {"notes/a.md": "# Notes\n\nThe cat sees the red ball.\n", "book.txt": "A dog likes the blue sky. " * 20,
             "chats.jsonl": '{"text": "Hello there."}\n{"text": "What is the capital of France?"}\n',
             # docs/training.md, Fine-tuning: the shipped example chats, as the docs run them from the root
             "examples/conversations.jsonl": (ROOT / "examples" / "conversations.jsonl").read_text(encoding="utf-8"),
             # docs/sampling.md, Structured output
             "examples/person.schema.json": (ROOT / "examples" / "person.schema.json").read_text(encoding="utf-8")}


def _flag(argv: list[str], name: str) -> str | None:
    """The value of a flag as argparse sees it: the last one given wins (TINY_ARGS relies on that)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values[-1] if values else None


def _prepared(argv: list[str], out: str, cwd: Path) -> None:
    data = cwd / _flag(argv, "--out")
    assert (data / "meta.json").is_file() and (data / "tokenizer.json").is_file(), sorted(data.iterdir())
    assert list(data.glob("train-*.bin")) and list(data.glob("val-*.bin")), sorted(data.iterdir())


def _trained(argv: list[str], out: str, cwd: Path) -> None:
    from dgemma.weights.checkpoint import list_checkpoints

    ckpts = list_checkpoints(cwd / _flag(argv, "--out"))
    assert ckpts, f"no checkpoint under {_flag(argv, '--out')}"
    last = _flag(argv, "--until-step") or _flag(argv, "--max-steps")
    assert last is None or int(ckpts[-1].name.removeprefix("step-")) == int(last), [c.name for c in ckpts]


def _exported(argv: list[str], out: str, cwd: Path) -> None:
    folder = cwd / _flag(argv, "--out")
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors")), sorted(folder.iterdir())


def _generated(argv: list[str], out: str, cwd: Path) -> None:
    if "--json" in argv:
        assert json.loads(out)["token_ids"], out[:500]
    else:
        assert out.strip(), "generate printed nothing"  # the text, or the ids where there is no tokenizer
    if _flag(argv, "--trace"):
        trace = cwd / _flag(argv, "--trace")
        assert trace.with_suffix(".json").is_file() and trace.with_suffix(".npz").is_file(), sorted(cwd.iterdir())


def _answered(argv: list[str], out: str, cwd: Path) -> None:
    assert out.strip(), "the chat printed no answer"


def _pattern(regex: str):
    def check(argv: list[str], out: str, cwd: Path) -> None:
        assert re.search(regex, out, re.M), f"expected {regex!r} in the output:\n{out[-2000:]}"
    return check


# What success looks like beyond exit 0, per `dgemma` subcommand (the longest matching word prefix wins): files it
# must have written (paths from the command's own flags, relative to the block's folder) or a pattern its stdout
# must show. A subcommand not in the table is checked by its exit status only.
OUTPUT_CHECKS = {
    ("data", "prepare"): _prepared,
    ("data", "inspect"): _pattern(r"^train +[\d,]+ +[\d,]+.*\n^val +[\d,]+ +[\d,]+"),
    ("train",): _trained,
    ("finetune",): _trained,
    ("distill",): _trained,
    ("export",): _exported,
    ("generate",): _generated,
    ("chat",): _answered,
    ("inspect",): _pattern(r"^model \S+: \d+ layers"),
    ("bench",): _pattern(r"^ +fast +\d[\d.]* +\d"),
}


def check_doc_output(argv: list[str], out: str, cwd: Path) -> None:
    """Run OUTPUT_CHECKS' check for a documented `dgemma` command (argv without `dgemma`, TINY_ARGS appended)."""
    for n in (2, 1):
        if (check := OUTPUT_CHECKS.get(tuple(argv[:n]))) is not None:
            check(argv, out, cwd)
            return


def check_curl_output(argv: list[str], out: str) -> None:
    """A documented curl against the server answered what its endpoint answers: a stream ends with `data: [DONE]`,
    anything else is a JSON body without an error."""
    if "-sN" in argv or "-N" in argv:
        assert out.rstrip().endswith("data: [DONE]"), out[-2000:]
    else:
        body = json.loads(out)
        assert "error" not in body, body


def doc_blocks() -> list[tuple[str, list[tuple[str, str]]]]:
    """(doc:line, [(command, marker)]) for every block of commands in README.md and docs/*.md."""
    blocks = []
    for doc in markdown_files():
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M):
            lines = m.group(2).replace("\\\n", " ").splitlines()
            if m.group(1) != "bash" and not any(line.strip().startswith("dgemma ") for line in lines):
                continue
            commands = []
            for line in lines:
                code, _, comment = line.partition("  #")
                code = " ".join(code.split())
                if code:
                    commands.append((code, next((k for k in MARKERS if k in comment), "")))
            where = f"{doc.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
            blocks.append((where, commands))
    return blocks


def test_every_tiny_args_entry_is_a_doc_command():
    quoted = {c for _, cmds in doc_blocks() for c, _ in cmds}
    assert not set(TINY_ARGS) - quoted, f"TINY_ARGS entries no doc quotes: {sorted(set(TINY_ARGS) - quoted)}"


FILE_MENTION = re.compile(r"(?<![\w./-])((?:runs|dgemma|docs|tests)/[\w./-]*\w\.(?:py|sh|md|png|html|json))\b")


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_exist(doc: Path) -> None:
    """Every repository file a doc names (runs/..., dgemma/..., docs/..., tests/...) is there."""
    named = dict.fromkeys(FILE_MENTION.findall(doc.read_text(encoding="utf-8")))
    missing = [f for f in named if not (ROOT / f).is_file()]
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


RUNS_HELPER = ROOT / "runs" / "harness.py"  # what the scripts of runs/ share: a module, not a script


def runs_scripts() -> list[Path]:
    return sorted(p for p in (ROOT / "runs").glob("*") if p.suffix in (".py", ".sh") and p != RUNS_HELPER)


def test_every_runs_script_is_quoted_and_exercised():
    """Each script under runs/ is quoted as a command in a doc, and that command runs: in the integration tier (in
    its tiny mode, TINY_ARGS) or, marked [long], under --runslow. A doc may name only scripts that exist
    (test_named_files_exist)."""
    scripts = [p.relative_to(ROOT).as_posix() for p in runs_scripts()]
    assert scripts, "runs/ has no scripts"
    commands = [(code, marker) for _, cmds in doc_blocks() for code, marker in cmds]
    for script in scripts:
        quoted = [(c, m) for c, m in commands if c.split()[1:2] == [script] and c.split()[0] in ("python", "bash")]
        assert quoted, f"{script} is quoted in no doc's command block"
        assert any(m == "[long]" or (not m and c in TINY_ARGS) for c, m in quoted), (
            f"{script}: no quoted command runs it in a test (add its tiny flags to TINY_ARGS, or mark it [long])")


def test_runs_scripts_import_no_script_and_edit_no_path():
    """A script of runs/ imports dgemma as installed and what the scripts share from runs/harness.py, never another
    script, and leaves sys.path (and its children's PYTHONPATH) alone."""
    import ast

    scripts = {p.stem for p in runs_scripts() if p.suffix == ".py"}
    wrong = []
    for path in [*runs_scripts(), RUNS_HELPER]:
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.name} imports the script {n}" for n in names if n.split(".")[0] in scripts]
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                wrong.append(f"{path.name}:{node.lineno} uses sys.path")
            if isinstance(node, ast.Constant) and node.value == "PYTHONPATH":
                wrong.append(f"{path.name}:{node.lineno} sets PYTHONPATH")
    assert not wrong, "\n".join(wrong)


def test_recipe_ablations_refuses_an_unknown_variant(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "runs" / "recipe_ablations.py"), "--only", "time,nope",
                        "--out", str(tmp_path / "abl")], capture_output=True, text=True)
    assert p.returncode == 2
    assert "error: --only nope: no such variant; choose from baseline, time," in p.stderr, p.stderr
    assert not (tmp_path / "abl").exists()  # refused before anything is written


def test_ci_markers_are_true():
    ci = (ROOT / ".ci" / "run").read_text()
    for where, cmds in doc_blocks():
        for code, marker in cmds:
            if marker == "[CI]":
                pip_args = {a for line in re.findall(r"pip install ([^&\n]*)", ci) for a in shlex.split(line)}
                for part in code.split(" && "):
                    if part.startswith("pip install "):  # CI installs the same requirements (quietly, maybe split)
                        missing = set(shlex.split(part)[2:]) - pip_args
                        assert not missing, f"{where}: .ci/run never installs {sorted(missing)}"
                    else:
                        assert part in ci, f"{where}: .ci/run never runs {part!r}"


def torchrun_argv(code: str, ports: dict[str, int], gpu: bool) -> list[str]:
    """A documented torchrun command as this test runs it (see the header)."""
    argv = shlex.split(code.removesuffix(" &")) + TINY_ARGS.get(code.removesuffix(" &"), [])
    for i, a in enumerate(argv[:-1]):
        if a in ("--rdzv-endpoint", "--rdzv_endpoint"):
            argv[i + 1] = f"127.0.0.1:{ports.setdefault(argv[i + 1], free_port())}"
        elif a in ("--master-port", "--master_port"):
            argv[i + 1] = str(ports.setdefault(argv[i + 1], free_port()))
        elif a in ("--nproc-per-node", "--nproc_per_node") and gpu:
            import torch

            argv[i + 1] = str(min(int(argv[i + 1]), torch.cuda.device_count()))
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_doc_command(code: str, cwd: Path, toy: Path) -> None:
    from dgemma import cli

    stdin = None
    if code.startswith("echo ") and " | " in code:
        echo, code = code.split(" | ", 1)
        stdin = shlex.split(echo)[1] + "\n"
    argv = shlex.split(code)
    while argv and "=" in argv[0] and not argv[0].startswith("-"):  # VAR=value prefixes
        argv.pop(0)
    if argv[0] == "curl":
        urls = [a for a in argv if "://" in a or a.startswith(("localhost", "127.0.0.1"))]
        assert urls and all(u.split("://")[-1].startswith(("localhost:", "127.0.0.1:")) for u in urls), code
        done = subprocess.run([*argv, "--fail-with-body", "--max-time", "120"], cwd=cwd, capture_output=True, text=True,
                              timeout=150)
        assert done.returncode == 0, f"{code!r} -> exit {done.returncode}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
        check_curl_output(argv, done.stdout)
        return
    if argv[0] in ("python", "bash"):
        args = argv[1:] + TINY_ARGS.get(code, [])
        if args[0].startswith("runs/"):  # a measurement script of the repository, run from the block's folder
            args[0] = str(ROOT / args[0])
        exe = [sys.executable] if argv[0] == "python" else ["bash"]
        env = {**os.environ, "PYTHON": sys.executable, "OUT": str(cwd / "out")}
        here = ROOT if args[:2] == ["-m", "pytest"] else cwd  # the repository's own tests run from its root
        done = subprocess.run([*exe, *args], cwd=here, env=env, timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, f"{code!r} -> exit {done.returncode}: {done.stderr[-3000:]}"
        return
    assert argv[0] == "dgemma", f"no way to run {code!r}: add it to TINY_ARGS or mark it in the doc"
    argv = argv[1:] + TINY_ARGS.get(code, [])
    if argv[:2] == ["data", "prepare"]:
        if "--corpus" not in argv:
            argv += ["--corpus", str(toy)]
        argv += ["--cache-dir", str(cwd / ".cache"), "-q"]
    old_cwd, old_stdin = os.getcwd(), sys.stdin
    out, err = io.StringIO(), io.StringIO()
    try:
        os.chdir(cwd)
        if stdin is not None:
            sys.stdin = io.StringIO(stdin)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    finally:
        os.chdir(old_cwd)
        sys.stdin = old_stdin
    assert rc == 0, f"{code!r} -> exit {rc}: {err.getvalue()}"
    check_doc_output(argv, out.getvalue(), cwd)


def _block_params():
    params = []
    for where, cmds in doc_blocks():
        markers = {m for _, m in cmds}
        runnable = [c for c, m in cmds if m != "[CI]"]
        if not runnable:
            continue
        marks = [pytest.mark.slow] if markers & {"[long]", "[GPU]"} else []
        params.append(pytest.param(where, [(c, m) for c, m in cmds if m != "[CI]"],
                                   id=where, marks=marks))
        if marks:  # the block's unmarked commands still run by default, without the marked ones
            fast = [(c, m) for c, m in cmds if not m]
            if fast:
                params.append(pytest.param(where, fast, id=where + "-unmarked"))
    return params


@pytest.mark.integration
@pytest.mark.parametrize("where, commands", _block_params())
def test_doc_commands_run(where, commands, tmp_path):
    import torch

    from dgemma.data.tokenizer import write_toy_corpus

    toy = write_toy_corpus(tmp_path / "toy-corpus")
    for name, text in DOC_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with contextlib.ExitStack() as servers:
        port, ports = None, {}
        for code, marker in commands:
            if marker == "[GPU]" and not torch.cuda.is_available():
                pytest.skip(f"{where}: {code!r} needs CUDA")
            if code.startswith("torchrun "):
                argv = shlex.split(code)
                model = argv[argv.index("--model") + 1] if "--model" in argv else None
                if marker == "[GPU]" and model is not None and not (tmp_path / model).exists():
                    continue  # a released checkpoint this machine does not have
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
                cmd = torchrun_argv(code, ports, marker == "[GPU]")
                if code.endswith(" &"):
                    node = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE)
                    servers.callback(wait_node, code, node)
                    continue
                done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, f"{code!r} -> exit {done.returncode}: {done.stderr[-3000:]}"
                check_doc_output(cmd[cmd.index("dgemma") + 1:], done.stdout, tmp_path)
                continue
            if code.endswith(" &"):
                port = start_doc_server(code.removesuffix(" &"), tmp_path, servers)
                continue
            run_doc_command(code if port is None else code.replace(f":{DOC_PORT}", f":{port}"), tmp_path, toy)


def wait_node(code: str, node: subprocess.Popen) -> None:
    """The end of a block: a background torchrun (a node of a multi-node job) must have finished, with exit 0."""
    try:
        _, err = node.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        node.kill()
        raise AssertionError(f"{code!r} did not finish") from None
    assert node.returncode == 0, f"{code!r} -> exit {node.returncode}: {err[-3000:]}"


DOC_PORT = 8000  # the port the docs' server commands show


def start_doc_server(code: str, cwd: Path, stack: contextlib.ExitStack) -> int:
    """Start the server `code` (a `dgemma` command with `--port 8000`) in the background on a free port, wait for
    its /health, and register its stop (SIGINT; exit 0 expected) on `stack`. Returns the port."""
    import signal
    import socket
    import time
    import urllib.request

    argv = shlex.split(code) + TINY_ARGS.get(code, [])
    assert argv[0] == "dgemma" and argv[argv.index("--port") + 1] == str(DOC_PORT), code
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv[argv.index("--port") + 1] = str(port)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dgemma", *argv[1:]], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{code!r} did not stop on SIGINT") from None
        assert rc == 0, f"{code!r} -> exit {rc}: {proc.stderr.read()[-3000:]}"

    stack.callback(stop)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"{code!r} exited with {proc.returncode}: {proc.stderr.read()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return port
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{code!r}: /health did not answer within 120 s"
        time.sleep(0.2)
