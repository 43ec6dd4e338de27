"""The digits task: the quality its README states, and the data it ships."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.data import digits
from {{ cookiecutter.package_name }}.data.digits import NoisyDigits
from {{ cookiecutter.package_name }}.utils.config import ConfigError
from {{ cookiecutter.package_name }}.utils.run.task_check import TaskModel

from ..conftest import FIGURE, PROJECT, assert_quoted, last_eval, run_training


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


def test_the_worked_example_of_own_task_md_imports_what_it_uses_and_its_loss_reads_its_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/own-task.md's worked example (which starts from this preset), run as a module of this package:
    its imports are all it needs (TrainConfig, setting), its data loads from a table, and its loss divides
    by the temperature that build_model kept on the model (loss gets no config)."""
    text = (PROJECT / "docs" / "own-task.md").read_text(encoding="utf-8")
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "(TrainConfig):" in block]
    example = types.ModuleType(f"{task.__package__}.own_task_example")
    example.__package__ = task.__package__
    monkeypatch.setitem(sys.modules, example.__name__, example)  # where @dataclass looks its module up
    exec(compile(code, "docs/own-task.md", "exec"), vars(example))
    generator = np.random.default_rng(0)
    table = np.column_stack([generator.normal(size=(40, 20)), generator.integers(0, 3, size=40)])
    np.savetxt(tmp_path / "train.csv", table, delimiter=",", header="features and label", comments="")
    config = example.Config(data_file=str(tmp_path / "train.csv"), temperature=2.0)
    train_set, _ = example.build_datasets(config)
    model = example.build_model(config).eval()  # no dropout: the same loss twice
    inputs, labels = train_set[:8]
    loss = example.loss(TaskModel(model, model, training=True), [inputs, labels])
    assert torch.equal(loss, torch.nn.functional.cross_entropy(model(inputs) / 2.0, labels))
