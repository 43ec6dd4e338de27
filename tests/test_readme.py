"""The generated README fits its reader: a short main path, with the internals on docs/ pages it links,
and every relative link of the README and of those pages leads to a file and a heading that exist."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import TASKS, Render

# Words of the generated README (whitespace-separated, code included): what it is, the quick start, the
# platforms, the task, your own task, the loop, outputs, publishing, a sweep, the FAQ. The rest is in docs/.
WORD_BUDGET = 1500
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The fragments a link may name in a page: GitHub's slug of each heading, and each `<a id=...>`."""
    text = page.read_text(encoding="utf-8")
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.DOTALL), re.MULTILINE)
    slugs = {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}
    return slugs | set(re.findall(r'<a id="([^"]+)"', text))


def pages(project: Render) -> list[Path]:
    return [project.path / "README.md", *sorted((project.path / "docs").glob("*.md"))]


@pytest.mark.parametrize("task", TASKS)
def test_readme_main_path_fits_the_word_budget(render: Callable[..., Render], task: str) -> None:
    """Each preset's README, its included task section counted, is at most WORD_BUDGET words."""
    words = len((render(task=task).path / "README.md").read_text(encoding="utf-8").split())
    assert words <= WORD_BUDGET, f"task={task}: the README has {words} words; move details to docs/"


@pytest.mark.parametrize("task", TASKS)
def test_every_link_of_readme_and_docs_resolves_and_every_page_is_linked(
    render: Callable[..., Render], task: str
) -> None:
    """Relative links name files of the project and headings of those files; every docs/ page is linked
    from the README or from another page."""
    project = render(task=task)
    broken, linked = [], set()
    for page in pages(project):
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            linked.add(file)
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and fragment not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
    assert set(pages(project)[1:]) <= linked, set(pages(project)[1:]) - linked


def test_publishing_code_matches_the_installed_huggingface_hub(render: Callable[..., Render]) -> None:
    """The README's publishing code compiles, and each `api.<method>(...)` it makes binds to the signature
    of that HfApi method in the installed huggingface_hub (accelerate's dependency). Nothing is uploaded:
    there is no network here."""
    from huggingface_hub import HfApi

    readme = (render().path / "README.md").read_text(encoding="utf-8")
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "HfApi" in block]
    calls = [
        node
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if isinstance(node.func.value, ast.Name) and node.func.value.id == "api"
    ]
    assert [call.func.attr for call in calls] == ["create_repo", "upload_folder"]
    for call in calls:
        signature = inspect.signature(getattr(HfApi, call.func.attr))
        signature.bind(HfApi(), *call.args, **{keyword.arg: keyword.value for keyword in call.keywords})


def test_the_repository_readme_quotes_the_digits_accuracy_its_preset_quotes() -> None:
    """The digits preset's test checks its README's figures against a fresh run (tests/task/test_task.py);
    this README quotes the same run, so the same figure (bench/readme_figures.py writes them all)."""
    template = Path(__file__).resolve().parent.parent
    quoted = re.findall(r"`eval/accuracy (\d\.\d+)`", (template / "README.md").read_text(encoding="utf-8"))
    preset = template / "{{cookiecutter.project_slug}}" / "_presets" / "digits" / "README.md"
    assert quoted and set(quoted) == set(re.findall(r"eval accuracy \**(\d\.\d+)", preset.read_text()))
