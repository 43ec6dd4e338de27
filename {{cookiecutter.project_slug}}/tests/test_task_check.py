"""The task check: this task passes it, and each breach of the contract, made from this task's own
functions, is one line naming the function, what it returned and what the contract wants."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, Subset

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.utils.run.cli import check_contract
from {{ cookiecutter.package_name }}.utils.run.task_check import TaskError, build_datasets, check_task

from .conftest import PROJECT, QUICK, framework_warnings, training_command


@pytest.fixture(scope="module")
def setup() -> tuple[task.Config, Dataset, Dataset]:
    config, _ = load_config([], PROJECT / "configs" / "local.yaml", task.Config)
    return (config, *task.build_datasets(config))


def test_this_task_follows_the_contract_and_the_random_streams_are_kept(setup: tuple) -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert check_task(*setup, predict_inputs=2) == []
    assert torch.equal(torch.rand(3), expected)  # the run's weights and dropout are as without the check


original_loss, original_eval_step, original_metrics = task.loss, task.eval_step, task.metrics
original_collate = task.collate
original_predict = task.predict
BREACHES: dict[str, tuple[str, Callable[..., Any], str]] = {
    "per-sample loss": (
        "loss",
        lambda model, batch: original_loss(model, batch).repeat(2),
        "loss(model, batch) returned a torch.float32 tensor of shape [2] for a batch of 2 samples: the "
        "contract wants the batch's mean loss, a scalar floating-point tensor (shape [])",
    ),
    "loss without gradient": (
        "loss",
        lambda model, batch: original_loss(model, batch).detach(),
        "loss(model, batch) returned a tensor that does not require grad",
    ),
    "loss that raises": (
        "loss",
        lambda model, batch: 1 // 0,
        "task.py's loss(model, batch) raised ZeroDivisionError",
    ),
    "a collate that loss cannot read": (
        "collate",
        lambda samples: (original_collate(samples), "extra"),
        "task.py's loss(model, batch) raised ",
    ),
    "a loss that calls the model's forward itself": (
        "loss",
        lambda model, batch: original_loss(model.forward, batch),
        "loss(model, batch) calls model.forward: on several processes only model(...) itself syncs",
    ),
    "scalar eval_step": (
        "eval_step",
        lambda model, batch: {name: v.sum() for name, v in original_eval_step(model, batch).items()},
        "for a batch of 2 samples: the contract wants one value per sample, a tensor of shape [2]",
    ),
    "an eval_step value with 4 columns": (
        "eval_step",
        lambda model, batch: {
            name: value[:, None].repeat(1, 4) for name, value in original_eval_step(model, batch).items()
        },
        "tensor of shape [2, 4] as ",
    ),
    "an eval_step value with 4 values per sample: the refusal names the way out": (
        "eval_step",
        lambda model, batch: {
            name: value[:, None].repeat(1, 4) for name, value in original_eval_step(model, batch).items()
        },
        "[2]; return one name per column ('",
    ),
    "metrics without best_metric": (
        "metrics",
        lambda values, config: {
            name: value
            for name, value in original_metrics(values, config).items()
            if name != config.best_metric
        },
        "which METRIC_GOALS names (best_metric is one of them)",
    ),
    "a predict that returns one dict, not a list of rows": (
        "predict",
        lambda model, batch, config: original_predict(model, batch, config)[0],
        "predict(model, batch, config) returned a dict with the keys [",
    ),
    "a tensor as metric": (
        "metrics",
        lambda values, config: {name: torch.tensor(0.5) for name in original_metrics(values, config)},
        "the contract wants a Python number (a tensor's .item())",
    ),
}


@pytest.mark.parametrize("breach", BREACHES)
def test_each_breach_is_one_line(setup: tuple, monkeypatch: pytest.MonkeyPatch, breach: str) -> None:
    """As every run checks before training (predict included, on the eval batch)."""
    function, broken, message = BREACHES[breach]
    monkeypatch.setattr(task, function, broken)
    with pytest.raises(TaskError) as caught:
        check_task(*setup)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_setting_kept_on_the_model_is_read_in_loss_and_eval_step(
    setup: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """loss gets no config: a task may keep a setting on its model (see the gloo run below)."""
    build = task.build_model

    def build_model(config: task.Config) -> torch.nn.Module:
        model = build(config)
        model.loss_scale = 0.5
        return model

    monkeypatch.setattr(task, "build_model", build_model)
    monkeypatch.setattr(task, "loss", lambda model, batch: original_loss(model, batch) * model.loss_scale)
    scaled = lambda model, batch: original_eval_step(model, batch) if model.loss_scale else {}  # noqa: E731
    monkeypatch.setattr(task, "eval_step", scaled)
    assert check_task(*setup) == []


DATASETS = {
    "one set instead of two": (
        lambda sets: sets[0],
        "build_datasets(config) returned a ",
        ": the contract wants two datasets, (train_set, eval_set)",
    ),
    "an empty train set": (
        lambda sets: (Subset(sets[0], []), sets[1]),
        "build_datasets returned an empty train set (a Subset of 0 samples): the contract wants samples",
        "",
    ),
    "an empty eval set": (
        lambda sets: (sets[0], Subset(sets[1], [])),
        "build_datasets returned an empty eval set",
        "",
    ),
}


@pytest.mark.parametrize("mistake", DATASETS)
def test_what_build_datasets_returns_is_one_line(
    setup: tuple, monkeypatch: pytest.MonkeyPatch, mistake: str
) -> None:
    change, start, end = DATASETS[mistake]
    monkeypatch.setattr(task, "build_datasets", lambda config: change(setup[1:]))
    with pytest.raises(TaskError) as caught:
        build_datasets(setup[0])
    assert start in str(caught.value) and end in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_missing_or_misshapen_function_is_one_line_before_the_config_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_contract(task)
    monkeypatch.delattr(task, "predict_inputs")
    with pytest.raises(ConfigError, match=r"^task.py has no predict_inputs: the contract wants a function "):
        check_contract(task)
    monkeypatch.undo()
    monkeypatch.setattr(task, "loss", lambda batch: 0.0)
    with pytest.raises(ConfigError, match=r"does not take the arguments of loss\(model, batch\)"):
        check_contract(task)


def test_a_config_class_without_dataclass_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """`class Config(TrainConfig)` without @dataclass: its fields would be plain class attributes."""

    class Config(task.Config):
        width: int = 3

    monkeypatch.setattr(task, "Config", Config)
    with pytest.raises(ConfigError, match=r"^task.py's Config is not a dataclass: put @dataclass"):
        check_contract(task)


def test_a_check_that_raises_names_the_field_its_value_and_the_exception(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks = [*task.Config.CHECKS, ("per_device_batch_size", lambda v: 64 // (v - v) > 0, "> 0")]
    monkeypatch.setattr(task.Config, "CHECKS", checks)
    with pytest.raises(ConfigError) as caught:
        load_config([], PROJECT / "configs" / "local.yaml", task.Config)
    message = str(caught.value)
    assert "per_device_batch_size=" in message and "raised ZeroDivisionError: integer division" in message
    assert "\n" not in message


def test_a_typo_in_metric_goals_is_refused_with_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo, "maximum" for "max", would pick the worst evaluation as best_model/ and stop early wrongly."""
    best = task.Config.best_metric
    monkeypatch.setattr(task.Config, "METRIC_GOALS", {**task.Config.METRIC_GOALS, best: "maximum"})
    with pytest.raises(ConfigError, match=rf"METRIC_GOALS\['{best}'\] is 'maximum': it must be 'max'"):
        load_config([], PROJECT / "configs" / "local.yaml", task.Config)


@pytest.mark.slow
def test_train_py_checks_before_writing_and_check_task_alone(tmp_path: Path) -> None:
    """A per-sample loss stops train.py with one line before the output folder exists; `--check_task`
    checks this task, predict included, and writes nothing."""
    output_dir = tmp_path / "run"
    patched = (
        "import runpy, sys\n"
        "from {{ cookiecutter.package_name }} import task\n"
        "loss = task.loss\n"
        "task.loss = lambda model, batch: loss(model, batch).repeat(2)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    args = ["train.py", "--config", "configs/local.yaml", "--output_dir", str(output_dir)]
    result = subprocess.run(
        [sys.executable, "-c", patched, *args], cwd=PROJECT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith("config error: loss(model, batch) returned a "), (
        result.stderr[-3000:]
    )
    assert "Traceback" not in result.stderr
    assert not output_dir.exists()

    result = subprocess.run(
        [sys.executable, *args, "--check_task"], cwd=PROJECT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "task.py follows the contract" in result.stdout
    assert not output_dir.exists()


@pytest.mark.slow
def test_a_setting_kept_on_the_model_trains_on_two_processes(tmp_path: Path) -> None:
    """DDP wraps the model on two processes; loss and eval_step still read what build_model set on it."""
    script = tmp_path / "train_with_a_setting_on_the_model.py"
    script.write_text(
        "import runpy\n"
        "from {{ cookiecutter.package_name }} import task\n"
        "build, loss, eval_step = task.build_model, task.loss, task.eval_step\n"
        "def build_model(config):\n"
        "    model = build(config)\n"
        "    model.loss_scale = 0.5\n"
        "    return model\n"
        "task.build_model = build_model\n"
        "task.loss = lambda model, batch: loss(model, batch) * model.loss_scale\n"
        "task.eval_step = lambda model, batch: eval_step(model, batch) if model.loss_scale else {}\n"
        f"runpy.run_path({str(PROJECT / 'train.py')!r}, run_name='__main__')\n"
    )
    command, env = training_command(tmp_path / "run", *QUICK, "--max_steps", "4", processes=2)
    command[command.index("train.py")] = str(script)
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2" in result.stdout and "done: 4 optimizer steps" in result.stdout


@pytest.mark.slow  # imports transformers and peft: the fast selection's longest test
def test_a_task_that_calls_peft_itself_prints_no_library_warning() -> None:
    """peft warns that transformers 5 renamed a name it reads: not the user's to fix, so a task.py of a
    user's own that makes a LoRA model gets no warning in its run (the generic tests count them)."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    own_task = (
        "from {{ cookiecutter.package_name }} import task\n"  # imported first, as train.py imports it
        "import peft, transformers\n"
        "config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,\n"
        "    num_attention_heads=2, intermediate_size=32)\n"
        "model = transformers.BertForSequenceClassification(config)\n"
        "peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=['query', 'value']))\n"
    )
    result = subprocess.run([sys.executable, "-c", own_task], cwd=PROJECT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert framework_warnings(result) == []
