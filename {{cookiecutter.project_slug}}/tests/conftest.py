"""Shared helpers: real runs of train.py and predict.py, as a user would start them (a plain CPU run forked
from a process that has imported torch already: tests/forked_runs.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import checkpoint_step, list_checkpoints
from {{ cookiecutter.package_name }}.utils.run.history import HISTORY_FILE

from . import task_settings
from .forked_runs import ForkedRun, ForkServer, free_port

PROJECT = Path(__file__).resolve().parents[1]
# The suite runs on the CPU, on a GPU machine too: the numbers are those of CI, and a 1-process run is
# compared with 2 CPU processes. Runs made with `gpu=True` (tests/test_cuda.py) take the GPU back.
os.environ["ACCELERATE_USE_CPU"] = "1"
# The short runs of the generic tests (task_settings.py: TrainConfig's fields only), with the smaller model
# of a preset's own tests where it has one (task fields, tests/task/model.yaml); a task of one's own has none.
MODEL_FILE = PROJECT / "tests" / "task" / "model.yaml"
MODEL_FIELDS = yaml.safe_load(MODEL_FILE.read_text()) if MODEL_FILE.is_file() else {}
MODEL = [f"--{name}={value}" for name, value in MODEL_FIELDS.items()]
QUICK, SIGNAL_RUN = [*task_settings.QUICK, *MODEL], [*task_settings.SIGNAL_RUN, *MODEL]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `cuda` run wherever torch sees a CUDA GPU, and are skipped, saying why, elsewhere."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


def gpu_env() -> dict[str, str]:
    """The environment of a run that uses the GPU as a user's run would."""
    return {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"} | {"PYTHONUNBUFFERED": "1"}


def training_command(
    output_dir: Path, *args: str, processes: int = 1, gpu: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a train.py run: on the CPU, with processes > 1 a real multi-process
    gloo job; with `gpu`, one process on the GPU."""
    env = gpu_env() if gpu else {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable]
    if processes > 1:
        # --multi_gpu with ACCELERATE_USE_CPU=1 is what starts CPU processes that really talk (gloo);
        # `--cpu --num_processes 2` would start a single process.
        env["ACCELERATE_USE_CPU"] = "1"
        # The launcher dies on SIGUSR1 unless told to forward it (SLURM sends it before the time limit).
        env["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
        command += ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1"]
        command += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
        command += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["train.py", "--config", "configs/local.yaml", "--output_dir", str(output_dir), *args]
    return command, env


# The fork server imports the task's libraries (task_settings.IMPORTS) and the tracker's, which every run
# that logs loads (MLflow's import alone takes 4 s).
TRACKER_IMPORTS = {{ {"none": "()", "tensorboard": '("torch.utils.tensorboard",)', "mlflow": '("mlflow",)', "wandb": '("wandb",)'}[cookiecutter.tracker] }}
FORK_SERVER = ForkServer((*task_settings.IMPORTS, *TRACKER_IMPORTS))


def forked(env: dict[str, str]) -> bool:
    """Whether a CPU run with this environment is forked from the fork server: the same run, sooner."""
    return not torch.cuda.is_available() and FORK_SERVER.can_run(env)


def run_script(
    command: list[str], env: dict[str, str], timeout: float, processes: int
) -> subprocess.CompletedProcess[str]:
    """Run `python [-m accelerate.commands.launch ...] train.py|predict.py ...` to its end in the project,
    output captured: forked from the fork server where that is the same run (tests/forked_runs.py: on the
    CPU), else as the command says, in fresh interpreters."""
    script = next(index for index, part in enumerate(command) if part in ("train.py", "predict.py"))
    if forked(env):
        return FORK_SERVER.run(command[script:], env, PROJECT, timeout, processes)
    return subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout)


def start_training(output_dir: Path, *args: str, processes: int = 1) -> subprocess.Popen[str] | ForkedRun:
    """Start train.py with the local config on the CPU, to be signalled (each of its processes, as the
    launcher passes a signal on) and read as `Popen(stdout=PIPE, stderr=STDOUT, text=True)`."""
    command, env = training_command(output_dir, *args, processes=processes)
    if forked(env):
        return FORK_SERVER.start(command[command.index("train.py") :], env, PROJECT, processes)
    return subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_training(
    output_dir: Path, *args: str, processes: int = 1, gpu: bool = False, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run train.py to its end with the local config."""
    command, env = training_command(output_dir, *args, processes=processes, gpu=gpu)
    result = run_script(command, env, timeout=600, processes=processes)
    if check and result.returncode != 0:
        pytest.fail(
            f"train.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def run_predict(
    *args: str, processes: int = 1, gpu: bool = False, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """predict.py as a user starts it; with processes > 1 the same real gloo job as `training_command`."""
    env = gpu_env() if gpu else {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable]
    if processes > 1:
        env["ACCELERATE_USE_CPU"] = "1"
        command += ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1"]
        command += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
        command += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["predict.py", *args]
    result = run_script(command, env, timeout=300, processes=processes)
    if check and result.returncode != 0:
        pytest.fail(
            f"predict.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def printed_metrics(stdout: str) -> dict[str, float]:
    """The metrics that predict.py printed for the eval split: `eval split: eval/loss 0.1 | ...`."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("eval split: ")]
    pairs = [item.rsplit(" ", 1) for item in line.removeprefix("eval split: ").split(" | ")]
    return {name: float(value) for name, value in pairs}


# The fields of train.py's start line, in order (main): `platform local | config ... | world size 1 |
# distributed NO | device cpu | ...`.
START_FIELDS = (
    "platform", "config", "world size", "distributed", "device", "mixed precision", "per-device batch",
    "deterministic kernels", "CPU threads", "output",
)  # fmt: skip


def start_line(stdout: str) -> dict[str, str]:
    """The start line of a train.py run, field -> value (`{"world size": "2", "device": "cuda:0", ...}`).
    Every test that reads the line reads it here, the CPU tests too: a change of its format fails them
    on any machine, not only the GPU tests that CI cannot run."""
    lines = [line for line in stdout.splitlines() if line.startswith("platform ")]
    assert len(lines) == 1, f"expected one start line, got {lines}:\n{stdout[-3000:]}"
    parts = lines[0].split(" | ")
    names = [next((name for name in START_FIELDS if part.startswith(f"{name} ")), part) for part in parts]
    assert names == list(START_FIELDS), f"the start line's fields changed: {lines[0]}"
    return {name: part.removeprefix(f"{name} ") for name, part in zip(names, parts, strict=True)}


def framework_warnings(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines of a run's output that are warnings of a library (Accelerate, torch, tqdm, ...): a
    Python warning, a logged one, or torch's glog-style `W1124 12:00:00...` lines. The run's own begin
    with `WARNING: `. A command of this project, as its README gives it, should trigger none."""
    lines = re.split(r"[\r\n]+", f"{result.stdout}\n{result.stderr}")
    return [
        line
        for line in lines
        if ("warn" in line.lower() and not line.startswith("WARNING: ")) or re.match(r"[WE]\d{4} ", line)
    ]


def assert_same_run(resumed: Path, reference: Path) -> None:
    """Bitwise-equal exported weights (every safetensors file of model/: model.safetensors, or a LoRA
    adapter and its merged model) and the same metrics.jsonl, line for line."""
    files = sorted(path.relative_to(reference) for path in (reference / "model").rglob("*.safetensors"))
    assert files, f"no weights exported in {reference / 'model'}"
    for file in files:
        expected, actual = load_file(reference / file), load_file(resumed / file)
        assert expected.keys() == actual.keys(), file
        for name in expected:
            assert torch.equal(actual[name], expected[name]), f"{file}: {name} differs"
    assert read_metrics(resumed) == read_metrics(reference)


def assert_readable_log(output: str, checkpoints: list[Path]) -> None:
    """What a run printed off a terminal (a pipe here, a file on SLURM or Kaggle): no carriage-return
    frames of a progress bar, the last step's progress line once, and one line per checkpoint saved, from
    the main process alone whatever the number of processes (`checkpoints`: those on disk)."""
    assert "\r" not in output, "a progress bar drew frames into a pipe"
    lines = output.splitlines()
    assert sum(1 for line in lines if line.startswith("train: step") and "(100%)" in line) <= 1, output
    saved = [line for line in lines if line.startswith("checkpoint: step")]
    assert len(saved) == len(set(saved)), saved
    for path in checkpoints:  # those rotation kept; it removed older ones
        assert f"checkpoint: step {int(path.name[5:])} saved to {path}" in saved, (path, saved)


def wait_for_training(
    output_dir: Path, process: subprocess.Popen | ForkedRun, since: float, step: int = 0, timeout: float = 120
) -> None:
    """Block until this run has written metrics.jsonl (it cuts it on resume, then logs): it is training;
    with `step`, until it has logged that optimizer step or a later one. Polling the log, not sleeping,
    keeps a signal mid-run however fast the machine is."""
    deadline = time.monotonic() + timeout
    metrics = output_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.stat().st_mtime > since and _logged_step(metrics) >= step):
        if process.poll() is not None:
            return
        assert time.monotonic() < deadline, f"train.py did not reach step {step}"
        time.sleep(0.01)


def wait_for_checkpoint(
    output_dir: Path, process: subprocess.Popen | ForkedRun, timeout: float = 120
) -> None:
    """Block until a checkpoint is published and a step is logged after it: a kill now leaves training
    to redo after the newest checkpoint. Checkpoints are written in the background, so one saved at a
    step may be published several steps later on a busy machine."""
    deadline = time.monotonic() + timeout
    metrics = output_dir / "metrics.jsonl"
    while True:
        saved = list_checkpoints(output_dir)
        if saved and metrics.exists() and _logged_step(metrics) > checkpoint_step(saved[-1]):
            return
        assert process.poll() is None, "train.py ended before a checkpoint and a step after it"
        assert time.monotonic() < deadline, "no checkpoint was published with a step logged after it"
        time.sleep(0.01)


def _logged_step(metrics: Path) -> int:
    lines = metrics.read_text().splitlines()
    try:
        return json.loads(lines[-1])["step"] if lines else -1
    except (ValueError, KeyError):  # a line being written
        return -1


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def sessions_of(output_dir: Path) -> list[dict]:
    """The run's sessions, as the run folder's history.json records them."""
    return json.loads((output_dir / HISTORY_FILE).read_text())["sessions"]


def last_eval(output_dir: Path) -> dict:
    """The last logged evaluation (a task's metrics need not include eval/loss)."""
    return [row for row in read_metrics(output_dir) if any(name.startswith("eval/") for name in row)][-1]


# A figure a README quotes: one value, or the range measured on several CPUs and thread counts.
FIGURE = r"(\d+\.\d+(?: to \d+\.\d+)?)"


def assert_quoted(value: float, pattern: str) -> None:
    """Each figure that `pattern` (its one group) finds in README.md and docs/task.md is `value`, at the
    precision quoted, or holds it (a range): what a fresh run prints (bench/readme_figures.py writes them)."""
    text = "".join((PROJECT / page).read_text(encoding="utf-8") for page in ("README.md", "docs/task.md"))
    quotes = re.findall(pattern, text)
    assert quotes, f"nothing in README.md or docs/task.md matches {pattern!r}"
    for quote in quotes:
        low, _, high = quote.partition(" to ")
        shown = f"{value:.{len(low.partition('.')[2])}f}"
        assert float(low) <= float(shown) <= float(high or low), f"{quote} quoted, a fresh run gives {value}"


@pytest.fixture(scope="session")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A short real run (task_settings.QUICK), shared by the tests that only read its outputs."""
    output_dir = tmp_path_factory.mktemp("single") / "run"
    return output_dir, run_training(output_dir, *QUICK)


# The shared references: a run made once per session, for every test that compares a run of its own with
# one never stopped (assert_same_run). A new test that needs such a reference takes one of these, with its
# arguments, instead of training its own; each runs with one thread per process, as on 1 and 2 processes
# alike the same kernels add in the same order.
# SIGNAL_RUN with per-device batch 32 of a global 64: the same run on 1 process (2 accumulation steps) and
# on 2 (1 each), long enough for a signal to land mid-run.
SIGNAL_ARGS = [*SIGNAL_RUN, "--mixed_precision", "no", "--per_device_batch_size", "32"]
# QUICK in the same split.
PAIR_ARGS = [*QUICK, "--mixed_precision", "no", "--per_device_batch_size", "32"]


@pytest.fixture(scope="session")
def signal_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SIGNAL_ARGS run once on 1 process, never stopped: its output folder."""
    reference = tmp_path_factory.mktemp("signal") / "reference"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        run_training(reference, *SIGNAL_ARGS)
    return reference


@pytest.fixture(scope="session")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """PAIR_ARGS run once on 1 process (forked), never stopped: its output folder and what it printed."""
    output_dir = tmp_path_factory.mktemp("one") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        return output_dir, run_training(output_dir, *PAIR_ARGS)
