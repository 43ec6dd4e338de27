"""What every task keeps, tested with this project's task (task.py) and real runs on the CPU:

- a run stopped by SIGTERM mid-training and started again with the same command ends bitwise identical
  to a run that was never stopped;
- 1 and 2 processes with the same global batch (dropout 0, one thread each) end at the same eval metrics;
- predict.py writes the same bytes on 1 and 2 processes.
"""

from __future__ import annotations

import csv
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoint import list_checkpoints
from {{ cookiecutter.package_name }}.utils.config import load_config
from {{ cookiecutter.package_name }}.utils.signals import EXIT_STOPPED

from .conftest import (
    PROJECT,
    QUICK,
    assert_readable_log,
    assert_same_run,
    framework_warnings,
    read_metrics,
    run_predict,
    run_training,
    training_command,
    wait_for_training,
)
from .task_settings import SIGNAL_RUN, TWO_PROCESS_EVAL_TOLERANCE

pytestmark = pytest.mark.slow


def test_sigterm_mid_run_then_the_same_command_ends_bitwise_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    run_training(reference, *SIGNAL_RUN)
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *SIGNAL_RUN)
    started = time.time()
    process = subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for_training(output_dir, process, since=started)
    assert process.poll() is None, "train.py ended before it was signalled"
    time.sleep(random.uniform(0.0, 0.05))  # an arbitrary moment, not aligned with any step
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == EXIT_STOPPED, output[-2000:]
    assert "checkpoint saved, run the same command to continue" in output
    assert not (output_dir / "model").exists()
    assert_readable_log(output, list_checkpoints(output_dir))
    stopped_at = max(int(path.name[5:]) for path in list_checkpoints(output_dir))
    resumed = run_training(output_dir, *SIGNAL_RUN)
    assert f"step_{stopped_at:08d}" in resumed.stdout and "resuming from" in resumed.stdout
    assert_same_run(output_dir, reference)


def test_one_and_two_processes_end_at_the_same_eval_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-device batch 32 of a global 64: 1 process accumulates 2 micro-batches, 2 processes 1 each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # threads change the summation order of matrix products
    args = [*QUICK, "--dropout", "0", "--mixed_precision", "no", "--per_device_batch_size", "32"]
    one = run_training(tmp_path / "one", *args)
    two = run_training(tmp_path / "two", *args, processes=2)
    assert "x 1 processes x 2 accumulation = global batch 64" in one.stdout
    assert "x 2 processes x 1 accumulation = global batch 64" in two.stdout
    assert "train: step" in one.stdout + two.stdout  # the last step's line, at least
    for name, result in (("one", one), ("two", two)):  # two processes, one line per event
        assert_readable_log(result.stdout + result.stderr, list_checkpoints(tmp_path / name))
    assert framework_warnings(one) == [] and framework_warnings(two) == []
    evals = [[row for row in read_metrics(tmp_path / name) if "eval/loss" in row] for name in ("one", "two")]
    assert evals[0], "no evaluation was logged"
    assert [row["step"] for row in evals[0]] == [row["step"] for row in evals[1]]
    for first, second in zip(*evals, strict=True):
        assert second == pytest.approx(first, rel=TWO_PROCESS_EVAL_TOLERANCE, abs=0)


def test_predict_writes_the_same_bytes_on_one_and_two_processes(
    single_run: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of 5 over the eval split: several batches, and an uneven share for the two processes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same kernels in both: a thread count changes sums
    model_dir = single_run[0] / "model"
    files = {n: tmp_path / f"{n}.csv" for n in (1, 2)}
    for processes, output in files.items():
        args = ["--model_dir", str(model_dir), "--output", str(output), "--batch_size", "5"]
        result = run_predict(*args, processes=processes)
        assert f"world size {processes}" in result.stdout  # 2 processes really formed one group
        assert framework_warnings(result) == []
    assert files[1].read_bytes() == files[2].read_bytes()
    config, _ = load_config([], model_dir / "config.yaml", task.Config)
    with files[1].open(newline="") as file:
        indices = [row["index"] for row in csv.DictReader(file)]
    assert indices == [str(i) for i in range(len(task.predict_inputs(config, None)))]  # each input once
