"""Platform detection, device facts from a faked nvidia-smi, output folders that survive the session."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest
import torch
from packaging.version import Version

from {{ cookiecutter.package_name }}.utils.config import ConfigError
from {{ cookiecutter.package_name }}.utils.machine import hardware
from {{ cookiecutter.package_name }}.utils.machine.hardware import (
    Gpu,
    check_output_dir,
    detect_platform,
    precision_for,
    query_gpus,
)
from {{ cookiecutter.package_name }}.utils.run.cli import read_config

from .conftest import PROJECT, free_port, run_training, start_line

PLATFORM_VARIABLES = ("COLAB_RELEASE_TAG", "COLAB_GPU", "KAGGLE_KERNEL_RUN_TYPE", "SLURM_JOB_ID")
T4 = "Tesla T4, 7.5"
A100 = "NVIDIA A100-SXM4-40GB, 8.0"
P100 = "Tesla P100-PCIE-16GB, 6.0"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*PLATFORM_VARIABLES, "CUDA_VISIBLE_DEVICES", "SLURM_TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def fake_nvidia_smi(directory: Path, *lines: str) -> Path:
    """A stand-in nvidia-smi that answers the --query-gpu call with `lines`."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(f"'{line}'" for line in lines) + "\n")
    script.chmod(0o755)
    return directory


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, "local"),
        ({"COLAB_RELEASE_TAG": "release-colab_20260101"}, "colab"),
        ({"COLAB_GPU": "1"}, "colab"),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "kaggle"),
        ({"SLURM_JOB_ID": "4242"}, "slurm"),
    ],
)
def test_detect_platform(clean_env: pytest.MonkeyPatch, variables: dict[str, str], expected: str) -> None:
    for name, value in variables.items():
        clean_env.setenv(name, value)
    assert detect_platform() == expected


@pytest.mark.parametrize(
    ("lines", "names", "precision"),
    [
        ([T4], ["Tesla T4"], "fp16"),
        ([A100], ["NVIDIA A100-SXM4-40GB"], "bf16"),
        ([T4, T4], ["Tesla T4", "Tesla T4"], "fp16"),
        ([A100, T4], ["NVIDIA A100-SXM4-40GB", "Tesla T4"], "fp16"),  # the weakest GPU decides
        ([P100], ["Tesla P100-PCIE-16GB"], "fp16"),
    ],
)
def test_gpu_facts_and_precision_from_nvidia_smi(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, lines: list[str], names: list[str], precision: str
) -> None:
    clean_env.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', *lines)}{os.pathsep}{os.environ['PATH']}")
    gpus = query_gpus()[0]
    assert [gpu.name for gpu in gpus] == names
    assert precision_for(gpus)[0] == precision


def test_gpu_facts_respect_cuda_visible_devices(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', T4, A100)}{os.pathsep}{os.environ['PATH']}")
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert query_gpus()[0] == [Gpu("NVIDIA A100-SXM4-40GB", (8, 0))]


def test_no_nvidia_smi_means_cpu(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("PATH", str(tmp_path))  # nothing there
    assert query_gpus()[0] == []
    assert precision_for([])[0] == "no"


@pytest.mark.parametrize(
    ("arch_list", "gpu", "refused"),
    [
        (["sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"], (6, 0), False),  # a CUDA 12.6 build: P100
        (["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], (6, 0), True),  # CUDA 12.8: no sm_60
        (["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], (7, 5), False),  # its T4
        (["sm_80"], (8, 6), False),  # sm_80 kernels run on 8.6 (same major, newer minor)
        (["sm_86"], (8, 0), True),  # but not on an older minor
        (["sm_80", "sm_90a"], (10, 0), True),  # nor on another major
        (["sm_80", "compute_90"], (10, 0), False),  # PTX is compiled for newer GPUs
        ([], (7, 5), True),
        (["gfx90a"], (9, 0), True),  # ROCm's names
    ],
)
def test_a_gpu_is_refused_where_this_pytorch_has_no_kernels_for_it(
    arch_list: list[str], gpu: tuple[int, int], refused: bool
) -> None:
    problem = hardware.unsupported_gpu([Gpu("Tesla P100-PCIE-16GB", gpu)], arch_list)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith(f"Tesla P100-PCIE-16GB (compute {gpu[0]}.{gpu[1]}) has no kernels in this")
        assert f"install one with sm_{gpu[0]}{gpu[1]}" in problem and "GPU T4 x2" in problem, problem
    assert hardware.unsupported_gpu([], []) is None  # no GPU: nothing to refuse


# A sitecustomize that makes torch see a P100 it has no kernels for (a CUDA 12.8 build), as on Kaggle.
P100_TORCH = """import torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda device=None: (6, 0)
torch.cuda.get_arch_list = lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
"""


def test_train_py_refuses_a_gpu_this_pytorch_has_no_kernels_for_in_one_line(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Kaggle's P100 with a torch built without sm_60: train.py stops at its start, before anything touches
    CUDA, with the one line that says what to install or choose (issue 55)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(P100_TORCH)
    hooked = [str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")]
    clean_env.setenv("PYTHONPATH", os.pathsep.join(hooked))
    clean_env.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', P100)}{os.pathsep}{os.environ['PATH']}")
    clean_env.delenv("ACCELERATE_USE_CPU", raising=False)
    result = run_training(tmp_path / "run", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: Tesla P100-PCIE-16GB (compute 6.0) has no kernels in this PyTorch"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("torch_new_enough", "precision"), [(True, "fp16"), (False, "no")])
def test_fp16_runs_on_mps_where_accelerate_supports_it(
    clean_env: pytest.MonkeyPatch, torch_new_enough: bool, precision: str
) -> None:
    clean_env.delenv("ACCELERATE_USE_CPU", raising=False)
    clean_env.setattr(torch.backends.mps, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    clean_env.setattr(accelerate.utils, "is_torch_version", lambda operation, version: torch_new_enough)
    with pytest.warns(UserWarning, match="on MPS") if precision == "no" else contextlib.nullcontext():
        assert hardware.resolve_mixed_precision("fp16")[0] == precision
    clean_env.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="running in fp32 on the CPU"):
        assert hardware.resolve_mixed_precision("fp16") == ("no", "fp16 needs a GPU")


@pytest.mark.parametrize("entry", ["train.py", "predict.py", "-m {{ cookiecutter.package_name }}.launch"])
def test_native_windows_is_refused_in_one_line_before_anything_loads(entry: str) -> None:
    """Each entry point run as Python runs it, with sys.platform as on Windows: exit 2, one line, no
    traceback (the package's __init__ refuses, before torch or fcntl load)."""
    module = entry.removeprefix("-m ")
    run = f"run_module('{module}'" if module != entry else f"run_path('{entry}'"
    code = f"import runpy, sys; sys.platform = 'win32'; runpy.{run}, run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": "src"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 2, result
    assert (
        result.stderr == "native Windows is not supported: run this project under WSL (docs/platforms.md)\n"
    )
    assert result.stdout == ""


@pytest.mark.parametrize(("use_cpu", "hidden"), [("1", True), ("true", True), ("0", False), (None, False)])
def test_a_cpu_run_hides_the_gpus(clean_env: pytest.MonkeyPatch, use_cpu: str | None, hidden: bool) -> None:
    """ACCELERATE_USE_CPU as Accelerate reads it; the GPUs are hidden through CUDA's own variable."""
    if use_cpu is None:
        clean_env.delenv("ACCELERATE_USE_CPU", raising=False)
    else:
        clean_env.setenv("ACCELERATE_USE_CPU", use_cpu)
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "0")  # also makes monkeypatch restore it after the test
    hardware.hide_gpus_from_cpu_run()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ("" if hidden else "0")
    assert hardware.cpu_forced() == hidden


@pytest.mark.slow  # trains (single_run)
def test_deterministic_kernels_are_on_unless_turned_off(single_run: tuple, tmp_path: Path) -> None:
    assert "| deterministic kernels on" in single_run[1].stdout
    result = run_training(tmp_path / "run", "--max_steps", "2", "--deterministic", "false")
    assert "| deterministic kernels off" in result.stdout


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
@pytest.mark.parametrize(
    ("cpus", "variables", "expected"),
    [
        (2, {}, "2 (2 CPUs / 1 process)"),
        (2, {"LOCAL_WORLD_SIZE": "2"}, "1 (2 CPUs / 2 processes)"),  # torchrun and accelerate set it
        (1, {"LOCAL_WORLD_SIZE": "2"}, "1 (1 CPU / 2 processes)"),  # as `taskset -c 0` or a 1-CPU SLURM task
        (2, {"OMP_NUM_THREADS": "1"}, "1 (OMP_NUM_THREADS)"),
    ],
)
def test_cpu_threads_follow_the_cpus_and_processes_or_omp_num_threads(
    cpus: int, variables: dict[str, str], expected: str
) -> None:
    """The threads that a process of train.py gets on `cpus` CPUs, and the start line's words for them."""
    if len(os.sched_getaffinity(0)) < cpus:
        pytest.skip(f"needs {cpus} CPUs")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    code = (
        "import os, torch\n"
        f"os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:{cpus}])\n"
        f"from {hardware.__name__} import choose_cpu_threads\n"
        "print(choose_cpu_threads(), '|', torch.get_num_threads())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env | variables, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == f"{expected} | {expected.split()[0]}"


@pytest.mark.slow  # trains (single_run)
def test_the_start_line_names_the_cpu_threads(single_run: tuple) -> None:
    threads, cpus = os.environ.get("OMP_NUM_THREADS"), hardware.usable_cpus()
    expected = (
        f"{threads} (OMP_NUM_THREADS)" if threads else f"{cpus} ({cpus} CPU{'s' * (cpus > 1)} / 1 process)"
    )
    assert f"| CPU threads {expected} |" in single_run[1].stdout


def test_output_dir_checks_per_platform(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setattr(hardware, "COLAB_DRIVE", tmp_path / "MyDrive")  # not mounted
    with pytest.raises(ValueError, match="on Google Drive, which is not mounted"):
        check_output_dir("/content/drive/MyDrive/run", "colab")
    with pytest.raises(ValueError, match="on Google Drive, which is not mounted"):
        check_output_dir("/content/outputs/run", "colab", "/content/drive/MyDrive/run")
    (tmp_path / "MyDrive").mkdir()
    assert check_output_dir("/content/drive/MyDrive/run", "colab") == []
    # The session's disk mirrored to Drive: what configs/colab.yaml does.
    assert check_output_dir("/content/outputs/run", "colab", "/content/drive/MyDrive/run") == []
    assert "nor mirror_dir is on Google Drive" in check_output_dir("/content/outputs", "colab")[0]
    with pytest.raises(ValueError, match="overlap"):
        check_output_dir("/content/outputs", "colab", "/content/outputs/copy")
    assert check_output_dir("/kaggle/working/outputs", "kaggle") == []
    assert "Kaggle keeps only" in check_output_dir("/tmp/outputs", "kaggle")[0]
    clean_env.setenv("SLURM_TMPDIR", str(tmp_path / "node"))
    assert "wiped when the job ends" in check_output_dir(str(tmp_path / "node" / "run"), "slurm")[0]
    assert check_output_dir(str(tmp_path / "node" / "run"), "slurm", str(tmp_path / "home" / "run")) == []
    assert check_output_dir("outputs/run", "local") == []


@pytest.mark.slow  # trains
def test_train_uses_the_detected_platforms_config_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    result = subprocess.run(
        [sys.executable, "train.py", "--output_dir", str(tmp_path / "run"), "--max_steps", "3"],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"platform kaggle | config {PROJECT / 'configs' / 'kaggle.yaml'}" in result.stdout
    assert "WARNING: output_dir" in result.stdout and "Kaggle keeps only" in result.stdout


@pytest.mark.parametrize(
    ("platform", "variables", "refused"),
    [
        ("colab", {}, "output_dir /content/outputs/"),
        ("kaggle", {}, "output_dir /kaggle/working/outputs/"),
        ("kaggle", {"COLAB_GPU": "1"}, "output_dir /kaggle/working/outputs/"),
    ],
)
def test_a_platform_config_off_its_platform_is_refused_in_one_line(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, platform: str, variables: dict[str, str], refused: str
) -> None:
    """`python train.py --config configs/colab.yaml` on a laptop (or kaggle.yaml on Colab) would write that
    platform's folders at this disk's root: one `config error:` line, before torch loads, says the ways
    out. With this machine's paths in their place (what the line proposes) the same config is read."""
    env = {key: value for key, value in os.environ.items() if key not in PLATFORM_VARIABLES} | variables
    config = f"configs/{platform}.yaml"
    command = [sys.executable, "train.py", "--config", config]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"config error: {config}: {refused}"), line
    assert f"a {platform.capitalize()} folder" in line, line
    assert f"run it on {platform.capitalize()}, use --config configs/" in line, line
    assert "--output_dir <folder> --mirror_dir '' --import_from ''" in line and "ANY_PLATFORM=1" in line, line
    assert "loading PyTorch" not in result.stdout

    for name, value in variables.items():
        clean_env.setenv(name, value)
    paths = ["--output_dir", str(tmp_path / "run"), "--mirror_dir", "", "--import_from", ""]
    read, _, _ = read_config(["--config", config, *paths], PROJECT)
    assert read.output_dir == str(tmp_path / "run") and read.mirror_dir == read.import_from == ""
    with pytest.raises(ConfigError, match="ANY_PLATFORM=1"):
        read_config(["--config", config, "--output_dir", str(tmp_path / "run")], PROJECT)  # the other paths
    clean_env.setenv("ANY_PLATFORM", "1")
    assert read_config(["--config", config, "--output_dir", str(tmp_path / "run")], PROJECT)[0].import_from


def test_colab_without_drive_stops_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20260101")
    result = subprocess.run(
        [sys.executable, "train.py"], cwd=PROJECT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 1
    assert "colab.yaml: mirror_dir /content/drive/MyDrive/" in result.stderr
    assert "which is not mounted" in result.stderr


SHORT = ["--max_steps", "4", "--log_every", "2", "--checkpoint_every", "4"]


def launch_with(config_file: str, output_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`accelerate launch --config_file configs/accelerate/<config_file> train.py`, as a user types it."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [f"configs/accelerate/{config_file}", "--main_process_port", str(free_port())]
    command += ["train.py", "--config", "configs/local.yaml", "--output_dir", str(output_dir), *SHORT]
    return subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs this launch is a real DDP run")
def test_processes_that_do_not_communicate_are_refused(tmp_path: Path) -> None:
    """multi_gpu.yaml on a machine without GPUs (and without ACCELERATE_USE_CPU): from Accelerate 1.13 the
    2 processes each form a group of one and would both train alone into one folder, so train.py refuses,
    as predict.py does. Accelerate before 1.13 joins them into one gloo group itself: a real 2-process run."""
    env = {name: value for name, value in os.environ.items() if name != "ACCELERATE_USE_CPU"}
    result = launch_with("multi_gpu.yaml", tmp_path / "run", env)
    if Version(accelerate.__version__) < Version("1.13"):
        assert result.returncode == 0, result.stderr[-3000:]
        started = start_line(result.stdout)
        assert (started["world size"], started["distributed"]) == ("2", "MULTI_CPU")
        return
    assert result.returncode != 0
    assert (
        "config error: 2 processes were started but they do not communicate (world size 1)" in result.stderr
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_launch_that_asked_for_fsdp_and_got_cpu_processes_trains(tmp_path: Path) -> None:
    """ACCELERATE_USE_CPU=1 with fsdp.yaml runs plain multi-CPU DDP, which the start line names. Before
    torch 2.6 (no FSDP2 there) Accelerate stops the launch with an ImportError, before anything is written."""
    result = launch_with("fsdp.yaml", tmp_path / "run", {**os.environ, "ACCELERATE_USE_CPU": "1"})
    if Version(torch.__version__) < Version("2.6"):
        assert result.returncode != 0
        assert "ImportError" in result.stderr
        assert not (tmp_path / "run").exists()
        return
    assert result.returncode == 0, result.stderr[-3000:]
    started = start_line(result.stdout)
    assert (started["world size"], started["distributed"]) == ("2", "MULTI_CPU")
