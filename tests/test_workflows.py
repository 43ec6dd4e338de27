"""The GitHub workflows, the template's and a render's: valid, safe, and running the README's commands.

Checked offline with actionlint, GitHub's workflow and Dependabot schemas (the copies check-jsonschema
ships) and zizmor --offline. GitHub itself was out of reach where these were written: no test here says
that GitHub ran a workflow.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from .conftest import CHOICES, DEFAULT_ANSWERS, RENDERS, TASKS, TEMPLATE, Render, explain, run, tool
from .test_render import pyproject

WORKFLOWS = TEMPLATE / ".github" / "workflows"
PYTHONS = json.loads((TEMPLATE / "cookiecutter.json").read_text())["python_version"]
# `uses: owner/action@<40 hex digits> # v1.2.3`: pinned to a commit, its release named for Dependabot.
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+(\.\d+)*$")


@pytest.fixture(params=["template", "default", "python_version=3.13"])
def github_dir(request: pytest.FixtureRequest, render: Callable[..., Render]) -> Path:
    """The .github folder of the template repository, or of a render (python_version picks its matrix)."""
    if request.param == "template":
        return TEMPLATE / ".github"
    return render(**RENDERS[request.param]).path / ".github"


def workflow_files(github: Path) -> list[str]:
    files = sorted(str(path) for path in (github / "workflows").glob("*.yml"))
    assert files, f"no workflow in {github}"
    return files


def steps(workflow: Path) -> list[dict]:
    jobs = yaml.safe_load(workflow.read_text(encoding="utf-8"))["jobs"]
    return [step for job in jobs.values() for step in job["steps"]]


def run_lines(workflow: Path) -> list[str]:
    """Every command line of the workflow's `run:` steps."""
    lines = [line.strip() for step in steps(workflow) for line in step.get("run", "").splitlines()]
    return [line for line in lines if line]


def readme_commands(readme: Path, language: str = "bash") -> set[str]:
    """The command lines of a README's `language` blocks, without their trailing comments."""
    blocks = re.findall(rf"```{language}\n(.*?)```", readme.read_text(encoding="utf-8"), re.DOTALL)
    return {re.sub(r"\s+#.*$", "", line).strip() for block in blocks for line in block.splitlines()}


def project_commands(project: Path, language: str = "bash") -> set[str]:
    """The command lines of a generated project's README and of its docs/ pages, which it links."""
    pages = [project / "README.md", *sorted((project / "docs").glob("*.md"))]
    return set().union(*(readme_commands(page, language) for page in pages))


def checker_env() -> dict[str, str]:
    """PATH with this venv's tools first: actionlint checks `run:` scripts with the shellcheck it finds."""
    bin_dir = str(Path(tool("shellcheck")).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_actionlint_passes(github_dir: Path) -> None:
    result = run([tool("actionlint"), *workflow_files(github_dir)], cwd=github_dir, env=checker_env())
    assert result.returncode == 0, explain(result)


def test_github_schemas_pass(github_dir: Path) -> None:
    """The workflows match GitHub's workflow schema, dependabot.yml Dependabot's."""
    checks = [
        ["--builtin-schema", "vendor.github-workflows", *workflow_files(github_dir)],
        ["--builtin-schema", "vendor.dependabot", str(github_dir / "dependabot.yml")],
    ]
    for arguments in checks:
        result = run([tool("check-jsonschema"), *arguments], cwd=github_dir)
        assert result.returncode == 0, explain(result)


def test_zizmor_finds_nothing(github_dir: Path) -> None:
    """zizmor's offline audits (permissions, credentials left by checkout, unpinned actions, injection,
    Dependabot cooldown, ...) find nothing."""
    result = run([tool("zizmor"), "--offline", "--no-progress", str(github_dir)], cwd=github_dir)
    assert result.returncode == 0, explain(result)


def test_every_action_is_pinned_to_a_commit(github_dir: Path) -> None:
    for workflow in workflow_files(github_dir):
        text = Path(workflow).read_text(encoding="utf-8")
        for uses in re.findall(r"uses: (.+)$", text, re.MULTILINE):
            assert PINNED.match(uses), f"{workflow}: {uses}"


def test_the_checkers_reject_a_broken_workflow(tmp_path: Path) -> None:
    """Each checker fails on a workflow with an unknown key, write-all permissions and an action used by
    its tag: the passes above come from checks that ran."""
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    broken = workflows / "broken.yml"
    broken.write_text(
        "on: push\npermissions: write-all\njobs:\n  a:\n    runs-on: ubuntu-24.04\n    timeout: 5\n"
        "    steps:\n      - uses: actions/checkout@v4\n",
        encoding="utf-8",
    )
    commands = [
        [tool("actionlint"), str(broken)],
        [tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(broken)],
        [tool("zizmor"), "--offline", "--no-progress", str(tmp_path / ".github")],
    ]
    for command in commands:
        result = run(command, cwd=tmp_path)
        assert result.returncode != 0, explain(result)


def test_template_workflow_runs_the_ci_scripts_of_the_readme() -> None:
    """ci.yml runs `bash .ci/run` (the README's test command), `bash .ci/lowest`, `bash .ci/stacks` and
    `bash .ci/platform`,
    commands of the README, and nothing else: the steps live in those scripts, once. Its legs are the
    oldest and the newest Python that cookiecutter.json offers, and the platform script runs on macOS."""
    workflow = WORKFLOWS / "ci.yml"
    lines = run_lines(workflow)
    assert set(lines) == {"bash .ci/run", "bash .ci/lowest", "bash .ci/stacks", "bash .ci/platform"}, lines
    assert set(lines) <= readme_commands(TEMPLATE / "README.md")
    jobs = yaml.safe_load(workflow.read_text(encoding="utf-8"))["jobs"]
    assert jobs["tests"]["strategy"]["matrix"]["python"] == [PYTHONS[0], PYTHONS[-1]]
    assert jobs["platforms"]["strategy"]["matrix"]["os"] == ["macos-latest"]
    assert {step["env"]["TORCH_SPEC"] for step in steps(workflow) if "TORCH_SPEC" in step.get("env", {})} == {
        "torch==2.13.0",  # what .ci/run installs by default
        "torch",  # the weekly leg: the newest
    }
    assert "torch==2.13.0" in (TEMPLATE / ".ci" / "run").read_text(encoding="utf-8")


def test_generated_workflow_runs_the_readme_commands(render: Callable[..., Render]) -> None:
    """tests.yml runs commands of the project's README and docs/ only: the CPU torch of the quick start,
    the dev install, pre-commit, the fast tests and the whole suite; on the project's Python and the
    newest."""
    project = render()
    workflow = project.path / ".github" / "workflows" / "tests.yml"
    lines = run_lines(workflow)
    readme = project_commands(project.path)
    assert set(lines) <= readme, set(lines) - readme
    assert {"python -m pytest", 'python -m pytest -m "not slow"', "pre-commit run --all-files"} <= set(lines)
    matrix = yaml.safe_load(workflow.read_text(encoding="utf-8"))["jobs"]["tests"]["strategy"]["matrix"]
    assert matrix["python"] == [project.answer("python_version"), PYTHONS[-1]]


def test_generated_workflow_runs_the_readme_macos_commands_on_macos(render: Callable[..., Render]) -> None:
    """tests.yml's platform leg runs on macos-latest, with commands the project's docs give: the install,
    the fast tests, and the portability tests with their real training stopped and resumed."""
    project = render()
    workflow = project.path / ".github" / "workflows" / "tests.yml"
    job = yaml.safe_load(workflow.read_text(encoding="utf-8"))["jobs"]["platforms"]
    assert job["strategy"]["matrix"]["os"] == ["macos-latest"]
    runs = [step.get("run", "") for step in job["steps"]]
    lines = {line.strip() for run in runs for line in run.splitlines() if line.strip()}
    assert "python -m pytest tests/test_portability.py" in lines
    missing = lines - project_commands(project.path)
    assert not missing, missing


def test_ci_none_leaves_github_out(render: Callable[..., Render]) -> None:
    """ci=none: no .github folder, and the README does not mention one."""
    project = render(ci="none")
    assert not (project.path / ".github").exists()
    assert ".github" not in (project.path / "README.md").read_text(encoding="utf-8")
    assert ".github" in (render().path / "README.md").read_text(encoding="utf-8")


def pins_of(name: str) -> dict[str, str]:
    """The `name==version` lines of a file of .ci/."""
    lines = (TEMPLATE / ".ci" / name).read_text(encoding="utf-8").splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def bounds_of(requirements: list[str]) -> dict[str, str]:
    """{name: version} of `name>=version` requirements, without their environment markers."""
    return dict(requirement.split(";")[0].split(">=") for requirement in requirements)


def test_lowest_versions_are_the_bounds_of_pyproject(render: Callable[..., Render]) -> None:
    """.ci/lowest.txt pins each dependency of every task and every tracker, and the lm preset's data extra,
    at its `>=` bound; .ci/lowest-streams.txt the text preset's data extra (and what it lifts); .ci/lowest
    renders for the oldest Python the template offers, and the workflow's legs cover every task and
    tracker between them, and both data extras."""
    options = [{"task": task} for task in TASKS] + [{"tracker": tracker} for tracker in CHOICES["tracker"]]
    projects = {tuple(answers.items()): pyproject(render(**answers))["project"] for answers in options}
    bounds = {
        name: bound
        for project in projects.values()
        for name, bound in bounds_of(project["dependencies"]).items()
    }
    extras = {
        answers: project.get("optional-dependencies", {}).get("data", [])
        for answers, project in projects.items()
    }
    streams = bounds_of(extras[(("task", "text"),)])
    bounds |= bounds_of(extras[(("task", "lm"),)])
    pins, stream_pins = pins_of("lowest.txt"), pins_of("lowest-streams.txt")
    assert set(pins) - {"numpy"} == set(bounds)
    assert set(streams) <= set(stream_pins) and not set(streams) & set(pins), (streams, stream_pins)
    for name, bound in bounds.items():
        assert Version(pins[name]) == Version(bound), (name, pins[name], bound)
    for name, bound in streams.items():
        assert Version(stream_pins[name]) == Version(bound), (name, stream_pins[name], bound)
    lifted = set(stream_pins) - set(streams)  # what datasets needs above lowest.txt's pins
    assert all(Version(stream_pins[name]) > Version(pins[name]) for name in lifted & set(pins)), lifted
    assert f"python_version={PYTHONS[0]}" in (TEMPLATE / ".ci" / "lowest").read_text(encoding="utf-8")

    matrix = yaml.safe_load((WORKFLOWS / "ci.yml").read_text(encoding="utf-8"))["jobs"]["lowest"]["strategy"][
        "matrix"
    ]
    covered = [DEFAULT_ANSWERS | dict(pair.split("=") for pair in leg.split()) for leg in matrix["answers"]]
    assert {answers["task"] for answers in covered} == set(TASKS)
    assert {answers["tracker"] for answers in covered} == set(CHOICES["tracker"])
    with_data = {leg["answers"] for leg in matrix["include"] if leg["extras"] == "data"}
    assert with_data == {"task=text", "task=lm"}, matrix["include"]
