"""Shared fixtures: each combination of answers is rendered once per session and reused by every test.

The renders come from the working tree (not from git), so a test run checks exactly what
`cookiecutter .` would generate right now.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = TEMPLATE / "{{cookiecutter.project_slug}}"
HOOKS_DIR = TEMPLATE / "hooks"
CHOICES: dict[str, list[str]] = {
    key: value
    for key, value in json.loads((TEMPLATE / "cookiecutter.json").read_text()).items()
    if isinstance(value, list) and not key.startswith("_")
}
# The task presets, the default first: cookiecutter.json's choice list (each has a folder under _presets/;
# folders named _<name> are shared by several presets, post_gen_project.py).
TASKS = CHOICES["task"]
DEFAULT_ANSWERS = {key: values[0] for key, values in CHOICES.items()}
# The default project name follows the task; the slug and the package derive from it.
TASK_SLUGS = {"digits": "digits-classifier", "images": "image-classifier", "text": "speaker-classifier"}
TASK_SLUGS |= {"lm": "char-gpt"}
DEFAULT_SLUG = TASK_SLUGS[TASKS[0]]
DEFAULT_PACKAGE = DEFAULT_SLUG.replace("-", "_")

# Answers with names of their own: every name is set explicitly, and none is the default.
CUSTOM_NAMES = {"project_name": "Vision Lab", "project_slug": "vision.lab", "package_name": "vision_core"}
# Only project_name is set: the slug and the package name are derived from it.
DERIVED_NAMES = {"project_name": "Protein Folding_v2"}

# Every render the option tests need: the default, each value of each choice option (each task preset
# among them), custom names.
RENDERS: dict[str, dict[str, str]] = {
    "default": {},
    **{f"{key}={value}": {key: value} for key, values in CHOICES.items() for value in values},
    "custom-names": CUSTOM_NAMES,
    "derived-names": DERIVED_NAMES,
}


@dataclass(frozen=True)
class Render:
    """A generated project: where it is, the answers that made it, and the files it had when rendered."""

    path: Path
    context: dict[str, str]
    # Snapshot taken right after rendering: later tests may add caches (__pycache__, .ruff_cache).
    files: tuple[Path, ...]

    @property
    def package(self) -> str:
        return self.context["package_name"]

    def answer(self, key: str) -> str:
        return self.context[key]


def render_template(output_dir: Path, extra_context: Mapping[str, str]) -> Path:
    """Run cookiecutter like `cookiecutter --no-input` with the given answers, ignoring ~/.cookiecutterrc."""
    return Path(
        cookiecutter(
            str(TEMPLATE),
            no_input=True,
            extra_context=dict(extra_context),
            output_dir=str(output_dir),
            default_config=True,
        )
    )


def _answers(project: Path, extra_context: Mapping[str, str]) -> dict[str, str]:
    """The answers as cookiecutter resolved them (defaults, derived names), read back from the render."""
    context = DEFAULT_ANSWERS | dict(extra_context)
    context.setdefault("project_slug", project.name)
    if "package_name" not in context:
        (package_dir,) = (project / "src").iterdir()
        context["package_name"] = package_dir.name
    return context


def _key(extra_context: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    # Answers equal to a choice's default give the same project as leaving them out: render it once.
    return tuple(sorted((k, v) for k, v in extra_context.items() if DEFAULT_ANSWERS.get(k) != v))


@pytest.fixture(scope="session")
def render(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Render]:
    """`render(key=value, ...)`: the project generated with those answers, rendered once per session."""
    cache: dict[tuple[tuple[str, str], ...], Render] = {}

    def get(**extra_context: str) -> Render:
        key = _key(extra_context)
        if key not in cache:
            output_dir = tmp_path_factory.mktemp("render")
            project = render_template(output_dir, dict(key))
            files = tuple(sorted(p.relative_to(project) for p in project.rglob("*") if p.is_file()))
            cache[key] = Render(project, _answers(project, dict(key)), files)
        return cache[key]

    return get


@pytest.fixture(params=list(RENDERS), ids=list(RENDERS))
def any_render(request: pytest.FixtureRequest, render: Callable[..., Render]) -> Render:
    """Each render of RENDERS in turn: the default, one per choice value, and the custom names."""
    return render(**RENDERS[request.param])


def run(
    command: list[str], cwd: Path, *, timeout: float = 600, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command, capture its output, and never hang the suite (stdin is closed, there is a timeout)."""
    return subprocess.run(
        command,
        cwd=cwd,
        env=dict(os.environ if env is None else env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def explain(result: subprocess.CompletedProcess[str], limit: int = 6000) -> str:
    """The tail of a command's output, for assertion messages."""
    return (
        f"$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-limit:]}\n--- stderr ---\n{result.stderr[-limit:]}"
    )


def tool(name: str) -> str:
    """A console script installed next to the running interpreter (the venv's ruff, shellcheck, ...)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed for {sys.executable}: pip install -r requirements-dev.txt")
    return found


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slurm", action="store_true", help="run tests/test_slurm.py on a real SLURM started here (root)"
    )


# The longest tests (seconds on the 2-core CI machine, from `--durations`), in the order xdist should start
# them: it hands its workers the tests in collection order, and a long one collected late would leave the
# other worker idle at the end of the run.
LONGEST_FIRST = (
    "test_generated_test_suite_passes[lm]",  # 530 s
    "test_generated_test_suite_passes[digits]",  # 500 s
    "test_the_whole_generated_suite_passes_with_a_task_of_its_own",  # 430 s
    "test_generated_test_suite_passes[text]",  # 410 s
    "test_generated_test_suite_passes[images]",  # 175 s
    "test_tracker_test_passes[mlflow]",
    "test_tracker_test_passes[wandb]",
    "test_tracker_test_passes[none]",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONGEST_FIRST first, the other tests after them in their order."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.name, len(rank)))
