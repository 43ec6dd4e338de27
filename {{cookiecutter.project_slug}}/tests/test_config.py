"""The config contract: YAML + flags, precedence, and errors that name the file, the key and a fix."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import (
    REFUSED_FIELDS,
    REMOVED_FIELDS,
    ConfigError,
    TrainConfig,
    field_help,
    gradient_accumulation_steps,
    load_config,
    run_defining_fields,
)
from {{ cookiecutter.package_name }}.utils.machine import hardware
from {{ cookiecutter.package_name }}.utils.run.cli import read_config
from {{ cookiecutter.package_name }}.utils.run.start import changed_settings

from .conftest import PROJECT, run_training
from .task_settings import QUICK, SIGNAL_RUN

BEST = task.Config().best_metric


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_precedence_is_flag_then_yaml_then_default(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 7\nlearning_rate: 0.01\n")
    config, used = load_config(["--config", str(path), "--learning_rate", "0.5"], Path("unused"), task.Config)
    assert used == str(path)
    assert config.seed == 7  # YAML over default
    assert config.learning_rate == 0.5  # flag over YAML
    assert config.num_epochs == task.Config().num_epochs  # default


@pytest.mark.parametrize("name", ["local", "colab", "kaggle", "slurm"])
def test_every_platform_file_is_valid(name: str) -> None:
    config, _ = load_config([], PROJECT / "configs" / f"{name}.yaml", task.Config)
    # The platforms differ in hardware use, never in the optimization itself.
    assert config.global_batch_size == task.Config().global_batch_size
    gradient_accumulation_steps(config, 1)  # the per-device batch divides the global one


def test_unknown_key_names_file_key_and_nearest_field(tmp_path: Path) -> None:
    path = write(tmp_path, "learning_rat: 0.1\n")
    with pytest.raises(
        ConfigError, match=r"config\.yaml: unknown key 'learning_rat' \(did you mean 'learning_rate'\?\)"
    ):
        load_config(["--config", str(path)], path, task.Config)


@pytest.mark.parametrize("name", [name for name in REMOVED_FIELDS if name not in REFUSED_FIELDS])
def test_a_field_of_an_earlier_version_in_a_saved_config_is_skipped(tmp_path: Path, name: str) -> None:
    """The config.yaml of every run and export saved before a field was removed holds it: it still loads,
    as without that line, with one warning naming it and what replaced it; as a flag it is unknown."""
    path = write(tmp_path, f"seed: 7\n{name}: true\n")
    notes: list[str] = []
    saved = load_config(["--config", str(path)], path, task.Config, notes=notes)[0]
    assert notes == [f"{path}: {name} no longer exists, skipped: {REMOVED_FIELDS[name]}"]
    path.write_text("seed: 7\n")
    assert saved == load_config(["--config", str(path)], path, task.Config)[0]
    with pytest.raises(ConfigError, match=rf"unknown argument '--{name}'"):
        load_config(["--config", str(path), f"--{name}", "false"], path, task.Config)


@pytest.mark.slow  # trains
def test_a_removed_field_is_one_warning_of_a_run_that_goes_on(tmp_path: Path) -> None:
    """train.py reads its config twice (before torch loads, then in main): the warning is printed once."""
    path = tmp_path / "old.yaml"
    path.write_text((PROJECT / "configs" / "local.yaml").read_text() + "resume: auto\n")
    result = run_training(tmp_path / "run", "--config", str(path), "--max_steps", "1")
    warning = f"WARNING: {path}: resume no longer exists, skipped: {REMOVED_FIELDS['resume']}"
    assert result.stdout.count("resume no longer exists") == 1 and warning in result.stdout.splitlines()
    assert "done: 1 optimizer steps" in result.stdout


def test_checkpoint_every_minutes_is_refused_where_a_person_sets_it_and_skipped_where_a_run_saved_it(
    tmp_path: Path,
) -> None:
    """max_time_lost replaced it: a file or a flag that sets it stops in one line naming max_time_lost; the
    config.yaml of a run or an export of an earlier version (predict.py reads those) still loads."""
    path = write(tmp_path, "seed: 7\ncheckpoint_every_minutes: 15\n")
    with pytest.raises(ConfigError, match=r"yaml: checkpoint_every_minutes no longer exists: set max_time"):
        load_config(["--config", str(path)], path, task.Config)
    assert load_config([], path, task.Config, saved=True)[0] == task.Config(seed=7)
    with pytest.raises(ConfigError, match=r"^--checkpoint_every_minutes no longer exists: set max_time_lost"):
        load_config(["--checkpoint_every_minutes", "15"], write(tmp_path, ""), task.Config)
    # A checkpoint of an earlier version holds it in its config.yaml, which a resume compares: it continues.
    older = {**dataclasses.asdict(task.Config()), "checkpoint_every_minutes": 15.0}
    del older["max_time_lost"]
    assert changed_settings(yaml.safe_dump(older), task.Config()) == ""


def test_every_removed_field_of_a_file_is_named_in_its_one_line(tmp_path: Path) -> None:
    """Two fields of an earlier version in one file: one warning naming both; where one of them is refused,
    one error naming both, so that the second is not found only after fixing the first."""
    path = write(tmp_path, "resume: auto\nseed: 7\ncheck_disk_space: true\n")
    notes: list[str] = []
    assert load_config(["--config", str(path)], path, task.Config, notes=notes)[0].seed == 7
    assert len(notes) == 1 and "resume no longer exists" in notes[0], notes
    assert f"check_disk_space no longer exists, skipped: {REMOVED_FIELDS['check_disk_space']}" in notes[0]
    path.write_text("checkpoint_every_minutes: 15\nresume: auto\n")
    with pytest.raises(ConfigError, match=r"checkpoint_every_minutes no longer exists: .*; resume no longer"):
        load_config(["--config", str(path)], path, task.Config)


@pytest.mark.parametrize(
    ("platform", "variable"), [("colab", "COLAB_RELEASE_TAG"), ("kaggle", "KAGGLE_KERNEL_RUN_TYPE")]
)
def test_a_users_file_is_read_over_the_platforms_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str, variable: str
) -> None:
    """On Colab (a stand-in: its variable, a mounted Drive folder) a user's YAML with early stopping keeps
    colab.yaml's mirror_dir on Drive and its import_from; on Kaggle, kaggle.yaml's time_budget. The user's
    values win over the platform's, flags over both; the start line names both files. Another platform's
    file replaces the platform's (tests/test_platform.py)."""
    for name in ("COLAB_RELEASE_TAG", "COLAB_GPU", "KAGGLE_KERNEL_RUN_TYPE", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(hardware, "COLAB_DRIVE", tmp_path)  # mounted
    mine = write(tmp_path, "eval_every: 20\nearly_stopping_patience: 3\nper_device_batch_size: 16\n")
    platform_file = PROJECT / "configs" / f"{platform}.yaml"
    expected = yaml.safe_load(platform_file.read_text())
    config, files, _ = read_config(["--config", str(mine), "--eval_every", "10"], PROJECT)
    assert (config.eval_every, config.early_stopping_patience, config.per_device_batch_size) == (10, 3, 16)
    for name in ("output_dir", "mirror_dir", "import_from", "time_budget", "max_time_lost", "tracker"):
        assert getattr(config, name) == expected.get(name, getattr(task.Config(), name)), name
    assert config.mirror_dir.startswith("/content/drive/") if platform == "colab" else config.time_budget
    assert files == f"{platform_file} + {mine}"


def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path: Path) -> None:
    """YAML parsers keep the last of two equal keys without a word: the first value would be ignored."""
    path = write(tmp_path, "seed: 7\nlearning_rate: 0.01\nnum_epochs: 2\nlearning_rate: 0.5\n")
    expected = r"config\.yaml: key 'learning_rate' is given twice, on line 2 and on line 4: keep one of them"
    with pytest.raises(ConfigError, match=expected):
        load_config(["--config", str(path)], path, task.Config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_epochs: ten\n", r"config\.yaml: num_epochs must be int, got 'ten'"),
        ("num_epochs: 2.5\n", r"config\.yaml: num_epochs must be int, got 2\.5"),
        ("seed: true\n", r"config\.yaml: seed must be int, got True"),
        ("output_dir: 3\n", r"config\.yaml: output_dir must be str"),
        ("mixed_precision: fp32\n", r"config\.yaml: mixed_precision='fp32' is not one of"),
        ("num_epochs: 0\n", r"config\.yaml: num_epochs=0 is invalid: it must be > 0"),
        ("- a list\n", r"config\.yaml: expected a mapping"),
        (  # a letter short of this task's best metric, whatever it is called
            f"best_metric: {BEST[:-1]}\n",
            rf"best_metric='{re.escape(BEST[:-1])}' is not one of .*did you mean '{re.escape(BEST)}'",
        ),
        ("early_stopping_patience: -1\n", r"early_stopping_patience=-1 is invalid: it must be >= 0"),
        ("compile: maybe\n", r"compile must be bool, got 'maybe'"),
        ("learning_rate: .inf\n", r"config\.yaml: learning_rate must be a finite number, got inf"),
        ("learning_rate: inf\n", r"config\.yaml: learning_rate must be a finite number, got inf"),
        ("weight_decay: .nan\n", r"config\.yaml: weight_decay must be a finite number, got nan"),
        ("max_grad_norm: 1e999\n", r"config\.yaml: max_grad_norm must be a finite number, got inf"),
        ("seed: -5\n", r"config\.yaml: seed=-5 is invalid: it must be between 0 and 2\*\*32 - 1"),
        ("seed: 4294967296\n", r"seed=4294967296 is invalid"),
        ("fp16_skip_patience: 0\n", r"fp16_skip_patience=0 is invalid: it must be > 0"),
        ("loss_spike_factor: 0.5\n", r"loss_spike_factor=0.5 is invalid: it must be 0 \(off\) or > 1"),
        ("max_rollbacks: -1\n", r"max_rollbacks=-1 is invalid: it must be >= 0"),
        ("checkpoint_every: -1\n", r"checkpoint_every=-1 is invalid: it must be >= 0"),
        ("max_time_lost: 1min\n", r"max_time_lost='1min' is invalid: it must be a duration such as 11h40m"),
        (
            "time_budget: '11:40'\n",
            r"config\.yaml: time_budget='11:40' is invalid: it must be a duration such as 11h40m, 90m, 45s",
        ),
        ("time_budget: 12\n", r"time_budget must be str, got 12 \(int\): it must be a duration such as"),
    ],
)
def test_wrong_types_and_values_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", str(path)], path, task.Config)


def test_bad_flags_are_named(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    with pytest.raises(ConfigError, match=r"--seed: seed must be int, got 'abc'"):
        load_config(["--config", str(path), "--seed", "abc"], path, task.Config)
    with pytest.raises(ConfigError, match=r"'--num_epoch' \(did you mean '--num_epochs'\?\)"):
        load_config(["--config", str(path), "--num_epoch", "3"], path, task.Config)


def test_yaml_float_in_exponent_notation_is_accepted(tmp_path: Path) -> None:
    # PyYAML reads 1e-3 (no dot) as a string; users write it anyway.
    config, _ = load_config([], write(tmp_path, "learning_rate: 1e-3\n"), task.Config)
    assert config.learning_rate == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("per_device", "processes", "expected"), [(32, 1, 2), (32, 2, 1), (16, 2, 2), (8, 8, 1)]
)
def test_accumulation_keeps_the_global_batch(per_device: int, processes: int, expected: int) -> None:
    config = task.Config(per_device_batch_size=per_device, global_batch_size=64)
    assert gradient_accumulation_steps(config, processes) == expected


def test_non_dividing_batch_sizes_say_what_would_work() -> None:
    config = task.Config(per_device_batch_size=32, global_batch_size=100)
    with pytest.raises(ConfigError) as error:
        gradient_accumulation_steps(config, 2)
    message = str(error.value)
    assert "global_batch_size=100" in message
    assert "multiple of 64 (e.g. 64 or 128)" in message
    assert "per_device_batch_size to one of [1, 2, 5, 10, 25, 50]" in message


def test_bad_config_stops_train_py_before_training(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    path = write(tmp_path, f"output_dir: {output_dir}\nglobal_batch_size: 48\n")
    result = subprocess.run(
        [sys.executable, "train.py", "--config", str(path)], cwd=PROJECT, capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "config error: global_batch_size=48 is not divisible" in result.stderr
    assert not (output_dir / "metrics.jsonl").exists()
    # The first line comes as soon as the config is read, before the seconds torch takes to load; a user's
    # file is read over the platform's.
    platform = PROJECT / "configs" / f"{hardware.detect_platform()}.yaml"
    assert result.stdout.startswith(f"config {platform} + {path} checked: loading PyTorch and Accelerate\n")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"learning_rate: [0.1\n", "not valid YAML: line 2, column 1: expected ',' or ']', but got"),
        (b"a: 1\n  b: 2\n", "not valid YAML: line 2, column 4: mapping values are not allowed here"),
        ("output_dir: caf\u00e9\n".encode("latin-1"), "not valid YAML: unacceptable character #x00e9"),
    ],
)
def test_a_config_file_that_cannot_be_read_is_one_line(tmp_path: Path, content: bytes, expected: str) -> None:
    """Bad YAML and a file saved in another encoding: one line naming the file and the problem."""
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    command = [sys.executable, "train.py", "--config", str(path)]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"config error: {path}: {expected}"), line


# Runs a script as `python <script> <args>` does, then prints the top-level packages it imported.
IMPORTS_OF = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "finally:\n"
    "    print('imported:', *sorted({name.split('.')[0] for name in sys.modules}))\n"
)
HEAVY = {"torch", "accelerate", "numpy", "matplotlib", "sklearn", "transformers", "tokenizers", "PIL", "tqdm"}


@pytest.mark.parametrize(
    ("args", "status", "expected"),
    [
        (["train.py", "--help"], 0, "--learning_rate FLOAT"),
        (["predict.py", "--help"], 0, "--model_dir MODEL_DIR"),
        (["train.py", "--learning_rate", "-1"], 1, "config error: --learning_rate: learning_rate=-1.0 is"),
        (["train.py", "--learning_rat", "1"], 1, "config error: unknown argument '--learning_rat'"),
        (["train.py", "--config", "BAD_YAML"], 1, "config error: BAD_YAML: not valid YAML"),
        (["predict.py", "--model_dir", "MODEL", "--learning_rat", "1"], 1, "error: unknown argument '--lea"),
    ],
)
def test_help_and_config_errors_answer_before_torch_loads(
    tmp_path: Path, args: list[str], status: int, expected: str
) -> None:
    """No torch, Accelerate or task library is imported to print the help or to refuse a command."""
    bad_yaml = write(tmp_path, "learning_rate: [0.1\n")
    (tmp_path / "model").mkdir()  # a model folder whose config.yaml is read (predict.py)
    shutil.copy(PROJECT / "configs" / "local.yaml", tmp_path / "model" / "config.yaml")
    paths = {"BAD_YAML": str(bad_yaml), "MODEL": str(tmp_path / "model")}
    args = [paths.get(arg, arg) for arg in args]
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_OF, *args], cwd=PROJECT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == status, result.stderr[-2000:]
    assert expected.replace("BAD_YAML", str(bad_yaml)) in result.stdout + result.stderr
    imported = set(result.stdout.splitlines()[-1].split()[1:])
    assert not imported & HEAVY, f"{args} imported {sorted(imported & HEAVY)}"


EMPTY = '""'  # how --help shows an empty default


def test_help_gives_every_field_its_meaning_default_and_allowed_values() -> None:
    """`python train.py --help` lists every field of this task's Config, TrainConfig's and the task's own,
    each with its one-line meaning, its default, the choices of a Literal field and the ranges of CHECKS."""
    env = {**os.environ, "COLUMNS": "1000"}  # one line per field where argparse can
    command = [sys.executable, "train.py", "--help"]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    entries: dict[str, str] = {}  # flag -> what follows it, up to the next flag
    for line in result.stdout.splitlines():
        if line.startswith("  -"):
            flag, _, text = line.strip().partition(" ")
            entries[flag] = text
        elif entries and line.startswith("   "):
            entries[flag] += " " + line.strip()
    kinds = typing.get_type_hints(task.Config)
    for field in dataclasses.fields(task.Config):
        meaning = field_help(task.Config, field.name)
        assert meaning and "\n" not in meaning, f"{field.name}: declare it with setting(default, meaning)"
        text = " ".join(entries[f"--{field.name}"].split())
        assert meaning in text, field.name
        default = str(field.default).lower() if isinstance(field.default, bool) else str(field.default)
        assert f"[default: {default or EMPTY}" in text, field.name
        for name, _, expected in task.Config.CHECKS:
            if name == field.name:
                assert expected in text, field.name
        if typing.get_origin(kinds[field.name]) is typing.Literal:
            assert text.startswith("{" + ",".join(typing.get_args(kinds[field.name])) + "}"), field.name
    assert entries["--best_metric"].startswith("{" + ",".join(task.Config.METRIC_GOALS) + "}")


@pytest.mark.slow  # trains (single_run)
def test_resolved_config_round_trips(single_run: tuple) -> None:
    output_dir, _ = single_run
    saved = yaml.safe_load((output_dir / "config.yaml").read_text())
    config, _ = load_config(["--config", str(output_dir / "config.yaml")], Path("unused"), task.Config)
    assert saved["output_dir"] == str(output_dir)
    assert dataclasses.asdict(config) == saved


def test_the_short_runs_of_the_generic_tests_set_only_train_config_fields() -> None:
    """QUICK and SIGNAL_RUN are sized by the fields every task has (steps, epochs, logging, checkpoints): a
    task.py of a user's own, whose fields are named otherwise, runs the generic suite with them."""
    flags = {arg.removeprefix("--") for arg in [*QUICK, *SIGNAL_RUN] if arg.startswith("--")}
    assert flags - {field.name for field in dataclasses.fields(TrainConfig)} == set()


def test_a_new_default_keeps_whether_a_field_may_change_on_resume() -> None:
    """A checkpoint is continued with other session fields, never with other settings; a subclass that only
    changes a default keeps what TrainConfig's part declared the field to be."""

    @dataclasses.dataclass
    class Own(task.Config):
        eval_every: int = 7
        num_epochs: int = 3

    defining = set(run_defining_fields(Own()))
    assert {"num_epochs", "learning_rate", "global_batch_size", "seed", "best_metric"} <= defining
    assert not {"eval_every", "output_dir", "per_device_batch_size", "mixed_precision", "tracker"} & defining
