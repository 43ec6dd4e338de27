"""The size budget: each preset's generated project, in lines, by room, and each budget against its
figure. Its output is docs/sizes.md.

    python bench/sizes.py                       # this checkout's template, every preset (seconds)
    python bench/sizes.py --template ../other   # another checkout, e.g. before a change, to compare
    python bench/sizes.py --check               # exit 1 when a figure is over its budget

Each generated file belongs to one room, by its path (ROOMS, first match wins): the loop, the run's
lifecycle, platform and launch, the task, the tests, and the docs. A file that matches no room stops the
script, naming it: a new file is placed in a room on purpose. The shipped data (data/ at the project's
root) and the license are not counted; a notebook counts the lines of its cells.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).resolve().parent.parent
TASKS = ("digits", "images", "text", "lm")
PACKAGE = "src/*/"
ROOMS = {
    "loop": [
        "train.py",
        "predict.py",
        f"{PACKAGE}__init__.py",
        f"{PACKAGE}utils/__init__.py",
        f"{PACKAGE}utils/config.py",
        f"{PACKAGE}utils/training/*.py",
    ],
    "run lifecycle": [f"{PACKAGE}utils/run/*.py", f"{PACKAGE}utils/checkpoints/*.py"],
    "platform and launch": [
        f"{PACKAGE}launch.py",
        f"{PACKAGE}notebook.py",
        f"{PACKAGE}utils/machine/*.py",
        "scripts/*",
        "configs/*.yaml",
        "configs/accelerate/*.yaml",
        "notebooks/*.ipynb",
        ".github/*",
        "pyproject.toml",
        ".pre-commit-config.yaml",
        ".shellcheckrc",
        ".gitignore",
    ],
    "task": [f"{PACKAGE}{name}.py" for name in ("task", "prepare", "fine_tuning", "data/*", "models/*")],
    "tests": ["tests/*"],
    "docs": ["*.md"],
}
NOT_COUNTED = ["data/*", "LICENSE"]
CODE_ROOMS = [room for room in ROOMS if room != "docs"]

# What a user carries, capped. Python lines outside tests/ as `find . -name '*.py' -not -path './tests/*'`
# counts them; a function or class from its def/class line to its last; words as `wc -w` counts them.
BUDGETS = {
    # Raised from 7,000 and 7,800 when rollback, --resume_from with wsd, --find_lr and unpacked code came
    # (about +520 lines, -135 paid back by removing duplication and prose): docs/sizes.md.
    "digits: Python outside tests/, lines": 7400,
    "lm: Python outside tests/, lines": 8200,
    "longest function, lines": 60,
    "longest class, lines": 120,
    "template README.md, words": 2500,
    "a render's docs/, words": 9000,
}


def room_of(path: str) -> str | None:
    """The room of a generated file (its path in the project, / separated); None where it is not counted."""
    if any(fnmatch.fnmatch(path, pattern) for pattern in NOT_COUNTED):
        return None
    for room, patterns in ROOMS.items():
        if any(fnmatch.fnmatch(path, pattern) for pattern in patterns):
            return room
    raise SystemExit(f"{path}: in no room of bench/sizes.py: add it to ROOMS where it belongs")


def line_count(path: Path) -> int:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return sum(len("".join(cell["source"]).splitlines()) for cell in cells)
    return len(path.read_text(encoding="utf-8").splitlines())


def measure(template: Path, task: str, into: Path) -> tuple[dict[str, int], Path]:
    """Lines per room of the project rendered from `template` for `task`, and the project."""
    # The cookiecutter command, not its function: the template's hooks print what a user should do next.
    command = ["cookiecutter", str(template), "--no-input", "--default-config", "-o", str(into / task)]
    subprocess.run([sys.executable, "-m", *command, f"task={task}"], check=True, capture_output=True)
    (project,) = (into / task).iterdir()
    lines = dict.fromkeys(ROOMS, 0)
    for path in sorted(project.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        if room := room_of(path.relative_to(project).as_posix()):
            lines[room] += line_count(path)
    return lines, project


def python_files(project: Path) -> list[Path]:
    return [path for path in project.rglob("*.py") if path.relative_to(project).parts[0] != "tests"]


def longest(project: Path, kind: Any) -> tuple[int, str]:
    """The longest function (or class) of the project's Python outside tests/: its lines, and where."""
    found = [(0, "none")]
    for path in python_files(project):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, kind):
                where = f"{path.relative_to(project).as_posix()} {node.name}"  # type: ignore[attr-defined]
                found.append((node.end_lineno - node.lineno + 1, where))  # type: ignore[attr-defined]
    return max(found)


def words(*paths: Path) -> int:
    return sum(len(path.read_text(encoding="utf-8").split()) for path in paths)


def budget_rows(template: Path, projects: dict[str, Path]) -> list[tuple[str, int, str]]:
    """Each budget's figure, and where it was measured (the largest over the presets)."""
    functions = max(longest(project, ast.FunctionDef | ast.AsyncFunctionDef) for project in projects.values())
    classes = max(longest(project, ast.ClassDef) for project in projects.values())
    docs = max((words(*sorted((project / "docs").glob("*.md"))), task) for task, project in projects.items())
    figures = [
        (sum(map(line_count, python_files(projects["digits"]))), "digits render"),
        (sum(map(line_count, python_files(projects["lm"]))), "lm render"),
        functions,
        classes,
        (words(template / "README.md"), "README.md"),
        (docs[0], f"{docs[1]} render"),
    ]
    return [(name, figure, where) for name, (figure, where) in zip(BUDGETS, figures, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", type=Path, default=TEMPLATE, help="the template checkout to measure")
    parser.add_argument("--check", action="store_true", help="exit 1 when a figure is over its budget")
    args = parser.parse_args()
    template = args.template.resolve()
    rows = [
        "| preset | " + " | ".join(CODE_ROOMS) + " | code in all | docs |",
        "|---" * (len(CODE_ROOMS) + 3) + "|",
    ]
    projects = {}
    with tempfile.TemporaryDirectory(prefix="sizes-") as scratch:
        for task in TASKS:
            lines, projects[task] = measure(template, task, Path(scratch))
            code = sum(lines[room] for room in CODE_ROOMS)
            cells = [str(lines[room]) for room in CODE_ROOMS]
            rows.append(f"| {task} | " + " | ".join(cells) + f" | {code} | {lines['docs']} |")
        budgets = budget_rows(template, projects)
    rows += ["", "| budget | at most | figure | where |", "|---|---|---|---|"]
    over = [name for name, figure, _ in budgets if figure > BUDGETS[name]]
    for name, figure, where in budgets:
        rows.append(f"| {name} | {BUDGETS[name]} | {figure}{' (over)' if name in over else ''} | {where} |")
    print("\n".join(rows))
    if args.check and over:
        print(f"over budget: {'; '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
