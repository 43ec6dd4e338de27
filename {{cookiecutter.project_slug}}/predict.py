"""Batch predictions from the exported model, on one process or many (docs/outputs.md).

The model is rebuilt from `<model_dir>/config.yaml` and `model.safetensors` with plain PyTorch, or read by
the task's `load_export`. Without --input the eval split is predicted, with labels, and its metrics printed.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.durable import write_atomically
from {{ cookiecutter.package_name }}.utils.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.utils.machine.hardware import (
    choose_cpu_threads,
    cpu_forced,
    detect_platform,
    hide_gpus_from_cpu_run,
    launch_problem,
    main_process_of_launch,
)
from {{ cookiecutter.package_name }}.utils.run.cli import check_contract
from {{ cookiecutter.package_name }}.utils.training.signals import exit_process

# torch, Accelerate and safetensors are imported in main() and load_model(), after the checks: --help and a
# mistake in the command answer before they load (seconds).
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch
    from accelerate import PartialState

PROJECT = Path(__file__).resolve().parent
CONFIGS = PROJECT / "configs"
OWN_FLAGS = ("--model_dir", "--last", "--input", "--output", "--format", "--batch_size")
FLOAT_DIGITS = 6  # fixed, so that files compare byte for byte


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """predict.py's own flags, and the rest (config overrides)."""
    parser = argparse.ArgumentParser(
        description="Predict with the exported model. Other --field value flags override its config.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--model_dir",
        type=Path,
        help="folder with model.safetensors and config.yaml (default: <output_dir of the platform's config, "
        "from the project folder>/best_model, the best evaluation's, where there is one; else model/)",
    )
    parser.add_argument("--last", action="store_true", help="model/, the last step's, not best_model/")
    parser.add_argument(
        "--input",
        type=Path,
        help="a file in the task's input format (task.py: predict_inputs); default: the eval split of the "
        "training data, with labels",
    )
    parser.add_argument(
        "--output", type=Path, help="default: <model_dir>/../predictions.csv (or .jsonl with --format jsonl)"
    )
    parser.add_argument("--format", choices=["csv", "jsonl"], default="csv", help="default: %(default)s")
    parser.add_argument("--batch_size", type=int, default=256, help="per forward pass (default: %(default)s)")
    args, overrides = parser.parse_known_args(argv)
    if args.batch_size <= 0:
        parser.error(f"--batch_size must be > 0, got {args.batch_size}")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    check_contract(task)  # predict_inputs and predict there, taking what this file passes
    # Every check runs on every process, before any prediction: all stop alike, none waits. Those of the
    # command come first, before torch loads.
    if any(token.split("=")[0] == "--config" for token in overrides):
        raise ConfigError(
            "predict.py has no --config: the model is rebuilt from <model_dir>/config.yaml; pass "
            "--model_dir for another model, or --field value to override one of its fields"
        )
    model_dir = args.model_dir if args.model_dir is not None else default_model_dir(args.last)
    output = args.output or model_dir.resolve().parent / f"predictions.{args.format}"
    check_output(output, args.format, given=args.output is not None)
    config = model_config(model_dir, overrides)
    if main_process_of_launch():
        why = best_why(model_dir, config) if args.model_dir is None and model_dir.name == "best_model" else ""
        print(f"predicting with {model_dir}{why} into {output}: loading PyTorch and Accelerate", flush=True)

    hide_gpus_from_cpu_run()  # ACCELERATE_USE_CPU=1 on a GPU machine: before anything touches CUDA
    from accelerate import PartialState

    from {{ cookiecutter.package_name }}.utils.run.task_check import check_rows

    # The process group when started by `accelerate launch`; nothing more. PartialState, unlike the
    # Accelerator, ignores ACCELERATE_USE_CPU: without it, CPU processes would not form a group.
    state = PartialState(cpu=cpu_forced())
    threads = choose_cpu_threads()
    try:
        if unconnected := launch_problem(state.num_processes):
            raise ConfigError(unconnected)
        model = load_model(config, model_dir, overrides)
        model.to(state.device).eval()

        # Every process reads all inputs (small) and fails the same way on a bad file: no process waits.
        inputs = task.predict_inputs(config, args.input)
        if len(inputs) == 0:
            raise ConfigError(f"{args.input or 'the eval split'}: nothing to predict")

        batches = in_batches(state, inputs, args.batch_size, lambda batch: task.predict(model, batch, config))
        for start, rows in zip(range(0, len(inputs), args.batch_size), batches, strict=True):
            check_rows(rows, min(args.batch_size, len(inputs) - start))  # one line, on every process
        # The eval split has labels: its metrics, computed as train.py's evaluation computes them.
        metrics = eval_metrics(state, model, config, args.batch_size) if args.input is None else {}
        if state.is_main_process:
            rows = [row for batch_rows in batches for row in batch_rows]
            write_predictions(output, args.format, rows)
            print(
                f"wrote {len(rows)} predictions to {output} | world size {state.num_processes} | "
                f"device {state.device} | CPU threads {threads}"
            )
            if metrics:
                values = [f"{name} {value:.{FLOAT_DIGITS}f}" for name, value in metrics.items()]
                print("eval split: " + " | ".join(values))
        state.wait_for_everyone()  # no process leaves before the file is complete
    finally:
        state.destroy_process_group()
    return 0


def in_batches(
    state: PartialState, items: Sequence[Any], batch_size: int, step: Callable[[Any], Any]
) -> list[Any]:
    """`step` of each batch of `items` on the state's device, the batches split between the processes;
    the results of all of them, in order, on every process."""
    import torch
    from accelerate.utils import gather_object, send_to_device

    # Whole batches are split, not single items: batch k is always items [k*B, (k+1)*B), so its
    # numbers come out of the same kernels on any number of processes and the files are identical.
    starts = list(range(0, len(items), batch_size))
    done = []
    with state.split_between_processes(starts) as my_starts, torch.no_grad():
        for start in my_starts:
            batch = task.collate([items[i] for i in range(start, min(start + batch_size, len(items)))])
            done.append((start, step(send_to_device(batch, state.device))))
    # Unequal shares (no padding) are fine for gather_object: nothing is duplicated to drop later.
    return [result for _, result in sorted(gather_object(done), key=lambda item: item[0])]


def eval_metrics(
    state: PartialState, model: torch.nn.Module, config: task.Config, batch_size: int
) -> dict[str, float]:
    """The task's metrics (task.py: `eval_step`, `metrics`) over the eval split, in the split's order:
    those that train.py logged for this model, up to the rounding of another batch size."""
    import torch

    eval_set = task.build_datasets(config)[1]

    def step(batch: Any) -> dict[str, torch.Tensor]:
        return {name: values.cpu() for name, values in task.eval_step(model, batch).items()}

    steps = in_batches(state, eval_set, batch_size, step)
    return task.metrics({name: torch.cat([values[name] for values in steps]) for name in steps[0]}, config)


def default_model_dir(last: bool) -> Path:
    """<output_dir>/best_model of the platform's config where the run evaluated, else (or `last`) model/; a
    relative output_dir is taken from the project folder, as train.py does. A new Colab session's disk is
    empty: the model is then read from the run's copy on Drive (mirror_dir)."""
    path = CONFIGS / f"{detect_platform()}.yaml"
    if not path.is_file():
        raise ConfigError(f"{path} (whose output_dir holds the model) does not exist: pass --model_dir")
    platform_config, _ = load_config([], path, task.Config)
    run = PROJECT / platform_config.output_dir
    mirrored = PROJECT / platform_config.mirror_dir
    if not (run / "model").exists() and platform_config.mirror_dir and (mirrored / "model").is_dir():
        run = mirrored
    return run / "model" if last or not (run / "best_model" / "export.json").is_file() else run / "best_model"


def best_why(model_dir: Path, config: task.Config) -> str:
    """Why predict.py took best_model/: ` (<best_metric> <value> at step <N>, the best evaluation; ...)`."""
    export = json.loads((model_dir / "export.json").read_text(encoding="utf-8"))  # written whole, or not
    best = f"{config.best_metric} {export[config.best_metric]:.4f} at step {export['step']}"
    return f" ({best}, the best evaluation; --last for model/, the last step's)"


def check_output(output: Path, fmt: str, given: bool) -> None:
    """Refuse an output that cannot be written (a folder, a path under a file, a folder without write
    permission) before any work, naming it."""
    name = f"--output {output}" if given else f"the default output {output}"
    if output.is_dir():
        raise ConfigError(
            f"{name} is a folder: pass --output with a file path, e.g. {output / f'predictions.{fmt}'}"
        )
    folder = output.parent
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        folder = folder.parent  # the folders that do not exist yet are created
    if not folder.is_dir():
        raise ConfigError(f"{name}: {folder} is a file, not a folder; pass --output with a path in a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{name}: cannot write in {folder} (permission denied); pass --output with a path "
            "in a folder you can write to"
        )


def model_config(model_dir: Path, overrides: list[str]) -> task.Config:
    """The exported config of `model_dir`, with the --field value overrides."""
    if not model_dir.is_dir():
        problem = "is a file, not a folder" if model_dir.exists() else "does not exist"
        raise ConfigError(
            f"model folder {model_dir} {problem}: train first (python train.py), or pass --model_dir with a "
            "model folder exported by train.py (<output_dir>/model or <output_dir>/best_model)"
        )
    path = model_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: pass --model_dir with a model folder exported by train.py "
            "(model.safetensors and config.yaml)"
        )
    return load_config(overrides, path, task.Config, own_flags=OWN_FLAGS, saved=True)[0]


def load_model(config: task.Config, model_dir: Path, overrides: list[str]) -> torch.nn.Module:
    """The model of `config` with the exported weights (the task's `load_export` where it writes its own
    format); a ConfigError says why they do not load."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model as load_weights

    weights = model_dir / "model.safetensors"
    if not hasattr(task, "load_export") and not weights.is_file():
        raise ConfigError(f"{weights} does not exist: train first (python train.py), or pass --model_dir")
    try:
        if hasattr(task, "load_export"):  # the task's own format (it names a missing file itself)
            return task.load_export(model_dir, config)
        model = task.build_model(config)
        # safetensors' own loader: it knows that tied weights were saved under one of their names.
        load_weights(model, weights)
    except (SafetensorError, OSError) as error:
        raise ConfigError(f"{weights}: not a readable safetensors file ({error}): export it again") from None
    except RuntimeError:
        changed = f" with {' '.join(overrides)}" if overrides else ""
        raise ConfigError(
            f"{weights} does not fit the model of {model_dir / 'config.yaml'}{changed}: override only fields "
            "that leave the model as trained"
        ) from None
    return model


def write_predictions(path: Path, fmt: str, rows: list[dict[str, Any]]) -> None:
    """One row per input, in input order: its index, then the task's columns, floats rounded alike in
    both formats (a JSON line holds the values of its CSV row)."""
    rows = [
        {"index": index, **{k: round(v, FLOAT_DIGITS) if isinstance(v, float) else v for k, v in row.items()}}
        for index, row in enumerate(rows)
    ]
    if fmt == "csv":
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        content = text.getvalue()
    else:
        content = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, content)  # a complete file or none
    except OSError as error:  # checked before predicting (check_output); a full disk shows only now
        raise ConfigError(
            f"cannot write {path}: {error.strerror or error}; pass --output with a path in a folder you can "
            "write to"
        ) from None


if __name__ == "__main__":
    try:
        status: int | str = main()
    except ConfigError as error:
        status = f"error: {error}"
    exit_process(status)  # sys.exit, without the teardown that gloo's threads can abort
