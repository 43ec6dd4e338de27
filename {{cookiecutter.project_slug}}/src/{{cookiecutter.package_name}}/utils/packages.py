"""Optional packages of a task (transformers, torchvision): a missing one stops the run with a fix."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, requirement: str) -> ModuleType:
    """Import `module`; if it is not installed, exit with one line naming `requirement` and the pip command"""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module.split(".")[0]:
            raise  # the package is there but broken: its own error says more
        raise SystemExit(
            f"this task needs {requirement}, which is not installed: pip install -e . (pyproject.toml lists "
            f"it; the launchers in scripts/ install it), or pip install '{requirement}'"
        ) from None
