"""The GPU paths, run for real on a CUDA GPU; skipped, with the reason, on a machine without one.

The rest of the suite runs on the CPU everywhere (conftest.py). Here train.py and predict.py use the GPU
as a user's run does, with this project's task:
- in bf16 and in fp16 (with its real GradScaler), a run stopped by SIGTERM and one killed with SIGKILL
  both continue with the same command and end bitwise identical to a run that was never stopped (the
  resume after SIGTERM says its first step was verified);
- fp16 steps that the loss scaler keeps skipping stop the run as diverged after `fp16_skip_patience`;
- `--compile true` trains to the end, to nearly the same eval metrics as the eager run;
- predict.py writes its predictions from the GPU, the same bytes twice, row for row like the CPU;
- the launcher, with the machine's real nvidia-smi, picks one process per GPU and the precision the
  GPUs support, and train.py runs on the GPU;
- CPU processes (ACCELERATE_USE_CPU=1) on a GPU machine train in a gloo group without touching the GPU;
- an ordinary training step (not a logging step) never waits for the GPU: no host-device sync.
"""

from __future__ import annotations

import csv
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import checkpoint_problem, list_checkpoints
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from .conftest import (
    PROJECT,
    QUICK,
    SIGNAL_RUN,
    assert_same_run,
    free_port,
    gpu_env,
    last_eval,
    run_predict,
    run_training,
    start_line,
    training_command,
    wait_for_training,
)

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

# A checkpoint at every step makes the short run last long enough on a fast GPU for a signal to land
# mid-run, and a kill -9 likely to hit a save. It changes where checkpoints are, not the training.
GPU_RUN = [*SIGNAL_RUN, "--checkpoint_every", "1", "--keep_checkpoints", "2"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sigterm_and_kill_9_on_the_gpu_then_the_same_command_ends_bitwise_identical(
    tmp_path: Path, precision: str
) -> None:
    args = [*GPU_RUN, "--mixed_precision", precision]
    reference = tmp_path / "reference"
    result = run_training(reference, *args, gpu=True)
    started = start_line(result.stdout)
    assert started["device"] == "cuda:0" and started["mixed precision"].startswith(f"{precision} (")

    stopped = tmp_path / "sigterm"
    command, env = training_command(stopped, *args, gpu=True)
    started = time.time()
    process = subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for_training(stopped, process, since=started)
    assert process.poll() is None, "train.py ended before it was signalled"
    time.sleep(random.uniform(0.0, 0.3))
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == EXIT_STOPPED, output[-3000:]
    resumed = run_training(stopped, *args, gpu=True).stdout
    assert "resuming from" in resumed and "resume verified: step " in resumed, resumed[-3000:]
    assert_same_run(stopped, reference)

    killed = tmp_path / "kill"
    command, env = training_command(killed, *args, gpu=True)
    process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list_checkpoints(killed) and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.02)
    assert process.poll() is None, "train.py ended before it was killed"
    time.sleep(random.uniform(0.0, 0.3))  # mid-step or mid-save
    process.kill()
    process.wait()
    for path in list_checkpoints(killed):
        assert checkpoint_problem(path) is None, path
    assert "resuming from" in run_training(killed, *args, gpu=True).stdout
    assert_same_run(killed, reference)


def test_fp16_steps_skipped_past_the_patience_stop_the_run_as_diverged(tmp_path: Path) -> None:
    """learning_rate 1e6 in fp16: the weights grow until the fp16 forward overflows, the loss scaler skips
    every step from then on, and after fp16_skip_patience of them in a row the run stops, with no export."""
    output_dir = tmp_path / "run"
    args = [*QUICK, "--mixed_precision", "fp16", "--learning_rate", "1e6", "--fp16_skip_patience", "5"]
    result = run_training(output_dir, *args, "--log_every", "1000", gpu=True, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: training diverged: fp16's loss scaler skipped 5 optimizer steps in a row")
    assert not (output_dir / "model").exists()


def test_compiled_model_trains_to_the_eager_metrics(tmp_path: Path) -> None:
    run_training(tmp_path / "eager", *QUICK, gpu=True)
    compiled = run_training(tmp_path / "compiled", *QUICK, "--compile", "true", gpu=True)
    assert start_line(compiled.stdout)["device"] == "cuda:0", compiled.stdout[-2000:]
    expected, actual = last_eval(tmp_path / "eager"), last_eval(tmp_path / "compiled")
    assert actual["step"] == expected["step"]
    # Fused kernels round differently: close, not equal.
    best = task.Config().best_metric  # this task's
    assert actual[best] == pytest.approx(expected[best], rel=0.05)


def test_predict_on_the_gpu(tmp_path: Path) -> None:
    run_training(tmp_path / "run", *QUICK, gpu=True)
    model_dir = tmp_path / "run" / "model"
    files = [tmp_path / f"{name}.csv" for name in ("gpu", "again", "cpu")]
    for output, gpu in zip(files, (True, True, False), strict=True):
        result = run_predict("--model_dir", str(model_dir), "--output", str(output), gpu=gpu)
        assert ("device cuda" in result.stdout) == gpu, result.stdout
    assert files[0].read_bytes() == files[1].read_bytes()  # deterministic on the GPU too
    gpu_rows, cpu_rows = (list(csv.DictReader(path.read_text().splitlines())) for path in files[::2])
    assert [list(row) for row in gpu_rows] == [list(row) for row in cpu_rows]  # columns
    assert [row["index"] for row in gpu_rows] == [row["index"] for row in cpu_rows]


def test_launcher_decides_from_the_real_nvidia_smi(tmp_path: Path) -> None:
    """scripts/run_local.sh with nothing faked: one process per visible GPU, bf16 on compute capability
    8.0 and newer (fp16 below), and train.py on the GPU in that precision."""
    gpus = torch.cuda.device_count()
    capabilities = [torch.cuda.get_device_capability(index) for index in range(gpus)]
    precision = "bf16" if all(capability >= (8, 0) for capability in capabilities) else "fp16"
    env = gpu_env() | {
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "SKIP_INSTALL": "1",
        "MAIN_PROCESS_PORT": str(free_port()),
    }
    result = subprocess.run(
        ["bash", "scripts/run_local.sh", *QUICK, "--output_dir", str(tmp_path / "run")],
        cwd=PROJECT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert f"run_local: GPUs: {gpus} x {torch.cuda.get_device_name(0)}" in output, output[:3000]
    assert f"run_local: processes: {gpus} (one per GPU)" in output
    assert f"run_local: precision: {precision} (" in output
    started = start_line(result.stdout)
    assert (started["world size"], started["device"]) == (str(gpus), "cuda:0")
    assert started["mixed precision"].startswith(f"{precision} (")
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def test_cpu_processes_on_a_gpu_machine_leave_the_gpu_alone(tmp_path: Path) -> None:
    """Two CPU processes of one gloo group, started with the GPU visible: they train to the end (rank 1
    would crash in Accelerate's barrier on cuda:1) and neither sees the GPU: a process that did would
    record the CUDA random state in its checkpoint."""
    result = run_training(tmp_path / "run", *QUICK, processes=2)
    started = start_line(result.stdout)
    assert (started["world size"], started["distributed"], started["device"]) == ("2", "MULTI_CPU", "cpu")
    states = sorted((tmp_path / "run" / "checkpoints").glob("step_*/random_states_*.pkl"))
    assert {path.name for path in states} == {"random_states_0.pkl", "random_states_1.pkl"}
    for path in states:
        assert "torch_cuda_manual_seed" not in torch.load(path, weights_only=False), path


# train.py as a user starts it (argv: its arguments), with torch.cuda.set_sync_debug_mode("error") from the
# end of the first step (its lazy set-up may sync) to the last step: any call that waits for the
# GPU then raises. Allowed to sync: the logging step's one read-back of the train loss (TrainLoss.total),
# fp16's loss scaler deciding whether to skip the step (GradScaler._maybe_opt_step reads whether any
# gradient overflowed: inherent to fp16), the task's model forward and backward (task.loss and
# Tensor.backward: the text preset's loss trims padding columns; torch's backward of an embedding may
# read a count back for large batches), and the run's end (the last step's checkpoint, the final
# evaluation, the exports). The loop's own work (batches, their copies, accumulation, clipping, the
# optimizer and the schedule, the bookkeeping) may not.
SYNC_FREE = """
import atexit, runpy, sys, torch
from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.training import loop

def allowed(function):
    def call(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    return call

loop.TrainLoss.total = allowed(loop.TrainLoss.total)
torch.amp.GradScaler._maybe_opt_step = allowed(torch.amp.GradScaler._maybe_opt_step)
task.loss, torch.Tensor.backward = allowed(task.loss), allowed(torch.Tensor.backward)
count, checkpoint, modes = loop.Bookkeeping.count, loop.Bookkeeping.checkpoint, []

def strict_from_here(self, *args):
    modes.append(torch.cuda.get_sync_debug_mode())  # the step that ends here ran in this mode
    count(self, *args)
    torch.cuda.set_sync_debug_mode("error")

def at_the_end(self, *args):
    if self.state.step == self.total_steps:
        torch.cuda.set_sync_debug_mode(0)
    return checkpoint(self, *args)

loop.Bookkeeping.count, loop.Bookkeeping.checkpoint = strict_from_here, at_the_end
atexit.register(lambda: print(f"STRICT_STEPS {modes.count(2)}", flush=True))
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_sync_debug_mode_raises_on_this_torch() -> None:
    """What the next test relies on: a read-back of a GPU value raises in this mode."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.ones(1, device="cuda").item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_ordinary_steps_never_wait_for_the_gpu(tmp_path: Path, precision: str) -> None:
    """30 steps of the real loop with accumulation 2 and an epoch's end among them (the digits preset's
    epoch is 22 steps), logging every 10: only the allowed calls (SYNC_FREE) wait for the GPU."""
    args = [*SIGNAL_RUN, "--max_steps", "30", "--log_every", "10", "--eval_every", "1000"]
    args += ["--checkpoint_every", "1000", "--mixed_precision", precision, "--output_dir", str(tmp_path)]
    command = [sys.executable, "-c", SYNC_FREE, "--config", "configs/local.yaml", *args]
    result = subprocess.run(command, cwd=PROJECT, env=gpu_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    assert start_line(result.stdout)["device"] == "cuda:0"
    assert "STRICT_STEPS 29" in result.stdout, result.stdout[-3000:]
