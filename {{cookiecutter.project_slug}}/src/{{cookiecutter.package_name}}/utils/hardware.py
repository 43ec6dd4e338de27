"""Where the run landed: platform, devices, and the decisions that follow from them.

Device facts and the precision rule live in `devices.py`, shared with the launcher
(`python -m {{ cookiecutter.package_name }}.launch`, behind scripts/run_*.sh); this module adds what needs torch.

Print an environment report, the first thing to paste into a bug report:

    python -m {{ cookiecutter.package_name }}.utils.hardware

torch and Accelerate are imported inside the functions that use them: train.py checks its output_dir
(`check_output_dir`) with the config, before they load.
"""

from __future__ import annotations

import os
import platform
import warnings
from pathlib import Path

from .devices import auto_precision, detect_platform, gpu_facts
from .remote import is_url

COLAB_DRIVE = Path("/content/drive/MyDrive")
KAGGLE_WORKING = Path("/kaggle/working")


def cpu_forced() -> bool:
    """`ACCELERATE_USE_CPU=1` (what `accelerate launch --cpu` sets) asks for a CPU run even where a GPU is."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_CPU")


def hide_gpus_from_cpu_run() -> None:
    """Make a CPU run blind to the machine's GPUs; call it before anything touches CUDA.

    CPU processes that still see a GPU use it behind the run's back: Accelerate's barrier allocates on
    cuda:<local rank>, which crashes rank 1 of 2 CPU processes on a one-GPU machine ("invalid device
    ordinal"), and every checkpoint would record the CUDA random state, creating a context on GPU 0 in
    each process. CUDA reads CUDA_VISIBLE_DEVICES once, when it starts, hence the order.
    """
    if not cpu_forced():
        return
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("hide_gpus_from_cpu_run() must run before CUDA is initialized")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def cuda_usable() -> bool:
    import torch

    return torch.cuda.is_available() and not cpu_forced()


# FSDP version 2 (`fully_shard`, what configs/accelerate/fsdp.yaml asks for) became public in
# torch.distributed.fsdp in torch 2.6; before it Accelerate fails with an ImportError on every process.
FSDP2_MIN_TORCH = "2.6"


def torch_lacks_fsdp2() -> str | None:
    """Why this launch cannot start with the installed torch, or None; ask before creating the Accelerator."""
    import torch
    from accelerate.utils import parse_flag_from_env

    if not parse_flag_from_env("ACCELERATE_USE_FSDP") or os.environ.get("FSDP_VERSION", "1") != "2":
        return None
    if torch.__version__ >= FSDP2_MIN_TORCH:  # a TorchVersion: compared as a version, not as text
        return None
    return (
        f"the launch asked for FSDP version 2 (configs/accelerate/fsdp.yaml), which needs torch >= "
        f"{FSDP2_MIN_TORCH}; this is torch {torch.__version__}: install a newer torch, "
        "or launch with configs/accelerate/multi_gpu.yaml (DDP)"
    )


def launch_problems(num_processes: int, distributed_type: str) -> tuple[str | None, list[str]]:
    """What is wrong with how this process was launched: an error (processes that were started together but
    do not form one group: each would train alone and all would write one folder) and warnings (a launch
    config that asked for FSDP or DeepSpeed and got something else)."""
    from accelerate.utils import parse_flag_from_env

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    error = None
    if launched != num_processes:
        error = (
            f"{launched} processes were started but they do not communicate (world size {num_processes}): "
            "on a machine without GPUs set ACCELERATE_USE_CPU=1 for `accelerate launch --multi_gpu` (gloo), "
            "or launch one process"
        )
    warnings = [
        f"the launch asked for {kind} ({flag}) but this run is {distributed_type}: {kind} needs GPUs "
        "(ACCELERATE_USE_CPU=1 turns it off); configs/accelerate/multi_gpu.yaml is the one for CPU processes"
        for flag, kind in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED"))
        if parse_flag_from_env(flag) and distributed_type != kind
    ]
    return error, warnings


def resolve_mixed_precision(choice: str) -> str:
    """Turn the config's `mixed_precision` into what Accelerate should use here.

    fp16 asked for on a CPU would silently run in fp32, so it is turned off with a warning instead.
    """
    gpus = gpu_facts() if cuda_usable() else []
    if choice == "auto":
        return auto_precision(gpus)
    if choice == "fp16" and not gpus:
        warnings.warn("mixed_precision=fp16 needs a GPU; running in fp32 on the CPU", stacklevel=2)
        return "no"
    return choice


def check_output_dir(output_dir: str, where: str, mirror_dir: str = "") -> list[str]:
    """Warnings for an output_dir that will not survive the platform's session; raise if it cannot work.

    `where` is the detected platform; `mirror_dir` the run's persistent copy, if any. Raises ValueError
    for a Google Drive path on a Colab session where Drive is not mounted (writing there would fill the
    mount point and lose everything), and for a mirror that is output_dir itself or inside it.
    """
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


def report() -> str:
    """Platform, devices, memory, precision, processes, distributed type and library versions."""
    import accelerate
    import torch

    gpus = gpu_facts()
    processes = int(os.environ.get("WORLD_SIZE", os.environ.get("NUM_PROCESSES", max(1, len(gpus)))))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        f"platform:          {detect_platform()}",
        f"cpu:               {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{memory_gib:.1f} GiB RAM",
    ]
    lines += [
        f"gpu {index}:             {gpu.name}, compute capability {gpu.compute_capability[0]}."
        f"{gpu.compute_capability[1]}, {gpu.memory_mib} MiB"
        for index, gpu in enumerate(gpus)
    ] or ["gpu:               none (nvidia-smi not found or lists no GPU)"]
    if processes > 1:
        distributed = "MULTI_GPU (nccl)" if gpus else "MULTI_CPU (gloo, needs ACCELERATE_USE_CPU=1)"
    else:
        distributed = "NO (one process)"
    lines += [
        f"mixed precision:   {auto_precision(gpus)} (what mixed_precision: auto picks)",
        f"processes:         {processes}",
        f"distributed type:  {distributed}",
        f"torch:             {torch.__version__} (CUDA build {torch.version.cuda or 'none'}, "
        f"CUDA available: {torch.cuda.is_available()})",
        f"accelerate:        {accelerate.__version__}",
        f"python:            {platform.python_version()} on {platform.platform()}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
