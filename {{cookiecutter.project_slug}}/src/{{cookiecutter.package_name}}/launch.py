"""Start training on this machine or a cluster: each launch decision printed with its reason, then the run
(docs/platforms.md, docs/slurm.md). Standard library only: this runs before anything is installed.
scripts/run_<platform>.sh run it from the project root; without bash (after `pip install -e .`):

    python -m {{ cookiecutter.package_name }}.launch local|colab|kaggle|slurm [--field value ...]"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .utils.checkpoints.durable import write_atomically
from .utils.machine.hardware import Gpu, precision_for, query_gpus, wrong_platform
from .utils.machine.packages import declared
from .utils.training.signals import EXIT_STOPPED, LAUNCHER_PID

PLATFORMS = ("local", "colab", "kaggle", "slurm")
# Signals the multi-process launcher forwards to its workers instead of dying (SIGUSR1: SLURM's warning,
# read from PET_SIGNALS_TO_HANDLE by torch >= 2.10; older launchers forward the others only).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# Where train.py's main process reports how it ended, for the SLURM launcher's requeue decision.
OUTCOME_FILE = "TRAIN_OUTCOME_FILE"


class LaunchError(Exception):
    """A launch that cannot go ahead, in one line that says what to do."""


def interpreter() -> str:
    """The Python that trains and installs: $PYTHON (the scripts start this launcher with it), else this."""
    return os.environ.get("PYTHON") or sys.executable


def say(platform: str, text: str) -> None:
    print(f"run_{platform}: {text}", flush=True)


def check_platform(platform: str) -> str:
    """Refuse a Colab or Kaggle launcher elsewhere: it would write that platform's paths on this disk."""
    if here := wrong_platform(platform):
        raise LaunchError(
            f"scripts/run_{platform}.sh is for {platform.capitalize()}, but this machine is {here}: use "
            f"scripts/run_{'slurm' if here == 'slurm' else 'local'}.sh, or set ANY_PLATFORM=1 to use "
            f"configs/{platform}.yaml here anyway"
        )
    return f"platform: {platform} (project {Path.cwd()})"


def slurm_tasks_per_node() -> int | None:
    """Tasks per node the job asked for (--ntasks-per-node, or --ntasks spread evenly), None if 1."""
    text = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    counts = {int(match) for match in re.findall(r"(\d+)(?:\(x\d+\))?", text)}
    if len(counts) > 1:
        raise LaunchError(
            f"the job has different task counts per node (SLURM_TASKS_PER_NODE={text}): ask for "
            "--ntasks-per-node instead of --ntasks"
        )
    return counts.pop() if counts and max(counts) > 1 else None


def choose_processes(gpus: list[Gpu], platform: str) -> tuple[int, str]:
    """Processes on this machine (per node on SLURM), and why."""
    requested = os.environ.get("NUM_PROCESSES", "")
    source = "NUM_PROCESSES"
    if not requested and platform == "slurm" and (tasks := slurm_tasks_per_node()):
        requested = str(tasks)
        source = "the job's tasks per node"
    if requested:
        if not requested.isdigit() or int(requested) < 1:
            raise LaunchError(f"NUM_PROCESSES must be a positive integer, not '{requested}'")
        if gpus and int(requested) > len(gpus):
            raise LaunchError(
                f"{source} asks for {requested} processes but only {len(gpus)} GPU(s) are visible: one "
                "process per GPU at most"
            )
        return int(requested), f"processes: {requested} ({source})"
    if gpus:
        return len(gpus), f"processes: {len(gpus)} (one per GPU)"
    return 1, "processes: 1 (CPU only; NUM_PROCESSES=2 starts 2 CPU processes that talk over gloo)"


def last_flag_value(flag: str, args: list[str]) -> str | None:
    """The value of the last `FLAG value` or `FLAG=value` in args."""
    found = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            found = args[index + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def choose_precision(gpus: list[Gpu], args: list[str]) -> tuple[str, str]:
    """The mixed precision (a --mixed_precision of yours, else the hardware's), and the decision line."""
    hardware, reason = precision_for(gpus)
    if chosen := last_flag_value("--mixed_precision", args):
        reason = f"your --mixed_precision; the hardware suggests {hardware}: {reason}"
    return chosen or hardware, f"precision: {chosen or hardware} ({reason})"


def nccl_settings(platform: str, total_processes: int, gpus: list[Gpu]) -> tuple[dict[str, str], str]:
    if total_processes == 1 or not gpus:
        return {}, "NCCL: not used (a single process, or CPU processes on gloo)"
    if platform == "kaggle":
        # NCCL's peer-to-peer transport hangs between Kaggle's two T4s: traffic goes through host memory
        # instead (slower, never stuck). Your own NCCL_P2P_DISABLE wins.
        value = os.environ.get("NCCL_P2P_DISABLE", "1")
        line = f"NCCL: NCCL_P2P_DISABLE={value} (P2P between Kaggle's T4s can hang)"
        return {"NCCL_P2P_DISABLE": value}, line
    return {}, "NCCL: library defaults"


def train_args(platform: str, precision: str, args: list[str]) -> tuple[list[str], str]:
    config = f"configs/{platform}.yaml"
    chosen = last_flag_value("--config", args)
    how = "instead of" if Path(chosen or "").stem in PLATFORMS else "read over"  # a platform's file, or yours
    line = f"config: {chosen} (your --config, {how} {config})" if chosen else f"config: {config}"
    return ["train.py", "--config", config, "--mixed_precision", precision, *args], line


def missing_dependencies(pyproject: Path) -> list[str]:
    """pyproject.toml's dependencies not installed, or outside their requirement (from metadata alone)."""
    from importlib import metadata

    # pip's own copy: nothing else may be installed yet.
    from pip._vendor.packaging.requirements import Requirement

    missing = []
    for text in declared(pyproject):
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate():
            continue  # for another system
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(text)
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            missing.append(f"{text} (installed: {installed})")
    return missing


def install_missing(platform: str) -> None:
    """`pip install -e .` when a dependency is missing, the installed torch pinned (Colab's stays)."""
    if os.environ.get("SKIP_INSTALL") == "1":
        say(platform, "install: skipped (SKIP_INSTALL=1)")
        return
    missing = missing_dependencies(Path("pyproject.toml"))
    if not missing:
        say(platform, "install: nothing to do (every dependency of pyproject.toml is installed)")
        return
    say(platform, f"install: missing {'; '.join(missing)}")
    from importlib import metadata

    command = [interpreter(), "-m", "pip", "install", "-e", "."]
    try:
        command.append(f"torch=={metadata.version('torch')}")
        say(platform, f"install: {shlex.join(command[2:])}: the installed torch stays")
    except metadata.PackageNotFoundError:
        say(
            platform,
            "install: torch is not installed, so pip installs its default build (install the torch "
            "build you want first to choose it)",
        )
    # pip's own lines (dozens) would bury the decisions in a notebook cell: shown only when it fails.
    say(platform, "install: running pip (its output is shown if it fails)")
    started = time.monotonic()
    installed = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if installed.returncode != 0:
        print((installed.stdout + installed.stderr).strip()[-4000:], file=sys.stderr, flush=True)
        raise LaunchError(
            "pip install failed. Without internet (Kaggle: Settings > Internet), install the packages "
            "another way and rerun with SKIP_INSTALL=1."
        )
    say(platform, f"install: done in {time.monotonic() - started:.0f} s")


def rendezvous_port() -> tuple[int, str]:
    """MAIN_PROCESS_PORT, else a TCP port nobody listens on now: two runs on a machine must not share one."""
    if chosen := os.environ.get("MAIN_PROCESS_PORT"):
        return int(chosen), "MAIN_PROCESS_PORT"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1], "free now"


def accelerate_command(
    processes: int, precision: str, port: int, nodes: int = 1, head: str = ""
) -> list[str]:
    """`accelerate launch` for several processes; with `head`, on several nodes ($SLURM_NODEID)."""
    machine = ["--machine_rank", "$SLURM_NODEID", "--main_process_ip", head] if head else []
    options = {
        "--num_processes": processes,
        "--num_machines": nodes,
        "--main_process_port": port,
        "--mixed_precision": precision,
        "--dynamo_backend": "no",
    }
    flags = [str(part) for option in options.items() for part in option]
    return ["accelerate", "launch", "--multi_gpu", *machine, *flags]


def multi_process_env(gpus: list[Gpu], total: int, where: str) -> tuple[dict[str, str], str]:
    env = {"PET_SIGNALS_TO_HANDLE": FORWARDED_SIGNALS}
    if gpus:
        return env, f"distributed: {total} GPU processes on NCCL{where}"
    # Plain --multi_gpu without GPUs starts independent copies that never communicate.
    env["ACCELERATE_USE_CPU"] = "1"
    return env, f"distributed: {total} CPU processes on gloo (ACCELERATE_USE_CPU=1){where}"


def decide(platform: str, args: list[str]) -> dict:
    """Every decision for this machine, printed; the numbers the launch needs."""
    say(platform, check_platform(platform))
    gpus, why_none = query_gpus()
    listed = f"{len(gpus)} x {', '.join(str(gpu) for gpu in gpus)}"
    say(platform, f"GPUs: {listed}" if gpus else f"GPUs: none ({why_none}): CPU only")
    processes, line = choose_processes(gpus, platform)
    say(platform, line)
    nodes = 1
    if platform == "slurm":
        nodes = int(os.environ.get("SLURM_NNODES", "1"))
        say(platform, f"nodes: {nodes} ({processes} process(es) per node, {processes * nodes} in total)")
    precision, line = choose_precision(gpus, args)
    say(platform, line)
    nccl_env, line = nccl_settings(platform, processes * nodes, gpus)
    say(platform, line)
    command, line = train_args(platform, precision, args)
    say(platform, line)
    install_missing(platform)
    return {
        "gpus": gpus,
        "processes": processes,
        "nodes": nodes,
        "precision": precision,
        "env": nccl_env,
        "train": command,
    }


def launch_here(platform: str, args: list[str]) -> None:
    """Colab, Kaggle, a laptop or workstation: decide, then become the training command (never returns)."""
    plan = decide(platform, args)
    env = {**os.environ, **plan["env"]}
    if plan["processes"] == 1:
        command = [interpreter(), *plan["train"]]  # no launcher in between: train.py gets every signal
    else:
        port, why = rendezvous_port()
        extra, line = multi_process_env(plan["gpus"], plan["processes"], f", port {port} ({why})")
        say(platform, line)
        env.update(extra)
        # Through this module's `accelerate` mode (run_accelerate): a stop exits 75, not 1 with a traceback.
        launcher = [interpreter(), "-m", f"{__package__}.launch"]
        command = launcher + accelerate_command(plan["processes"], plan["precision"], port) + plan["train"]
    say(platform, f"launch: {shlex.join(command)}")
    os.execvpe(command[0], command, env)


class StepSignals:
    """Stop signals to the batch process, passed on to the srun step as SIGUSR1: srun passes that on to
    every task, but kills them on a SIGTERM and answers a lone SIGINT with a status report (docs/slurm.md)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.step: subprocess.Popen | None = None
        for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name
        say("slurm", f"{signal.Signals(signum).name}: asking training to save a checkpoint and stop")
        if self.step is not None and self.step.poll() is None:
            self.step.send_signal(signal.SIGUSR1)


def report_outcome(status: str, start_step: int, step: int) -> None:
    """train.py's main process at its end ("finished", "stopped"): how far it got, for a launcher."""
    if path := os.environ.get(OUTCOME_FILE):
        write_atomically(Path(path), json.dumps({"status": status, "start_step": start_step, "step": step}))


def step_command(plan: dict, port: int) -> tuple[list[str], dict[str, str], str]:
    nodes = plan["nodes"]
    processes = plan["processes"]
    # srun no longer passes the job's CPUs per task down (Slurm >= 22.05): a step without them gets one.
    cpus = os.environ.get("SLURM_CPUS_ON_NODE", "1")
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
    if nodes * processes == 1:
        return [*srun, interpreter(), *plan["train"]], {}, ""
    head = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True, text=True
    ).stdout.split()[0]
    env, line = multi_process_env(plan["gpus"], nodes * processes, f" on {nodes} node(s), head {head}:{port}")
    # torch's launcher SIGKILLs workers 30 s after forwarding a signal: 120 s lets a large model save.
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    launch = accelerate_command(nodes * processes, plan["precision"], port, nodes, head)
    # One task per node; $SLURM_NODEID expands there, in that task.
    per_node = " ".join(part if part.startswith("$") else shlex.quote(part) for part in launch)
    command = [*srun, "--kill-on-bad-exit=1", "bash", "-c", f'exec {per_node} "$@"', "bash", *plan["train"]]
    return command, env, line


def run_slurm_job(args: list[str], signals: StepSignals) -> int:
    """Inside a job: train as an srun step; requeue the job when training stopped after a checkpoint."""
    job = os.environ["SLURM_JOB_ID"]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    say("slurm", f"job {job}, restart {restarts}")
    plan = decide("slurm", args)
    port, why = rendezvous_port()
    command, env, line = step_command(plan, port)
    if line:
        say("slurm", f"{line} (port {why})")

    if signals.received:  # during start-up (pip, say): nothing ran, so the requeued job loses nothing
        status = 1
        outcome = {}
        why = f"{signals.received} arrived before training started"
    else:
        status, outcome = run_step(command, {**os.environ, **plan["env"], **env}, signals)
        if outcome.get("status") == "finished" or (status == 0 and not outcome):
            say("slurm", "done: training finished")
            return 0
        if outcome.get("status") != "stopped" and (signals.received is None or status == 0):
            say("slurm", f"training failed (exit {status}): not requeued")
            return status or 1
        where = (
            f"steps {outcome['start_step']} -> {outcome['step']}" if outcome else "no report from train.py"
        )
        why = f"training stopped after a checkpoint ({where}, exit {status})"
    if outcome.get("step", 0) > outcome.get("start_step", 0) or restarts == 0:
        say(
            "slurm",
            f"requeue: {why}; scontrol requeue {job} (the requeued job continues from the checkpoint)",
        )
        return subprocess.run(["scontrol", "requeue", job]).returncode
    say(
        "slurm",
        f"{why}, without progress since the last requeue: not requeued again, so it cannot loop; resubmit, "
        "with a longer --time if the signal came at once",
    )
    return status or 1


def run_step(command: list[str], env: dict[str, str], signals: StepSignals) -> tuple[int, dict]:
    """Run the srun step; its exit status and what train.py's main process reported ({} if nothing)."""
    with tempfile.TemporaryDirectory(prefix="launch-") as folder:
        outcome = Path(folder) / "outcome.json"
        env[OUTCOME_FILE] = str(outcome)
        say("slurm", f"launch: {shlex.join(command)}")
        signals.step = subprocess.Popen(command, env=env)
        status = signals.step.wait()
        return status, json.loads(outcome.read_text()) if outcome.exists() else {}


def run_accelerate(args: list[str]) -> int:
    """`accelerate launch ARGS` in this process; 75 after a stop (torch's: a traceback, 1)."""
    import torch.distributed.run  # noqa: F401 (creates the loggers quieted below)
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Its log lines on a stop ("Received 2 death signal", "failed (exitcode: 75)") say what train.py says;
    # a real failure still ends in its ChildFailedError report, which names each process's exit.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="launch-") as folder:
        outcome = Path(folder) / "outcome.json"
        os.environ[OUTCOME_FILE] = str(outcome)
        os.environ[LAUNCHER_PID] = str(os.getpid())  # its workers' parent (utils/training/signals.py)
        try:
            launch_command(launch_command_parser().parse_args(args))
        except (SignalException, ChildFailedError):
            if not outcome.exists() or json.loads(outcome.read_text()).get("status") != "stopped":
                raise
            return EXIT_STOPPED
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["accelerate", "launch"]:  # the multi-process command of launch_here
        return run_accelerate(argv[2:])
    # First: a SLURM warning that arrives during start-up must not kill the batch process.
    signals = StepSignals() if argv[:1] == ["slurm"] and "SLURM_JOB_ID" in os.environ else None
    if not argv or argv[0] not in PLATFORMS:
        print(
            f"usage: python -m {__package__}.launch local|colab|kaggle|slurm [train.py arguments]",
            file=sys.stderr,
        )
        return 2
    platform, *args = argv
    try:
        if platform != "slurm":
            launch_here(platform, args)
        if signals is None:
            raise LaunchError(
                "not inside a SLURM job: submit it with `sbatch [options] scripts/run_slurm.sh "
                "[--field value ...]`, with sbatch options such as --gpus-per-node=1 --cpus-per-task=8"
            )
        return run_slurm_job(args, signals)
    except LaunchError as error:
        print(f"run_{platform}: ERROR: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
