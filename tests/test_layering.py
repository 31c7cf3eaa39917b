"""The module map of docs/architecture.md against the code: every module of dgemma/ is on the map, the map names no
module that does not exist, and each module imports only modules of lower layers (so imports point one way and
there is no cycle). Imports inside functions count; those under `if TYPE_CHECKING:` (annotations only) do not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dgemma"
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w.]+)`\s*\|")


def module_map() -> dict[str, int]:
    """module (relative to dgemma, "" for the package itself) -> layer, from the table under '## Module map'."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            name = "" if m.group(2) == "dgemma" else m.group(2)
            assert name not in layers, f"docs/architecture.md: {m.group(2)} is on the module map twice"
            layers[name] = int(m.group(1))
    return layers


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


def test_imports_point_down_the_layers():
    layers, mods = module_map(), modules()
    wrong = []
    for name, path in sorted(mods.items()):
        for dep in sorted(dgemma_imports(path, set(mods)) - {name}):
            if dep in layers and layers[dep] >= layers[name]:
                wrong.append(f"{name or 'dgemma'} (layer {layers[name]}) imports {dep or 'dgemma'} "
                             f"(layer {layers[dep]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


# The packages, from the bottom: a module may import its own package and the packages of lower rank (the core, ""
# below everything), never a package of the same or a higher rank (train and serving share a rank: neither imports
# the other). docs/architecture.md, "Module map", draws it.
PACKAGE_RANK = {"": 0, "testing": 0, "data": 1, "train": 2, "serving": 2, "eval": 3, "cli": 4}


def package_of(module: str) -> str:
    """The package a module belongs to ("" for the core modules at the top of dgemma/ and the package itself)."""
    if module == "__main__":
        return "cli"
    first = module.split(".")[0]
    return first if first in PACKAGE_RANK and (module != first or (PACKAGE / first).is_dir()) else ""


def test_packages_point_one_way():
    mods = modules()
    assert {package_of(m) for m in mods} <= set(PACKAGE_RANK), "a package missing from PACKAGE_RANK"
    wrong = []
    for name, path in sorted(mods.items()):
        own = package_of(name)
        for dep in sorted(dgemma_imports(path, set(mods)) - {name}):
            theirs = package_of(dep)
            if theirs != own and PACKAGE_RANK[theirs] >= PACKAGE_RANK[own]:
                wrong.append(f"{name or 'dgemma'} ({own or 'core'}) imports {dep} ({theirs or 'core'})")
    assert not wrong, "imports between packages that point up or sideways:\n" + "\n".join(wrong)
