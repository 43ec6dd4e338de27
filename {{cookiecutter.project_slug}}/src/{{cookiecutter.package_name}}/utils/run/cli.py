"""train.py's command line, answered before torch loads (train.main reads the config again, in milliseconds),
and task.py's contract checked before a run (what each function returns is task_check.py's to check)."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from types import ModuleType

from ... import task
from ..checkpoints.remote import check_urls, is_url
from ..config import ConfigError, TrainConfig, load_config
from ..machine.hardware import (
    check_output_dir,
    detect_platform,
    foreign_paths_problem,
    main_process_of_launch,
)


def read_config(argv: list[str] | None, project: Path) -> tuple[TrainConfig, str, list[str]]:
    """The run's config, its file(s), and warnings (fields that no longer exist, its output_dir); a
    ConfigError says what is wrong."""
    check_contract(task)  # every function of task.py there: a missing one is not found after training
    where = detect_platform()
    notes: list[str] = []
    files = {name: project / "configs" / f"{name}.yaml" for name in ("local", "colab", "kaggle", "slurm")}
    config, config_path = load_config(argv, files[where], task.Config, notes=notes, platforms=files.values())
    paths = {name: getattr(config, name) for name in ("output_dir", "mirror_dir", "import_from")}
    if problem := foreign_paths_problem(paths, config_path):
        raise ConfigError(problem)
    # Relative to the project, not to the working directory: the same command finds its run from anywhere.
    # Normalised lexically, not resolved: a path through a symlink (a mounted Drive) keeps its name.
    config.output_dir = os.path.normpath(project / config.output_dir)
    if config.mirror_dir and not is_url(config.mirror_dir):  # a URL is a remote store (checkpoints/remote.py)
        config.mirror_dir = os.path.normpath(project / config.mirror_dir)
    check_urls(config, config_path)  # no network: a protocol that cannot work, a key inside a URL
    try:
        notes += check_output_dir(config.output_dir, where, config.mirror_dir)
    except ValueError as error:
        raise ConfigError(f"{config_path}: {error}") from error
    return config, config_path, notes


def check_first(project: Path) -> None:
    """`python train.py`: exit at once after --help, --check_task or a config error; else say what comes."""
    if "--check_task" in sys.argv[1:]:  # after editing task.py: its contract on two samples, nothing written
        from .task_check import command

        sys.argv.remove("--check_task")
        sys.exit(command(lambda argv: read_config(argv, project)))
    try:
        _, config_path, _ = read_config(None, project)
    except ConfigError as error:
        sys.exit(f"config error: {error}")
    if main_process_of_launch():
        print(f"config {config_path} checked: loading PyTorch and Accelerate", flush=True)


# Each function of the contract, as train.py and predict.py call it (README, "Bring your own task").
FUNCTIONS = {
    "build_datasets": ("config",),
    "collate": ("samples",),
    "build_model": ("config",),
    "loss": ("model", "batch"),
    "eval_step": ("model", "batch"),
    "metrics": ("values", "config"),
    "predict_inputs": ("config", "path"),
    "predict": ("model", "batch", "config"),
}
# Optional: without them, model.safetensors holds the state dict (utils/checkpoints/checkpoint.py).
OPTIONAL = {"export": ("model", "state_dict", "folder", "config"), "load_export": ("folder", "config")}


def check_contract(task: ModuleType) -> None:
    """Raise a ConfigError naming the first contract function that task.py lacks or that takes other
    arguments than the contract passes; and if its Config is not a TrainConfig."""
    config = getattr(task, "Config", None)
    if not (isinstance(config, type) and issubclass(config, TrainConfig)):
        raise ConfigError(
            f"task.py's Config is {'missing' if config is None else repr(config)}: the contract wants a "
            "dataclass `Config(TrainConfig)`, TrainConfig's fields plus the task's"
        )
    if "__dataclass_fields__" not in vars(config):  # inherited only: its own fields would be plain attributes
        raise ConfigError(
            "task.py's Config is not a dataclass: put @dataclass on the line above `class Config(...)`"
        )
    for name, arguments in [*FUNCTIONS.items(), *OPTIONAL.items()]:
        call = f"{name}({', '.join(arguments)})"
        function = getattr(task, name, None)
        if function is None:
            if name in OPTIONAL:
                continue
            raise ConfigError(
                f"task.py has no {name}: the contract wants a function {call} (the README's section on "
                "your own task; a preset's task.py shows each)"
            )
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # a builtin or a C function: its arguments cannot be read
            continue
        try:
            signature.bind(*arguments)
        except TypeError:
            raise ConfigError(
                f"task.py's {name}{signature} does not take the arguments of {call}, which is how train.py "
                "and predict.py call it: give it those arguments, in this order"
            ) from None
