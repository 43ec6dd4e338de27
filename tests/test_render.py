"""What each answer changes in the generated project, and that every render is complete."""

from __future__ import annotations

import ast
import re
import sys
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10, the oldest the template supports: tomllib's origin (requirements-dev.txt)
    import tomli as tomllib

from .conftest import (
    CHOICES,
    CUSTOM_NAMES,
    DEFAULT_ANSWERS,
    DEFAULT_PACKAGE,
    DEFAULT_SLUG,
    DERIVED_NAMES,
    TASK_SLUGS,
    TASKS,
    TEMPLATE_DIR,
    Render,
)

# `{{ x }}`, `{% tag %}` and `{# comment #}` left in the output mean a broken or unrendered template.
# `${#var}` is bash (string length), not Jinja.
JINJA = re.compile(r"(?<!\$)\{[{%#]")

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}
LICENSE_TEXT = {
    "MIT": ["MIT License", "Permission is hereby granted, free of charge"],
    "Apache-2.0": ["Apache License", "Version 2.0, January 2004"],
    "BSD-3-Clause": ["BSD 3-Clause License", "Redistribution and use in source and binary forms"],
}


def pyproject(project: Render) -> dict[str, Any]:
    return tomllib.loads((project.path / "pyproject.toml").read_text(encoding="utf-8"))


def dependency_names(project: Render) -> set[str]:
    return {
        re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()
        for requirement in pyproject(project)["project"]["dependencies"]
    }


def test_no_jinja_survives(any_render: Render) -> None:
    """Every file and path of the render is fully rendered: no `{{`, `{%` or `{#` is left anywhere."""
    assert any_render.files, "the render is empty"
    leftovers = []
    for relative in any_render.files:
        if JINJA.search(str(relative)):
            leftovers.append(f"{relative}: in the path")
        if relative.suffix == ".png":  # a preset's images: binary, never rendered
            continue
        text = (any_render.path / relative).read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), start=1):
            if JINJA.search(line):
                leftovers.append(f"{relative}:{number}: {line.strip()}")
    assert not leftovers, "unrendered Jinja:\n" + "\n".join(leftovers)


def test_pyproject_is_valid_and_names_the_project(any_render: Render) -> None:
    """pyproject.toml parses as TOML and carries the slug, the author and the description."""
    project = pyproject(any_render)["project"]
    assert project["name"] == any_render.path.name
    assert project["authors"][0]["name"] == "Your Name"
    assert project["description"]


def test_default_render_uses_the_default_names(render: Callable[..., Render]) -> None:
    """With no answers, the project is `digits-classifier` with the package `src/digits_classifier/`."""
    default = render()
    assert default.path.name == DEFAULT_SLUG
    assert [p.name for p in (default.path / "src").iterdir()] == [DEFAULT_PACKAGE]


@pytest.mark.parametrize("task", TASKS)
def test_default_names_follow_the_task(render: Callable[..., Render], task: str) -> None:
    """With only the task given, the project is named after it (`task=lm` makes `char-gpt/`, package
    `char_gpt`, README titled "Char GPT"), not after another preset."""
    project = render(task=task)
    assert project.path.name == TASK_SLUGS[task]
    assert [p.name for p in (project.path / "src").iterdir()] == [TASK_SLUGS[task].replace("-", "_")]
    title = TASK_SLUGS[task].replace("-", " ").title().replace("Gpt", "GPT")
    assert (project.path / "README.md").read_text(encoding="utf-8").startswith(f"# {title}\n")


@pytest.mark.parametrize("version", CHOICES["python_version"])
def test_python_version_sets_requires_python_and_ruff_target(
    render: Callable[..., Render], version: str
) -> None:
    """python_version sets `requires-python = ">=3.X"` and ruff's `target-version = "py3X"`."""
    project = render(python_version=version)
    config = pyproject(project)
    assert config["project"]["requires-python"] == f">={version}"
    assert config["tool"]["ruff"]["target-version"] == f"py{version.replace('.', '')}"
    text = (project.path / "pyproject.toml").read_text(encoding="utf-8")
    assert f'requires-python = ">={version}"' in text


@pytest.mark.parametrize("version", CHOICES["python_version"])
def test_python_sources_use_only_syntax_of_the_minimum_version(
    render: Callable[..., Render], version: str
) -> None:
    """Every .py file parses with the grammar of the chosen minimum Python (no newer syntax slips in)."""
    project = render(python_version=version)
    major, minor = (int(part) for part in version.split("."))
    for relative in project.files:
        if relative.suffix == ".py":
            source = (project.path / relative).read_text(encoding="utf-8")
            ast.parse(source, filename=str(relative), feature_version=(major, minor))


@pytest.mark.parametrize("license_id", [value for value in CHOICES["license"] if value != "none"])
def test_license_file_and_spdx_field(render: Callable[..., Render], license_id: str) -> None:
    """license writes that license's text to LICENSE and its SPDX id to `license`; no other license's text."""
    project = render(license=license_id)
    text = (project.path / "LICENSE").read_text(encoding="utf-8")
    for phrase in LICENSE_TEXT[license_id]:
        assert phrase in text
    for other, phrases in LICENSE_TEXT.items():
        if other != license_id:
            assert phrases[0] not in text, f"{license_id} LICENSE contains the {other} title"
    if license_id != "Apache-2.0":  # the Apache text itself names no copyright holder
        year = datetime.now(timezone.utc).year
        assert re.search(rf"Copyright \(c\) ({year}|{year - 1}),? Your Name", text), text[:300]
    config = pyproject(project)["project"]
    assert config["license"] == license_id
    assert config["license-files"] == ["LICENSE"]


def test_license_none_has_no_license_file_or_field(render: Callable[..., Render]) -> None:
    """license=none leaves no LICENSE file, and pyproject.toml has no `license`/`license-files` key."""
    project = render(license="none")
    assert not (project.path / "LICENSE").exists()
    config = pyproject(project)["project"]
    assert "license" not in config
    assert "license-files" not in config
    assert not re.search(r"^license", (project.path / "pyproject.toml").read_text(), re.MULTILINE)


@pytest.mark.parametrize("tracker", CHOICES["tracker"])
def test_tracker_dependency_is_only_the_chosen_one(render: Callable[..., Render], tracker: str) -> None:
    """tracker adds its package to the dependencies, and no other tracker's (none for `none`)."""
    names = dependency_names(render(tracker=tracker))
    expected = {TRACKER_PACKAGES[tracker]} if tracker in TRACKER_PACKAGES else set()
    assert names & set(TRACKER_PACKAGES.values()) == expected


@pytest.mark.parametrize("tracker", CHOICES["tracker"])
def test_tracker_is_the_default_of_every_config(render: Callable[..., Render], tracker: str) -> None:
    """Every platform config under configs/ says `tracker: <choice>`."""
    project = render(tracker=tracker)
    configs = sorted((project.path / "configs").glob("*.yaml"))
    assert configs, "no configs/*.yaml"
    for path in configs:
        assert yaml.safe_load(path.read_text(encoding="utf-8"))["tracker"] == tracker, path.name
        assert re.search(rf"^tracker: {re.escape(tracker)}$", path.read_text(), re.MULTILINE), path.name


def test_every_render_can_log_to_every_tracker(render: Callable[..., Render]) -> None:
    """The answer is the default and the dependency only: run/tracking.py is the same file in every render
    (each tracker's code runs when the config names it), and pyproject.toml has an extra per tracker, the
    one that the error of a tracker not installed names."""
    projects = [render(tracker=tracker) for tracker in CHOICES["tracker"]]
    paths = [project.path / "src" / project.package / "utils" / "run" / "tracking.py" for project in projects]
    code = {path.read_text(encoding="utf-8") for path in paths}
    assert len(code) == 1, "tracking.py differs between the tracker answers"
    for project in projects:
        extras = pyproject(project)["project"]["optional-dependencies"]
        for tracker, package in TRACKER_PACKAGES.items():
            assert any(requirement.startswith(f"{package}>=") for requirement in extras[tracker]), tracker


def test_custom_names_are_used_everywhere(render: Callable[..., Render]) -> None:
    """Custom project_name/project_slug/package_name: the folder, src/<package>/, the imports, the title."""
    project = render(**CUSTOM_NAMES)
    package = CUSTOM_NAMES["package_name"]
    assert project.path.name == CUSTOM_NAMES["project_slug"]
    assert (project.path / "src" / package / "__init__.py").is_file()
    assert [p.name for p in (project.path / "src").iterdir()] == [package]
    train = (project.path / "train.py").read_text(encoding="utf-8")
    assert re.search(rf"^from {package}(\.\w+)* import ", train, re.MULTILINE), "train.py does not import it"
    assert pyproject(project)["project"]["name"] == CUSTOM_NAMES["project_slug"]
    readme = (project.path / "README.md").read_text(encoding="utf-8")
    assert readme.startswith(f"# {CUSTOM_NAMES['project_name']}\n")
    stale = [
        str(relative)
        for relative in project.files
        if re.search(
            r"digits[-_]classifier|Digits Classifier", (project.path / relative).read_text(encoding="utf-8")
        )
    ]
    assert not stale, f"default names left in {stale}"


def test_slug_and_package_derive_from_project_name(render: Callable[..., Render]) -> None:
    """With only project_name given, the slug is its lowercase-dashed form and the package its identifier."""
    project = render(**DERIVED_NAMES)
    assert project.path.name == "protein-folding-v2"
    assert (project.path / "src" / "protein_folding_v2" / "__init__.py").is_file()
    assert "from protein_folding_v2." in (project.path / "train.py").read_text(encoding="utf-8")


def test_empty_author_email_is_allowed(render: Callable[..., Render]) -> None:
    """An empty author_email passes the hook and gives an author entry without an email key."""
    project = render(author_email="")
    assert pyproject(project)["project"]["authors"] == [{"name": "Your Name"}]


def test_free_text_with_quotes_and_backslashes_stays_valid(render: Callable[..., Render]) -> None:
    """Quotes and backslashes in the free-text answers reach the files intact and break no syntax."""
    description = 'Says "hi" to C:\\data'
    author = 'Seán O\'Brien "Jr"'
    project = render(description=description, author_name=author)
    config = pyproject(project)["project"]
    assert config["description"] == description
    assert config["authors"][0]["name"] == author
    for relative in project.files:
        if relative.suffix == ".py":
            source = (project.path / relative).read_text(encoding="utf-8")
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # an invalid escape such as "\\d" is only a warning
                compile(source, str(relative), "exec")
    init = (project.path / "src" / project.package / "__init__.py").read_text(encoding="utf-8")
    assert description in (ast.get_docstring(ast.parse(init)) or "")


def test_scripts_are_executable(render: Callable[..., Render]) -> None:
    """scripts/*.sh keep their executable bit, so `scripts/run_local.sh` runs as the README shows."""
    project = render()
    scripts = sorted((project.path / "scripts").glob("*.sh"))
    assert scripts, "the template has no scripts/*.sh"
    for script in scripts:
        assert script.stat().st_mode & 0o111, f"{script.name} is not executable"


# What each task needs beyond the shared dependencies, and the modules that hold its data and model.
TASK_PACKAGES = {
    "digits": set(),  # its data ships as data/digits.csv
    "images": {"pillow", "transformers", "peft"},
    "text": {"transformers", "tokenizers", "peft"},
    "lm": set(),
}
OPTIONAL_PACKAGES = set().union(*TASK_PACKAGES.values())
# What every render depends on, whatever its options.
SHARED_PACKAGES = {"torch", "accelerate", "safetensors", "pyyaml", "tqdm", "xxhash", "matplotlib"}


def test_every_preset_is_described_here() -> None:
    """A new folder under _presets/ needs its dependencies stated in TASK_PACKAGES."""
    assert sorted(TASK_PACKAGES) == sorted(TASKS)


@pytest.mark.parametrize("task", TASKS)
def test_task_renders_only_its_own_files_and_dependencies(render: Callable[..., Render], task: str) -> None:
    """The chosen preset's task.py, data and model modules, tests and dependencies; nothing of the others."""
    project = render(task=task)
    assert not (project.path / "_presets").exists()
    package = project.path / "src" / project.package
    assert (package / "task.py").is_file()
    assert (project.path / "tests" / "task_settings.py").is_file()
    modules = {path.name for path in (package / "data").glob("*.py")} | {
        path.name for path in (package / "models").glob("*.py")
    }
    for other in TASKS:
        if other != task:
            preset = TEMPLATE_DIR / "_presets" / other / "src" / "{{cookiecutter.package_name}}"
            theirs = {path.name for path in preset.glob("*/*.py")} - modules - {"__init__.py"}
            for name in theirs:
                assert not list(package.rglob(name)), f"task={task}: {other}'s {name} was rendered"
    assert dependency_names(project) & OPTIONAL_PACKAGES == TASK_PACKAGES[task]
    configs = [yaml.safe_load(path.read_text()) for path in (project.path / "configs").glob("*.yaml")]
    assert all(config["output_dir"].endswith(f"outputs/{task}") for config in configs)
    # The GPU platforms start DataLoader workers only where items are decoded from files (they restart
    # every epoch); the laptop config never does.
    workers = {
        path.stem: yaml.safe_load(path.read_text()).get("num_workers", 0)
        for path in (project.path / "configs").glob("*.yaml")
    }
    assert workers.pop("local") == 0
    assert all((count > 0) == (task == "images") for count in workers.values()), workers
    readme = (project.path / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n## The task: ") == 1, "the task's README section is missing or repeated"


@pytest.mark.parametrize("task", TASKS)
def test_dependencies_are_the_shared_ones_and_the_options(render: Callable[..., Render], task: str) -> None:
    """The shared packages, the task's and the default tracker's, nothing else: a package only one option
    needs is installed with that option only (`pip install -e .` is most of the quick start's time)."""
    names = dependency_names(render(task=task))
    assert names == SHARED_PACKAGES | TASK_PACKAGES[task] | {TRACKER_PACKAGES[DEFAULT_ANSWERS["tracker"]]}


def test_train_and_predict_are_the_same_for_every_task(render: Callable[..., Render]) -> None:
    """train.py and predict.py hold no task-specific line: they are byte for byte the same in every preset,
    and name no loss, label or metric (the package's name aside)."""
    projects = {task: render(task=task) for task in TASKS}
    for name in ("train.py", "predict.py"):
        # Each task's default project name is its own: compare with the package's name left out.
        texts = {
            task: (project.path / name).read_text(encoding="utf-8").replace(project.package, "PACKAGE")
            for task, project in projects.items()
        }
        assert len(set(texts.values())) == 1, f"{name} differs between tasks"
        code = texts[TASKS[0]]
        for word in ("cross_entropy", "accuracy", "logits", "argmax", "inputs, labels", "batch["):
            assert word not in code, f"{name} mentions {word!r}"
