"""The digits task: the quality its README states, and the data it ships."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.data import digits
from {{ cookiecutter.package_name }}.data.digits import NoisyDigits
from {{ cookiecutter.package_name }}.utils.config import ConfigError

from ..conftest import FIGURE, assert_quoted, last_eval, run_training


@pytest.mark.slow
def test_the_default_config_reaches_the_stated_accuracy(tmp_path: Path) -> None:
    """README and docs/task.md: configs/local.yaml, 440 optimizer steps, the eval accuracy and loss they quote
    (seeded: the same on every run of a CPU, with one thread as CI runs)."""
    output_dir = tmp_path / "run"
    result = run_training(output_dir)
    assert "done: 440 optimizer steps" in result.stdout
    final = last_eval(output_dir)
    assert_quoted(final["eval/accuracy"], rf"eval accuracy \**{FIGURE}")
    assert_quoted(final["eval/loss"], rf"eval\s+loss\s+\**{FIGURE}")


def test_the_shipped_data_is_the_digits_set() -> None:
    """data/digits.csv: 1,797 images of 64 integer pixels 0..16, then the digit; every digit ~180 times."""
    table = np.loadtxt(digits.DATA_FILE, delimiter=",", dtype=np.int64)
    assert table.shape == (1797, 65)
    assert table[:, :64].min() == 0 and table[:, :64].max() == 16
    assert np.bincount(table[:, 64]).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    train_set, eval_set = task.build_datasets(task.Config())
    assert (len(train_set), len(eval_set)) == (1438, 359)


def test_a_missing_data_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(digits, "DATA_FILE", tmp_path / "digits.csv")
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'digits.csv'} does not exist: the data ships in"):
        task.build_datasets(task.Config())


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
