"""The generated project works with its own tools: pre-commit, pip, and its own test suite.

These run real subprocesses (hook installs from PyPI, CPU training runs), so they are marked `slow`;
they still run by default.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import (
    CHOICES,
    DEFAULT_PACKAGE,
    RENDERS,
    TASKS,
    Render,
    explain,
    render_template,
    run,
)

pytestmark = pytest.mark.slow


def project_env(project: Path) -> dict[str, str]:
    """The environment a user's shell would give the project: its src/ importable, no outer pytest options."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(project / "src")
    return env


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("task", TASKS)
def test_pre_commit_passes_in_a_fresh_project(tmp_path: Path, task: str) -> None:
    """In a new git repo of each preset's render, `pre-commit run --all-files` passes without changing a file.

    The hooks are `repo: local` with pinned PyPI packages; their environments are cached in
    PRE_COMMIT_HOME (default ~/.cache/pre-commit), which this test leaves as it is.
    """
    project = render_template(tmp_path, {"task": task})
    for command in (["git", "init", "-q"], ["git", "add", "-A"]):
        result = run(command, cwd=project, timeout=60)
        assert result.returncode == 0, explain(result)
    result = run(
        [sys.executable, "-m", "pre_commit", "run", "--all-files", "--show-diff-on-failure", "--color=never"],
        cwd=project,
        timeout=1800,
    )
    assert result.returncode == 0, explain(result)


@pytest.mark.parametrize("name", ["default", "license=none", "custom-names", "task=images", "task=text"])
def test_pip_can_install_the_project_with_dev_extras(tmp_path: Path, name: str) -> None:
    """`pip install --dry-run -e '.[dev]'` succeeds: the PEP 621 metadata and the src layout build.

    torch is already installed, so the resolver must not want another torch (a multi-GB download).
    """
    project = render_template(tmp_path, RENDERS[name])
    result = run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-input", "-e", ".[dev]"],
        cwd=project,
        timeout=900,
    )
    assert result.returncode == 0, explain(result)
    would_install = re.search(r"^Would install (.*)$", result.stdout, re.MULTILINE)
    assert would_install, explain(result)
    pairs = (package.rsplit("-", 1) for package in would_install.group(1).split())
    packages = {canonical(name): version for name, version in pairs}
    assert packages.get(canonical(project.name)) == "0.1.0", packages
    assert not [name for name in packages if name == "torch" or name.startswith("nvidia")], packages


# What a preset changes in its project: the task (task.py, models/, data/, its configs and docs) and its
# own tests (tests/task/, tests/task_settings.py). Everything else, the machinery and its generic tests, is
# the same text in every preset's render (test_the_machinery_and_its_tests_are_the_same_in_every_preset).
MACHINERY = ("train.py", "predict.py", "src/*/utils/**/*.py", "src/*/launch.py", "scripts/*", "tests/*.py")
# The generic tests whose outcome depends on the task they train, which each preset runs with its own
# tests/task/, and the fast checks of its task and short runs (test_config.py: its Config's flags and
# files; QUICK and SIGNAL_RUN set only TrainConfig's fields). The machinery's other tests run whole once,
# with a user's own task (test_the_whole_generated_suite_passes_with_a_task_of_its_own): a preset's task
# would not change them. (The resume's verification with each task's batches is in test_guarantees.py's
# 1-2-1 hop.)
TASK_BOUND = ["tests/task", "tests/test_guarantees.py", "tests/test_task_check.py", "tests/test_config.py"]
# The slow tests of those files that the task does not change (the machinery's: utils/__init__.py's filter of
# peft's warning, the model unwrapped from DDP, a removed config field): they run in the default preset's
# suite (test_generated_test_suite_passes[digits]) and are deselected in every other render's run, the own
# task's whole suite included.
TASK_FREE = (
    "tests/test_task_check.py::test_a_task_that_calls_peft_itself_prints_no_library_warning",
    "tests/test_task_check.py::test_a_setting_kept_on_the_model_trains_on_two_processes",
    "tests/test_config.py::test_a_removed_field_is_one_warning_of_a_run_that_goes_on",
)


def task_free_deselected(task: str) -> list[str]:
    """pytest's options that leave TASK_FREE out, but in the default preset's run."""
    return [] if task == TASKS[0] else [f"--deselect={test}" for test in TASK_FREE]


def machinery(project: Path, task: str) -> dict[str, str]:
    """The machinery's files of a render, with the names a render chooses (slug, package, task) made alike."""
    package = next((project / "src").iterdir()).name
    texts = {}
    for pattern in MACHINERY:
        for path in project.glob(pattern):
            if path.name == "task_settings.py":
                continue
            text = path.read_text(encoding="utf-8").replace(package, "PACKAGE").replace(project.name, "SLUG")
            texts[str(path.relative_to(project)).replace(package, "PACKAGE")] = text.replace(
                f"outputs/{task}", "outputs/TASK"
            )
    return texts


def test_the_machinery_and_its_tests_are_the_same_in_every_preset(render: Callable[..., Render]) -> None:
    """Why the generic tests run whole once: a preset brings its task and nothing else."""
    default = machinery(render(task=TASKS[0]).path, TASKS[0])
    assert len(default) > 40, sorted(default)
    for test in TASK_FREE:  # renamed, it would run in every render again
        file, _, name = test.partition("::")
        assert f"def {name}(" in default[file], test
    for task in TASKS[1:]:
        other = machinery(render(task=task).path, task)
        assert sorted(other) == sorted(default), task
        assert [name for name in default if default[name] != other[name]] == [], task


@pytest.mark.parametrize("task", TASKS)
def test_generated_test_suite_passes(render: Callable[..., Render], task: str) -> None:
    """Each preset's own tests (tests/task/: its task's quality, and for the default preset the remote store,
    continuing on new data, the sweep, predictions) and the generic tests that depend on the task: exact
    resume after SIGTERM and after a time stop, 1 against 2 processes and a 1-2-1 hop whose resumes verify
    themselves, predictions on 1 and 2 processes, the task check. Real CPU training throughout."""
    project = render(task=task).path
    result = run(
        [sys.executable, "-m", "pytest", "-q", "-x", *TASK_BOUND, *task_free_deselected(task)],
        cwd=project,
        env=project_env(project),
        timeout=2400,
    )
    assert result.returncode == 0, explain(result)


def test_the_whole_generated_suite_passes_with_a_task_of_its_own(tmp_path: Path) -> None:
    """tests/own_task/task.py in place of the render's task.py, and tests/task/ (the preset's own tests)
    deleted, as the README tells a user: a regression task as a new user writes one, with none of the
    presets' fields, a BatchNorm model, input jitter drawn from the global generators (the loader seeds
    them per row) and metrics that read the config. The whole generated suite passes with it (exact resume
    after SIGTERM and after a time stop; 1 against 2 processes; predictions; signals, faults, launchers,
    the task check): no generic test assumes a preset. The one run of the whole generic suite: about 10
    minutes on an idle 2-core machine."""
    project = render_template(tmp_path, {})
    own_task = Path(__file__).parent / "own_task"
    shutil.copy(own_task / "task.py", project / "src" / DEFAULT_PACKAGE / "task.py")
    shutil.copy(own_task / "task_settings.py", project / "tests" / "task_settings.py")
    shutil.rmtree(project / "tests" / "task")
    result = run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-rs", *task_free_deselected("own")],
        cwd=project,
        env=project_env(project),
        timeout=2400,
    )
    assert result.returncode == 0, explain(result)
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, explain(result)
    # What it may skip is what this machine cannot run (a CUDA GPU; permissions as root), never a test of
    # the guarantees, of the task check or of the data fingerprint (TASK_FREE is deselected: the digits
    # suite runs it).
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    guarded = ("test_guarantees", "test_task_check", "test_fingerprint")
    assert not [line for line in skipped if any(name in line for name in guarded)], skipped


def test_a_streamed_task_of_its_own_passes_the_guarantees(tmp_path: Path) -> None:
    """The own task with its train rows streamed (tests/own_task/streamed.py, a stream of the user's own): a
    run stopped on 1 process, continued on 2 and finished on 1 ends as one never stopped, each resume saying
    what docs/resume.md promises a stream (its next batch is not read ahead: "resume not verified"). (The
    own task unstreamed, whose train set jitters through a transform attribute, passes the fingerprint's
    tests in the whole generic suite: test_the_whole_generated_suite_passes_with_a_task_of_its_own.)"""
    project = render_template(tmp_path, {})
    own_task = Path(__file__).parent / "own_task"
    task_file = project / "src" / DEFAULT_PACKAGE / "task.py"
    shutil.copy(own_task / "task.py", task_file.with_name("table_task.py"))
    shutil.copy(own_task / "streamed.py", task_file)
    shutil.copy(own_task / "task_settings.py", project / "tests" / "task_settings.py")
    shutil.rmtree(project / "tests" / "task")
    selected = ["tests/test_guarantees.py", "-k", "one_then_two_then_one"]
    result = run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *selected],
        cwd=project,
        env=project_env(project),
        timeout=900,
    )
    assert result.returncode == 0, explain(result)
    assert " passed" in result.stdout and "skipped" not in result.stdout, explain(result)


# The tests of test_tracking.py that name their trackers (`--tracker tensorboard,wandb,mlflow`) instead of
# taking the render's: the same test in every render (test_the_tests_that_name_their_trackers_are_the_same_
# with_every_tracker), run once, in the whole generic suite (the own task's render, the default tracker).
TRACKER_FREE = (
    "test_several_trackers_at_once_each_show_a_killed_run_as_never_stopped",
    "test_a_tracker_added_to_a_resumed_run_gets_every_step",
    "test_a_tracker_not_installed_is_one_line_before_anything_is_written",
    "test_tracker_takes_a_list_in_yaml_and_a_comma_separated_flag",
)


def tracker_free_sources(project: Path) -> dict[str, str]:
    """The source of each TRACKER_FREE test of a render and of the module's names it reads."""
    tree = ast.parse((project / "tests" / "test_tracking.py").read_text(encoding="utf-8"))
    top = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node]
        for target in targets:
            name = getattr(target, "name", getattr(target, "id", None))
            if name:
                top[name] = node
    wanted = list(TRACKER_FREE)
    for name in wanted:  # grows with what the tests and their helpers read
        for used in ast.walk(top[name]):
            if isinstance(used, ast.Name) and used.id in top and used.id not in wanted:
                wanted.append(used.id)
    return {name: ast.unparse(top[name]) for name in wanted}


def test_the_tests_that_name_their_trackers_are_the_same_with_every_tracker(
    render: Callable[..., Render],
) -> None:
    """Why test_tracker_test_passes leaves TRACKER_FREE out: they do not read the render's tracker."""
    default = tracker_free_sources(render().path)
    assert "interrupt" in default and "STEPS" in default, sorted(default)
    for tracker in CHOICES["tracker"][1:]:
        assert tracker_free_sources(render(tracker=tracker).path) == default, tracker


# The default tracker's tests run in the whole generic suite (the own task's render has the default tracker).
@pytest.mark.parametrize("tracker", CHOICES["tracker"][1:])
def test_tracker_test_passes(render: Callable[..., Render], tracker: str) -> None:
    """With each tracker, the project's tracker tests but TRACKER_FREE (offline logs; a run killed, stopped
    and resumed shows in the tracker as one never stopped; keys from the platform's secrets never written),
    its notebook tests, its full-disk tests (a tracker's own store fills too: MLflow's SQLite file) and the
    repair of a metrics log cut short (replayed into the tracker at the start) run for real and pass."""
    project = render(tracker=tracker).path
    tests = ["tests/test_tracking.py", "tests/test_notebooks.py"]
    tests += [
        "tests/test_faults.py::test_disk_full_names_the_disk_and_keeps_the_last_checkpoint",
        "tests/test_faults.py::test_disk_full_before_the_start_names_the_output_folder_and_leaves_nothing",
        "tests/test_faults.py::test_a_metrics_log_shorter_than_its_checkpoint_is_repaired_with_one_warning",
    ]
    tests += ["-k", " and ".join(f"not {name}" for name in TRACKER_FREE)]
    result = run(
        [sys.executable, "-m", "pytest", "-q", "-x", *tests],
        cwd=project,
        env=project_env(project),
        timeout=900,
    )
    assert result.returncode == 0, explain(result)
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary, explain(result)
    assert "skipped" not in summary, f"the tracker test did not really run: {summary}"
