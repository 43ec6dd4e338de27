"""The package's modules import each other without a circle, and each one first says what it owns.

A circle (a.py imports b.py, which imports a.py, perhaps inside a function) makes a reader go back and
forth to follow one call, and breaks as soon as someone moves an import to the top of a file. Every
import counts here, those inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import {{ cookiecutter.package_name }} as package

SOURCE = Path(package.__file__).resolve().parent


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package under `root` (a package is its __init__.py)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports anywhere in it (relative or absolute)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*here, *([base] if base else [])])
            found.add(base)
            # `from . import task` imports a module, `from .config import load_config` a name in one.
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {module for module in found if module in modules and module != name}


def import_cycle(root: Path) -> list[str]:
    """One circle of imports among the modules under `root`, as [a, b, ..., a]; [] if there is none."""
    modules = module_names(root)
    edges = {name: sorted(imported_modules(name, path, modules)) for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> list[str]:
        if name in trail:
            return [*trail[trail.index(name) :], name]
        if name in done:
            return []
        for target in edges[name]:
            if cycle := visit(target, [*trail, name]):
                return cycle
        done.add(name)
        return []

    for name in sorted(modules):
        if cycle := visit(name, []):
            return cycle
    return []


def test_no_import_cycle_among_the_package_modules() -> None:
    cycle = import_cycle(SOURCE)
    assert not cycle, f"import cycle: {' -> '.join(cycle)}: move what both need into a module of its own"


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    """The check above can fail: a circle closed by a function-level import, as checkpoint.py and runs.py
    once had, is found."""
    root = tmp_path / "pkg"
    (root / "utils").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "utils" / "__init__.py").write_text("")
    (root / "utils" / "one.py").write_text("from .two import helper\n")
    (root / "utils" / "two.py").write_text("def helper():\n    from . import one\n")
    assert import_cycle(root) == ["pkg.utils.one", "pkg.utils.two", "pkg.utils.one"]


def test_every_module_first_says_what_it_owns() -> None:
    undocumented = [
        str(path.relative_to(SOURCE))
        for path in module_names(SOURCE).values()
        if not (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").strip()
    ]
    assert not undocumented, f"modules without a docstring saying what they own: {undocumented}"
