"""What the run's file safety costs: the atomic config.yaml, the duplicate-key check, the fsync of
metrics.jsonl before each checkpoint, an export's checksums.json and its verification when a copy is
brought in. Medians of repeated calls of the freshly rendered project's own functions, on the disk of
--dir (default: the system's temporary folder), each next to what the code did before.

    python bench/durability.py [--dir FOLDER] [--export_mib 100]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent


def median_ms(function: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        function()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def measure(folder: Path, export_mib: int) -> None:
    import yaml
    from digits_classifier import task
    from digits_classifier.utils.checkpoints.checkpoint import export_problem, write_manifest
    from digits_classifier.utils.checkpoints.durable import fsync_path
    from digits_classifier.utils.config import UniqueKeyLoader, load_config, save_config

    config, _ = load_config([], Path("configs/local.yaml"), task.Config)
    text = Path("configs/local.yaml").read_text()
    values = dataclasses.asdict(config)
    dump = yaml.safe_dump(values, sort_keys=False)
    before = median_ms(lambda: (folder / "old.yaml").write_text(yaml.safe_dump(values, sort_keys=False)), 100)
    now = median_ms(lambda: save_config(config, folder / "config.yaml"), 100)
    print(
        f"start: config.yaml written in {now:.2f} ms (atomic, fsynced); before {before:.2f} ms (write_text)"
    )
    before = median_ms(lambda: yaml.safe_load(text), 300)
    now = median_ms(lambda: yaml.load(text, Loader=UniqueKeyLoader), 300)
    print(f"start: configs/local.yaml read in {now:.3f} ms (duplicate keys checked); before {before:.3f} ms")
    metrics = folder / "metrics.jsonl"
    metrics.write_text(
        "".join(json.dumps({"step": s, "train/loss": 0.5, "train/lr": 1e-3}) + "\n" for s in range(5000))
    )

    def log_and_sync() -> None:
        with metrics.open("a") as file:
            file.write(json.dumps({"step": 1, "train/loss": 0.5}) + "\n")
        fsync_path(metrics)

    print(
        f"per checkpoint: metrics.jsonl fsynced in {median_ms(log_and_sync, 100):.2f} ms (after one new line)"
    )
    export = folder / "model"
    export.mkdir()
    (export / "model.safetensors").write_bytes(os.urandom(export_mib * 2**20))
    (export / "config.yaml").write_text(dump)
    before = median_ms(lambda: [fsync_path(path) for path in export.iterdir()], 9)
    now = median_ms(lambda: write_manifest(export), 9)
    print(f"per export of {export_mib} MiB: {now:.1f} ms with checksums.json; before {before:.1f} ms (fsync)")
    verified = median_ms(lambda: export_problem(export), 9)
    print(f"import of a copy: its {export_mib} MiB export verified in {verified:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--export_mib", type=int, default=100)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        measure(args.worker, args.export_mib)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        command = [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", f"{root}/render"]
        subprocess.run(command, check=True, capture_output=True)
        project = Path(root) / "render" / "digits-classifier"
        (Path(root) / "files").mkdir()
        worker = [sys.executable, __file__, "--worker", f"{root}/files", "--export_mib", str(args.export_mib)]
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        subprocess.run(worker, check=True, cwd=project, env=env)


if __name__ == "__main__":
    main()
