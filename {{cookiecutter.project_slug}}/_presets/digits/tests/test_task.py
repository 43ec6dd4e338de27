"""The digits task: the quality its README states, and a clear message when its package is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import PROJECT, last_eval, run_training

# Runs train.py as `python train.py` does, with scikit-learn hidden (None in sys.modules fails its import).
WITHOUT_SKLEARN = (
    "import runpy, sys; sys.modules['sklearn'] = None; sys.argv = ['train.py', *sys.argv[1:]]; "
    "runpy.run_path('train.py', run_name='__main__')"
)


@pytest.mark.slow
def test_the_default_config_reaches_the_stated_accuracy(tmp_path: Path) -> None:
    """README: configs/local.yaml, 440 optimizer steps, eval accuracy 0.9805 (seeded; 0.97 leaves room for
    another CPU's arithmetic)."""
    output_dir = tmp_path / "run"
    result = run_training(output_dir)
    assert "done: 440 optimizer steps" in result.stdout
    assert last_eval(output_dir)["eval/accuracy"] >= 0.97


def test_missing_scikit_learn_names_the_package_and_the_pip_command(tmp_path: Path) -> None:
    command = [sys.executable, "-c", WITHOUT_SKLEARN, "--output_dir", str(tmp_path / "run")]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    expected = "this task needs scikit-learn>=1.3, which is not installed: pip install -e ."
    assert last_line.startswith(expected), result.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # stopped before anything was written
