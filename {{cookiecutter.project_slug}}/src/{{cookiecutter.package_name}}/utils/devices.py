"""Device facts and the decisions that follow from them, shared by the launcher and train.py.

Standard library only: `python -m {{ cookiecutter.package_name }}.launch` imports this before anything is
installed. The one source of GPU facts is `nvidia-smi --query-gpu=...` (no CUDA initialised, nothing
imported), so tests can fake a T4 or an A100 with a stand-in `nvidia-smi` first on PATH.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import PurePosixPath

# The oldest GPU current PyTorch CUDA wheels ship kernels for (Volta); a P100 (6.0) fails with "no kernel
# image is available". MIN_COMPUTE_CAPABILITY lowers it for a torch build that still supports older GPUs.
MIN_COMPUTE_CAPABILITY = "7.0"
QUERY = ["--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader"]


class DeviceError(Exception):
    """Device facts that cannot be read or used, in one line."""


def main_process_of_launch() -> bool:
    """Whether this is the process that speaks for the run: the only one, or rank 0 of a launch. Readable
    before torch loads (launchers set RANK in every process they start)."""
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
    """The platform this machine is, where `platform` is Colab or Kaggle and this machine is not it (then
    that platform's paths would be written on this disk); None where it is, or where ANY_PLATFORM=1 says
    to use them anyway. The launchers and train.py refuse on it."""
    here = detect_platform()
    if platform in PLATFORM_FOLDERS and here != platform and os.environ.get("ANY_PLATFORM") != "1":
        return here
    return None


def foreign_paths_problem(paths: dict[str, str], config_path: str) -> str | None:
    """One line refusing a config whose paths (output_dir, mirror_dir, import_from) lie in another
    platform's own folders (configs/colab.yaml on a laptop would write /content at the root), saying the
    ways out; None where every path is this machine's, a URL, or empty."""
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
    memory_mib: int

    def __str__(self) -> str:
        major, minor = self.compute_capability
        return f"{self.name} (compute {major}.{minor}, {self.memory_mib} MiB)"


def parse_capability(text: str) -> tuple[int, int]:
    """'7.5' -> (7, 5); DeviceError for anything else."""
    major, dot, minor = text.strip().partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        raise DeviceError(f"cannot read the compute capability '{text.strip()}'")
    return int(major), int(minor)


def query_gpus() -> tuple[list[Gpu], str]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES respected when it lists indices), and, when
    there are none, why: no nvidia-smi, a failing one, or none visible."""
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
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3:
            raise DeviceError(f"cannot read nvidia-smi's line '{line.strip()}'")
        name, capability, memory = parts
        memory_mib = memory.split()[0] if memory else ""
        gpus.append(Gpu(name, parse_capability(capability), int(memory_mib) if memory_mib.isdigit() else 0))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # Indices select among nvidia-smi's GPUs; GPU UUIDs (which this query does not list) keep them all.
    if visible is not None and all(part.strip().isdigit() for part in visible.split(",") if part.strip()):
        indices = [int(part) for part in visible.split(",") if part.strip()]
        gpus = [gpus[index] for index in indices if index < len(gpus)]
        if not gpus:
            return [], f"none visible (CUDA_VISIBLE_DEVICES='{visible}')"
    return gpus, "" if gpus else "nvidia-smi lists none"


def gpu_facts() -> list[Gpu]:
    """The GPUs this process may use, as nvidia-smi reports them; [] without nvidia-smi."""
    return query_gpus()[0]


def unsupported_gpu(gpus: list[Gpu]) -> str | None:
    """Why one of `gpus` cannot run current PyTorch CUDA wheels (compute capability below the minimum)."""
    minimum = parse_capability(os.environ.get("MIN_COMPUTE_CAPABILITY", MIN_COMPUTE_CAPABILITY))
    for gpu in gpus:
        if gpu.compute_capability < minimum:
            major, minor = gpu.compute_capability
            return (
                f"{gpu.name} has compute capability {major}.{minor}; current PyTorch CUDA wheels need "
                f"{minimum[0]}.{minimum[1]} or newer, so training would fail with 'no kernel image is "
                "available'"
            )
    return None


def precision_for(gpus: list[Gpu]) -> tuple[str, str]:
    """The mixed precision these GPUs run best, and why: bf16 where every GPU computes it natively
    (compute capability 8.0+: A100, L4, H100, RTX 30xx and newer), fp16 below (T4, V100: bf16 would be
    emulated, slowly), no mixed precision without a GPU (fp16 on the CPU would silently run in fp32)."""
    if not gpus:
        return "no", "no GPU; fp16 on the CPU would silently run in fp32"
    older = [gpu for gpu in gpus if gpu.compute_capability < (8, 0)]
    if older:
        major, minor = older[-1].compute_capability
        return "fp16", f"{older[-1].name} (compute {major}.{minor}) is below 8.0, where bf16 is only emulated"
    return "bf16", "every GPU has compute capability >= 8.0"


# Why `mixed_precision: auto` trains in float32 on Apple silicon (MPS): its GPUs compute float16 at about the
# float32 rate, so autocast would save memory but little time; fp16 adds a loss scaler and needs torch >= 2.5
# there, bf16 torch >= 2.6 and macOS 14. Pass --mixed_precision fp16 or bf16 to have it anyway.
MPS_PRECISION = "Apple silicon (MPS): float32, as fast as float16 on its GPUs and free of a loss scaler"


def apple_silicon() -> bool:
    """A Mac with Apple's GPU, where torch trains on MPS (known without importing torch)."""
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def auto_precision(gpus: list[Gpu]) -> str:
    """What `mixed_precision: auto` becomes on `gpus` (see `precision_for`)."""
    return precision_for(gpus)[0]
