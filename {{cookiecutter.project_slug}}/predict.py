"""Batch predictions from the exported model, on one process or many.

    python predict.py --model_dir outputs/digits/model [--input pixels.csv] [--output p.csv] [--format jsonl]
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 predict.py --model_dir ...  # CPU
    accelerate launch --multi_gpu --num_processes 2 predict.py --model_dir ...                       # 2 GPUs

The model is rebuilt from `<model_dir>/config.yaml` and `<model_dir>/model.safetensors` with plain PyTorch;
no checkpoint or Accelerate state is needed. Without --input it predicts the eval split of the default
example (with labels). The file is written once, by the main process, in input order, and is byte for byte
the same on any number of processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object, parse_flag_from_env
from safetensors.torch import load_file

from {{ cookiecutter.package_name }}.data import build_datasets
from {{ cookiecutter.package_name }}.data.digits import NUM_FEATURES
from {{ cookiecutter.package_name }}.models import build_model
from {{ cookiecutter.package_name }}.utils.config import ConfigError, load_config

PROB_DIGITS = 6  # fixed, so that files compare byte for byte


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Predict with the exported model.", allow_abbrev=False)
    parser.add_argument(
        "--model_dir",
        type=Path,
        default=Path("outputs/digits/model"),
        help="folder with model.safetensors and config.yaml (default: %(default)s)",
    )
    parser.add_argument(
        "--input",
        type=Path,
        help=f"CSV file, one image per line: {NUM_FEATURES} comma-separated pixel values 0..16 (8x8, row by "
        "row, like sklearn's load_digits); an optional header line is skipped. "
        "Default: the eval split of the training data, with labels",
    )
    parser.add_argument(
        "--output", type=Path, help="default: <model_dir>/../predictions.csv (or .jsonl with --format jsonl)"
    )
    parser.add_argument("--format", choices=["csv", "jsonl"], default="csv", help="default: %(default)s")
    parser.add_argument("--batch_size", type=int, default=256, help="per forward pass (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.batch_size <= 0:
        parser.error(f"--batch_size must be > 0, got {args.batch_size}")
    return args


def read_pixels(path: Path) -> torch.Tensor:
    """The images of a pixel CSV as model inputs; a ConfigError names the file and line of a bad row."""
    if not path.is_file():
        raise ConfigError(f"input file {path} does not exist")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        try:
            values = [float(cell) for cell in cells]
        except ValueError:
            if number == 1:  # a header
                continue
            raise ConfigError(f"{path}:{number}: not a number in {line[:80]!r}") from None
        if len(values) != NUM_FEATURES:
            raise ConfigError(
                f"{path}:{number}: expected {NUM_FEATURES} comma-separated pixel values, got {len(values)}"
            )
        bad = [v for v in values if not (math.isfinite(v) and 0 <= v <= 16)]
        if bad:
            raise ConfigError(f"{path}:{number}: pixel values must be between 0 and 16, got {bad[0]}")
        rows.append(values)
    if not rows:
        raise ConfigError(f"{path}: no rows of pixel values")
    # The same scaling as build_datasets, so that a file of eval images gives the eval predictions.
    return torch.tensor(np.array(rows, dtype=np.float64) / 16.0, dtype=torch.float32)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The process group when started by `accelerate launch`; nothing more. PartialState, unlike the
    # Accelerator, ignores ACCELERATE_USE_CPU: without it, CPU processes would not form a group.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    try:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != state.num_processes:  # each would predict everything and overwrite the file
            raise ConfigError(
                f"{launched} processes were started but they do not communicate (world size "
                f"{state.num_processes}); on a CPU-only machine set ACCELERATE_USE_CPU=1"
            )
        config, _ = load_config([], default_path=args.model_dir / "config.yaml")
        weights = args.model_dir / "model.safetensors"
        if not weights.is_file():
            raise ConfigError(f"{weights} does not exist: train first, or pass --model_dir")
        model = build_model(config)
        model.load_state_dict(load_file(weights))
        model.to(state.device).eval()

        # Every process reads all inputs (small) and fails the same way on a bad file: no process waits.
        if args.input is None:
            features, labels = build_datasets(config)[1].tensors
        else:
            features, labels = read_pixels(args.input), None

        # Whole batches are split, not single items: batch k is always items [k*B, (k+1)*B), so its
        # numbers come out of the same kernels on any number of processes and the files are identical.
        starts = list(range(0, len(features), args.batch_size))
        done = []
        with state.split_between_processes(starts) as my_starts, torch.no_grad():
            for start in my_starts:
                logits = model(features[start : start + args.batch_size].to(state.device)).float()
                done.append((start, logits.argmax(dim=-1).cpu(), logits.softmax(dim=-1).cpu()))
        # Unequal shares (no padding) are fine for gather_object: nothing is duplicated to drop later.
        gathered = sorted(gather_object(done), key=lambda batch: batch[0])
        if state.is_main_process:
            if [start for start, _, _ in gathered] != starts:  # a launch whose processes do not talk
                raise RuntimeError(f"expected batches {starts}, gathered {[s for s, _, _ in gathered]}")
            predictions = torch.cat([batch[1] for batch in gathered])
            probs = torch.cat([batch[2] for batch in gathered])
            output = args.output or args.model_dir.resolve().parent / f"predictions.{args.format}"
            write_predictions(output, args.format, predictions, probs, labels)
            if labels is not None:
                accuracy = (predictions == labels).sum().item() / len(labels)
                print(f"accuracy {accuracy:.4f} on {len(labels)} labelled inputs")
            print(f"wrote {len(predictions)} predictions to {output} | world size {state.num_processes}")
        state.wait_for_everyone()  # no process leaves before the file is complete
    finally:
        state.destroy_process_group()
    return 0


def write_predictions(
    path: Path, fmt: str, predictions: torch.Tensor, probs: torch.Tensor, labels: torch.Tensor | None
) -> None:
    """One row per input, in input order: index, prediction, label (if known), prob_0..prob_<n-1>."""
    names = ["index", "prediction"] + (["label"] if labels is not None else [])
    names += [f"prob_{k}" for k in range(probs.shape[1])]
    lines = [",".join(names)] if fmt == "csv" else []
    known = labels.tolist() if labels is not None else None
    for index, (prediction, row) in enumerate(zip(predictions.tolist(), probs.tolist(), strict=True)):
        values = [str(index), str(prediction)] + ([str(known[index])] if known is not None else [])
        values += [f"{p:.{PROB_DIGITS}f}" for p in row]
        if fmt == "csv":
            lines.append(",".join(values))
        else:  # the values are JSON numbers already; keeping their text keeps the fixed digits
            fields = (f"{json.dumps(name)}: {value}" for name, value in zip(names, values, strict=True))
            lines.append("{" + ", ".join(fields) + "}")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("\n".join(lines) + "\n")
    temporary.replace(path)  # a complete file or none


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as error:
        sys.exit(f"error: {error}")
