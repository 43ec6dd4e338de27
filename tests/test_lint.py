"""Every render passes ruff (with its own config) and shellcheck; so do the rendered hooks and this repo."""

from __future__ import annotations

from pathlib import Path

import pytest
from cookiecutter.environment import StrictEnvironment
from cookiecutter.generate import generate_context
from cookiecutter.prompt import prompt_for_config

from .conftest import HOOKS_DIR, RENDERS, TEMPLATE, Render, explain, run, tool


def test_ruff_check_passes(any_render: Render) -> None:
    """`ruff check` passes in the rendered project, with the rules of its own pyproject.toml."""
    result = run([tool("ruff"), "check", "--no-cache", "."], cwd=any_render.path)
    assert result.returncode == 0, explain(result)


def test_ruff_sees_every_python_file(any_render: Render) -> None:
    """No .py file of the render is excluded from ruff (check and format discover files the same way)."""
    result = run([tool("ruff"), "check", "--no-cache", "--show-files", "."], cwd=any_render.path)
    assert result.returncode == 0, explain(result)
    seen = {Path(line).resolve() for line in result.stdout.splitlines() if line.strip()}
    python_files = {
        (any_render.path / relative).resolve() for relative in any_render.files if relative.suffix == ".py"
    }
    assert python_files, "the render has no .py file"
    assert not python_files - seen, f"ruff skips: {sorted(map(str, python_files - seen))}"


def test_ruff_format_check_passes(any_render: Render) -> None:
    """`ruff format --check` passes in the rendered project, with its own pyproject.toml."""
    result = run([tool("ruff"), "format", "--check", "--no-cache", "."], cwd=any_render.path)
    assert result.returncode == 0, explain(result)


def test_shellcheck_passes(any_render: Render) -> None:
    """shellcheck finds nothing in any scripts/*.sh of the render."""
    scripts = sorted(str(p.relative_to(any_render.path)) for p in (any_render.path / "scripts").glob("*.sh"))
    assert scripts, "the template has no scripts/*.sh"
    result = run([tool("shellcheck"), *scripts], cwd=any_render.path)
    assert result.returncode == 0, explain(result)


def rendered_hooks(output_dir: Path, extra_context: dict[str, str]) -> list[Path]:
    """The hooks as cookiecutter runs them: rendered with the answers' context, written to output_dir."""
    context = generate_context(context_file=str(TEMPLATE / "cookiecutter.json"), extra_context=extra_context)
    context["cookiecutter"] = prompt_for_config(context, no_input=True)
    environment = StrictEnvironment(context=context, keep_trailing_newline=True)
    paths = []
    for hook in sorted(HOOKS_DIR.glob("*.py")):
        path = output_dir / hook.name
        text = environment.from_string(hook.read_text(encoding="utf-8")).render(**context)
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


@pytest.mark.parametrize("name", ["default", "custom-names"])
def test_rendered_hooks_pass_ruff(tmp_path: Path, name: str) -> None:
    """Rendered, hooks/*.py pass ruff with this repo's rules (ruff skips them unrendered: they hold Jinja).

    Target: Python 3.10, the oldest Python cookiecutter (and so the hooks) may run on.
    """
    hooks = rendered_hooks(tmp_path, RENDERS[name])
    assert hooks, "no hooks/*.py"
    config = ["--config", str(TEMPLATE / "pyproject.toml"), "--target-version", "py310", "--no-cache"]
    files = [str(path) for path in hooks]
    check = run([tool("ruff"), "check", *config, *files], cwd=tmp_path)
    assert check.returncode == 0, explain(check)
    formatted = run([tool("ruff"), "format", "--check", "--diff", *config, *files], cwd=tmp_path)
    assert formatted.returncode == 0, explain(formatted)


def test_repository_tooling_passes_ruff() -> None:
    """This repository's own Python (tests/) passes ruff check and ruff format with the top-level config."""
    for command in (["check"], ["format", "--check"]):
        result = run([tool("ruff"), *command, "--no-cache", "."], cwd=TEMPLATE)
        assert result.returncode == 0, explain(result)


@pytest.mark.parametrize("name", ["run", "lowest", "stacks", "platform"])
def test_ci_script_passes_shellcheck(name: str) -> None:
    """.ci/run (the CI entry point), .ci/lowest, .ci/stacks and .ci/platform pass shellcheck and are
    executable."""
    script = TEMPLATE / ".ci" / name
    assert script.stat().st_mode & 0o111, f".ci/{name} is not executable"
    result = run([tool("shellcheck"), str(script.relative_to(TEMPLATE))], cwd=TEMPLATE)
    assert result.returncode == 0, explain(result)
