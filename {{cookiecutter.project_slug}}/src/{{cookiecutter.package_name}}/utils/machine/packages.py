"""Optional packages (a task's Pillow or transformers, a streamed loader's torchdata)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType


def require(module: str, requirement: str) -> ModuleType:
    """Import `module`; if it is not installed, exit with one line naming `requirement` and the pip command"""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        parts = module.split(".")
        if error.name not in {".".join(parts[:n]) for n in range(1, len(parts) + 1)}:
            raise  # the package is there but one of its own imports fails: that error says more
        raise SystemExit(
            f"this task needs {requirement}, which is not installed: pip install -e . (pyproject.toml lists "
            f"it; the launchers in scripts/ install it), or pip install '{requirement}'"
        ) from None


def declared(pyproject: Path) -> list[str]:
    """pyproject.toml's `dependencies`, read without tomllib (Python 3.10 has none) or anything installed."""
    text = pyproject.read_text(encoding="utf-8")
    tokens = re.findall(r'"[^"]*"|#.*|\]', text[re.search(r"^dependencies = \[", text, re.M).end() :])
    return [token.strip('"') for token in tokens[: tokens.index("]")] if token[0] == '"']
