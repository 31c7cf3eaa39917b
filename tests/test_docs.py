"""The docs stay true to the code: every `file.py:Dotted.Path` pointer in docs/*.md and README.md resolves to a real
attribute of the dgemma package, and docs/architecture.md covers the `# Gemma:` quirks of dgemma/model.py."""

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
    `dgemma/` is tolerated), e.g. `model.py` or `cli/inspect.py`."""
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
    lines = (PACKAGE / "model.py").read_text(encoding="utf-8").splitlines()
    marks = [(n, line.split("# Gemma:", 1)[1].strip()) for n, line in enumerate(lines, 1) if "# Gemma:" in line]
    assert marks, "dgemma/model.py has no `# Gemma:` comments"
    empty = [n for n, text in marks if not text]
    assert not empty, f"empty `# Gemma:` comments in dgemma/model.py at lines {empty}"
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    missing = [k for k in QUIRK_KEYWORDS if k not in doc]
    assert not missing, f"docs/architecture.md does not mention {missing}"
