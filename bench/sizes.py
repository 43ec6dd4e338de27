"""The size budget: each preset's generated project, in lines, by room. Its output is docs/sizes.md.

    python bench/sizes.py                       # this checkout's template, every preset (seconds)
    python bench/sizes.py --template ../other   # another checkout, e.g. before a change, to compare

Each generated file belongs to one room, by its path (ROOMS, first match wins): the loop, the run's
lifecycle, platform and launch, the task, the tests, and the docs. A file that matches no room stops the
script, naming it: a new file is placed in a room on purpose. The shipped data (data/ at the project's
root) and the license are not counted; a notebook counts the lines of its cells.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
TASKS = ("digits", "images", "text", "lm")
PACKAGE = "src/*/"
ROOMS = {
    "loop": [
        "train.py",
        "predict.py",
        *(
            f"{PACKAGE}utils/{name}.py"
            for name in (
                "__init__",
                "cli",
                "config",
                "loop",
                "finish",
                "memory",
                "accelerate_fixes",
                "progress",
                "tracking",
                "plots",
                "task_check",
                "contract",
                "streams",
            )
        ),
        f"{PACKAGE}__init__.py",
    ],
    "run lifecycle": [
        f"{PACKAGE}utils/{name}.py"
        for name in (
            "checkpoint",
            "start",
            "fingerprint",
            "history",
            "exact",
            "durable",
            "run_dir",
            "persist",
            "compile_cache",
            "disk_budget",
            "mirror",
            "mirror_stores",
            "remote",
            "signals",
            "timing",
        )
    ],
    "platform and launch": [
        f"{PACKAGE}launch.py",
        f"{PACKAGE}notebook.py",
        f"{PACKAGE}utils/devices.py",
        f"{PACKAGE}utils/hardware.py",
        f"{PACKAGE}utils/packages.py",
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


def measure(template: Path, task: str, into: Path) -> dict[str, int]:
    """Lines per room of the project rendered from `template` for `task`."""
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
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", type=Path, default=TEMPLATE, help="the template checkout to measure")
    args = parser.parse_args()
    rows = [
        "| preset | " + " | ".join(CODE_ROOMS) + " | code in all | docs |",
        "|---" * (len(CODE_ROOMS) + 3) + "|",
    ]
    with tempfile.TemporaryDirectory(prefix="sizes-") as scratch:
        for task in TASKS:
            lines = measure(args.template.resolve(), task, Path(scratch))
            code = sum(lines[room] for room in CODE_ROOMS)
            cells = [str(lines[room]) for room in CODE_ROOMS]
            rows.append(f"| {task} | " + " | ".join(cells) + f" | {code} | {lines['docs']} |")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
