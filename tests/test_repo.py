"""The template repository itself: git holds every template file, its pre-commit hooks pass, and its docs
are reference pages, not a history."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from .conftest import HOOKS_DIR, TEMPLATE, TEMPLATE_DIR, explain, run

# Byproducts of running Python or its tools, never part of the template.
CACHES = {"__pycache__", ".pytest_cache", ".ruff_cache"}
# A dated passage: a line of docs that holds a date (2026-11-30, "Nov 2026") or speaks of a round of work.
# Figures keep the date they were measured; the story of how they changed is git's.
DATED = re.compile(
    r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b"  # 2026-11-30
    r"|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.? (?:19|20)\d\d\b"  # Nov 2026
    r"|\bround\b",  # "this round", "in round 3"
    re.IGNORECASE,
)
MOST_DATED = 12
BENCHMARKS_WORDS = 6000


def git(*args: str) -> list[str]:
    result = run(["git", *args], cwd=TEMPLATE, timeout=60)
    assert result.returncode == 0, explain(result)
    return [line for line in result.stdout.split("\0") if line]


@pytest.fixture(scope="module")
def checkout() -> None:
    if shutil.which("git") is None or run(["git", "rev-parse"], cwd=TEMPLATE).returncode != 0:
        pytest.skip("not a git checkout")


def walk(folder: Path) -> set[str]:
    """Every file under folder, as a path relative to the repository root, without caches."""
    found = set()
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in CACHES]
        for name in files:
            if not name.endswith((".pyc", ".pyo")):
                found.add((Path(root) / name).relative_to(TEMPLATE).as_posix())
    return found


@pytest.mark.usefixtures("checkout")
def test_every_template_file_is_tracked() -> None:
    """Each file under the template folder and hooks/ is in git: nothing a clone would miss.

    A .gitignore rule (the repo's, or the generated project's own, which also applies inside the template
    folder) that matches a template file hides it from `git add -A`; a fresh clone then renders a
    project without it. Locally this also flags a new template file that was never added.
    """
    tracked = set(git("ls-files", "-z", "--", TEMPLATE_DIR.name, HOOKS_DIR.name))
    untracked = sorted((walk(TEMPLATE_DIR) | walk(HOOKS_DIR)) - tracked)
    if not untracked:
        return
    ignored = set(git("ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--", *untracked))
    report = [
        f"{path}  ({'IGNORED by a .gitignore' if path in ignored else 'not added'})" for path in untracked
    ]
    pytest.fail("template files git does not track:\n" + "\n".join(report))


@pytest.mark.usefixtures("checkout")
def test_no_tracked_file_matches_an_ignore_rule() -> None:
    """No tracked file matches a .gitignore rule: such a rule would hide the next file of its kind.

    This is the check that still works on a clean clone, where ignored files simply do not exist.
    """
    ignored = git("ls-files", "-z", "--cached", "--ignored", "--exclude-standard")
    assert not ignored, "tracked files that a .gitignore rule matches:\n" + "\n".join(ignored)


@pytest.mark.slow
@pytest.mark.usefixtures("checkout")
def test_repository_pre_commit_passes(tmp_path: Path) -> None:
    """`pre-commit run --all-files` passes on what `git add -A` would commit (run in a copy: fixers write)."""
    files = git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    copy = tmp_path / "repo"
    for relative in files:
        source = TEMPLATE / relative
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (copy / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / relative)
    for command in (["git", "init", "-q"], ["git", "add", "-A"]):
        result = run(command, cwd=copy, timeout=60)
        assert result.returncode == 0, explain(result)
    result = run(
        [sys.executable, "-m", "pre_commit", "run", "--all-files", "--show-diff-on-failure", "--color=never"],
        cwd=copy,
        timeout=1800,
    )
    assert result.returncode == 0, explain(result)


def docs_pages() -> list[Path]:
    """The template's docs/ and what a render's docs/ is made of (its docs/ and each preset's task.md)."""
    folders = [TEMPLATE / "docs", TEMPLATE_DIR / "docs"]
    return [
        *(page for folder in folders for page in sorted(folder.glob("*.md"))),
        *sorted(TEMPLATE_DIR.glob("_presets/*/README.md")),
    ]


def test_docs_hold_few_dated_passages() -> None:
    """At most MOST_DATED lines of docs hold a date or a round: the pages say what is, with the date each
    figure was measured, and leave the narration of how it came to be to git."""
    dated = [
        f"{page.relative_to(TEMPLATE)}:{number}: {line.strip()[:80]}"
        for page in docs_pages()
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if DATED.search(line)
    ]
    assert len(dated) <= MOST_DATED, f"{len(dated)} dated lines, at most {MOST_DATED}:\n" + "\n".join(dated)


def test_benchmarks_page_fits_its_word_budget() -> None:
    """docs/benchmarks.md holds each figure once, with its command, machine and date: a reference page."""
    words = len((TEMPLATE / "docs" / "benchmarks.md").read_text(encoding="utf-8").split())
    assert words <= BENCHMARKS_WORDS, f"docs/benchmarks.md has {words} words, at most {BENCHMARKS_WORDS}"


def test_utils_is_a_few_named_rooms_each_on_the_map() -> None:
    """utils/ holds config.py and folders of at most 10 modules; docs/development.md's map names every
    folder and module, so a newcomer finds a function's room there."""
    utils = TEMPLATE_DIR / "src" / "{{cookiecutter.package_name}}" / "utils"
    mapped = (TEMPLATE_DIR / "docs" / "development.md").read_text().split("## Tests")[0]
    assert sorted(path.name for path in utils.glob("*.py")) == ["__init__.py", "config.py"]
    for folder in (path for path in utils.iterdir() if path.is_dir() and path.name not in CACHES):
        modules = sorted(path.name for path in folder.glob("*.py") if path.name != "__init__.py")
        assert 0 < len(modules) <= 10, f"{folder.name}/ holds {len(modules)} modules"
        assert f"`utils/{folder.name}/`" in mapped, f"docs/development.md's map lacks utils/{folder.name}/"
        missing = [name for name in modules if f"`{name}`" not in mapped]
        assert not missing, f"docs/development.md's map lacks {folder.name}/{', '.join(missing)}"
