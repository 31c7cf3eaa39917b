"""The module map of docs/architecture.md against the code: every module of dgemma/ is in a package and on the map
(under its package), the map names no module that does not exist, each module imports only its own package and
packages of lower rank, no import cycle inside a package, and the model imports only itself and `io`. Imports inside
functions count; those under `if TYPE_CHECKING:` (annotations only) do not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dgemma"
ROW = re.compile(r"^\|\s*`([\w.]+)`\s*\|")
HEADING = re.compile(r"^### `(\w+)`")


def module_map() -> dict[str, str]:
    """module (relative to dgemma, "" for the package itself) -> its package, from the tables under '## Module map':
    a module's row (its name in backquotes, first cell) under its package's heading (### and the name in backquotes;
    the rows before the first heading: the package's own)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    found, package = {}, ""
    for line in section.splitlines():
        if (h := HEADING.match(line)):
            package = h.group(1)
            found[package] = package  # the package's __init__
        elif (m := ROW.match(line)) and m.group(1) != "module":
            name = "" if m.group(1) == "dgemma" else ".".join(filter(None, (package, m.group(1))))
            assert name not in found, f"docs/architecture.md: {m.group(1)} is on the module map twice"
            found[name] = package
    return found


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def dgemma_imports(path: Path, known: set[str]) -> set[str]:
    """The dgemma modules `path` imports, as names relative to dgemma ("" for the package)."""
    found: set[str] = set()
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1]  # what a relative import starts from (a package's __init__ sits in it)

    def resolve(name: str) -> str | None:
        if name != "dgemma" and not name.startswith("dgemma."):
            return None
        return name.removeprefix("dgemma").removeprefix(".")

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(m for a in node.names if (m := resolve(a.name)) is not None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from .x import y
                anchor = package[: len(package) - node.level + 1]
                base = resolve(".".join((*anchor, *([node.module] if node.module else []))))
            else:
                base = resolve(node.module or "")
            if base is not None:
                subs = {f"{base}.{a.name}".lstrip(".") for a in node.names}
                found.update(subs & known or {base})  # `from dgemma import model` imports the module
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_every_module_is_on_the_map_and_the_map_names_only_modules():
    on_map, real = set(module_map()), set(modules())
    assert not real - on_map, f"modules missing from the module map in docs/architecture.md: {sorted(real - on_map)}"
    assert not on_map - real, f"the module map names modules that do not exist: {sorted(on_map - real)}"


# The packages, from the bottom: a module may import its own package and the packages of lower rank, never a
# package of the same or a higher rank (diffusion and parallel share a rank, as do train and serving: neither of a
# pair imports the other). "" is the package itself (the public API) and `__main__`, above everything.
# docs/architecture.md, "Module map", draws it.
PACKAGE_RANK = {"io": 0, "testing": 0, "model": 1, "diffusion": 2, "parallel": 2, "sampling": 3, "weights": 4,
                "data": 5, "train": 6, "serving": 6, "eval": 7, "cli": 8, "": 9}


def package_of(module: str) -> str:
    """The package a module belongs to ("" for the package itself and `__main__`)."""
    return "" if module in ("", "__main__") else module.split(".")[0]


def test_dgemma_has_no_loose_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules directly in dgemma/ (each belongs in a package): {loose}"


def test_packages_point_one_way():
    mods = modules()
    assert {package_of(m) for m in mods} <= set(PACKAGE_RANK), "a package missing from PACKAGE_RANK"
    wrong = []
    for name, path in sorted(mods.items()):
        own = package_of(name)
        for dep in sorted(dgemma_imports(path, set(mods)) - {name}):
            theirs = package_of(dep)
            if theirs != own and PACKAGE_RANK[theirs] >= PACKAGE_RANK[own]:
                wrong.append(f"{name or 'dgemma'} ({own or 'dgemma'}) imports {dep} ({theirs or 'dgemma'})")
    assert not wrong, "imports between packages that point up or sideways:\n" + "\n".join(wrong)


def test_no_import_cycle_inside_a_package():
    mods = modules()
    graph = {name: {d for d in dgemma_imports(path, set(mods)) - {name} if package_of(d) == package_of(name)}
             for name, path in mods.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycle = [*stack[stack.index(name):], name]
            raise AssertionError("an import cycle: " + " -> ".join(m or "dgemma" for m in cycle))
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_model_imports_only_itself_and_io():
    """The model is a pure module: loading, quantization, offload and sampling are applied from outside."""
    mods = modules()
    wrong = [f"{name} imports {dep}" for name, path in sorted(mods.items()) if package_of(name) == "model"
             for dep in sorted(dgemma_imports(path, set(mods))) if package_of(dep) not in ("model", "io")]
    assert not wrong, "\n".join(wrong)
