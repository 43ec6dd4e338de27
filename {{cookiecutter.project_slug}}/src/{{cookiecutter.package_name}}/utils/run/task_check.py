"""The task's contract (task.py), checked on two real samples and a fresh model on the CPU before a run takes
its folder: a breach, or an exception in a task function, is one line naming it (docs/own-task.md)."""

from __future__ import annotations

import contextlib
import inspect
import math
import random
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ... import task
from ..config import ConfigError, TrainConfig
from ..training.resume_check import batch_tensors

SAMPLES = 2  # a batch of two: enough to tell a per-sample value from a per-batch one


class TaskError(ConfigError):
    """A breach of task.py's contract, in one line."""


def check_task(
    config: TrainConfig, train_set: Dataset, eval_set: Dataset, predict_inputs: int = 1
) -> list[str]:
    """Run task.py's functions on a few samples (`predict` on `predict_inputs`); raise TaskError on a breach,
    return warnings to print. The random streams are left as they were: the run trains as without it."""
    with kept_random_state([]):  # CPU only: the check builds its model there
        train_batch = _first_batch(train_set, "training")
        eval_batch = _first_batch(eval_set, "eval")
        _rows(train_batch)
        rows = _rows(eval_batch)
        model = _call("build_model(config)", task.build_model, config)
        if not isinstance(model, torch.nn.Module):
            raise TaskError(
                f"build_model(config) returned {_describe(model)}: the contract wants a torch.nn.Module"
            )
        warnings = _check_loss(model, train_batch)
        _check_metrics(config, _check_eval_step(model, eval_batch, rows))
        _check_predict(config, model.eval(), predict_inputs)
        return warnings


def build_datasets(config: TrainConfig) -> tuple[Dataset, Dataset]:
    """task.build_datasets(config), checked: two sets, each map-style (or a train stream), neither empty."""
    sets = _call("build_datasets(config)", task.build_datasets, config)
    if not (isinstance(sets, list | tuple) and len(sets) == 2):
        raise TaskError(
            f"build_datasets(config) returned {_describe(sets)}: the contract wants two datasets, "
            "(train_set, eval_set)"
        )
    _check_sets(*sets)
    return sets[0], sets[1]


def _check_sets(train_set: Dataset, eval_set: Dataset) -> None:
    for name, dataset in (("train", train_set), ("eval", eval_set)):
        if name == "train" and isinstance(dataset, IterableDataset):
            continue  # a stream (utils/training/streams.py checks what it needs)
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TaskError(
                f"build_datasets returned a {type(dataset).__name__} as the {name} set: the contract wants "
                "a map-style dataset (with __len__ and __getitem__), or to train, a stream (IterableDataset)"
            )
        if len(dataset) == 0:
            raise TaskError(
                f"build_datasets returned an empty {name} set (a {type(dataset).__name__} of 0 samples): the "
                "contract wants samples in both sets; check the path or the split that selects them"
            )


def _check_loss(model: torch.nn.Module, train_batch: Any) -> list[str]:
    """loss on a training batch: a finite scalar with a gradient; warnings for buffers it changed."""
    model.train()
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    # The model as the loop passes it (TaskModel): what loss may use of it is the same on 1 and N processes.
    loss = _call("loss(model, batch)", task.loss, TaskModel(model, model, training=True), train_batch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        raise TaskError(
            f"loss(model, batch) returned {_describe(loss)} for a batch of {SAMPLES} samples: the contract "
            "wants the batch's mean loss, a scalar floating-point tensor (shape []); for per-sample losses "
            "take their .mean()"
        )
    if not loss.requires_grad:
        raise TaskError(
            "loss(model, batch) returned a tensor that does not require grad: compute it from the model's "
            "output, outside torch.no_grad()"
        )
    if not math.isfinite(loss.item()):
        raise TaskError(f"loss(model, batch) is {loss.item()} on {SAMPLES} samples with the initial weights")
    loss.backward()
    return _changed_buffers(model, buffers)


def _check_eval_step(model: torch.nn.Module, eval_batch: Any, rows: int) -> Mapping:
    """eval_step on an eval batch: a dict of named tensors with one value per sample."""
    model.eval()
    with torch.no_grad():
        values = _call("eval_step(model, batch)", task.eval_step, TaskModel(model, model), eval_batch)
    if not isinstance(values, Mapping) or not values:
        raise TaskError(
            f"eval_step(model, batch) returned {_describe(values)}: the contract wants a dict of named "
            "tensors with one value per sample, e.g. {'loss': per_sample_losses}"
        )
    for name, value in values.items():
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (rows,):
            columns = isinstance(value, torch.Tensor) and value.dim() == 2 and len(value) == rows
            way_out = f"; return one name per column ('{name}_0': v[:, 0], ...), stacked in metrics" * columns
            raise TaskError(
                f"eval_step(model, batch) returned {_describe(value)} as {name!r} for a batch of {rows} "
                f"samples: the contract wants one value per sample, a tensor of shape [{rows}]{way_out}"
            )
    return values


def _check_metrics(config: TrainConfig, values: Mapping) -> None:
    """metrics on eval_step's values: Python numbers, every one METRIC_GOALS names among them."""
    results = _call("metrics(values, config)", task.metrics, dict(values), config)
    if not isinstance(results, Mapping):
        raise TaskError(
            f"metrics(values, config) returned {_describe(results)}: the contract wants a dict of metric "
            "name -> number"
        )
    for name, value in results.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise TaskError(
                f"metrics(values, config) returned {_describe(value)} as {name!r}: the contract wants a "
                "Python number (a tensor's .item())"
            )
    if missing := [name for name in config.METRIC_GOALS if name not in results]:
        raise TaskError(
            f"metrics(values, config) returned {sorted(results)}, without {missing}, which METRIC_GOALS "
            "names (best_metric is one of them): return every metric of METRIC_GOALS, or remove it there"
        )


def _check_predict(config: TrainConfig, model: torch.nn.Module, samples: int) -> None:
    inputs = _call("predict_inputs(config, None)", task.predict_inputs, config, None)
    if not (hasattr(inputs, "__len__") and hasattr(inputs, "__getitem__")) or len(inputs) == 0:
        raise TaskError(
            f"predict_inputs(config, None) returned {_describe(inputs)}: the contract wants the eval split, "
            "a map-style dataset that is not empty"
        )
    count = min(samples, len(inputs))
    batch = _call("collate(items of predict_inputs)", task.collate, [inputs[i] for i in range(count)])
    with torch.no_grad():
        check_rows(_call("predict(model, batch, config)", task.predict, model, batch, config), count)


def check_rows(predicted: Any, count: int) -> None:
    """What `predict` returned for a batch of `count` inputs: a list of `count` rows, or a TaskError."""
    if not isinstance(predicted, list) or len(predicted) != count:
        raise TaskError(
            f"predict(model, batch, config) returned {_describe(predicted)} for a batch of {count} inputs: "
            f"the contract wants a list of {count} rows (dicts of column -> value), one per input"
        )
    if bad := next((row for row in predicted if not isinstance(row, Mapping)), None):
        raise TaskError(
            f"predict(model, batch, config) returned a row that is {_describe(bad)}: the contract wants a "
            "dict of column -> value per input"
        )


class TaskModel:
    """The model as loss and eval_step get it: called, it runs `forward` (the prepared model: DDP, compile);
    attributes come from `model`, the module build_model returned. In loss (`training`), a submodule with
    parameters or a method of the model's own is refused: it would skip DDP's gradient sync."""

    def __init__(self, forward: Callable[..., Any], model: torch.nn.Module, training: bool = False) -> None:
        self._forward = forward
        self._model = model
        self._training = training

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._model, name)
        shared = name != "forward" and hasattr(torch.nn.Module, name)  # parameters(), training, ...
        weighted = isinstance(value, torch.nn.Module) and any(True for _ in value.parameters())
        if self._training and not shared and (weighted or inspect.ismethod(value)):
            raise TaskError(
                f"loss(model, batch) calls model.{name}: on several processes only model(...) itself syncs "
                "the gradients (DDP), so 1 and N processes would train differently; compute the loss from "
                "what model(...) returns (its forward may return several outputs)"
            )
        return value


def _first_batch(dataset: Dataset, split: str) -> Any:
    """The first items as the loop gets them: through the dataset's `__getitems__` if any, by task.collate."""
    loader = DataLoader(dataset, batch_size=SAMPLES, collate_fn=task.collate)
    batch = _call(f"collate(the first {SAMPLES} {split} samples)", lambda: next(iter(loader)))
    tensors = list(batch_tensors(batch))
    if not tensors:
        raise TaskError(
            f"collate(samples) returned {_describe(batch)}: the contract wants a tensor, a tuple/list or a "
            "mapping of tensors, each with one row per sample"
        )
    return batch


def _rows(batch: Any) -> int:
    """The number of samples in a collated batch; TaskError if its tensors disagree."""
    sizes = {tuple(t.shape[:1]) for t in batch_tensors(batch)}
    if len(sizes) != 1 or () in sizes:
        shapes = [list(t.shape) for t in batch_tensors(batch)]
        raise TaskError(
            f"collate(samples) returned tensors of shapes {shapes}: the contract wants one row per sample in "
            "each (train.py cuts micro-batches along the first dimension)"
        )
    return sizes.pop()[0]


# Running statistics of normalization layers: train.py makes them agree on any number of processes.
_NORM_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _changed_buffers(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """A warning naming buffers other than normalization statistics that a training forward changed."""
    norms = {
        f"{prefix}.{stat}" if prefix else stat
        for prefix, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._NormBase)
        for stat in _NORM_STATS
    }
    changed = [
        name
        for name, value in model.named_buffers()
        if name not in norms and name in before and not torch.equal(value, before[name])
    ]
    if not changed:
        return []
    return [
        f"the model's forward changes the buffer(s) {changed[:5]}: each process updates its own from its "
        "micro-batches until DDP copies the main process's, so 1 and N processes train differently (train.py "
        "keeps BatchNorm's running statistics equal on any layout, not other buffers)"
    ]


def _call(what: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`; an exception becomes a TaskError naming the contract's function and the line."""
    try:
        return function(*args)
    except ConfigError:  # the task's own one-line errors (a missing data file) are already worded
        raise
    except Exception as error:
        package = Path(task.__file__).parent
        frames = traceback.extract_tb(error.__traceback__)
        ours = [frame for frame in frames if Path(frame.filename).is_relative_to(package)]
        where = f" at {Path(ours[-1].filename).relative_to(package.parent)}:{ours[-1].lineno}" if ours else ""
        text = (str(error).splitlines() or [""])[0]
        raise TaskError(
            f"task.py's {what} raised {type(error).__name__}{where}: {text} (in the task check on "
            f"{SAMPLES} samples; python train.py --check_task shows the traceback)"
        ) from error


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, list | tuple) and len(value) <= 4:
        return f"a {type(value).__name__} of {[_describe(item) for item in value]}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with the keys {list(value)[:8]}"
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"{value!r}"[:80] if isinstance(value, int | float | str | None) else f"a {type(value).__name__}"


@contextlib.contextmanager
def kept_random_state(devices: list[Any]) -> Iterator[None]:
    """Python's, NumPy's and torch's generators (on `devices`) left as they were by what runs inside."""
    python_state = random.getstate()
    numpy_state = numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)


def command(read_config: Callable[[list[str] | None], tuple[TrainConfig, Any, list[str]]]) -> int | str:
    """`python train.py --check_task [--config FILE] [--field value ...]`: check task.py; write nothing."""
    try:
        config = read_config(None)[0]
        train_set, eval_set = build_datasets(config)
        warnings = check_task(config, train_set, eval_set, predict_inputs=SAMPLES)
    except ConfigError as error:
        if isinstance(error, TaskError) and error.__cause__ is not None:
            traceback.print_exception(error.__cause__)
        return f"config error: {error}"
    for warning in warnings:
        print(f"WARNING: {warning}")
    train_size = "a stream" if isinstance(train_set, IterableDataset) else f"{len(train_set)} samples"
    print(
        f"task.py follows the contract: datasets of {train_size} and {len(eval_set)} samples, every "
        f"function checked on {SAMPLES} samples"
    )
    return 0
