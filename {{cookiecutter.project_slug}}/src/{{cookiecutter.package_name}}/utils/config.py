"""The run's configuration: one typed dataclass, filled from a YAML file and command-line flags.

Precedence is flag > YAML > default. Anything that is not a field, or not of the field's type,
stops the run before training with the file (or flag) and the key named.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

# Hours, minutes, seconds, each optional but in this order: what `time_budget` accepts.
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")
DURATION_FORMS = "a duration such as 11h40m, 90m, 45s or 1.5h (h, m, s in this order)"

# (field, predicate, what the value must be): checked after loading, naming where a bad value came from.
Check = tuple[str, typing.Callable[[Any], bool], str]


@dataclass
class TrainConfig:
    """The fields every task shares. A task adds its own (data, model) in task.py's `Config`, a subclass,
    which may also change the defaults below."""

    # Where this run writes metrics, checkpoints and the exported model; a relative path is relative to
    # the project folder (where train.py is), whatever the working directory. One run at a time per folder.
    output_dir: str = "outputs/run"
    seed: int = 42
    num_workers: int = 0  # DataLoader worker processes

    # Optimization. Accumulation is derived, never set: global = per_device x processes x accumulation,
    # so the same file gives the same optimization on 1 CPU, 1 GPU or 8 GPUs.
    num_epochs: int = 20
    # Stop after this many optimizer steps (0 = no cap). The LR schedule stays sized by num_epochs,
    # so a later run with a higher cap continues exactly where this one stopped.
    max_steps: int = 0
    per_device_batch_size: int = 32
    global_batch_size: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"

    # Memory and speed, both off by default. auto_batch_size: if per_device_batch_size does not fit
    # on the device, use the largest that does and raise accumulation to keep global_batch_size.
    auto_batch_size: bool = False
    compile: bool = False  # torch.compile the model after prepare (slow start, faster steps)
    # Deterministic kernels: on a GPU, what makes a rerun or a resumed run bitwise equal. An op that has
    # none stops the run with its name; false = a little faster, reruns equal up to float rounding.
    deterministic: bool = True

    # Bookkeeping, all counted in optimizer steps.
    log_every: int = 10
    eval_every: int = 0  # 0 = at the end of every epoch
    # The evaluation metric (a key of METRIC_GOALS) that picks best_model/ (kept apart from the rotating
    # checkpoints) and that early stopping watches: stop after `early_stopping_patience` evaluations
    # without a new best (0 = never stop early).
    best_metric: str = "eval/loss"
    early_stopping_patience: int = 0
    checkpoint_every: int = 100
    # Also checkpoint at the first logging step after this many minutes without a checkpoint (0 = off):
    # caps the work a lost session costs when steps are slow. A fraction of a minute is allowed.
    checkpoint_every_minutes: float = 0.0
    keep_checkpoints: int = 3
    # How long this session may train, counted once train.py has loaded PyTorch: e.g. 11h40m, 90m, 45s or
    # 1.5h; empty (or 0s) = no limit. When the next logging interval, a checkpoint and the export would
    # not fit in what is left (estimated from this run's own slowest interval and checkpoint), the run
    # checkpoints, exports model/, draws its curves and exits with status 75: run it again to continue.
    time_budget: str = ""
    # auto: continue from the newest valid checkpoint in output_dir, if any; never; or a checkpoint path.
    resume: str = "auto"
    # When output_dir holds a run this one cannot continue (other settings, no readable checkpoint,
    # resume: never): false refuses to start; true moves that run's files to output_dir/set_aside/<time>/
    # and starts over. Nothing is deleted either way.
    start_over: bool = False
    # Stop as diverged after this many optimizer steps in a row that fp16's loss scaler skipped (overflowing
    # gradients; a few at the start are normal). A non-finite loss or weight stops the run at once.
    fp16_skip_patience: int = 25
    tracker: Literal[{% if cookiecutter.tracker != "none" %}"{{ cookiecutter.tracker }}", {% endif %}"none"] = "{{ cookiecutter.tracker }}"

    # What the task's evaluation reports, and whether a higher or a lower value is better.
    METRIC_GOALS: ClassVar[dict[str, Literal["max", "min"]]] = {"eval/loss": "min"}
    # Fields that may change between sessions and platforms (batch split, precision, logging, output).
    # Every other field defines the optimization: a checkpoint continues only a run with the same values.
    SESSION_FIELDS: ClassVar[tuple[str, ...]] = (
        "output_dir",
        "num_workers",
        "max_steps",
        "per_device_batch_size",
        "mixed_precision",
        "auto_batch_size",
        "compile",
        "deterministic",
        "log_every",
        "eval_every",
        "early_stopping_patience",
        "checkpoint_every",
        "checkpoint_every_minutes",
        "keep_checkpoints",
        "time_budget",
        "resume",
        "start_over",
        "fp16_skip_patience",
        "tracker",
    )
    CHECKS: ClassVar[list[Check]] = [
        ("output_dir", lambda v: v.strip() != "", "a non-empty path"),
        ("seed", lambda v: 0 <= v < 2**32, "between 0 and 2**32 - 1"),
        ("num_workers", lambda v: v >= 0, ">= 0"),
        ("num_epochs", lambda v: v > 0, "> 0"),
        ("max_steps", lambda v: v >= 0, ">= 0 (0 means no cap)"),
        ("per_device_batch_size", lambda v: v > 0, "> 0"),
        ("global_batch_size", lambda v: v > 0, "> 0"),
        ("learning_rate", lambda v: v > 0, "> 0"),
        ("weight_decay", lambda v: v >= 0, ">= 0"),
        ("warmup_steps", lambda v: v >= 0, ">= 0"),
        ("max_grad_norm", lambda v: v > 0, "> 0"),
        ("log_every", lambda v: v > 0, "> 0"),
        ("eval_every", lambda v: v >= 0, ">= 0 (0 means every epoch)"),
        ("early_stopping_patience", lambda v: v >= 0, ">= 0 (0 means never stop early)"),
        ("checkpoint_every", lambda v: v > 0, "> 0"),
        ("checkpoint_every_minutes", lambda v: v >= 0, ">= 0 (0 means only every checkpoint_every steps)"),
        ("time_budget", lambda v: parse_duration(v) is not None, f"{DURATION_FORMS}, or empty for no limit"),
        ("keep_checkpoints", lambda v: v > 0, "> 0"),
        ("fp16_skip_patience", lambda v: v > 0, "> 0"),
        ("resume", lambda v: v in ("auto", "never") or Path(v).is_dir(), "auto, never or a checkpoint path"),
    ]


def parse_duration(text: str) -> float | None:
    """Seconds in a duration such as 11h40m, 90m, 45s or 1.5h (0 for an empty text), None if it is not one."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        return None
    hours, minutes, seconds = (float(part or 0) for part in match.groups())
    return 3600 * hours + 60 * minutes + seconds


def run_defining_fields(config: TrainConfig) -> list[str]:
    """The fields a resumed run must share with its checkpoint."""
    return [f.name for f in fields(config) if f.name not in config.SESSION_FIELDS]


class ConfigError(ValueError):
    """A configuration problem, worded for the person who has to fix the file or flag."""


def _field_types(config_class: type[TrainConfig]) -> dict[str, Any]:
    hints = typing.get_type_hints(config_class)
    return {f.name: hints[f.name] for f in fields(config_class)}


def _nearest(key: str, options: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _coerce(key: str, value: Any, kind: Any, where: str, forms: str = "") -> Any:
    """Return `value` as the field's type, or raise a ConfigError that names `where` and `key` (and the
    `forms` the field accepts, if given)."""
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if value in choices:
            return value
        hint = _nearest(str(value), choices)
        raise ConfigError(f"{where}: {key}={value!r} is not one of {list(choices)}{hint}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif kind is float:
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        # YAML 1.1 reads "1e-3" as a string; accept any numeric text.
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, float):  # inf and nan pass any range check, and train NaN
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {key} must be a finite number, got {value!r}")
            return value
    elif kind is str and isinstance(value, str):
        return value
    hint = f": it must be {forms}" if forms else ""
    raise ConfigError(f"{where}: {key} must be {kind.__name__}, got {value!r} ({type(value).__name__}){hint}")


def read_yaml(path: Path, config_class: type[TrainConfig]) -> dict[str, Any]:
    """The typed values set in a YAML config file; unknown keys and wrong types raise ConfigError."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (pass --config path/to/file.yaml)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(raw).__name__}")
    types = _field_types(config_class)
    # What a text field accepts, for a number written where text was expected (time_budget: 90).
    text_forms = {name: forms for name, _, forms in config_class.CHECKS if types.get(name) is str}
    values = {}
    for key, value in raw.items():
        if key not in types:
            raise ConfigError(f"{path}: unknown key {key!r}{_nearest(str(key), types)}")
        values[key] = _coerce(key, value, types[key], str(path), text_forms.get(key, ""))
    return values


def check_values(config: TrainConfig, sources: dict[str, str]) -> None:
    """Reject values of the right type but outside their range, naming where each came from."""
    for key, is_valid, expected in config.CHECKS:
        value = getattr(config, key)
        if not is_valid(value):
            where = sources.get(key, "default")
            raise ConfigError(f"{where}: {key}={value!r} is invalid: it must be {expected}")
    if config.best_metric not in config.METRIC_GOALS:
        where = sources.get("best_metric", "default")
        hint = _nearest(config.best_metric, config.METRIC_GOALS)
        raise ConfigError(
            f"{where}: best_metric={config.best_metric!r} is not one of {list(config.METRIC_GOALS)}{hint}"
        )


def load_config(
    argv: list[str] | None, default_path: str | Path, config_class: type[TrainConfig]
) -> tuple[TrainConfig, Path]:
    """Build a `config_class` (task.Config) from `--config FILE` (default `default_path`) and `--field value`
    flags."""
    types = _field_types(config_class)
    parser = argparse.ArgumentParser(description="Train with Accelerate.", allow_abbrev=False)
    parser.add_argument("--config", type=Path, default=Path(default_path), help="YAML file")
    for name in types:
        parser.add_argument(f"--{name}", metavar="VALUE", help=f"override {name}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0]
        hint = _nearest(flag.lstrip("-").split("=")[0], types)
        raise ConfigError(f"unknown argument {flag!r}{hint}; each config field is a --field flag")

    values = read_yaml(args.config, config_class)
    sources = {key: str(args.config) for key in values}
    for name, kind in types.items():
        text = getattr(args, name)
        if text is not None:
            values[name] = _coerce(name, text, kind, f"--{name}")
            sources[name] = f"--{name}"
    config = config_class(**values)
    # "$SCRATCH/runs/digits" or "~/runs": cluster paths differ per user.
    config.output_dir = os.path.expanduser(os.path.expandvars(config.output_dir))
    if "$" in config.output_dir:
        where = sources.get("output_dir", "default")
        raise ConfigError(f"{where}: output_dir={config.output_dir!r} names an unset environment variable")
    check_values(config, sources)
    return config, args.config


def save_config(config: TrainConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))


def gradient_accumulation_steps(config: TrainConfig, num_processes: int) -> int:
    """Accumulation steps that keep `global_batch_size`; a ConfigError that says what works otherwise."""
    per_step = config.per_device_batch_size * num_processes
    if config.global_batch_size % per_step == 0:
        return config.global_batch_size // per_step
    lower = max(per_step, config.global_batch_size // per_step * per_step)
    per_process, remainder = divmod(config.global_batch_size, num_processes)
    divisors = [d for d in range(1, per_process + 1) if per_process % d == 0] if remainder == 0 else []
    hint = f"set global_batch_size to a multiple of {per_step} (e.g. {lower} or {lower + per_step})"
    if divisors:
        hint += f", or per_device_batch_size to one of {divisors[-8:]}"
    raise ConfigError(
        f"global_batch_size={config.global_batch_size} is not divisible by per_device_batch_size "
        f"({config.per_device_batch_size}) x processes ({num_processes}) = {per_step}: {hint}"
    )
