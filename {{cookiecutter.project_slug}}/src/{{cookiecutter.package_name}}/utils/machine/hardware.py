"""Where the run landed: platform, devices, and the decisions that follow. Standard library at import (the
launcher runs before anything is installed); GPU facts come from `nvidia-smi` alone (no CUDA initialised)."""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

QUERY = ["--query-gpu=name,compute_cap", "--format=csv,noheader"]


def main_process_of_launch() -> bool:
    """Whether this is the only process or rank 0 of a launch: read from RANK, before torch loads."""
    return os.environ.get("RANK", "0") == "0"


def detect_platform() -> str:
    """`colab`, `kaggle`, `slurm` or `local`, from the environment each platform sets."""
    if "COLAB_RELEASE_TAG" in os.environ or "COLAB_GPU" in os.environ:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
        return "kaggle"
    if "SLURM_JOB_ID" in os.environ:
        return "slurm"
    return "local"


# The folders only Colab's and Kaggle's machines have: their configs write and read there.
PLATFORM_FOLDERS = {"colab": PurePosixPath("/content"), "kaggle": PurePosixPath("/kaggle")}


def wrong_platform(platform: str) -> str | None:
    """This machine's platform where `platform` is Colab or Kaggle and this is not (unless ANY_PLATFORM=1)."""
    here = detect_platform()
    if platform in PLATFORM_FOLDERS and here != platform and os.environ.get("ANY_PLATFORM") != "1":
        return here
    return None


def foreign_paths_problem(paths: dict[str, str], config_path: str) -> str | None:
    """One line refusing a config whose paths lie in another platform's own folders; None where none does."""
    for name, value in paths.items():
        for owner, folder in PLATFORM_FOLDERS.items():
            if value and PurePosixPath(value).is_relative_to(folder) and (here := wrong_platform(owner)):
                return (
                    f"{config_path}: {name} {value} is a {owner.capitalize()} folder, but this machine is "
                    f"{here}: run it on {owner.capitalize()}, use --config configs/{here}.yaml, or pass "
                    "this machine's paths (--output_dir <folder> --mirror_dir '' --import_from ''); "
                    "ANY_PLATFORM=1 uses these anyway"
                )
    return None


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_capability: tuple[int, int]

    def __str__(self) -> str:
        major, minor = self.compute_capability
        return f"{self.name} (compute {major}.{minor})"


def query_gpus() -> tuple[list[Gpu], str]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES respected), and why there are none if so."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return [], "no nvidia-smi"
    try:
        result = subprocess.run([executable, *QUERY], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return [], f"nvidia-smi failed: {error}"
    if result.returncode != 0:
        why = (result.stderr or result.stdout).strip().splitlines() or [f"exit {result.returncode}"]
        return [], f"nvidia-smi failed: {why[0]}"
    gpus = []
    for line in result.stdout.splitlines():
        if not line.strip():
            continue
        name, capability = (part.strip() for part in line.split(","))
        major, minor = capability.split(".")
        gpus.append(Gpu(name, (int(major), int(minor))))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # Indices select among nvidia-smi's GPUs; GPU UUIDs (which this query does not list) keep them all.
    if visible is not None and all(part.strip().isdigit() for part in visible.split(",") if part.strip()):
        indices = [int(part) for part in visible.split(",") if part.strip()]
        gpus = [gpus[index] for index in indices if index < len(gpus)]
        if not gpus:
            return [], f"none visible (CUDA_VISIBLE_DEVICES='{visible}')"
    return gpus, "" if gpus else "nvidia-smi lists none"


def unsupported_gpu(gpus: list[Gpu], arch_list: list[str]) -> str | None:
    """Why this PyTorch cannot train on one of `gpus`: its build (`arch_list`, torch.cuda.get_arch_list())
    has no kernels for the GPU. Kaggle's P100 (6.0) needs sm_60, which the CUDA 12.8 builds dropped."""
    for gpu in gpus:
        if not any(has_kernels(arch, gpu.compute_capability) for arch in arch_list):
            major, minor = gpu.compute_capability
            return (
                f"{gpu} has no kernels in this PyTorch build ({' '.join(arch_list) or 'none'}): install one "
                f"with sm_{major}{minor} (the CUDA 12.6 builds have sm_60), or use another GPU (on Kaggle: "
                "Settings > Accelerator > GPU T4 x2)"
            )
    return None


def has_kernels(arch: str, capability: tuple[int, int]) -> bool:
    """Whether torch's `arch` runs on `capability`: sm_XY on X.Y to X.9, PTX (compute_XY) on X.Y and newer."""
    kind, _, number = arch.rstrip("abf").partition("_")
    if not number.isdigit():  # not CUDA's (ROCm's gfx90a)
        return False
    built = (int(number[:-1]), int(number[-1]))
    return built <= capability and (kind == "compute" or built[0] == capability[0])


def precision_for(gpus: list[Gpu]) -> tuple[str, str]:
    """The mixed precision these GPUs run best, and why (docs/platforms.md): bf16 from compute capability
    8.0 (A100, L4, H100, RTX 30xx), fp16 below (T4, V100: bf16 only emulated), none on the CPU."""
    if not gpus:
        return "no", "no GPU; fp16 on the CPU would silently run in fp32"
    older = [gpu for gpu in gpus if gpu.compute_capability < (8, 0)]
    if older:
        return "fp16", f"{older[-1]} is below 8.0, where bf16 is only emulated"
    return "bf16", "every GPU has compute capability >= 8.0"


COLAB_DRIVE = Path("/content/drive/MyDrive")
KAGGLE_WORKING = Path("/kaggle/working")


def cpu_forced() -> bool:
    """`ACCELERATE_USE_CPU=1` (`accelerate launch --cpu`), read as Accelerate would, without it."""
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "y", "yes", "t", "true", "on")


def choose_cpu_threads() -> str:
    """Set torch's intra-op threads (OMP_NUM_THREADS, else the usable CPUs shared by this machine's processes:
    torch's default ignores affinity and quotas); return them and why, for the start line."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return f"{torch.get_num_threads()} (OMP_NUM_THREADS)"
    cpus = usable_cpus()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun and accelerate launch
    threads = max(1, cpus // processes)
    torch.set_num_threads(threads)
    return f"{threads} ({cpus} CPU{'s' * (cpus > 1)} / {processes} process{'es' * (processes > 1)})"


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by a cgroup CPU quota (containers)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            fields = Path(path).read_text().split()
            if not path.endswith("cpu.max"):  # cgroup v1: the period in a file of its own
                fields.append(Path(path).with_name("cpu.cfs_period_us").read_text().strip())
            quota, period = fields[:2]
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1"):  # no quota
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))  # a part of a CPU counts as one
        break
    return cpus


def hide_gpus_from_cpu_run() -> None:
    """Make a CPU run blind to the GPUs before CUDA reads CUDA_VISIBLE_DEVICES: Accelerate's barrier would
    allocate on cuda:<local rank>, and each checkpoint would create a CUDA context to record its RNG."""
    if cpu_forced():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def launch_problem(num_processes: int) -> str | None:
    """One line for processes started together that do not form one group (each would train alone)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched == num_processes:
        return None
    return (
        f"{launched} processes were started but they do not communicate (world size {num_processes}): "
        "on a machine without GPUs set ACCELERATE_USE_CPU=1 for `accelerate launch --multi_gpu` (gloo), "
        "or launch one process"
    )


def resolve_mixed_precision(choice: str) -> tuple[str, str]:
    """The config's `mixed_precision` as Accelerate should use it here, and why; a RunError where this
    PyTorch has no kernels for the GPU. fp16 without a GPU (or MPS, torch >= 2.5): off, with a warning."""
    import torch
    from accelerate.utils import is_torch_version

    gpus = query_gpus()[0] if torch.cuda.is_available() and not cpu_forced() else []
    if problem := unsupported_gpu(gpus, torch.cuda.get_arch_list()):
        from ..run.run_dir import RunError

        raise RunError(problem)
    if choice == "auto":
        precision, why = precision_for(gpus)
        return precision, f"auto: {why}"
    if choice == "fp16" and not gpus:
        where = "MPS" if torch.backends.mps.is_available() and not cpu_forced() else "the CPU"
        if where == "MPS" and is_torch_version(">=", "2.5"):
            return choice, "as configured, on MPS"
        warning = f"mixed_precision=fp16 needs a GPU, or MPS with torch >= 2.5; running in fp32 on {where}"
        warnings.warn(warning, stacklevel=2)
        return "no", "fp16 needs a GPU"
    return choice, "as configured"


def check_output_dir(output_dir: str, where: str, mirror_dir: str = "") -> list[str]:
    """Warnings for an output_dir that platform `where` will not keep; ValueError for one on an unmounted
    Google Drive (it would fill the mount point) or overlapping `mirror_dir`."""
    # Not at import: the launcher imports this module before yaml is installed.
    from ..checkpoints.remote import is_url

    path = Path(output_dir).absolute()
    kept = {"output_dir": path}
    remote = is_url(mirror_dir)  # a remote store (s3://, hf://...) outlives every session
    if mirror_dir and not remote:
        mirror = Path(mirror_dir).absolute()
        if mirror.is_relative_to(path) or path.is_relative_to(mirror):
            raise ValueError(f"mirror_dir {mirror_dir} and output_dir {output_dir} overlap: use two folders")
        kept["mirror_dir"] = mirror
    if where == "colab":
        drive = Path("/content/drive")
        on_drive = [f"{name} {folder}" for name, folder in kept.items() if folder.is_relative_to(drive)]
        if on_drive and not COLAB_DRIVE.is_dir():
            raise ValueError(
                f"{on_drive[0]} is on Google Drive, which is not mounted: run "
                "`from google.colab import drive; drive.mount('/content/drive')` first, or pass "
                "--mirror_dir '' to keep the run on the session disk only (lost when it ends)"
            )
        if on_drive or remote:
            return []
        return [
            f"neither output_dir {output_dir} nor mirror_dir is on Google Drive: checkpoints are lost when "
            f"the Colab session ends. Mount Drive and set mirror_dir to a folder under {COLAB_DRIVE}."
        ]
    if where == "kaggle" and not path.is_relative_to(KAGGLE_WORKING):
        return [f"output_dir {output_dir} is outside {KAGGLE_WORKING}: Kaggle keeps only that folder."]
    node_local = os.environ.get("SLURM_TMPDIR")
    if where == "slurm" and node_local and path.is_relative_to(node_local) and not mirror_dir:
        return [
            f"output_dir {output_dir} is in $SLURM_TMPDIR, which is wiped when the job ends: set mirror_dir "
            "to persistent storage, or choose another output_dir."
        ]
    return []
