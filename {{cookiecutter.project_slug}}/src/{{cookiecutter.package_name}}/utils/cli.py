"""train.py's command line, answered before torch and Accelerate load: only what reading the config needs.

`read_config` reads the run's config (the platform's file unless --config names one, then the command
line's fields) and checks it without writing anything. `check_first` is what `python train.py` does
first: --help, --check_task and a config error answer in seconds, not after PyTorch has loaded; otherwise
it says what comes next, and train.main reads the config again (milliseconds).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .. import task
from .config import ConfigError, TrainConfig, load_config
from .contract import check_contract
from .hardware import check_output_dir, detect_platform, foreign_paths_problem, main_process_of_launch
from .remote import check_urls, is_url


def read_config(argv: list[str] | None, project: Path) -> tuple[TrainConfig, Path, list[str]]:
    """The run's config, its file, and warnings about its output_dir; a ConfigError says what is wrong."""
    check_contract(task)  # every function of task.py there: a missing one is not found after training
    where = detect_platform()
    config, config_path = load_config(argv, project / "configs" / f"{where}.yaml", task.Config)
    paths = {name: getattr(config, name) for name in ("output_dir", "mirror_dir", "import_from")}
    if problem := foreign_paths_problem(paths, str(config_path)):
        raise ConfigError(problem)
    # Relative to the project, not to the working directory: the same command finds its run from anywhere.
    # Normalised lexically, not resolved: a path through a symlink (a mounted Drive) keeps its name.
    config.output_dir = os.path.normpath(project / config.output_dir)
    if config.mirror_dir and not is_url(config.mirror_dir):  # a URL is a remote store (utils/remote.py)
        config.mirror_dir = os.path.normpath(project / config.mirror_dir)
    check_urls(config, config_path)  # no network: a protocol that cannot work, a key inside a URL
    try:
        output_warnings = check_output_dir(config.output_dir, where, config.mirror_dir)
    except ValueError as error:
        raise ConfigError(f"{config_path}: {error}") from error
    return config, config_path, output_warnings


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
