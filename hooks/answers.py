"""Refuse cookiecutter answers that would generate a broken project, before anything is written.

cookiecutter.json loads this module as a Jinja extension (`_extensions`) and renders its last variable,
`__answers_checked`, through `check_answers` right after the prompts. A pre-generation hook would be too
late: cookiecutter creates the project folder, and every missing parent of it (project_slug 'a/b' makes
'a/'), before that hook runs, and on a refusal removes the project folder only. Here nothing exists yet.

Each problem is one "ERROR: ..." line on stderr, all of them at once, naming the value the user typed
(or the one it was derived from) and what to type instead. Choices (task, tracker, ...) need no check here:
cookiecutter refuses a value outside their list itself, before this runs and before anything is written.
"""

from __future__ import annotations

import json
import keyword
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import jinja2
from cookiecutter.exceptions import FailedHookException
from cookiecutter.utils import simple_filter

# A package of one of these names would hide the real module from the project's imports (or from a
# package users commonly add next to it).
SHADOWED = {"torch", "accelerate", "numpy", "yaml", "sklearn", "safetensors", "tqdm"}
SHADOWED |= {"tensorboard", "wandb", "mlflow", "transformers", "tokenizers", "PIL"}

# The default of project_slug derives it from project_name, and package_name's from project_slug.
DERIVED_FROM = {"project_slug": "project_name", "package_name": "project_slug"}
DEFAULTS = json.loads((Path(__file__).resolve().parents[1] / "cookiecutter.json").read_text(encoding="utf-8"))


def derived(key: str, answers: Mapping[str, str]) -> bool:
    """Whether answers[key] is what its default gives from the answer it derives from (not typed)."""
    default = jinja2.Environment().from_string(DEFAULTS[key]).render(cookiecutter=answers)
    return answers[key] == default


def typed(key: str, answers: Mapping[str, str]) -> tuple[str, str]:
    """What the user typed that gave answers[key]: (key, value), following derived defaults upwards."""
    while key in DERIVED_FROM and derived(key, answers):
        key = DERIVED_FROM[key]
    return key, answers[key]


def refusal(key: str, answers: Mapping[str, str], problem: str, advice: str) -> str:
    """One refusal: the value, where it came from when it was derived, what is wrong and what to do."""
    source, value = typed(key, answers)
    if source == key:
        return f"{key} {answers[key]!r} {problem}: {advice}."
    return (
        f"{key} {answers[key]!r} (derived from {source} {value!r}) {problem}: {advice}; "
        f"set {key}=... or change {source}."
    )


def problems(answers: Mapping[str, str]) -> list[str]:
    slug, package = answers["project_slug"], answers["package_name"]
    email = answers["author_email"]
    found = []
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", slug) or slug.endswith("."):
        advice = "use letters, digits, '-', '_' or '.', starting with a letter or digit"
        advice += " (e.g. 'digits-classifier')"
        found.append(refusal("project_slug", answers, "is not a usable directory name", advice))
    if not package.isidentifier() or not package.isascii():
        advice = "use lowercase ASCII letters, digits and '_', not starting with a digit"
        advice += " (e.g. 'digits_classifier')"
        found.append(refusal("package_name", answers, "is not a Python identifier", advice))
    elif keyword.iskeyword(package) or keyword.issoftkeyword(package):
        found.append(refusal("package_name", answers, "is a Python keyword", "pick another name"))
    elif package in sys.stdlib_module_names or package in SHADOWED:
        problem = "would shadow the module of the same name that the project imports or that Python ships"
        found.append(refusal("package_name", answers, problem, f"pick another name (e.g. 'my_{package}')"))
    if email and not re.fullmatch(r"[^@\s]+@[^@\s]+", email):
        found.append(f"author_email {email!r} is not an email address: leave it empty or fix it.")
    return found


@simple_filter
def check_answers(answers: Mapping[str, str]) -> str:
    """Print every problem of the answers and stop cookiecutter (FailedHookException, which its command
    line reports in one line); an empty string when there is none."""
    errors = problems(answers)
    for error in errors:
        print(f"ERROR: {error}", file=sys.stderr)
    if errors:
        raise FailedHookException("the answers above were refused; nothing was written")
    return ""
