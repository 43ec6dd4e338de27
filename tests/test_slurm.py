"""The generated project on a real SLURM (slurmctld + slurmd + munge on this machine): submission,
preemption, requeue and exact resume, on one process, two tasks of one node, and two nodes.

Opt-in, about 15 minutes, as root (it installs Debian's slurm packages if needed and starts the daemons):

    python -m pytest tests/test_slurm.py --run-slurm

Not part of `.ci/run`: the suite already takes most of its 40-minute budget. The cluster is
tests/slurm/setup_slurm.sh (Slurm 22.05, no cgroups, no GPUs), with jobs allowed to share CPUs so that
the scenarios run side by side. One liberty is taken with Slurm: a requeued job waits about 2 minutes
before it may start again (its BeginTime); the tests release it after 20 s with `scontrol update
StartTime=now`. Everything else is what a user gets: `sbatch scripts/run_slurm.sh`, Slurm's own signals.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from .conftest import Render, run

# One xdist worker for all of them: one SLURM daemon for the machine.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

SETUP = Path(__file__).parent / "slurm" / "setup_slurm.sh"
# 440 optimizer steps of the digits example, checkpoints every 20: long enough to signal mid-run.
RUN = ["--num_epochs", "20", "--log_every", "5", "--checkpoint_every", "20", "--keep_checkpoints", "2"]
# Over 2 minutes of training here (250 steps/s): a 2-minute time limit must stop and requeue it.
LONG_RUN = ["--num_epochs", "800", "--log_every", "10", "--checkpoint_every", "200"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def cluster_problem() -> str | None:
    if os.geteuid() != 0:
        return "starting slurmctld, slurmd and munge needs root"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "no Slurm installed and no apt-get to install Debian's packages"
    return None


def start_cluster(nodes: int) -> None:
    env = {**os.environ, "SLURM_NODES": str(nodes), "SLURM_OVERSUBSCRIBE": "12", "SLURM_CLEAN_STATE": "1"}
    result = run(["bash", str(SETUP)], cwd=SETUP.parent, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def job_env() -> dict[str, str]:
    """What sbatch passes on to the job: this interpreter, its packages, one thread per process (the same
    thread count as the local references, so the same sums), nothing of an outer SLURM job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "PYTEST_"))}
    return {
        **env,
        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        "PYTHON": sys.executable,
        "SKIP_INSTALL": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


class Job:
    """One submitted job of the project: its state, log and outputs."""

    def __init__(self, project: Path, name: str, job_id: str, output_dir: Path) -> None:
        self.project, self.name, self.id, self.output_dir = project, name, job_id, output_dir

    def info(self) -> dict[str, str]:
        shown = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True)
        return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))

    def log(self) -> str:
        path = self.project / f"slurm-{self.name}-{self.id}.out"  # scripts/run_slurm.sh: slurm-%x-%j.out
        return path.read_text(errors="replace") if path.exists() else ""

    def explain(self) -> str:
        info = self.info()
        return f"job {self.id}: {info.get('JobState')} restarts {info.get('Restarts')}\n{self.log()[-6000:]}"

    def wait(self, done: Callable[[dict[str, str]], bool], timeout: float) -> dict[str, str]:
        """Poll until `done(info)`; a requeued job waiting for its BeginTime is released after 20 s (a job
        released at once may start before its last incarnation's processes are gone: "credential revoked")."""
        deadline = time.monotonic() + timeout
        waiting_since = None
        while True:
            info = self.info()
            if done(info):
                return info
            waiting = info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
            waiting_since = (waiting_since or time.monotonic()) if waiting else None
            if waiting_since and time.monotonic() - waiting_since > 20:
                release = ["scontrol", "update", f"JobId={self.id}", "StartTime=now"]
                subprocess.run(release, capture_output=True)
            assert time.monotonic() < deadline, f"timed out\n{self.explain()}"
            time.sleep(1)

    def finish(self, timeout: float = 900) -> dict[str, str]:
        return self.wait(lambda info: info.get("JobState") in ENDED, timeout)

    def wait_for_step(self, step: int, timeout: float = 600) -> None:
        """Until training has logged optimizer step `step` (it is running, mid-way)."""
        metrics = self.output_dir / "metrics.jsonl"

        def logged(info: dict[str, str]) -> bool:
            assert info.get("JobState") not in ENDED, f"ended before step {step}\n{self.explain()}"
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            try:
                return bool(lines) and json.loads(lines[-1])["step"] >= step
            except (ValueError, KeyError):
                return False

        self.wait(logged, timeout)


def sbatch(project: Path, name: str, options: list[str], args: list[str]) -> Job:
    output_dir = project.parent / "runs" / name
    command = ["sbatch", "--parsable", f"--job-name={name}", *options, "scripts/run_slurm.sh", *args]
    result = run([*command, "--output_dir", str(output_dir)], cwd=project, env=job_env())
    assert result.returncode == 0, result.stdout + result.stderr
    return Job(project, name, result.stdout.strip().split(";")[0], output_dir)


def weights(output_dir: Path) -> str:
    return hashlib.sha256((output_dir / "model" / "model.safetensors").read_bytes()).hexdigest()


def reference(project: Path, name: str, args: list[str], processes: int) -> str:
    """The uninterrupted run outside SLURM (same config, same thread count): the final weights' hash."""
    output_dir = project.parent / "references" / name
    env = {**job_env(), "PYTHONPATH": str(project / "src")}
    train = ["train.py", "--config", "configs/slurm.yaml", "--mixed_precision", "no", *args]
    command = [sys.executable, *train]
    if processes > 1:
        env["ACCELERATE_USE_CPU"] = "1"
        port = ["--main_process_port", str(29000 + os.getpid() % 500)]
        command = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes), *port, *train]
    result = run([*command, "--output_dir", str(output_dir)], cwd=project, env=env, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return weights(output_dir)


# --- scenarios: each runs in its own thread, all at once; the tests below check their results.


def submitted_as_the_readme_says(project: Path) -> Job:
    """`sbatch scripts/run_slurm.sh` on the "login node", with no options but the script's own."""
    job = sbatch(project, "train", [], RUN)
    job.finish()
    return job


def preempted(how: list[str], options: tuple[str, ...] = (), name: str = "") -> Callable[[Path], Job]:
    """A job signalled mid-run by `how` (a command; JOB stands for its id)."""

    def scenario(project: Path) -> Job:
        job = sbatch(project, name, list(options), RUN)
        job.wait_for_step(60)
        result = run([part.replace("JOB", job.id) for part in how], cwd=project)
        assert result.returncode == 0, result.stdout + result.stderr
        info = job.finish()
        if info.get("JobState") != "COMPLETED" and int(info.get("Restarts", "0")) == 0:
            # scancel cancels the job itself: requeue it by hand, as after a node failure.
            subprocess.run(["scontrol", "requeue", job.id], check=True)
            job.wait(lambda info: info.get("Restarts", "0") != "0", 60)
            job.finish()
        return job

    return scenario


def killed_like_a_dead_node(project: Path) -> Job:
    """Every process of the job SIGKILLed at once (the launcher and training: a node that died), after a
    checkpoint; then `scontrol requeue`, as Slurm does for a failed node."""
    job = sbatch(project, "hardkill", [], RUN)
    job.wait_for_step(70)
    # Not "--output_dir ...": pkill would read a pattern starting with dashes as its own option.
    subprocess.run(["pkill", "-KILL", "-f", f"output_dir {job.output_dir}$"], check=False)
    info = job.finish()
    assert info.get("JobState") != "COMPLETED", job.explain()
    subprocess.run(["scontrol", "requeue", job.id], check=True)
    job.wait(lambda info: info.get("Restarts", "0") != "0", 60)
    job.finish()
    return job


def time_limited(project: Path) -> Job:
    job = sbatch(project, "timelimit", ["--time=2", "--signal=B:USR1@60"], LONG_RUN)
    job.finish(timeout=1800)
    return job


SINGLE_NODE = {
    "submit": submitted_as_the_readme_says,
    "usr1_batch": preempted(["scancel", "--signal=USR1", "--batch", "JOB"], name="usr1batch"),
    "usr1_step": preempted(["scancel", "--signal=USR1", "JOB"], name="usr1step"),
    "requeue": preempted(["scontrol", "requeue", "JOB"], name="requeue"),
    "scancel_kill": preempted(["scancel", "--signal=KILL", "JOB"], name="scancelkill"),
    "hard_kill": killed_like_a_dead_node,
    "two_tasks": preempted(
        ["scancel", "--signal=USR1", "--batch", "JOB"], ("--ntasks-per-node=2",), name="twotasks"
    ),
    "time_limit": time_limited,
}


@pytest.fixture(scope="module")
def project(request: pytest.FixtureRequest, render: Callable[..., Render]) -> Iterator[Path]:
    if not request.config.getoption("--run-slurm"):
        pytest.skip("real SLURM, about 15 minutes: python -m pytest tests/test_slurm.py --run-slurm")
    if problem := cluster_problem():
        pytest.skip(problem)
    yield render().path
    run(["bash", str(SETUP), "stop"], cwd=SETUP.parent)


@pytest.fixture(scope="module")
def references(project: Path) -> Iterator[dict[str, Future[str]]]:
    pool = ThreadPoolExecutor(3)
    yield {
        "one": pool.submit(reference, project, "one", RUN, 1),
        "two": pool.submit(reference, project, "two", RUN, 2),
        "long": pool.submit(reference, project, "long", LONG_RUN, 1),
    }
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def single_node(project: Path) -> Iterator[dict[str, Future[Job]]]:
    start_cluster(nodes=1)
    pool = ThreadPoolExecutor(len(SINGLE_NODE))
    futures = {name: pool.submit(scenario, project) for name, scenario in SINGLE_NODE.items()}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def assert_resumed_exactly(job: Job, expected: str) -> None:
    info = job.info()
    assert info.get("JobState") == "COMPLETED", job.explain()
    assert int(info.get("Restarts", "0")) >= 1, job.explain()
    assert "resuming from " in job.log(), job.explain()
    assert weights(job.output_dir) == expected, job.explain()


def test_submitted_job_trains_to_completion_and_shows_its_decisions(
    single_node: dict[str, Future[Job]], references: dict[str, Future[str]]
) -> None:
    job = single_node["submit"].result()
    assert job.info().get("JobState") == "COMPLETED", job.explain()
    log = job.log()
    for decision in ("platform: slurm", "GPUs: none", "processes: 1", "precision: no", "launch: srun"):
        assert f"run_slurm: {decision}" in log, job.explain()
    assert "run_slurm: done: training finished" in log
    assert weights(job.output_dir) == references["one"].result()


@pytest.mark.parametrize("name", ["usr1_batch", "usr1_step", "requeue", "scancel_kill", "hard_kill"])
def test_preempted_job_requeues_and_resumes_bitwise(
    name: str, single_node: dict[str, Future[Job]], references: dict[str, Future[str]]
) -> None:
    """scancel --signal=USR1 --batch (the batch process), scancel --signal=USR1 (the step only),
    scontrol requeue, scancel --signal=KILL, and a SIGKILL of every process: the job comes back and ends
    with the weights of an uninterrupted run."""
    job = single_node[name].result()
    assert_resumed_exactly(job, references["one"].result())
    if name in ("usr1_batch", "usr1_step"):  # the job requeued itself
        assert "requeue: training stopped after a checkpoint (steps 0 -> " in job.log(), job.explain()
    if name == "hard_kill":
        assert "checkpoint" in job.log()


def test_two_tasks_of_one_node_preempted_resume_bitwise(
    single_node: dict[str, Future[Job]], references: dict[str, Future[str]]
) -> None:
    job = single_node["two_tasks"].result()
    assert "run_slurm: processes: 2 (the job's tasks per node)" in job.log(), job.explain()
    assert "world size 2" in job.log()
    # The batch process passed the stop on as SIGUSR1 and both processes saved a checkpoint at it.
    assert "requeue: training stopped after a checkpoint (steps 0 -> " in job.log(), job.explain()
    assert_resumed_exactly(job, references["two"].result())


def test_time_limit_warning_requeues_until_done(
    single_node: dict[str, Future[Job]], references: dict[str, Future[str]]
) -> None:
    """--time=2 --signal=B:USR1@60 on a run longer than 2 minutes: stopped before the limit, requeued by
    the job itself, and finally the weights of an uninterrupted run."""
    job = single_node["time_limit"].result()
    assert "run_slurm: SIGUSR1: asking training to save a checkpoint and stop" in job.log(), job.explain()
    assert_resumed_exactly(job, references["long"].result())


@pytest.fixture(scope="module")
def two_nodes(project: Path, single_node: dict[str, Future[Job]]) -> Job:
    for future in single_node.values():  # the single-node cluster goes away below
        future.exception()
    start_cluster(nodes=2)
    job = preempted(["scancel", "--signal=USR1", "--batch", "JOB"], ("--nodes=2",), name="twonodes")(project)
    return job


def test_two_nodes_preempted_resume_bitwise(two_nodes: Job, references: dict[str, Future[str]]) -> None:
    """Two slurmd posing as two nodes (both on loopback): one accelerate launch per node with its machine
    rank, preempted and requeued, equal to 2 processes on one machine."""
    log = two_nodes.log()
    assert "run_slurm: nodes: 2 (1 process(es) per node, 2 in total)" in log, two_nodes.explain()
    assert "--machine_rank" in log and "world size 2" in log
    assert "requeue: training stopped after a checkpoint (steps 0 -> " in log, two_nodes.explain()
    assert_resumed_exactly(two_nodes, references["two"].result())
