"""The run's configuration: one typed dataclass, filled from a YAML file and command-line flags; precedence,
and the errors that stop a run before training: docs/configuration.md."""

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

from .checkpoints.durable import write_atomically

# Hours, minutes, seconds, each optional but in this order: what `time_budget` accepts.
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")
DURATION_FORMS = "a duration such as 11h40m, 90m, 45s or 1.5h (h, m, s in this order)"

TRACKERS = ("tensorboard", "wandb", "mlflow", "none")  # what `tracker` names, several at once (a,b)
# (field, predicate, what the value must be): checked after loading, naming where a bad value came from.
Check = tuple[str, typing.Callable[[Any], bool], str]


def setting(default: Any, meaning: str) -> Any:
    """A config field with its one-line meaning (`train.py --help` shows it with the default and the allowed
    values) that defines the optimization: a checkpoint continues only a run with the same value."""
    return dataclasses.field(default=default, metadata={"help": meaning})


def session(default: Any, meaning: str) -> Any:
    """A `setting` that may change between sessions and platforms (batch split, precision, logging,
    output): a run continues with another value."""
    return dataclasses.field(default=default, metadata={"help": meaning, "session": True})


def _declared(config_class: type) -> dict[str, Any]:
    """Each field's metadata (its meaning, whether it is a `session` field) from the class that declared it:
    a subclass's plain `name: type = value` changes the default, not what the field is."""
    declared = (vars(cls).get("__dataclass_fields__", {}) for cls in reversed(config_class.__mro__))
    return {name: f.metadata for own in declared for name, f in own.items() if "help" in f.metadata}


@dataclass
class RunConfig:
    """The run: its folder, where it continues from, how long it may train, what it reports."""

    # A relative output_dir is taken from the project folder (utils/run/cli.py).
    output_dir: str = session(
        "outputs/run", "where this run writes metrics, checkpoints and the model (one run per folder)"
    )
    seed: int = setting(42, "seeds the weights, dropout, the data split and the data order")
    mirror_dir: str = session(
        "", "a second, persistent copy of the run, written in the background and verified ('': none)"
    )
    import_from: str = session("", "where to look for newer copies of this run to continue ('': nowhere)")
    start_over: bool = session(
        False, "where output_dir holds a run this one cannot continue, move it to set_aside/ (false: refuse)"
    )
    resume_from: str = session("", "go back to this checkpoint: a step, a folder or a URL (docs/resume.md)")
    time_budget: str = session("", "how long this session may train, e.g. 11h40m, 90m, 45s ('': no limit)")
    log_every: int = session(10, "log the train loss every this many optimizer steps")
    tracker: str = session("{{ cookiecutter.tracker }}", "experiment trackers (a,b or a YAML list); metrics.jsonl too")


@dataclass
class DataConfig:
    """The data: how it is loaded."""

    num_workers: int = session(
        -1, "DataLoader worker processes (0: load in the training process; -1: 2 for a stream, else 0)"
    )


@dataclass
class OptimizationConfig:
    """The optimization. Accumulation is derived, never set: global = per_device x processes x accumulation,
    so the same file gives the same optimization on 1 CPU, 1 GPU or 8 GPUs."""

    num_epochs: int = setting(20, "length of training, which sizes the learning-rate schedule")
    max_steps: int = session(0, "stop after this many optimizer steps")
    per_device_batch_size: int = session(32, "samples per process per forward pass: fit it to the device")
    global_batch_size: int = setting(64, "samples per optimizer step, over all processes and accumulation")
    learning_rate: float = setting(3e-3, "AdamW's peak learning rate, after warmup, then lr_schedule's decay")
    weight_decay: float = setting(0.01, "AdamW's weight decay")
    warmup_steps: int = setting(20, "optimizer steps of linear learning-rate warmup")
    lr_schedule: Literal["cosine", "wsd"] = setting("cosine", "after warmup: cosine, or wsd (docs/resume.md)")
    decay_fraction: float = setting(0.2, "wsd: the share of the planned steps over which the rate decays")
    max_grad_norm: float = setting(1.0, "gradients are clipped to this norm")
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = session(
        "auto", "auto: bf16 on GPUs of compute capability 8.0+, fp16 on older ones, no on the CPU"
    )
    auto_batch_size: bool = session(False, "on out of memory: smaller per-device batches, more accumulation")
    compile: bool = session(False, "torch.compile the model (slow start, faster steps)")
    find_lr: bool = session(False, "instead of training: a learning-rate range test, lr_find.png")
    deterministic: bool = session(True, "deterministic kernels: bitwise-equal reruns and resumes on a GPU")
    # A few steps skipped at the start are normal.
    fp16_skip_patience: int = session(
        25, "stop as diverged after this many optimizer steps in a row skipped by fp16's loss scaler"
    )
    # A non-finite loss or weight, or a loss spike: back to a checkpoint, past the data (docs/resume.md).
    max_rollbacks: int = session(3, "rollbacks per run; one more divergence stops it (0: stop at the first)")
    rollback_margin: int = session(10, "optimizer steps of data a rollback skips beyond the bad step")
    # Off by default: near convergence a tiny loss's noise is many times its median (0.0018 vs 0.00019).
    loss_spike_factor: float = session(
        0.0, "a logged train loss above this times the median of the last 5 logged is a spike (0: off)"
    )


@dataclass
class CheckpointConfig:
    """What the run keeps: checkpoints, best_model/ (apart from the rotating checkpoints, picked by
    evaluation) and the exported model, all counted in optimizer steps."""

    eval_every: int = session(0, "evaluate every this many optimizer steps")
    best_metric: str = setting("eval/loss", "the eval metric that picks best_model/ and early stopping")
    early_stopping_patience: int = session(0, "stop after this many evaluations without a better best_metric")
    # Checkpoints come as often as that takes, as far as their measured cost allows (training/timing.py).
    max_time_lost: str = session("1m", "the most training a kill may cost, e.g. 1m, 30s ('': no such bound)")
    checkpoint_every: int = session(0, "also save a checkpoint every this many optimizer steps (0: off)")
    keep_checkpoints: int = session(3, "how many of the newest checkpoints to keep")
    checkpoint_mode: Literal["background", "sync"] = session(
        "background", "background: write checkpoints while training goes on; sync: the loop waits for them"
    )
    export_dtype: Literal["auto", "bfloat16", "float16", "float32"] = session(
        "auto", "the dtype of the exported weights (auto: as trained)"
    )


@dataclass
class TrainConfig(CheckpointConfig, OptimizationConfig, DataConfig, RunConfig):
    """The fields every task shares, one YAML key and one --flag each. task.py's `Config`, a subclass, adds
    the task's own and may change defaults (a plain `name: type = value` keeps the meaning given above)."""

    # What the task's evaluation reports, and whether a higher or a lower value is better.
    METRIC_GOALS: ClassVar[dict[str, Literal["max", "min"]]] = {"eval/loss": "min"}
    CHECKS: ClassVar[list[Check]] = [
        ("output_dir", lambda v: v.strip() != "", "a non-empty path"),
        ("seed", lambda v: 0 <= v < 2**32, "between 0 and 2**32 - 1"),
        ("num_workers", lambda v: v >= -1, ">= 0, or -1 (2 for a streamed train set, else 0)"),
        ("num_epochs", lambda v: v > 0, "> 0"),
        ("max_steps", lambda v: v >= 0, ">= 0 (0 means no cap)"),
        ("per_device_batch_size", lambda v: v > 0, "> 0"),
        ("global_batch_size", lambda v: v > 0, "> 0"),
        ("learning_rate", lambda v: v > 0, "> 0"),
        ("weight_decay", lambda v: v >= 0, ">= 0"),
        ("warmup_steps", lambda v: v >= 0, ">= 0"),
        ("decay_fraction", lambda v: 0 < v <= 1, "> 0 and <= 1"),
        ("max_grad_norm", lambda v: v > 0, "> 0"),
        ("log_every", lambda v: v > 0, "> 0"),
        ("eval_every", lambda v: v >= 0, ">= 0 (0 means every epoch)"),
        ("early_stopping_patience", lambda v: v >= 0, ">= 0 (0 means never stop early)"),
        ("checkpoint_every", lambda v: v >= 0, ">= 0 (0 means only as max_time_lost needs)"),
        ("max_time_lost", lambda v: parse_duration(v) is not None, f"{DURATION_FORMS}, or empty for none"),
        ("time_budget", lambda v: parse_duration(v) is not None, f"{DURATION_FORMS}, or empty for no limit"),
        ("keep_checkpoints", lambda v: v > 0, "> 0"),
        ("fp16_skip_patience", lambda v: v > 0, "> 0"),
        ("max_rollbacks", lambda v: v >= 0, ">= 0"),
        ("rollback_margin", lambda v: v >= 0, ">= 0"),
        ("loss_spike_factor", lambda v: v == 0 or v > 1, "0 (off) or > 1"),
        ("tracker", lambda v: set(v.split(",")) <= set(TRACKERS), "one or several of " + ", ".join(TRACKERS)),
    ]


def parse_duration(text: str) -> float | None:
    """Seconds in a duration such as 11h40m, 90m, 45s or 1.5h (0 for an empty text), None if it is not one."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        return None
    hours, minutes, seconds = (float(part or 0) for part in match.groups())
    return 3600 * hours + 60 * minutes + seconds


# Run-defining, yet a branch (--resume_from) may change them: they shape the optimizer's steps, not its state.
BRANCH_SETTINGS = ("learning_rate", "weight_decay", "max_grad_norm")


def run_defining_fields(config: TrainConfig) -> list[str]:
    """The fields a resumed run must share with its checkpoint."""
    declared = _declared(type(config))
    return [f.name for f in fields(config) if not declared.get(f.name, {}).get("session")]


class ConfigError(ValueError):
    """A configuration problem, worded for the person who has to fix the file or flag."""


def _field_types(config_class: type[TrainConfig]) -> dict[str, Any]:
    hints = typing.get_type_hints(config_class)
    return {f.name: hints[f.name] for f in fields(config_class)}


def field_help(config_class: type[TrainConfig], name: str) -> str:
    """The meaning of field `name`, as `setting` or `session` declared it."""
    return _declared(config_class).get(name, {}).get("help", "")


def _metavar(config_class: type[TrainConfig], name: str, kind: Any) -> str:
    """What a flag takes, as --help shows it: the choices where there are few, else the type."""
    if typing.get_origin(kind) is Literal:
        return "{" + ",".join(map(str, typing.get_args(kind))) + "}"
    if kind is bool:
        return "{true,false}"
    if name == "best_metric":
        return "{" + ",".join(config_class.METRIC_GOALS) + "}"
    return kind.__name__.upper()


def _flag_help(config_class: type[TrainConfig], name: str, default: Any) -> str:
    shown = str(default).lower() if isinstance(default, bool) else default if default != "" else '""'
    ranges = "".join(f"; {expected}" for key, _, expected in config_class.CHECKS if key == name)
    # argparse expands %-formats in help texts.
    return f"{field_help(config_class, name)} [default: {shown}{ranges}]".replace("%", "%%")


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
        # YAML 1.1 reads "1e-3" as a string; accept any whole number or numeric text.
        if isinstance(value, int | str) and not isinstance(value, bool):
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, float):  # inf and nan pass any range check, and train NaN
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {key} must be a finite number, got {value!r}")
            return value
    elif kind is str and isinstance(value, str):
        return value
    elif key == "tracker" and isinstance(value, list):  # a YAML list: the text that the flag takes
        return ",".join(map(str, value))
    hint = f": it must be {forms}" if forms else ""
    raise ConfigError(f"{where}: {key} must be {kind.__name__}, got {value!r} ({type(value).__name__}){hint}")


# Fields of earlier versions -> what replaced them: a config.yaml that a run or an export saved still loads.
REMOVED_FIELDS = {
    "check_disk_space": "a full disk stops the run with one line, the last checkpoint kept",
    "continue_on_new_data": "a resume on other data is refused: give the run's own data, or start_over: true",
    "resume": "a run continues from its newest valid checkpoint; start_over: true starts it afresh",
    "checkpoint_every_minutes": "set max_time_lost instead (the most training a kill may cost: 1m, 30s)",
}
# Refused where a person sets them (a run's or an export's saved file only warns): one way to say it.
REFUSED_FIELDS = ("checkpoint_every_minutes",)


def read_yaml(
    path: Path, config_class: type[TrainConfig], notes: list[str], saved: bool = False
) -> dict[str, Any]:
    """The typed values set in a YAML config file (`saved`: a run's or an export's); unknown keys and wrong
    types raise ConfigError. Fields that no longer exist are skipped, named in one warning in `notes`."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (pass --config path/to/file.yaml)")
    try:
        # Bytes: PyYAML decodes them (UTF-8, or UTF-16 with a BOM) and names a byte it cannot decode.
        raw = yaml.load(path.read_bytes(), Loader=UniqueKeyLoader) or {}  # a SafeLoader
    except ConfigError as error:  # a key given twice
        raise ConfigError(f"{path}: {error}: keep one of them") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(error)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(raw).__name__}")
    types = _field_types(config_class)
    # What a text field accepts, for a number written where text was expected (time_budget: 90).
    text_forms = {name: forms for name, _, forms in config_class.CHECKS if types.get(name) is str}
    removed = [key for key in raw if key in REMOVED_FIELDS]  # all of them named in one line
    skipped = "" if not saved and any(key in REFUSED_FIELDS for key in removed) else ", skipped"
    gone = "; ".join(f"{key} no longer exists{skipped}: {REMOVED_FIELDS[key]}" for key in removed)
    if gone and not skipped:
        raise ConfigError(f"{path}: {gone}")
    notes.extend([f"{path}: {gone}"] if gone else [])
    values = {}
    for key, value in raw.items():
        if key in REMOVED_FIELDS:
            continue
        if key not in types:
            raise ConfigError(f"{path}: unknown key {key!r}{_nearest(str(key), types)}")
        values[key] = _coerce(key, value, types[key], str(path), text_forms.get(key, ""))
    return values


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice is a ConfigError: PyYAML would keep the last
    silently. (A merge key, `<<:`, is refused as YAML without a constructor: no field takes a mapping.)"""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in lines:
                raise ConfigError(f"key {key!r} is given twice, on line {lines[key]} and on line {line}")
            if isinstance(key, typing.Hashable):
                lines[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_problem(error: yaml.YAMLError) -> str:
    """A parser's several-line message as one line: what is wrong, and where (line and column)."""
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    return f"{where}{problem}" + (f" ({context})" if context else "")


def check_values(config: TrainConfig, sources: dict[str, str]) -> None:
    """Reject values of the right type but outside their range, naming where each came from."""
    for key, is_valid, expected in config.CHECKS:
        value = getattr(config, key)
        where = sources.get(key, "default")
        try:
            valid = is_valid(value)
        except Exception as error:  # the task's own check (e.g. `64 // v` with 0)
            raise ConfigError(
                f"{where}: {key}={value!r}: its check in CHECKS raised {type(error).__name__}: {error}; give "
                f"{key} a value it accepts, or make the check return False for it"
            ) from None
        if not valid:
            raise ConfigError(f"{where}: {key}={value!r} is invalid: it must be {expected}")
    for name, goal in config.METRIC_GOALS.items():
        if goal not in ("max", "min"):  # a typo would silently pick the worst model as best_model/
            raise ConfigError(f"task.py: METRIC_GOALS[{name!r}] is {goal!r}: it must be 'max' or 'min'")
    if config.best_metric not in config.METRIC_GOALS:
        where = sources.get("best_metric", "default")
        hint = _nearest(config.best_metric, config.METRIC_GOALS)
        raise ConfigError(
            f"{where}: best_metric={config.best_metric!r} is not one of {list(config.METRIC_GOALS)}{hint}"
        )


def load_config(
    argv: list[str] | None,
    default_path: str | Path,
    config_class: type[TrainConfig],
    own_flags: tuple[str, ...] = (),
    notes: list[str] | None = None,
    saved: bool = False,
    platforms: typing.Iterable[Path] = (),
) -> tuple[TrainConfig, str]:
    """A `config_class` from `--config FILE` (default_path; read over it if not one of the `platforms`) and
    `--field value` flags, and the file(s) read; `own_flags`: the caller's, for hints; notes: read_yaml's."""
    types = _field_types(config_class)
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--config FILE] [--FIELD VALUE ...]",
        description="Train with Accelerate. Every field is a flag and a key of the YAML --config file: "
        "a flag wins over the file, the file over the platform's file, that over the defaults shown.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"YAML file of field values, read over the platform's {os.path.relpath(default_path)} (another "
        "platform's file replaces it)",
    )
    shared = parser.add_argument_group("fields of every task (TrainConfig, utils/config.py)")
    own = parser.add_argument_group("fields of this task (Config, task.py)")
    for field in fields(config_class):
        group = shared if field.name in TrainConfig.__dataclass_fields__ else own
        group.add_argument(
            f"--{field.name}",
            metavar=_metavar(config_class, field.name, types[field.name]),
            help=_flag_help(config_class, field.name, field.default),
        )
    args, unknown = parser.parse_known_args(argv)
    if (flag := next(iter(unknown), None)) is not None:
        if (name := flag.split("=")[0].removeprefix("--")) in REFUSED_FIELDS:
            raise ConfigError(f"--{name} no longer exists: {REMOVED_FIELDS[name]}")
        hint = _nearest(flag.split("=")[0], [*own_flags, *(f"--{name}" for name in types)])
        raise ConfigError(f"unknown argument {flag!r}{hint}; each config field is a --field flag")
    files = [args.config or Path(default_path)]
    if args.config and platforms and args.config.resolve() not in {path.resolve() for path in platforms}:
        files.insert(0, Path(default_path))
    read = {str(path): read_yaml(path, config_class, [] if notes is None else notes, saved) for path in files}
    values = {key: value for file in read.values() for key, value in file.items()}
    sources = {key: path for path, file in read.items() for key in file}
    for name, kind in types.items():
        text = getattr(args, name)
        if text is not None:
            values[name] = _coerce(name, text, kind, f"--{name}")
            sources[name] = f"--{name}"
    config = config_class(**values)
    for name in ("output_dir", "mirror_dir", "import_from"):
        path = os.path.expanduser(os.path.expandvars(getattr(config, name)))  # "$SCRATCH/runs", "~/runs"
        if "$" in path:
            where = sources.get(name, "default")
            raise ConfigError(f"{where}: {name}={path!r} names an unset environment variable")
        setattr(config, name, path)
    check_values(config, sources)
    return config, " + ".join(read)


def save_config(config: TrainConfig, path: Path, durable: bool = True) -> None:
    """Write the resolved config, whole or not at all: an empty config.yaml would refuse every rerun.
    `durable=False` in a staging folder whose files are flushed to the disk together before its rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), durable)


def gradient_accumulation_steps(config: TrainConfig, num_processes: int) -> int:
    """Accumulation steps that keep `global_batch_size`; a ConfigError that says what works otherwise."""
    per_process, remainder = divmod(config.global_batch_size, num_processes)
    divisors = [d for d in range(1, per_process + 1) if per_process % d == 0] if remainder == 0 else []
    if config.auto_batch_size and divisors:  # it tries sizes down from the largest that divides the share
        config.per_device_batch_size = max(d for d in divisors if d <= config.per_device_batch_size)
    per_step = config.per_device_batch_size * num_processes
    if config.global_batch_size % per_step == 0:
        return config.global_batch_size // per_step
    lower = max(per_step, config.global_batch_size // per_step * per_step)
    hint = f"set global_batch_size to a multiple of {per_step} (e.g. {lower} or {lower + per_step})"
    if divisors:
        hint += f", or per_device_batch_size to one of {divisors[-8:]}"
    raise ConfigError(
        f"global_batch_size={config.global_batch_size} is not divisible by per_device_batch_size "
        f"({config.per_device_batch_size}) x processes ({num_processes}) = {per_step}: {hint}"
    )
