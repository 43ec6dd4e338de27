"""The digits task: the quality its README states, and a clear message when its package is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.data.digits import NoisyDigits

from .conftest import PROJECT, last_eval, run_training

# Runs train.py as `python train.py` does, with scikit-learn hidden (None in sys.modules fails its import).
WITHOUT_SKLEARN = (
    "import runpy, sys; sys.modules['sklearn'] = None; sys.argv = ['train.py', *sys.argv[1:]]; "
    "runpy.run_path('train.py', run_name='__main__')"
)


@pytest.mark.slow
def test_the_default_config_reaches_the_stated_accuracy(tmp_path: Path) -> None:
    """README: configs/local.yaml, 440 optimizer steps, eval accuracy 0.9833 (seeded; 0.97 leaves room for
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


def test_augmentation_is_a_function_of_seed_epoch_and_index() -> None:
    """Whole batches (DataLoader's __getitems__) and single items agree; an epoch's noise comes back when
    the epoch does (a resumed run), and differs between epochs and between seeds."""
    config = task.Config()
    train_set, _ = task.build_datasets(config)
    indices = [5, 0, 1000, 5]
    train_set.set_epoch(3)
    batch = task.collate(train_set.__getitems__(indices))
    items = task.collate([train_set[i] for i in indices])
    assert all(torch.equal(a, b) for a, b in zip(batch, items, strict=True))
    train_set.set_epoch(4)
    assert not torch.equal(task.collate([train_set[i] for i in indices])[0], items[0])
    train_set.set_epoch(3)
    assert torch.equal(task.collate([train_set[i] for i in indices])[0], items[0])
    blank = torch.zeros(2, 64), torch.zeros(2, dtype=torch.long)  # the images are the noise alone
    first, second = (NoisyDigits(*blank, noise=0.05, seed=seed) for seed in (1, 2))
    assert not torch.equal(first[0][0], second[0][0])
