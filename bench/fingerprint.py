"""What the data fingerprint (utils/run/fingerprint.py) costs at start-up, per GB of data, and print a table.

    python bench/fingerprint.py           # 2 GB of files, 256 MB of in-memory samples, every preset
    python bench/fingerprint.py --quick   # 64 MB and 16 MB (CI-sized: checks, no figures)

A run fingerprints its data once per session, on the main process, before it resumes:
1. files (a streamed `datasets` train set, an image folder): name, size and XXH3-128 of each file,
   measured on 8 files of random bytes, warm (in the page cache, as right after the data was read or
   written) and cold (each file's pages dropped first with posix_fadvise, so read from the disk);
2. token shard folders: meta.json's hashes, nothing read (verified by open_shards, which the lm preset
   does anyway);
3. in-memory data: a TensorDataset of 64 float32 features and a label per sample (digits' shape), hashed
   whole; and 100,000 of them asked for one by one (the rule for datasets that hold lists), per sample;
4. each preset's own data at its defaults, rendered fresh: build_datasets, then data_fingerprint.
The figures are the median of 3 runs (1 in --quick).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
PRESETS = ("digits", "images", "text", "lm")
GB = 1 << 30
ONE_BY_ONE = 100_000  # samples asked for one by one: enough for a steady figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data, one run: checks, no figures")
    args = parser.parse_args()
    file_bytes, sample_bytes = (64 << 20, 16 << 20) if args.quick else (2 * GB, 256 << 20)
    reps = 1 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="bench-fingerprint-") as scratch:
        root = Path(scratch)
        projects = {task: render(root, task) for task in PRESETS}
        fingerprint = load(projects["digits"], "utils.run.fingerprint")
        rows = [("measurement", "value", "target")]
        warm, cold = files_seconds(fingerprint, root / "files", file_bytes, reps)
        rows.append((f"files, warm ({file_bytes / GB:.2f} GB in 8 files)", f"{warm:.2f} s per GB", "<= 1"))
        rows.append((f"files, cold ({file_bytes / GB:.2f} GB in 8 files)", f"{cold:.2f} s per GB", "<= 1"))
        per_gb, per_sample = samples_seconds(fingerprint, sample_bytes, reps)
        rows.append((f"in-memory tensors ({sample_bytes >> 20} MB)", f"{per_gb:.2f} s per GB", "<= 1"))
        rows.append(("in-memory samples one by one", f"{per_sample * 1e6:.1f} us per sample", ""))
        for task, project in projects.items():
            seconds, entries = preset_seconds(project)
            rows.append((f"start-up, {task} preset's data ({entries} entries)", f"{seconds:.3f} s", ""))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for index, row in enumerate(rows):
        print("| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |")
        if index == 0:
            print("| " + " | ".join("-" * width for width in widths) + " |")


def render(root: Path, task: str) -> Path:
    command = [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(root / task)]
    subprocess.run([*command, f"task={task}"], check=True, capture_output=True)
    return next((root / task).iterdir())


def package_of(project: Path) -> str:
    return next(path.name for path in (project / "src").iterdir() if (path / "task.py").is_file())


def load(project: Path, module: str):
    if str(project / "src") not in sys.path:
        sys.path.insert(0, str(project / "src"))
    return importlib.import_module(f"{package_of(project)}.{module}")


def files_seconds(fingerprint, folder: Path, total: int, reps: int) -> tuple[float, float]:
    """Seconds per GB to fingerprint `total` bytes in 8 files: warm, cold."""
    folder.mkdir()
    files = [folder / f"part{index}.jsonl" for index in range(8)]
    for file in files:
        with file.open("wb") as handle:
            for _ in range(total // 8 // (4 << 20)):
                handle.write(os.urandom(4 << 20))
    warm, cold = [], []
    fingerprint.file_entries(files, "train")  # into the page cache
    for _ in range(reps):
        started = time.perf_counter()
        fingerprint.file_entries(files, "train")
        warm.append(time.perf_counter() - started)
        for file in files:  # this file's pages only: no other process's cache is touched
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        fingerprint.file_entries(files, "train")
        cold.append(time.perf_counter() - started)
    size = sum(file.stat().st_size for file in files) / GB
    return statistics.median(warm) / size, statistics.median(cold) / size


def samples_seconds(fingerprint, total: int, reps: int) -> tuple[float, float]:
    """(seconds per GB of a TensorDataset of digits-shaped samples, hashed whole; seconds per sample of the
    same samples asked for one by one)."""
    import torch
    from torch.utils.data import TensorDataset

    count = total // (64 * 4 + 8)
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.rand(count, 64, generator=generator), torch.arange(count) % 10)
    few = TensorDataset(*(tensor[:ONE_BY_ONE] for tensor in dataset.tensors))
    whole, one_by_one = [], []
    for _ in range(reps):
        started = time.perf_counter()
        fingerprint.describe(dataset, "train")
        whole.append(time.perf_counter() - started)
        started = time.perf_counter()
        fingerprint.samples_description(few)
        one_by_one.append(time.perf_counter() - started)
    return statistics.median(whole) / (total / GB), statistics.median(one_by_one) / len(few)


def preset_seconds(project: Path) -> tuple[float, int]:
    """Seconds of data_fingerprint on the preset's datasets at its defaults, in a process of its own."""
    code = (
        "import sys, time; sys.path.insert(0, 'src')\n"
        f"from {package_of(project)} import task\n"
        f"from {package_of(project)}.utils.run.fingerprint import data_fingerprint\n"
        "train, evaluation = task.build_datasets(task.Config())\n"
        "started = time.perf_counter(); found = data_fingerprint(train, evaluation)\n"
        "print(time.perf_counter() - started, len(found))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True, check=True
    )
    seconds, entries = result.stdout.split()[-2:]
    return float(seconds), int(entries)


if __name__ == "__main__":
    main()
