"""Bad answers stop generation right after the prompts, with a message naming the problem; nothing is written.

The check is hooks/answers.py (a Jinja filter of cookiecutter.json); a successful render ends with the
post-generation hook's next steps.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from cookiecutter.exceptions import FailedHookException

from .conftest import (
    DEFAULT_SLUG,
    TASK_SLUGS,
    TASKS,
    TEMPLATE,
    TEMPLATE_DIR,
    explain,
    render_template,
    run,
    tool,
)

# (answers, text the hook's message must contain)
BAD_ANSWERS: list[tuple[dict[str, str], str]] = [
    ({"project_slug": "my project"}, "project_slug 'my project' is not a usable directory name"),
    ({"project_slug": "../x"}, "project_slug '../x' is not a usable directory name"),
    ({"project_slug": "-x"}, "project_slug '-x' is not a usable directory name"),
    ({"project_slug": "x."}, "project_slug 'x.' is not a usable directory name"),
    # cookiecutter would make the missing parents of the project folder ('a/') before any hook runs.
    ({"project_slug": "a/b"}, "project_slug 'a/b' is not a usable directory name"),
    ({"project_slug": "a/b/c"}, "project_slug 'a/b/c' is not a usable directory name"),
    # Derived values name the answer they came from, and what to change.
    (
        {"project_name": "123 Go"},
        "package_name '123_go' (derived from project_name '123 Go') is not a Python identifier: use "
        "lowercase ASCII letters, digits and '_', not starting with a digit (e.g. 'digits_classifier'); "
        "set package_name=... or change project_name.",
    ),
    (
        {"project_name": "AC/DC"},
        "project_slug 'ac/dc' (derived from project_name 'AC/DC') is not a usable directory name",
    ),
    (
        {"project_slug": "class"},
        "package_name 'class' (derived from project_slug 'class') is a Python keyword: pick another name; "
        "set package_name=... or change project_slug.",
    ),
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
]


def ids(case: tuple[dict[str, str], str]) -> str:
    return ",".join(f"{key}={value}" for key, value in case[0].items())


def assert_nothing_written(tmp_path: Path, output_dir: Path) -> None:
    # "../x" would land next to output_dir, so look one level up as well.
    assert [p.name for p in tmp_path.iterdir()] == [output_dir.name], "something was written outside"
    assert not list(output_dir.iterdir()), f"left behind: {list(output_dir.iterdir())}"


@pytest.mark.parametrize("case", BAD_ANSWERS, ids=[ids(case) for case in BAD_ANSWERS])
def test_bad_answer_is_refused_and_nothing_is_written(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], case: tuple[dict[str, str], str]
) -> None:
    """Generation stops (FailedHookException), prints what is wrong, and writes no folder at all."""
    answers, message = case
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    with pytest.raises(FailedHookException):
        render_template(output_dir, answers)
    assert f"ERROR: {message}" in capfd.readouterr().err
    assert_nothing_written(tmp_path, output_dir)


# A few of them through the command line, as a user would meet them.
CLI_IDS = ("project_slug=../x", "project_slug=a/b", "package_name=match", "author_email=nope")
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


def test_a_parent_folder_that_exists_is_left_as_it_was(tmp_path: Path) -> None:
    """project_slug 'a/b', refused where out/a/ already holds a file: out/a/ and its file stay as they are."""
    output_dir = tmp_path / "out"
    (output_dir / "a").mkdir(parents=True)
    (output_dir / "a" / "keep.txt").write_text("mine")
    with pytest.raises(FailedHookException):
        render_template(output_dir, {"project_slug": "a/b"})
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "out",
        "out/a",
        "out/a/keep.txt",
    ]
    assert (output_dir / "a" / "keep.txt").read_text() == "mine"


def test_typed_values_are_not_called_derived(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A value the user typed is named alone, even where its default would have been derived."""
    with pytest.raises(FailedHookException):
        render_template(tmp_path, {"project_name": "123 Go", "project_slug": "go-123", "package_name": "9go"})
    err = capfd.readouterr().err
    assert "ERROR: package_name '9go' is not a Python identifier: use lowercase" in err
    assert "derived" not in err


def test_the_task_menu_offers_exactly_the_presets_of_the_template() -> None:
    """cookiecutter.json's task choices are the _presets/ folders (less the shared _<name> ones), each with
    a line of its own in the numbered menu, and a default project name of its own."""
    presets = {p.name for p in (TEMPLATE_DIR / "_presets").iterdir() if not p.name.startswith("_")}
    assert sorted(TASKS) == sorted(presets)
    labels = json.loads((TEMPLATE / "cookiecutter.json").read_text())["__prompts__"]["task"]
    assert set(labels) - {"__prompt__"} == set(TASKS)
    assert all(labels[task].startswith(f"{task}: ") for task in TASKS)
    assert sorted(TASK_SLUGS) == sorted(TASKS)


@pytest.mark.parametrize("value", ["vision", "../digits"])
def test_a_task_outside_the_menu_is_refused_and_nothing_is_written(tmp_path: Path, value: str) -> None:
    """cookiecutter refuses a task that is not one of its choices before it renders anything, in its last
    line of output naming the value and the choices."""
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    command = [sys.executable, "-m", "cookiecutter", "--no-input", "--default-config", "-o", str(output_dir)]
    result = run([*command, str(TEMPLATE), f"task={value}"], cwd=tmp_path, timeout=120)
    assert result.returncode != 0, explain(result)
    last = result.stderr.strip().splitlines()[-1]
    assert f"{value} provided for choice variable task, but the choices are {TASKS}" in last, explain(result)
    assert_nothing_written(tmp_path, output_dir)


def test_interactive_menu_numbers_the_tasks_and_names_the_project_after_the_choice(tmp_path: Path) -> None:
    """Without --no-input, the first question is the numbered task menu with a label per task; the
    project name's default, asked next, follows the number typed (Enter takes every other default)."""
    task = TASKS[-1]
    number = len(TASKS)
    command = [sys.executable, "-m", "cookiecutter", "--default-config", "-o", str(tmp_path), str(TEMPLATE)]
    result = subprocess.run(
        command, input=f"{number}\n" + "\n" * 20, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, explain(result)
    assert (tmp_path / TASK_SLUGS[task] / "train.py").is_file(), explain(result)
    menu = " ".join(result.stdout.split())  # the prompt wraps lines at the terminal's width
    labels = json.loads((TEMPLATE / "cookiecutter.json").read_text())["__prompts__"]["task"]
    for index, name in enumerate(TASKS, start=1):
        assert f"{index} - {' '.join(labels[name].split())}" in menu, explain(result)


@pytest.mark.parametrize("answers", [{}, {"project_name": "My Lab", "task": "lm"}], ids=["default", "lm"])
def test_command_line_prints_the_next_commands(tmp_path: Path, answers: dict[str, str]) -> None:
    """After a render, the command line prints what to run next, for the folder it made: cd into it, the
    CPU-only torch, the install, train.py, and where to read more."""
    output_dir = tmp_path / "out dir"  # a space: the cd line must quote it
    arguments = [f"{key}={value}" for key, value in answers.items()]
    command = [sys.executable, "-m", "cookiecutter", "--no-input", "--default-config", "-o", str(output_dir)]
    result = run([*command, str(TEMPLATE), *arguments], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, explain(result)
    project = output_dir / ("my-lab" if answers else DEFAULT_SLUG)
    assert (project / "train.py").is_file() and (project / "pyproject.toml").is_file()
    lines = [line.split("#")[0].strip() for line in result.stdout.splitlines()]
    commands = [
        f"cd '{project}'",
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",
        "pip install -e .",
        "OMP_NUM_THREADS=1 python train.py",  # one thread: several times faster on a busy CPU
    ]
    start = lines.index(commands[0])
    assert lines[start : start + len(commands)] == commands, explain(result)
    assert f"More in {project / 'README.md'}: the {answers.get('task', TASKS[0])} example" in result.stdout


def git(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
    result = run(["git", *identity, *arguments], cwd=cwd, timeout=60)
    assert result.returncode == 0, explain(result)
    return result


@pytest.mark.slow  # three renders through cruft and git: about 20 s
def test_cruft_update_names_no_temporary_folder_and_ends_with_the_conflict(tmp_path: Path) -> None:
    """A project made with `cruft create`, whose task.py and the template's next version change one line
    each: `cruft update` renders the template twice into temporary folders, where the post-generation
    hook says nothing (it used to print "Created <a temporary folder> ... cd <it>" twice), so that git's
    conflict is in its last lines; the README's command lists the conflicted file."""
    template = tmp_path / "template"
    template.mkdir()
    for name in ("cookiecutter.json", "hooks", "{{cookiecutter.project_slug}}"):
        copy = shutil.copytree if (TEMPLATE / name).is_dir() else shutil.copy
        copy(TEMPLATE / name, template / name)
    for arguments in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "v1"]):
        git(*arguments, cwd=template)
    create = [tool("cruft"), "create", "--no-input", str(template), "--output-dir", str(tmp_path)]
    created = run(create, tmp_path)
    project = tmp_path / DEFAULT_SLUG
    assert created.returncode == 0 and f"Created {project}. Next" in created.stdout, explain(created)
    for arguments in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "made"]):
        git(*arguments, cwd=project)
    task = next((project / "src").glob("*/task.py"))
    presets = template / "{{cookiecutter.project_slug}}" / "_presets"
    preset = next((presets / TASKS[0] / "src").glob("*/task.py"))
    for folder, path, value in ((project, task, "128"), (template, preset, "512")):
        old = 'hidden_size: int = setting(256, "'
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, old.replace("256", value)))
        git("commit", "-qam", f"hidden size {value}", cwd=folder)

    update = run([tool("cruft"), "update", "-y"], project, timeout=300)
    assert update.returncode == 0, explain(update)
    output = update.stdout + update.stderr
    assert "Created" not in output and "Next" not in output and tempfile.gettempdir() not in output, output
    relative = task.relative_to(project).as_posix()
    assert any(relative in line for line in output.strip().splitlines()[-3:]), output
    listed = run(["git", "diff", "--name-only", "--diff-filter=U"], project)  # the README's command
    assert listed.stdout.split() == [relative], explain(listed)
