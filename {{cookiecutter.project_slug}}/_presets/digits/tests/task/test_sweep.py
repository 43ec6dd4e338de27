"""scripts/sweep.sh: one run per value, each in its own folder, stopped by Ctrl-C and continued by the same
command. Task-independent; it lives in the fastest preset's tests to keep the suites short."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import PROJECT, read_metrics, wait_for_training
from ..task_settings import SIGNAL_RUN

pytestmark = pytest.mark.slow  # real training runs


def test_sweep_stopped_by_ctrl_c_continues_when_run_again(tmp_path: Path) -> None:
    """`scripts/sweep.sh seed 1 2`, Ctrl-C (SIGINT to its process group, as a terminal sends it) while the
    first run trains: that run saves a checkpoint, and the sweep exits 75 without starting the second.
    The same command again continues the first run from its checkpoint, then trains the second: each
    run ends in its own folder with every step logged once."""
    sweep_dir = tmp_path / "sweep"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env |= {"SWEEP_DIR": str(sweep_dir), "SKIP_INSTALL": "1", "PYTHON": sys.executable}
    env |= {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    command = ["bash", "scripts/sweep.sh", "seed", "1", "2", "--", *SIGNAL_RUN]
    first, second = sweep_dir / "seed=1", sweep_dir / "seed=2"

    since = time.time()
    sweep = subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    wait_for_training(first, sweep, since, step=5)
    os.killpg(sweep.pid, signal.SIGINT)
    output, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 75, output[-4000:]
    assert "checkpoint saved" in output, output[-4000:]
    assert not second.exists(), "the sweep went on after the stopped run"
    stopped = max(path.name for path in (first / "checkpoints").iterdir())  # the newest: step_<N>

    again = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-4000:]
    assert f"resuming from {first / 'checkpoints' / stopped}" in output, output[-4000:]
    assert f"starting fresh in {second}" in output, output[-4000:]
    exported = {}
    for run, seed in ((first, 1), (second, 2)):
        steps = [row["step"] for row in read_metrics(run) if "train/loss" in row]
        assert steps == sorted(set(steps)), f"{run}: steps logged twice or out of order"
        export = json.loads((run / "model" / "export.json").read_text())
        assert export["step"] == steps[-1] > 0
        assert f"seed={seed}: " in output
        exported[seed] = export
    assert exported[1]["step"] == exported[2]["step"] and exported[1] != exported[2], "same run twice"

    # Once more: both runs finished with these arguments, so neither starts (no launcher, no Python).
    third = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60)
    output = third.stdout + third.stderr
    assert third.returncode == 0, output[-4000:]
    assert output.count("finished earlier, skipped") == 2 and "run_local:" not in output, output[-4000:]
    assert all(f"seed={seed}: " in output for seed in (1, 2)), output[-4000:]
    # Other arguments for every run: both run again (here train.py refuses their folders' other settings).
    changed = [*command, "--num_epochs", "9"]
    other = subprocess.run(changed, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and "holds a run with other settings" in other.stdout + other.stderr
