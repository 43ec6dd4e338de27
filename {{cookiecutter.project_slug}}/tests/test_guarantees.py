"""What every task keeps, tested with this project's task (task.py) and real runs on the CPU:

- a run stopped by SIGTERM mid-training and started again with the same command ends bitwise identical
  to a run that was never stopped; so does a run stopped by its time_budget;
- 1 and 2 processes with the same global batch (the task's defaults, dropout on; one thread each) end
  with the same weights and buffers (BatchNorm's running statistics among them) and the same logged
  metrics, the train loss among them, bit for bit; the 2-process run stopped by its time_budget on the way;
- a run stopped by SIGTERM on 1 process, continued on 2 and stopped by SIGTERM again, then finished on 1,
  ends bitwise identical to a run never stopped, dropout on; each resume verifies its first step;
- predict.py writes the same bytes on 1 and 2 processes;
- the suite's shortcut, a plain run forked from a process that has imported torch (tests/forked_runs.py),
  is the run that `python train.py` started anew makes.
"""

from __future__ import annotations

import csv
import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import IterableDataset

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import list_checkpoints
from {{ cookiecutter.package_name }}.utils.config import load_config
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from .conftest import (
    FORK_SERVER,
    PAIR_ARGS,
    PROJECT,
    SIGNAL_ARGS,
    assert_readable_log,
    assert_same_run,
    framework_warnings,
    last_eval,
    printed_metrics,
    read_metrics,
    run_predict,
    run_training,
    sessions_of,
    start_training,
    training_command,
    wait_for_training,
)

pytestmark = pytest.mark.slow

# Spent before the first logging step on any machine (building the data and the model alone takes longer),
# so a run with it stops there, however fast or slow the machine is.
SPENT_BUDGET = "0.001s"
# Far less than a checkpoint costs: checkpoints as often as the loop's 2% share of the time allows.
AS_OFTEN_AS_ALLOWED = "0.001s"


def stopped_for_time(output_dir: Path, *args: str, processes: int = 1) -> Path:
    """Run with SPENT_BUDGET; check that it stopped for time at its first logging step and left a checkpoint
    and model/ there. Returns the checkpoint, which the rerun keeps (it resumed from it)."""
    result = run_training(output_dir, *args, "--time_budget", SPENT_BUDGET, processes=processes, check=False)
    output = result.stdout + result.stderr
    # One process exits with EXIT_STOPPED; accelerate launch reports its processes' 75 as a failure, 1.
    assert result.returncode == (EXIT_STOPPED if processes == 1 else 1), output[-3000:]
    config, _ = load_config(list(args), PROJECT / "configs" / "local.yaml", task.Config)
    assert f"stopped for time; run again to continue: step {config.log_every}," in result.stdout, output
    assert [int(path.name[5:]) for path in list_checkpoints(output_dir)] == [config.log_every]
    assert json.loads((output_dir / "model" / "export.json").read_text())["step"] == config.log_every
    assert [session["ending"] for session in sessions_of(output_dir)] == ["time budget spent"]
    return list_checkpoints(output_dir)[0]


def written_by_the_rerun(output_dir: Path, resumed_from: Path) -> list[Path]:
    return [path for path in list_checkpoints(output_dir) if path != resumed_from]


def test_sigterm_mid_run_then_the_same_command_ends_bitwise_identical(
    signal_reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    reference = signal_reference
    output_dir = tmp_path / "run"
    started = time.time()
    process = start_training(output_dir, *SIGNAL_ARGS)
    wait_for_training(output_dir, process, since=started)
    assert process.poll() is None, "train.py ended before it was signalled"
    time.sleep(random.uniform(0.0, 0.05))  # an arbitrary moment, not aligned with any step
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == EXIT_STOPPED, output[-2000:]
    assert "checkpoint saved, run the same command to continue" in output
    assert not (output_dir / "model").exists()  # no export: the platform wants the machine back
    assert_readable_log(output, list_checkpoints(output_dir))
    stopped_at = max(int(path.name[5:]) for path in list_checkpoints(output_dir))
    resumed = run_training(output_dir, *SIGNAL_ARGS)
    assert f"step_{stopped_at:08d}" in resumed.stdout and "resuming from" in resumed.stdout
    assert_same_run(output_dir, reference)
    # The run's history: two sessions, why each ended, and nothing changed between them.
    sessions = sessions_of(output_dir)
    assert [(s["start_step"], s["ending"]) for s in sessions] == [
        (0, "stopped by SIGTERM"),
        (stopped_at, sessions_of(reference)[0]["ending"]),  # done, or max_steps reached where it caps the run
    ]
    assert "; nothing changed since session 1 (local, steps 0-" in resumed.stdout


def test_one_then_two_then_one_process_with_sigterm_between_ends_bitwise_identical(
    signal_reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-device batch 32 of a global 64 throughout: 1 process x 2 accumulation, then 2 x 1, then 1 x 2,
    each session stopped by SIGTERM mid-run but the last. The random numbers follow the samples, so the
    run ends as one never stopped; each resume verifies its first step against the session before's record
    (a stream's, whose next batch is not read ahead, says it was not recorded, as docs/resume.md promises)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same kernels on 1 and 2 processes
    args, reference = SIGNAL_ARGS, signal_reference
    output_dir, stopped_at, outputs = tmp_path / "run", 0, []
    for processes in (1, 2):
        started = time.time()
        process = start_training(output_dir, *args, processes=processes)
        wait_for_training(output_dir, process, since=started, step=stopped_at + 1)
        assert process.poll() is None, "train.py ended before it was signalled"
        process.send_signal(signal.SIGTERM)  # to each of the 2 processes, as the launcher passes it on
        output, _ = process.communicate(timeout=120)
        assert "checkpoint saved, run the same command to continue" in output, output[-3000:]
        assert f"world size {processes}" in output
        stopped_at = max(int(path.name[5:]) for path in list_checkpoints(output_dir))
        outputs.append(output)
    outputs.append(run_training(output_dir, *args).stdout)
    assert_same_run(output_dir, reference)
    sessions = sessions_of(output_dir)
    assert [(s["processes"], s["accumulation"]) for s in sessions] == [(1, 2), (2, 1), (1, 2)]
    for output in outputs[1:]:  # the two gradients of a step, added as one sum on 1 and on 2 processes
        assert (
            "(per-device batch 32 kept): the same samples and random numbers (they follow the samples), "
            "the same two gradients added, so bitwise as one uninterrupted run" in output
        ), output
    # A stream's next batch is not read ahead, so nothing records the step after its last checkpoint:
    # docs/resume.md promises "resume not verified" there.
    config, _ = load_config(args, PROJECT / "configs" / "local.yaml", task.Config)
    stream = isinstance(task.build_datasets(config)[0], IterableDataset)
    assert [s.get("resume") for s in sessions] == [None, *["not recorded" if stream else "verified"] * 2]
    for session, output in zip(sessions[1:], outputs[1:], strict=True):
        step, before = session["start_step"] + 1, session["session"] - 1
        verified = f"resume verified: step {step} as session {before} recorded it, bit for bit"
        unrecorded = f"resume not verified: nothing was recorded of step {step} ("
        assert (unrecorded if stream else verified) in output, output


def test_a_run_stopped_for_time_then_rerun_ends_bitwise_identical(
    one_process: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped by its time_budget at the first logging step; the rerun, with no budget and checkpoints as
    often as their cost allows (max_time_lost), ends as the run that was never stopped."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as its reference ran
    output_dir = tmp_path / "run"
    resumed_from = stopped_for_time(output_dir, *PAIR_ARGS)
    rerun = ["--time_budget", "", "--max_time_lost", AS_OFTEN_AS_ALLOWED]
    resumed = run_training(output_dir, *PAIR_ARGS, *rerun)
    config, _ = load_config(PAIR_ARGS, PROJECT / "configs" / "local.yaml", task.Config)
    lines = resumed.stdout.splitlines()
    saved = [int(line.split()[2]) for line in lines if line.startswith("checkpoint: step")]
    assert any(step % config.checkpoint_every for step in saved[:-1]), saved  # taken for time
    assert "checkpoints every " in resumed.stdout and "not as max_time_lost 0.001s needs" in resumed.stdout
    assert_readable_log(resumed.stdout + resumed.stderr, written_by_the_rerun(output_dir, resumed_from))
    assert_same_run(output_dir, one_process[0])


def test_one_and_two_processes_end_at_the_same_eval_metrics(
    one_process: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-device batch 32 of a global 64: 1 process accumulates 2 micro-batches, 2 processes 1 each. The
    2 processes also agree on the main process's clock: stopped for time at the first logging step, then
    continued with checkpoints as often as allowed, they end where the uninterrupted process does."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # threads change the summation order of matrix products
    (one_dir, one), args = one_process, PAIR_ARGS
    resumed_from = stopped_for_time(tmp_path / "two", *args, processes=2)
    two = run_training(tmp_path / "two", *args, "--max_time_lost", AS_OFTEN_AS_ALLOWED, processes=2)
    assert "x 1 processes x 2 accumulation = global batch 64" in one.stdout
    assert "x 2 processes x 1 accumulation = global batch 64" in two.stdout
    assert "train: step" in one.stdout + two.stdout  # the last step's line, at least
    assert_readable_log(one.stdout + one.stderr, list_checkpoints(one_dir))
    # Two processes, one line per event.
    assert_readable_log(two.stdout + two.stderr, written_by_the_rerun(tmp_path / "two", resumed_from))
    assert framework_warnings(one) == [] and framework_warnings(two) == []
    # The optimization itself does not depend on the number of processes, bit for bit.
    ones, twos = (load_file(folder / "model" / "model.safetensors") for folder in (one_dir, tmp_path / "two"))
    assert ones.keys() == twos.keys()
    assert [name for name in ones if not torch.equal(ones[name], twos[name])] == []
    metric = next(iter(task.Config.METRIC_GOALS))
    evals = [[row for row in read_metrics(folder) if metric in row] for folder in (one_dir, tmp_path / "two")]
    assert evals[0], "no evaluation was logged"
    assert [row["step"] for row in evals[0]] == [row["step"] for row in evals[1]]
    # Float for float: eval_step computes every sample in a batch of the same shape on 1 and 2 processes,
    # and the train loss is summed without rounding, however its micro-batches are split.
    assert evals[0] == evals[1]
    assert read_metrics(one_dir) == read_metrics(tmp_path / "two")


def test_predict_writes_the_same_bytes_on_one_and_two_processes(
    one_process: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of 5 over the eval split: several batches, and an uneven share for the two processes. Both
    print the task's metrics over the split: those that train.py logged for the model."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same kernels in both: a thread count changes sums
    model_dir = one_process[0] / "model"
    logged = {name: value for name, value in last_eval(one_process[0]).items() if name != "step"}
    files = {n: tmp_path / f"{n}.csv" for n in (1, 2)}
    for processes, output in files.items():
        args = ["--model_dir", str(model_dir), "--output", str(output), "--batch_size", "5"]
        result = run_predict(*args, processes=processes)
        assert f"world size {processes}" in result.stdout  # 2 processes really formed one group
        assert framework_warnings(result) == []
        assert printed_metrics(result.stdout) == pytest.approx(logged, rel=1e-5, abs=1e-6)
    assert files[1].read_bytes() == files[2].read_bytes()
    config, _ = load_config([], model_dir / "config.yaml", task.Config)
    with files[1].open(newline="") as file:
        indices = [row["index"] for row in csv.DictReader(file)]
    assert indices == [str(i) for i in range(len(task.predict_inputs(config, None)))]  # each input once


def test_a_forked_run_is_the_run_a_fresh_interpreter_makes(
    one_process: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same weights, metrics and warnings, and the same session record: the task's libraries loaded
    and their versions, the code's hashes, the split of the batch."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as its reference ran
    assert FORK_SERVER.process or torch.cuda.is_available(), "the reference was not forked"
    command, env = training_command(tmp_path / "fresh", *PAIR_ARGS)
    fresh = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert_same_run(tmp_path / "fresh", one_process[0])
    assert framework_warnings(fresh) == framework_warnings(one_process[1])
    same = ("versions", "task_sha256", "code_sha256", "processes", "accumulation", "device", "deterministic")
    fresh_record, forked_record = (sessions_of(folder)[0] for folder in (tmp_path / "fresh", one_process[0]))
    assert {key: fresh_record[key] for key in same} == {key: forked_record[key] for key in same}
