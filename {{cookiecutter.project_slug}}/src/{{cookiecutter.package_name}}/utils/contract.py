"""task.py's functions are all there and take what train.py and predict.py pass: checked before the config is
read, without torch (microseconds), so that a missing `predict_inputs` is not found after a whole run.

What each function must return is checked on two samples by task_check.py; this is only the shape of the
module: a name that is missing, or a function that takes other arguments than the contract passes.
"""

from __future__ import annotations

import inspect
from types import ModuleType

from .config import ConfigError, TrainConfig

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
# Optional: without them, model.safetensors holds the state dict (utils/checkpoint.py).
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
        if not callable(function):
            raise ConfigError(f"task.py's {name} is a {type(function).__name__}: the contract wants {call}")
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
