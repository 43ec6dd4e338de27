"""Bad answers stop generation in the pre-gen hook with a message naming the problem; nothing is written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from cookiecutter.exceptions import FailedHookException

from .conftest import HOOKS_DIR, TASKS, TEMPLATE, explain, render_template, run

# (answers, text the hook's message must contain)
BAD_ANSWERS: list[tuple[dict[str, str], str]] = [
    ({"project_slug": "my project"}, "project_slug 'my project' is not a usable directory name"),
    ({"project_slug": "../x"}, "project_slug '../x' is not a usable directory name"),
    ({"project_slug": "-x"}, "project_slug '-x' is not a usable directory name"),
    ({"project_slug": "x."}, "project_slug 'x.' is not a usable directory name"),
    ({"package_name": "my-pkg"}, "package_name 'my-pkg' is not a Python identifier"),
    ({"package_name": "1abc"}, "package_name '1abc' is not a Python identifier"),
    ({"package_name": "café"}, "package_name 'café' is not a Python identifier"),
    ({"package_name": "class"}, "package_name 'class' is a Python keyword"),
    ({"package_name": "match"}, "package_name 'match' is a Python keyword"),  # soft keyword
    ({"package_name": "json"}, "package_name 'json' would shadow"),
    ({"package_name": "os"}, "package_name 'os' would shadow"),
    ({"package_name": "torch"}, "package_name 'torch' would shadow"),
    ({"package_name": "accelerate"}, "package_name 'accelerate' would shadow"),
    ({"author_email": "nope"}, "author_email 'nope' is not an email address"),
    ({"task": "vision"}, "task 'vision' is not a preset: choose one of digits, images, text, lm."),
    ({"task": "../digits"}, "task '../digits' is not a preset"),
]


def ids(case: tuple[dict[str, str], str]) -> str:
    return ",".join(f"{key}={value}" for key, value in case[0].items())


def assert_nothing_written(tmp_path: Path, output_dir: Path) -> None:
    # "../x" would land next to output_dir, so look one level up as well.
    assert [p.name for p in tmp_path.iterdir()] == [output_dir.name], "something was written outside"
    assert not list(output_dir.iterdir()), f"left behind: {list(output_dir.iterdir())}"


@pytest.mark.parametrize("case", BAD_ANSWERS, ids=[ids(case) for case in BAD_ANSWERS])
def test_bad_answer_is_rejected_by_the_hook(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], case: tuple[dict[str, str], str]
) -> None:
    """The pre-gen hook fails (FailedHookException), prints what is wrong, and no project folder remains."""
    answers, message = case
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    with pytest.raises(FailedHookException):
        render_template(output_dir, answers)
    assert f"ERROR: {message}" in capfd.readouterr().err
    assert_nothing_written(tmp_path, output_dir)


# A few of them through the command line, as a user would meet them.
CLI_IDS = ("project_slug=../x", "package_name=match", "author_email=nope", "task=vision")
CLI_CASES = [case for case in BAD_ANSWERS if ids(case) in CLI_IDS]


@pytest.mark.parametrize("case", CLI_CASES, ids=[ids(case) for case in CLI_CASES])
def test_command_line_shows_the_reason_and_fails(tmp_path: Path, case: tuple[dict[str, str], str]) -> None:
    """`python -m cookiecutter --no-input` with a bad answer exits non-zero and prints the hook's reason."""
    answers, message = case
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    arguments = [f"{key}={value}" for key, value in answers.items()]
    command = [sys.executable, "-m", "cookiecutter", "--no-input", "--default-config", "-o", str(output_dir)]
    result = run([*command, str(TEMPLATE), *arguments], cwd=tmp_path, timeout=120)
    assert result.returncode != 0, explain(result)
    assert f"ERROR: {message}" in result.stderr, explain(result)
    assert_nothing_written(tmp_path, output_dir)


def test_every_problem_is_reported_at_once(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Several bad answers give one message each in a single run, not one per attempt."""
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    with pytest.raises(FailedHookException):
        render_template(output_dir, {"package_name": "class", "author_email": "nope"})
    err = capfd.readouterr().err
    assert "package_name 'class'" in err
    assert "author_email 'nope'" in err
    assert_nothing_written(tmp_path, output_dir)


@pytest.mark.parametrize(
    "answers",
    [{"project_slug": "a.b_c-1"}, {"package_name": "MyPkg2"}, {"package_name": "my_torch"}],
    ids=["slug-with-dot-underscore-digit", "mixed-case-package", "prefixed-shadow-name"],
)
def test_unusual_but_valid_answers_pass(tmp_path: Path, answers: dict[str, str]) -> None:
    """The hook does not reject names that work: dots, underscores, digits, mixed case, prefixed names."""
    project = render_template(tmp_path, answers)
    assert project.is_dir()
    assert (project / "train.py").is_file()


def test_the_hook_knows_exactly_the_presets_of_the_template() -> None:
    """The pre-gen hook's list of tasks is the list of _presets/ folders (and the default comes first)."""
    source = (HOOKS_DIR / "pre_gen_project.py").read_text(encoding="utf-8")
    listed = re.search(r"^TASKS = \((.*)\)$", source, re.MULTILINE)
    assert listed, "pre_gen_project.py has no TASKS tuple"
    names = [name.strip().strip('"') for name in listed.group(1).split(",")]
    assert names[0] == TASKS[0] and sorted(names) == sorted(TASKS)
