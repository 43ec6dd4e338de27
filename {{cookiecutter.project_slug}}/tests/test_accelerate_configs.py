"""configs/accelerate/: ready Accelerate configs (DDP, FSDP, DeepSpeed) that accelerate itself accepts."""

from __future__ import annotations

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import launch_command_parser
from accelerate.utils import DistributedType

from .conftest import PROJECT

CONFIGS = PROJECT / "configs" / "accelerate"
EXPECTED = {"multi_gpu.yaml": "MULTI_GPU", "fsdp.yaml": "FSDP", "deepspeed_zero2.yaml": "DEEPSPEED"}


def launch_options() -> set[str]:
    return {option for action in launch_command_parser()._actions for option in action.option_strings}


def test_every_config_is_listed() -> None:
    """The folder holds exactly the documented configs, and the README names each one."""
    assert sorted(path.name for path in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)
    readme = (CONFIGS / "README.md").read_text()
    for name in EXPECTED:
        assert f"`{name}`" in readme


@pytest.mark.parametrize(("name", "distributed_type"), list(EXPECTED.items()))
def test_config_loads_with_accelerates_own_loader(name: str, distributed_type: str) -> None:
    """`load_config_from_file` (what `accelerate launch --config_file` uses) returns a ClusterConfig of
    the intended distributed type; an unknown top-level key would raise here."""
    config = load_config_from_file(str(CONFIGS / name))
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == DistributedType(distributed_type)
    assert config.num_machines == 1 and config.machine_rank == 0
    assert config.use_cpu is False


@pytest.mark.parametrize(
    ("name", "section"), [("fsdp.yaml", "fsdp_config"), ("deepspeed_zero2.yaml", "deepspeed_config")]
)
def test_plugin_keys_are_real_launch_options(name: str, section: str) -> None:
    """Each key of fsdp_config/deepspeed_config is an `accelerate launch` option: accelerate copies them
    onto its arguments and silently ignores a misspelled one."""
    config = load_config_from_file(str(CONFIGS / name))
    keys = getattr(config, section)
    assert keys, f"{name} has no {section}"
    unknown = sorted(key for key in keys if f"--{key}" not in launch_options())
    assert not unknown, f"{name}: {section} keys accelerate launch does not know: {unknown}"


def test_paths_in_readme_exist() -> None:
    """The README's commands point at files that exist."""
    readme = (CONFIGS / "README.md").read_text()
    for path in ("configs/accelerate/fsdp.yaml", "configs/slurm.yaml", "train.py"):
        assert path in readme
        assert (PROJECT / path).exists(), path
