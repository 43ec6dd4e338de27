"""The run's configuration: one typed dataclass, filled from a YAML file and command-line flags.

Precedence is flag > YAML > default. Anything that is not a field, or not of the field's type,
stops the run before training with the file (or flag) and the key named.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import yaml


@dataclass
class TrainConfig:
    # Where this run writes metrics, checkpoints and the exported model.
    output_dir: str = "outputs/digits"
    seed: int = 42

    # Data and model of the default example; add your own fields here.
    eval_fraction: float = 0.2
    augment_noise: float = 0.05  # std of the Gaussian pixel noise added to training images; 0 = off
    num_workers: int = 0
    hidden_size: int = 256
    dropout: float = 0.1

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

    # Bookkeeping, all counted in optimizer steps.
    log_every: int = 10
    eval_every: int = 0  # 0 = at the end of every epoch
    # The evaluation metric that picks best_model/ (kept apart from the rotating checkpoints) and
    # that early stopping watches: stop after `early_stopping_patience` evaluations without a new
    # best (0 = never stop early).
    best_metric: Literal["eval/accuracy", "eval/loss"] = "eval/accuracy"
    early_stopping_patience: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    # auto: continue from the newest valid checkpoint in output_dir, if any; never; or a checkpoint path.
    resume: str = "auto"
    tracker: Literal[{% if cookiecutter.tracker != "none" %}"{{ cookiecutter.tracker }}", {% endif %}"none"] = "{{ cookiecutter.tracker }}"


# Fields that define the optimization: a checkpoint continues only a run with the same values.
# The others (batch split, precision, logging, output) may change between sessions and platforms.
RUN_DEFINING_FIELDS = (
    "seed",
    "eval_fraction",
    "augment_noise",
    "hidden_size",
    "dropout",
    "num_epochs",
    "global_batch_size",
    "learning_rate",
    "weight_decay",
    "warmup_steps",
    "max_grad_norm",
    "best_metric",
)

# Whether a higher or a lower value of each `best_metric` choice is better.
METRIC_GOALS = {"eval/accuracy": "max", "eval/loss": "min"}


class ConfigError(ValueError):
    """A configuration problem, worded for the person who has to fix the file or flag."""


# Each check is (field, predicate, what the value must be).
_CHECKS: list[tuple[str, typing.Callable[[Any], bool], str]] = [
    ("output_dir", lambda v: v.strip() != "", "a non-empty path"),
    ("eval_fraction", lambda v: 0 < v < 1, "between 0 and 1 (exclusive)"),
    ("augment_noise", lambda v: v >= 0, ">= 0"),
    ("num_workers", lambda v: v >= 0, ">= 0"),
    ("hidden_size", lambda v: v > 0, "> 0"),
    ("dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
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
    ("keep_checkpoints", lambda v: v > 0, "> 0"),
    ("resume", lambda v: v in ("auto", "never") or Path(v).is_dir(), "auto, never or a checkpoint folder"),
]


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in fields(TrainConfig)}


def _nearest(key: str, options: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _coerce(key: str, value: Any, kind: Any, where: str) -> Any:
    """Return `value` as the field's type, or raise a ConfigError that names `where` and `key`."""
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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads "1e-3" as a string; accept any numeric text.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str and isinstance(value, str):
        return value
    raise ConfigError(f"{where}: {key} must be {kind.__name__}, got {value!r} ({type(value).__name__})")


def read_yaml(path: Path) -> dict[str, Any]:
    """The typed values set in a YAML config file; unknown keys and wrong types raise ConfigError."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (pass --config path/to/file.yaml)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(raw).__name__}")
    types = _field_types()
    values = {}
    for key, value in raw.items():
        if key not in types:
            raise ConfigError(f"{path}: unknown key {key!r}{_nearest(str(key), types)}")
        values[key] = _coerce(key, value, types[key], str(path))
    return values


def check_values(config: TrainConfig, sources: dict[str, str]) -> None:
    """Reject values of the right type but outside their range, naming where each came from."""
    for key, is_valid, expected in _CHECKS:
        value = getattr(config, key)
        if not is_valid(value):
            where = sources.get(key, "default")
            raise ConfigError(f"{where}: {key}={value!r} is invalid: it must be {expected}")


def load_config(argv: list[str] | None, default_path: str | Path) -> tuple[TrainConfig, Path]:
    """Build the config from `--config FILE` (default `default_path`) and `--field value` flags."""
    types = _field_types()
    parser = argparse.ArgumentParser(description="Train with Accelerate.", allow_abbrev=False)
    parser.add_argument("--config", type=Path, default=Path(default_path), help="YAML file")
    for name in types:
        parser.add_argument(f"--{name}", metavar="VALUE", help=f"override {name}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0]
        hint = _nearest(flag.lstrip("-").split("=")[0], types)
        raise ConfigError(f"unknown argument {flag!r}{hint}; each config field is a --field flag")

    values = read_yaml(args.config)
    sources = {key: str(args.config) for key in values}
    for name, kind in types.items():
        text = getattr(args, name)
        if text is not None:
            values[name] = _coerce(name, text, kind, f"--{name}")
            sources[name] = f"--{name}"
    config = TrainConfig(**values)
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
