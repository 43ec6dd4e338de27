"""Reject cookiecutter answers that would generate a broken project.

Runs before any file is written, so a bad answer costs the user nothing: cookiecutter removes the
half-made output directory when this hook exits non-zero. Each message says what was wrong and
what to type instead.
"""

import keyword
import re
import sys

# The values arrive as JSON string literals so that quotes or backslashes in an answer cannot
# break this file.
PROJECT_SLUG = {{ cookiecutter.project_slug | tojson }}
PACKAGE_NAME = {{ cookiecutter.package_name | tojson }}
AUTHOR_EMAIL = {{ cookiecutter.author_email | tojson }}
TASK = {{ cookiecutter.task | tojson }}

# The task presets, one folder each in the template's _presets/ (post_gen_project.py moves one in place).
TASKS = ("digits", "images", "text", "lm")

# Importing any of these under the project's name would hide the real module.
SHADOWED = {"torch", "accelerate", "numpy", "yaml", "sklearn", "safetensors", "tqdm"}
SHADOWED |= {"tensorboard", "wandb", "mlflow", "transformers", "tokenizers", "PIL"}


def problems() -> list[str]:
    found = []
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", PROJECT_SLUG) or PROJECT_SLUG.endswith("."):
        found.append(
            f"project_slug {PROJECT_SLUG!r} is not a usable directory name: use letters, digits, '-', '_' "
            "or '.', starting with a letter or digit (e.g. 'digits-classifier')."
        )
    if not PACKAGE_NAME.isidentifier() or not PACKAGE_NAME.isascii():
        found.append(
            f"package_name {PACKAGE_NAME!r} is not a Python identifier: use lowercase ASCII letters, "
            "digits and '_', not starting with a digit (e.g. 'digits_classifier')."
        )
    elif keyword.iskeyword(PACKAGE_NAME) or keyword.issoftkeyword(PACKAGE_NAME):
        found.append(f"package_name {PACKAGE_NAME!r} is a Python keyword: pick another name.")
    elif PACKAGE_NAME in sys.stdlib_module_names or PACKAGE_NAME in SHADOWED:
        found.append(
            f"package_name {PACKAGE_NAME!r} would shadow the module of the same name that the project "
            f"imports or that Python ships: pick another name (e.g. 'my_{PACKAGE_NAME}')."
        )
    if TASK not in TASKS:
        found.append(f"task {TASK!r} is not a preset: choose one of {', '.join(TASKS)}.")
    if AUTHOR_EMAIL and not re.fullmatch(r"[^@\s]+@[^@\s]+", AUTHOR_EMAIL):
        found.append(f"author_email {AUTHOR_EMAIL!r} is not an email address: leave it empty or fix it.")
    return found


if __name__ == "__main__":
    errors = problems()
    for error in errors:
        print(f"ERROR: {error}", file=sys.stderr)
    sys.exit(1 if errors else 0)
