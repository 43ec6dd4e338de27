"""The launchers (scripts/run_*.sh and the Python launcher behind them) on every platform, with faked GPUs.

Each launcher runs for real (bash, the real scripts, the real `python -m {{ cookiecutter.package_name }}.launch`)
with stand-ins first on PATH: `nvidia-smi` prints the CSV lines of the faked GPUs, and `accelerate`,
`srun`, `scontrol` and `sbatch` record their arguments and the relevant environment instead of training.
$PYTHON is a stand-in too: it runs the launcher with the real interpreter and records what the launcher
starts with it (train.py, pip). The tests assert the exact command and environment. Real runs at the
end start 2 CPU processes through run_local.sh and `accelerate launch` without any fake; tests/test_slurm.py
of the template runs the SLURM launcher on a real SLURM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import psutil
import pytest
import torch

from {{ cookiecutter.package_name }}.launch import train_args

from .conftest import (
    FORK_SERVER,
    PROJECT,
    assert_same_run,
    framework_warnings,
    free_port,
    run_training,
    sessions_of,
    start_line,
    training_command,
    wait_for_checkpoint,
    wait_for_training,
)
from .task_settings import SIGNAL_RUN

T4 = "Tesla T4, 7.5"
A100 = "NVIDIA A100-SXM4-80GB, 8.0"
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SRC = str(PROJECT / "src")
# The environment variables a recorder reports; any not listed in an expectation must be unset.
RECORDED_ENV = (
    "PYTHONPATH",
    "PET_SIGNALS_TO_HANDLE",
    "ACCELERATE_USE_CPU",
    "NCCL_P2P_DISABLE",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    "SLURM_NODEID",
)
# The directories of the system tools the scripts use (bash, dirname); after the fakes.
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"

# A recording stand-in: appends tool, argv, cwd, env to $LAUNCH_RECORD. (No str.format here: this file is
# rendered by Jinja.)
RECORDER = """\
import json, os, sys
env = dict((name, os.environ[name]) for name in RECORDED_NAMES if name in os.environ)
record = dict(tool=os.path.basename(sys.argv[0]), argv=sys.argv[1:], cwd=os.getcwd(), env=env)
with open(os.environ["LAUNCH_RECORD"], "a") as file:
    file.write(json.dumps(record) + "\\n")
"""
RECORD_AND_EXIT = RECORDER + 'sys.exit(int(os.environ.get("FAKE_EXIT", "0")))\n'

# $PYTHON: the launcher runs for real; what it starts with this interpreter is recorded. As train.py's
# main process would, it reports $FAKE_OUTCOME (JSON) to the SLURM launcher, then exits with $FAKE_EXIT.
FAKE_PYTHON = (
    """\
import os, sys
if sys.argv[1:3] == ["-m", "{{ cookiecutter.package_name }}.launch"] and sys.argv[3:4] != ["accelerate"]:
    os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])
"""
    + RECORDER
    + """\
if sys.argv[1:3] == ["-m", "pip"]:  # as pip does: many lines, FAKE_PIP_EXIT's status
    print("".join(f"Collecting package-{index}\\n" for index in range(60)), end="")
    sys.exit(int(os.environ.get("FAKE_PIP_EXIT", "0")))
if os.environ.get("FAKE_OUTCOME") and os.environ.get("TRAIN_OUTCOME_FILE"):
    with open(os.environ["TRAIN_OUTCOME_FILE"], "w") as file:
        file.write(os.environ["FAKE_OUTCOME"])
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""
)

# srun: records itself, then runs its command once per node with that node's SLURM_NODEID, as a
# task would (sequentially here). With FAKE_SRUN_WAIT set it instead waits for a signal, records it,
# and exits 1, as a multi-process launcher does after forwarding a signal.
FAKE_SRUN = (
    RECORDER
    + """\
import re, signal, subprocess, time
if os.environ.get("FAKE_SRUN_WAIT"):
    def stop(signum, frame):
        with open(os.environ["LAUNCH_RECORD"], "a") as file:
            file.write(json.dumps({"tool": "srun", "signal": signal.Signals(signum).name}) + "\\n")
        sys.exit(1)
    signal.signal(signal.SIGUSR1, stop)
    signal.signal(signal.SIGTERM, stop)
    open(os.environ["FAKE_SRUN_WAIT"], "w").close()
    while True:
        time.sleep(0.05)
args = sys.argv[1:]
start = next(i for i, arg in enumerate(args) if not arg.startswith("--"))
nodes = int(next((m.group(1) for a in args[:start] if (m := re.fullmatch(r"--nodes=(\\d+)", a))), "1"))
status = 0
for node in range(nodes):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node))
    status = max(status, subprocess.run(args[start:], env=env).returncode)
sys.exit(status)
"""
)

# scontrol: `show hostnames LIST` prints $FAKE_HOSTNAMES one per line; everything is recorded.
FAKE_SCONTROL = (
    RECORDER
    + """\
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(os.environ["FAKE_HOSTNAMES"].split()))
"""
)


def recorder(code: str) -> str:
    return code.replace("RECORDED_NAMES", repr(RECORDED_ENV))


def write_tool(directory: Path, name: str, code: str) -> None:
    path = directory / name
    path.write_text(f"#!{sys.executable}\n{code}")
    path.chmod(0o755)


def fake_nvidia_smi(directory: Path, gpus: list[str]) -> None:
    """nvidia-smi answering only the launchers' query with one CSV line per GPU; anything else fails."""
    lines = "".join(f"{gpu}\n" for gpu in gpus)
    query = "--query-gpu=name,compute_cap --format=csv,noheader"
    script = directory / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\nif [ "$*" != "{query}" ]; then echo "unexpected: $*" >&2; exit 2; fi\n'
        f'printf "%s" "{lines}"\n'
    )
    script.chmod(0o755)


@dataclass
class Run:
    """One launcher run in a faked environment: its result and what the stand-ins recorded."""

    result: subprocess.CompletedProcess[str]
    records: list[dict] = field(default_factory=list)

    def explain(self) -> str:
        return (
            f"exit {self.result.returncode}\n--- stdout ---\n{self.result.stdout}\n"
            f"--- stderr ---\n{self.result.stderr}\n--- records ---\n{json.dumps(self.records, indent=1)}"
        )


def fake_environment(tmp_path: Path, gpus: list[str] | None, env: dict[str, str]) -> dict[str, str]:
    """PATH with the stand-ins first (nvidia-smi only when `gpus` is not None), then the interpreter's dir."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    write_tool(fake_bin, "python", recorder(FAKE_PYTHON).replace("REAL_PYTHON", repr(sys.executable)))
    write_tool(fake_bin, "accelerate", recorder(RECORD_AND_EXIT))
    write_tool(fake_bin, "srun", recorder(FAKE_SRUN))
    write_tool(fake_bin, "scontrol", recorder(FAKE_SCONTROL))
    write_tool(fake_bin, "sbatch", recorder(RECORD_AND_EXIT))
    if gpus is not None:
        fake_nvidia_smi(fake_bin, gpus)
    elif shutil.which("nvidia-smi", path=SYSTEM_PATH):
        pytest.skip("a real nvidia-smi is installed: the CPU-only case cannot be faked here")
    return {
        "PATH": f"{fake_bin}:{Path(sys.executable).parent}:{SYSTEM_PATH}",
        "PYTHON": str(fake_bin / "python"),
        "HOME": str(tmp_path),
        "LAUNCH_RECORD": str(tmp_path / "record.jsonl"),
        **env,
    }


def read_records(path: Path, normalize_port: bool = True) -> list[dict]:
    """What the stand-ins recorded; a free port, which differs from run to run, reads PORT."""
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    for record in records:
        argv = record.get("argv", [])
        if "--main_process_port" in argv and normalize_port:
            port = argv.index("--main_process_port") + 1
            assert argv[port].isdigit(), argv
            argv[port] = "PORT"
    return records


def launch(tmp_path: Path, script: str, gpus: list[str] | None, args: list[str], env: dict[str, str]) -> Run:
    """Run `bash <script> ARGS` from outside the project (it must cd there itself) with the fakes."""
    environment = fake_environment(tmp_path, gpus, env)
    result = subprocess.run(
        ["bash", script, *args],
        cwd=tmp_path,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Run(result, read_records(Path(environment["LAUNCH_RECORD"]), "MAIN_PROCESS_PORT" not in env))


def train(platform: str, precision: str, *user_args: str) -> list[str]:
    """train.py's arguments as the launchers pass them: config and precision first, the user's last."""
    return ["train.py", "--config", f"configs/{platform}.yaml", "--mixed_precision", precision, *user_args]


def launched(accelerate_launch: list[str]) -> list[str]:
    """`accelerate launch` on one machine, run inside the launcher module (a stop exits 75 there)."""
    return ["-m", "{{ cookiecutter.package_name }}.launch", "accelerate", *accelerate_launch]


def multi_gpu(processes: int, precision: str, port: str = "PORT") -> list[str]:
    return [
        "launch",
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--main_process_port",
        port,
        "--mixed_precision",
        precision,
        "--dynamo_backend",
        "no",
    ]


USER_ARGS = ["--num_epochs", "2", "--output_dir", "/tmp/run dir"]  # a space: quoting must survive
COLAB = {"COLAB_RELEASE_TAG": "release-colab_20260101"}
KAGGLE = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}

# (id, script, platform variables, GPUs or None for no nvidia-smi, extra env, expected records)
SINGLE_MACHINE_CASES = [
    (
        "colab-t4",
        "run_colab.sh",
        COLAB,
        [T4],
        {},
        [{"tool": "python", "argv": train("colab", "fp16", *USER_ARGS), "env": {"PYTHONPATH": SRC}}],
    ),
    (
        "colab-a100",
        "run_colab.sh",
        {"COLAB_GPU": "1"},
        [A100],
        {},
        [{"tool": "python", "argv": train("colab", "bf16", *USER_ARGS), "env": {"PYTHONPATH": SRC}}],
    ),
    (
        "kaggle-2xt4",
        "run_kaggle.sh",
        KAGGLE,
        [T4, T4],
        {},
        [
            {
                "tool": "python",
                "argv": launched(multi_gpu(2, "fp16")) + train("kaggle", "fp16", *USER_ARGS),
                "env": {"PYTHONPATH": SRC, "PET_SIGNALS_TO_HANDLE": SIGNALS, "NCCL_P2P_DISABLE": "1"},
            }
        ],
    ),
    (
        "local-cpu",
        "run_local.sh",
        {},
        None,
        {},
        [{"tool": "python", "argv": train("local", "no", *USER_ARGS), "env": {"PYTHONPATH": SRC}}],
    ),
    (
        "local-cpu-2-processes",
        "run_local.sh",
        {},
        None,
        {"NUM_PROCESSES": "2"},
        [
            {
                "tool": "python",
                "argv": launched(multi_gpu(2, "no")) + train("local", "no", *USER_ARGS),
                "env": {"PYTHONPATH": SRC, "PET_SIGNALS_TO_HANDLE": SIGNALS, "ACCELERATE_USE_CPU": "1"},
            }
        ],
    ),
    (
        "local-2-gpus-1-visible",
        "run_local.sh",
        {},
        [T4, A100],
        {"CUDA_VISIBLE_DEVICES": "1"},
        [{"tool": "python", "argv": train("local", "bf16", *USER_ARGS), "env": {"PYTHONPATH": SRC}}],
    ),
    (
        "local-4-gpus-mixed-own-port",
        "run_local.sh",
        {},
        [A100, A100, A100, T4],
        {"MAIN_PROCESS_PORT": "29555"},
        [
            {
                "tool": "python",
                "argv": launched(multi_gpu(4, "fp16", "29555")) + train("local", "fp16", *USER_ARGS),
                "env": {"PYTHONPATH": SRC, "PET_SIGNALS_TO_HANDLE": SIGNALS},
            }
        ],
    ),
]


@pytest.mark.parametrize(
    ("script", "platform_env", "gpus", "extra_env", "expected"),
    [case[1:] for case in SINGLE_MACHINE_CASES],
    ids=[case[0] for case in SINGLE_MACHINE_CASES],
)
def test_single_machine_launch(
    tmp_path: Path,
    script: str,
    platform_env: dict[str, str],
    gpus: list[str] | None,
    extra_env: dict[str, str],
    expected: list[dict],
) -> None:
    """Each platform's launcher starts exactly this command with exactly this environment, from the project.

    Proves: GPUs counted from nvidia-smi (CUDA_VISIBLE_DEVICES respected), one process per GPU or
    NUM_PROCESSES, bf16 only when every GPU is >= 8.0, `python train.py` for one process, a gloo group
    (ACCELERATE_USE_CPU=1) for CPU processes, a free rendezvous port (or MAIN_PROCESS_PORT), SIGUSR1
    forwarding and Kaggle's NCCL_P2P_DISABLE for several, the config and precision before the user's
    arguments (which arrive intact).
    """
    run = launch(
        tmp_path,
        str(PROJECT / "scripts" / script),
        gpus,
        USER_ARGS,
        {**platform_env, **extra_env, "SKIP_INSTALL": "1"},
    )
    assert run.result.returncode == 0, run.explain()
    for record in run.records:
        assert record.pop("cwd") == str(PROJECT), run.explain()
    assert run.records == expected, run.explain()
    # One line per decision.
    for decision in ("platform", "GPUs", "processes", "precision", "NCCL", "config", "install", "launch"):
        assert f"{script.removesuffix('.sh')}: {decision}: " in run.result.stdout, run.explain()


def test_two_local_runs_get_different_free_ports(tmp_path: Path) -> None:
    """Multi-process runs do not take a fixed rendezvous port (two jobs on one node collided on 29500):
    each gets one that nobody listens on, so a port in use (a listener here) is never chosen."""
    ports = []
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        for attempt in range(2):
            folder = tmp_path / str(attempt)
            folder.mkdir()
            environment = fake_environment(folder, None, {"NUM_PROCESSES": "2", "SKIP_INSTALL": "1"})
            result = subprocess.run(
                ["bash", str(PROJECT / "scripts" / "run_local.sh")],
                env=environment,
                capture_output=True,
                text=True,
            )
            assert result.returncode == 0, result.stderr
            (record,) = read_records(Path(environment["LAUNCH_RECORD"]), normalize_port=False)
            ports.append(int(record["argv"][record["argv"].index("--main_process_port") + 1]))
            assert f"port {ports[-1]} (free now)" in result.stdout
        assert busy.getsockname()[1] not in ports


@pytest.mark.parametrize(("script", "platform_env"), [("run_colab.sh", KAGGLE), ("run_kaggle.sh", {})])
def test_platform_launcher_refuses_elsewhere(
    tmp_path: Path, script: str, platform_env: dict[str, str]
) -> None:
    """run_colab.sh on Kaggle, run_kaggle.sh on a laptop: refused in one line before anything starts or is
    written (no /content/drive or /kaggle/working made here); ANY_PLATFORM=1 runs it anyway."""
    env = {**platform_env, "SKIP_INSTALL": "1"}
    run = launch(tmp_path, str(PROJECT / "scripts" / script), None, [], env)
    assert run.result.returncode == 1, run.explain()
    platform = script.removesuffix(".sh").removeprefix("run_")
    (line,) = run.result.stderr.strip().splitlines()
    assert line.startswith(f"run_{platform}: ERROR: scripts/{script} is for {platform.capitalize()}, but "), (
        line
    )
    assert "ANY_PLATFORM=1" in line
    assert run.records == [], run.explain()
    forced = launch(tmp_path, str(PROJECT / "scripts" / script), None, [], {**env, "ANY_PLATFORM": "1"})
    assert forced.result.returncode == 0, forced.explain()
    assert [record["argv"] for record in forced.records] == [train(platform, "no")]


def test_user_arguments_come_last_and_set_the_launch_precision(tmp_path: Path) -> None:
    """A user's --mixed_precision/--config follow the launcher's (train.py keeps the last), and the
    precision the launcher passes to accelerate and train.py is the user's, so all agree."""
    user = ["--mixed_precision=bf16", "--config", "configs/local.yaml"]
    run = launch(
        tmp_path,
        str(PROJECT / "scripts" / "run_kaggle.sh"),
        [T4, T4],
        user,
        {"KAGGLE_KERNEL_RUN_TYPE": "Batch", "SKIP_INSTALL": "1"},
    )
    assert run.result.returncode == 0, run.explain()
    assert [record["argv"] for record in run.records] == [
        launched(multi_gpu(2, "bf16")) + train("kaggle", "bf16", *user)
    ]
    assert "precision: bf16 (your --mixed_precision; the hardware suggests fp16" in run.result.stdout
    assert "config: configs/local.yaml (your --config, instead of configs/kaggle.yaml)" in run.result.stdout


def test_a_users_own_config_is_said_to_be_read_over_the_platforms() -> None:
    """As train.py reads it: a file of the user's own over the platform's (which keeps its paths)."""
    line = train_args("colab", "no", ["--config", "my.yaml"])[1]
    assert line == "config: my.yaml (your --config, read over configs/colab.yaml)"


SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_CPUS_ON_NODE": "32",
    "FAKE_HOSTNAMES": "gpu07 gpu08",
    "SKIP_INSTALL": "1",
}


def slurm_launch(rank: int) -> dict:
    """What the accelerate of node `rank` must receive in the 2 nodes x 4 A100 job."""
    return {
        "tool": "accelerate",
        "argv": [
            "launch",
            "--multi_gpu",
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "gpu07",
            "--num_processes",
            "8",
            "--num_machines",
            "2",
            "--main_process_port",
            "PORT",
            "--mixed_precision",
            "bf16",
            "--dynamo_backend",
            "no",
            *train("slurm", "bf16", *USER_ARGS),
        ],
        "env": {
            "PYTHONPATH": SRC,
            "PET_SIGNALS_TO_HANDLE": SIGNALS,
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120",
            "SLURM_NODEID": str(rank),
        },
    }


def srun_options(nodes: int, cpus: str = "32") -> list[str]:
    return [f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]


@pytest.mark.parametrize("location", ["scripts", "spool"])
def test_slurm_two_nodes_of_four_gpus(tmp_path: Path, location: str) -> None:
    """run_slurm.sh on 2 nodes x 4 A100: one srun task per node with the node's CPUs, whose command
    expands on each node to `accelerate launch` with that node's --machine_rank, the head node from
    scontrol, 8 processes in total, bf16 and a free port. `spool`: run from a copy elsewhere, as sbatch
    does, it finds the project through SLURM_SUBMIT_DIR."""
    script = PROJECT / "scripts" / "run_slurm.sh"
    env = dict(SLURM_ENV)
    if location == "spool":
        spool = tmp_path / "spool"
        spool.mkdir()
        script = Path(shutil.copy(script, spool / "slurm_script"))
        env["SLURM_SUBMIT_DIR"] = str(PROJECT)
    run = launch(tmp_path, str(script), [A100] * 4, USER_ARGS, env)
    assert run.result.returncode == 0, run.explain()
    for record in run.records:
        record.pop("cwd")
    scontrol, srun, *accelerates = run.records
    assert scontrol["tool"] == "scontrol"
    assert scontrol["argv"] == ["show", "hostnames", "gpu[07-08]"]
    assert srun["tool"] == "srun"
    options, command = srun["argv"][:5], srun["argv"][5:]
    assert options == [*srun_options(2), "--kill-on-bad-exit=1"]
    assert command[:2] == ["bash", "-c"]
    assert "$SLURM_NODEID" in command[2], "the per-node command must expand on the node"
    assert command[3:] == ["bash", *train("slurm", "bf16", *USER_ARGS)]
    assert accelerates == [slurm_launch(0), slurm_launch(1)], run.explain()
    assert "run_slurm: nodes: 2 (4 process(es) per node, 8 in total)" in run.result.stdout


@pytest.mark.parametrize(
    ("tasks", "gpus", "expected"),
    [
        (
            {"SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2"},
            None,
            "processes: 2 (the job's tasks per node)",
        ),
        ({"SLURM_TASKS_PER_NODE": "2(x1)"}, None, "processes: 2 (the job's tasks per node)"),
        ({"SLURM_TASKS_PER_NODE": "1"}, [A100, A100], "processes: 2 (one per GPU)"),
        ({"SLURM_TASKS_PER_NODE": "3"}, [A100, A100], "asks for 3 processes but only 2 GPU(s)"),
    ],
    ids=["ntasks-per-node", "ntasks", "gpus-per-node", "more-tasks-than-gpus"],
)
def test_slurm_processes_follow_the_job_request(
    tmp_path: Path, tasks: dict[str, str], gpus: list[str] | None, expected: str
) -> None:
    """--ntasks-per-node (or --ntasks) gives that many processes per node; without it, one per GPU of
    the job (--gpus-per-node); more tasks than GPUs is refused."""
    env = {**SLURM_ENV, "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "n1", "FAKE_HOSTNAMES": "n1", **tasks}
    run = launch(tmp_path, str(PROJECT / "scripts" / "run_slurm.sh"), gpus, [], env)
    assert expected in run.result.stdout + run.result.stderr, run.explain()
    if "only" in expected:
        assert run.result.returncode == 1 and run.records == [], run.explain()
        return
    assert run.result.returncode == 0, run.explain()
    accelerate = [record for record in run.records if record["tool"] == "accelerate"]
    assert accelerate[0]["argv"][accelerate[0]["argv"].index("--num_processes") + 1] == "2"


def test_slurm_single_gpu_runs_python_under_srun(tmp_path: Path) -> None:
    """One node with one T4: `srun ... --cpus-per-task=<the job's> python train.py ...`, no launcher, fp16."""
    env = {**SLURM_ENV, "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu07", "SLURM_CPUS_ON_NODE": "6"}
    run = launch(tmp_path, str(PROJECT / "scripts" / "run_slurm.sh"), [T4], [], env)
    assert run.result.returncode == 0, run.explain()
    python = str(tmp_path / "bin" / "python")
    assert [(r["tool"], r["argv"]) for r in run.records] == [
        ("srun", [*srun_options(1, "6"), python, *train("slurm", "fp16")]),
        ("python", train("slurm", "fp16")),
    ], run.explain()


@pytest.mark.parametrize("signal_name", ["SIGUSR1", "SIGTERM"])
def test_slurm_passes_a_stop_signal_to_the_step_and_requeues(tmp_path: Path, signal_name: str) -> None:
    """SIGUSR1 to the batch process (what --signal=B:USR1@300 sends) or SIGTERM (scontrol requeue) reaches
    the running srun step; once the step has stopped, the job requeues itself."""
    started = tmp_path / "srun-started"
    env = fake_environment(tmp_path, [A100] * 4, {**SLURM_ENV, "FAKE_SRUN_WAIT": str(started)})
    process = subprocess.Popen(
        ["bash", str(PROJECT / "scripts" / "run_slurm.sh")],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "srun never started"
            time.sleep(0.05)
        process.send_signal(getattr(signal, signal_name))
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    records = read_records(Path(env["LAUNCH_RECORD"]))
    summary = [(r["tool"], r.get("argv", r.get("signal"))) for r in records]
    assert process.returncode == 0, (stdout, stderr, summary)
    assert summary[0] == ("scontrol", ["show", "hostnames", "gpu[07-08]"])
    assert summary[1][0] == "srun"
    # Every stop reaches the step as SIGUSR1: srun would answer a SIGTERM by killing its tasks.
    assert summary[2:] == [("srun", "SIGUSR1"), ("scontrol", ["requeue", "4242"])], (stdout, stderr)
    assert "requeue: training stopped after a checkpoint (no report from train.py, exit 1)" in stdout


@pytest.mark.parametrize(
    ("outcome", "restarts", "exit_code", "requeued", "message"),
    [
        ('{"status": "stopped", "start_step": 0, "step": 40}', "0", 75, True, "steps 0 -> 40"),
        ('{"status": "stopped", "start_step": 40, "step": 80}', "3", 75, True, "steps 40 -> 80"),
        ('{"status": "stopped", "start_step": 40, "step": 40}', "0", 75, True, "steps 40 -> 40"),
        ('{"status": "stopped", "start_step": 40, "step": 40}', "1", 75, False, "without progress"),
        ('{"status": "finished", "start_step": 40, "step": 90}', "1", 0, False, "done: training finished"),
        ("", "0", 3, False, "training failed (exit 3): not requeued"),
    ],
    ids=["stopped", "stopped-after-requeues", "no-progress-first", "no-progress-again", "finished", "failed"],
)
def test_slurm_requeue_follows_what_training_reports(
    tmp_path: Path, outcome: str, restarts: str, exit_code: int, requeued: bool, message: str
) -> None:
    """Whatever stopped training (a signal only the step got, say), a run that checkpointed and exited 75
    requeues the job; one that made no progress since the last requeue does not (no endless loop); a
    finished or failed run never does."""
    env = {
        **SLURM_ENV,
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_RESTART_COUNT": restarts,
        "FAKE_OUTCOME": outcome,
        "FAKE_EXIT": str(exit_code),
    }
    run = launch(tmp_path, str(PROJECT / "scripts" / "run_slurm.sh"), None, [], env)
    assert message in run.result.stdout, run.explain()
    tools = [(r["tool"], r["argv"]) for r in run.records]
    assert (("scontrol", ["requeue", "4242"]) in tools) == requeued, run.explain()
    assert run.result.returncode == (0 if requeued or exit_code == 0 else exit_code), run.explain()


def test_slurm_outside_a_job_says_to_submit_it_with_sbatch(tmp_path: Path) -> None:
    """`bash scripts/run_slurm.sh` outside a job (no SLURM_JOB_ID) submits nothing: one line says how."""
    run = launch(tmp_path, str(PROJECT / "scripts" / "run_slurm.sh"), None, USER_ARGS, {})
    assert run.result.returncode == 1, run.explain()
    assert run.result.stderr.strip().splitlines() == [
        "run_slurm: ERROR: not inside a SLURM job: submit it with `sbatch [options] scripts/run_slurm.sh "
        "[--field value ...]`, with sbatch options such as --gpus-per-node=1 --cpus-per-task=8"
    ], run.explain()
    assert not [record for record in run.records if record["tool"] in ("sbatch", "srun", "python")]


def test_install_only_when_needed_and_keep_torch(tmp_path: Path) -> None:
    """Without SKIP_INSTALL: nothing is installed when pyproject.toml's dependencies for this system are
    satisfied; otherwise `pip install -e . torch==<the installed version>` (torch pinned), then the
    launch."""
    project = tmp_path / "project"
    shutil.copytree(PROJECT / "scripts", project / "scripts")
    shutil.copytree(PROJECT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = (PROJECT / "pyproject.toml").read_text()
    for extra, missing in [
        (None, None),
        ("tqdm>=999; sys_platform == 'no-such-system'", None),  # for another system: not missing
        ("surely-not-an-installed-package>=1", "surely-not-an-installed-package>=1"),
        ("tqdm>=999", "tqdm>=999 (installed: "),
    ]:
        text = pyproject.replace("dependencies = [\n", f'dependencies = [\n    "{extra}",\n', 1)
        (project / "pyproject.toml").write_text(text if extra else pyproject)
        (tmp_path / "record.jsonl").unlink(missing_ok=True)
        run = launch(tmp_path, str(project / "scripts" / "run_local.sh"), None, [], {})
        assert run.result.returncode == 0, run.explain()
        launched = train("local", "no")
        if missing is None:
            assert [record["argv"] for record in run.records] == [launched], run.explain()
            assert "install: nothing to do" in run.result.stdout
            continue
        pip, started = run.records
        assert pip["argv"] == ["-m", "pip", "install", "-e", ".", f"torch=={metadata.version('torch')}"]
        assert started["argv"] == launched
        assert f"install: missing {missing}" in run.result.stdout, run.explain()
        # pip's own lines stay out of the output (a notebook cell): one line says it ran, one that it is done
        assert "Collecting" not in run.result.stdout + run.result.stderr, run.explain()
        assert "install: running pip (its output is shown if it fails)" in run.result.stdout, run.explain()
        assert re.search(r"run_local: install: done in \d+ s\n", run.result.stdout), run.explain()
    script = str(project / "scripts" / "run_local.sh")
    failing = launch(tmp_path, script, None, [], {"FAKE_PIP_EXIT": "1"})  # pip's output, then one line
    assert failing.result.returncode == 1, failing.explain()
    assert "Collecting package-59" in failing.result.stderr, failing.explain()
    assert "pip install failed" in failing.result.stderr.strip().splitlines()[-1], failing.explain()


def test_documented_accelerate_launch_commands_give_every_setting() -> None:
    """`accelerate launch` warns (5 lines) about each of these it fills in with a default: the commands
    in the README and in docs/ give them all, as the launchers do."""
    pages = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    # A command line: optional VAR=value assignments, then accelerate launch, with its continuation lines.
    commands = re.findall(r"^ *(?:\w+=\S+ )*accelerate launch (?:.*\\\n)*.*", text, re.MULTILINE)
    assert commands, "no `accelerate launch` command found in the README or docs/: the pattern is stale"
    for command in commands:
        for flag in ("--num_processes", "--num_machines", "--mixed_precision", "--dynamo_backend"):
            assert flag in command, command


def two_cpu_processes_env() -> dict[str, str]:
    """run_local.sh's environment for a real 2-process CPU run, without fakes."""
    return {
        **{key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")},
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,
        "NUM_PROCESSES": "2",
        "CUDA_VISIBLE_DEVICES": "",  # CPU processes, also on a machine with a GPU
        "SKIP_INSTALL": "1",
        "MAIN_PROCESS_PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
    }


@pytest.mark.slow
def test_run_local_starts_two_cpu_processes_that_train_together(tmp_path: Path) -> None:
    """No fakes: NUM_PROCESSES=2 scripts/run_local.sh trains in one 2-process gloo group (world size 2)
    to the end and exports the model."""
    output_dir = tmp_path / "run"
    result = subprocess.run(
        ["bash", "scripts/run_local.sh", "--max_steps", "6", "--output_dir", str(output_dir)],
        cwd=PROJECT,
        env=two_cpu_processes_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "run_local: distributed: 2 CPU processes on gloo (ACCELERATE_USE_CPU=1)" in output
    assert output.count("checked: loading PyTorch and Accelerate") == 1, output[-5000:]
    assert "world size 2" in output, output[-5000:]
    assert (output_dir / "model" / "model.safetensors").is_file()
    assert framework_warnings(result) == []


@pytest.mark.slow
def test_a_forked_two_process_run_is_the_run_accelerate_launch_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suite's shortcut for a run of 2 processes that must succeed (tests/forked_runs.py: both forked,
    with the environment the launcher gives each) against `accelerate launch` itself: the same start line,
    weights, metrics and warnings, and the same session record."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["--max_steps", "6", "--log_every", "2", "--checkpoint_every", "3"]
    forked = run_training(tmp_path / "forked", *args, processes=2)
    assert FORK_SERVER.process or torch.cuda.is_available(), "the 2 processes were not forked"
    command, env = training_command(tmp_path / "launched", *args, processes=2)
    launched = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert launched.returncode == 0, launched.stderr[-3000:]
    starts = [start_line(result.stdout) | {"output": ""} for result in (forked, launched)]
    assert starts[0] == starts[1] and starts[0]["world size"] == "2", starts
    assert_same_run(tmp_path / "forked", tmp_path / "launched")
    assert framework_warnings(forked) == framework_warnings(launched) == []
    same = ("versions", "task_sha256", "code_sha256", "processes", "accumulation", "device", "deterministic")
    records = [sessions_of(tmp_path / name)[0] for name in ("forked", "launched")]
    assert {key: records[0][key] for key in same} == {key: records[1][key] for key in same}


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop", ["SIGINT", "SIGTERM", "time"], ids=["ctrl-c", "sigterm-to-the-launcher", "time"]
)
def test_a_stopped_two_process_run_of_run_local_exits_75_with_its_line(tmp_path: Path, stop: str) -> None:
    """No fakes: Ctrl-C (SIGINT to the whole process group), a SIGTERM to the launcher alone, or the end of
    time_budget stops NUM_PROCESSES=2 scripts/run_local.sh after a checkpoint with exit 75 and train.py's
    line last, not 1 with torch's launcher traceback."""
    output_dir = tmp_path / "run"
    started = time.time()
    budget = ["--time_budget", "15s"] if stop == "time" else []
    process = subprocess.Popen(
        ["bash", "scripts/run_local.sh", "--num_epochs", "500", *budget, "--output_dir", str(output_dir)],
        cwd=PROJECT,
        env=two_cpu_processes_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    wait_for_training(output_dir, process, since=started, timeout=300)
    if stop == "SIGINT":
        os.killpg(process.pid, signal.SIGINT)
    elif stop == "SIGTERM":
        process.send_signal(signal.SIGTERM)  # run_local.sh execs the launcher: the same process
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 75, output[-5000:]
    assert "Traceback" not in output and "exitcode" not in output, output[-5000:]
    last = output.strip().splitlines()[-2]  # before the line that names curves.png
    if stop == "time":
        assert last.startswith("stopped for time; run again to continue: step "), output[-3000:]
    else:
        expected = rf"stopped by {stop} at step \d+: checkpoint saved, run the same command to continue"
        assert re.fullmatch(expected, last), output[-3000:]


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_orphan_and_the_rerun_ends_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of the process group of NUM_PROCESSES=2 scripts/run_local.sh (a notebook kernel's restart)
    misses its training processes, each in a session of its own: they notice within seconds, save a
    checkpoint, release the folder and end; the same run then continues to the end of one never stopped."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = [*SIGNAL_RUN, "--mixed_precision", "no"]
    output_dir, log = tmp_path / "run", tmp_path / "launch.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            ["bash", "scripts/run_local.sh", *args, "--output_dir", str(output_dir)],
            cwd=PROJECT,
            env=two_cpu_processes_env(),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a notebook's command or a terminal's job
        )
    wait_for_checkpoint(output_dir, process)
    training = psutil.Process(process.pid).children()
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    _, alive = psutil.wait_procs(training, timeout=60)  # ended (a zombie: ended, its new parent slow to reap)
    assert all(child.status() == psutil.STATUS_ZOMBIE for child in alive), log.read_text()[-3000:]
    assert len(training) == 2 and (output_dir / ".lock").read_text() == "", log.read_text()[-3000:]
    (session,) = sessions_of(output_dir)
    assert session["ending"] == "stopped by the launcher's death", log.read_text()[-3000:]
    assert log.read_text().count("is gone: stopping") == 1, log.read_text()[-3000:]
    stopped = session["end_step"]
    last = log.read_text().splitlines()[-2]  # before the line that names curves.png
    assert last.startswith(f"stopped by the launcher's death at step {stopped}: checkpoint saved"), last
    end = ["--max_steps", str(stopped + 10)]  # 10 steps more: enough to compare
    resumed = run_training(output_dir, *args, *end, processes=2)
    assert f"resuming from {output_dir / 'checkpoints' / f'step_{stopped:08d}'}" in resumed.stdout
    run_training(tmp_path / "reference", *args, *end, processes=2)
    assert_same_run(output_dir, tmp_path / "reference")


# A sitecustomize that holds each training process of a launch at its start (where it imports torch) once it
# has written its pid: time for the test to kill the launcher before the process knows its parent.
SLOW_START = """
import os, time
if "TORCHELASTIC_RUN_ID" in os.environ:  # a training process, not the launcher
    with open(os.environ["STARTED_PIDS"], "a") as file:
        file.write(f"{os.getpid()}\\n")
    time.sleep(3)
"""


@pytest.mark.slow
def test_a_launcher_killed_while_its_processes_start_leaves_no_orphan(tmp_path: Path) -> None:
    """kill -9 of NUM_PROCESSES=2 scripts/run_local.sh while its training processes are still starting (as
    they import torch): adopted before they could look at their parent, they would wait for ever on the
    launcher's rendezvous. They end within seconds of their start-up, saying so once, nothing written."""
    hook, started = tmp_path / "hook", tmp_path / "started"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_START)
    env = two_cpu_processes_env() | {"STARTED_PIDS": str(started), "PYTHONPATH": str(hook)}
    output_dir, log = tmp_path / "run", tmp_path / "launch.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            ["bash", "scripts/run_local.sh", *SIGNAL_RUN, "--output_dir", str(output_dir)],
            cwd=PROJECT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while len(started.read_text().split() if started.exists() else []) < 2:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    training = [psutil.Process(int(pid)) for pid in started.read_text().split()]
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    try:
        _, alive = psutil.wait_procs(training, timeout=120)  # a zombie: ended, its new parent slow to reap
        assert all(child.status() == psutil.STATUS_ZOMBIE for child in alive), log.read_text()[-3000:]
    finally:
        for child in training:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    said = re.findall(r"the launcher \(pid \d+\) is gone: stopping", log.read_text())
    assert len(said) == 1 and not output_dir.exists(), log.read_text()[-3000:]
