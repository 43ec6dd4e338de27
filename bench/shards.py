"""Benchmark the lm preset on a corpus larger than memory is meant for, and print a markdown table.

    python bench/shards.py            # full mode: a 512 MB corpus, 300 optimizer steps; about 10 minutes
    python bench/shards.py --quick    # a 16 MB corpus, 75 steps of a 1-layer model (CI runs it: no rot)

What is measured, on one CPU process, in a freshly rendered lm project:
1. `python -m <package>.prepare` on a generated corpus of 8 text files (lines of Tiny Shakespeare in a
   seeded shuffle, so no file repeats another): its throughput (input MB per second of wall time, both
   passes) and its peak resident memory (VmHWM, Linux).
2. train.py from those shards at the lm preset's default size (configs/local.yaml: 4 x 4 x 128 GPT, 64
   windows of 64 characters): its peak resident memory, its milliseconds per optimizer step, and the
   data wait: the share of the step time spent inside next() on the train loader (and the train set's
   set_epoch), timed as bench.py times it, over the steps after the first 20 and before the final
   evaluation. The same for the shipped Tiny Shakespeare file, for comparison.

The script renders the template itself; it needs the packages of requirements-dev.txt (torch included).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench as core  # bench.py: the rendering and timing helpers

FILES = 8
# The peak resident memory of the process (Linux): ru_maxrss would include its parent's, kept across exec.
PEAK = "print('VmHWM', [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a small corpus and few steps: checks, no figures"
    )
    args = parser.parse_args()
    megabytes, steps = (16, 75) if args.quick else (512, 300)
    # Quick: a one-layer model, so that the check of every row costs seconds, not the default's minute.
    model = ["--num_layers", "1", "--embed_dim", "32"] if args.quick else []
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as scratch:
        root = Path(scratch)
        core.run(
            [
                sys.executable,
                "-m",
                "cookiecutter",
                "--no-input",
                str(core.TEMPLATE),
                "-o",
                str(root),
                "task=lm",
            ],
            cwd=root,
        )
        project = next(path for path in root.iterdir() if (path / "train.py").is_file())
        package = next(path.name for path in (project / "src").iterdir() if (path / "__init__.py").exists())
        corpus = write_corpus(project / "data" / "tinyshakespeare.txt", root / "corpus", megabytes)
        prepared = measure_prepare(project, package, corpus, root / "tokens")
        trained = {
            name: train_worker(project, data, steps, model)
            for name, data in (("shards", str(root / "tokens")), ("file", "data/tinyshakespeare.txt"))
        }
    print(report(prepared, trained, megabytes, steps, args.quick))


def write_corpus(source: Path, folder: Path, megabytes: int) -> list[Path]:
    """FILES text files of megabytes / FILES MB each, from the lines of `source` in a seeded shuffle."""
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    folder.mkdir()
    files = []
    for index in range(FILES):
        rng, path = random.Random(index), folder / f"part{index}.txt"
        with path.open("w", encoding="utf-8") as file:
            while file.tell() < megabytes * 10**6 // FILES:
                rng.shuffle(lines)
                file.write("".join(lines))
        files.append(path)
    return files


def measure_prepare(project: Path, package: str, corpus: list[Path], output: Path) -> dict:
    driver = (
        f"import runpy, sys; sys.argv = ['prepare', *sys.argv[1:]]; "
        f"runpy.run_module('{package}.prepare', run_name='__main__'); {PEAK}"
    )
    command = [sys.executable, "-c", driver, "--input", *map(str, corpus), "--output", str(output)]
    start = time.perf_counter()
    output_text = core.run(command, cwd=project, src=project / "src")
    seconds = time.perf_counter() - start
    size = sum(path.stat().st_size for path in corpus)
    meta = json.loads((output / "meta.json").read_text())
    return {
        "bytes": size,
        "seconds": seconds,
        "peak_kb": peak_kb(output_text),
        "tokens": meta["tokens"],
        "shards": len(meta["shards"]),
    }


def peak_kb(output: str) -> int:
    return int(next(line.split()[1] for line in output.splitlines() if line.startswith("VmHWM")))


def train_worker(project: Path, data_file: str, steps: int, model: list[str]) -> dict:
    """train.py in a process of its own (its peak memory is its own), timed as bench.py times it; `model`:
    flags that size the model."""
    result = project.parent / f"train-{abs(hash(data_file))}.json"
    command = [sys.executable, __file__, "--worker", str(project), data_file, str(steps), str(result), *model]
    output = core.run(command, cwd=project, src=project / "src", extra_env={"CUDA_VISIBLE_DEVICES": ""})
    return {**json.loads(result.read_text()), "peak_kb": peak_kb(output)}


def worker(project: Path, data_file: str, steps: int, result: Path, model: list[str]) -> None:
    sys.path.insert(0, str(project))  # the generated train.py
    package = next(path.name for path in (project / "src").iterdir() if (path / "__init__.py").exists())
    task = importlib.import_module(f"{package}.task")
    config = task.Config(data_file=data_file)
    train_set, _ = task.build_datasets(config)
    fetches: list[tuple[float, float]] = []
    edges = core.block_edges(steps)
    with core.timed_fetches(fetches, package), tempfile.TemporaryDirectory() as scratch:
        stamps, handle = core.step_times(steps, gpu=False)
        # Evaluation and checkpoints fall after the last step: the timed window sees the steps and logging.
        argv = [
            *(
                "--config",
                str(project / "configs" / "local.yaml"),
                "--output_dir",
                str(Path(scratch) / "run"),
            ),
            *("--data_file", data_file, "--max_steps", str(steps), "--log_every", str(core.LOG_EVERY)),
            *("--eval_every", str(10**9), "--checkpoint_every", str(10**9), "--max_time_lost", ""),
            *model,
        ]
        core.run_template(argv)
        handle.remove()
    start, end = stamps[edges[0]], stamps[edges[-1]]
    inside = [done - begun for begun, done in fetches if start <= begun and done <= end]
    timed_steps = edges[-1] - edges[0]
    result.write_text(
        json.dumps(
            {
                "share": sum(inside) / (end - start),
                "ms_per_step": 1000 * (end - start) / timed_steps,
                "windows": len(train_set),
                "batch": config.global_batch_size,
            }
        )
    )
    exec(PEAK)


def report(prepared: dict, trained: dict, megabytes: int, steps: int, quick: bool) -> str:
    mb = prepared["bytes"] / 1e6
    shards, file = trained["shards"], trained["file"]
    rows = [
        "| measurement | value | target |",
        "|---|---|---|",
        f"| prepare: input, MB (8 text files) | {mb:.0f} | >= 500 |",
        f"| prepare: throughput, MB/s (both passes, wall time) | {mb / prepared['seconds']:.1f} | |",
        f"| prepare: peak resident memory, MB | {prepared['peak_kb'] / 1000:.0f} | < 1500 |",
        f"| prepare: tokens / shards | {prepared['tokens']:,} / {prepared['shards']} | |",
        f"| train from the shards: peak resident memory, MB | {shards['peak_kb'] / 1000:.0f} | < 1500 |",
        f"| train from the shards: ms per optimizer step | {shards['ms_per_step']:.1f} | |",
        f"| train from the shards: data wait, % of step time | {100 * shards['share']:.1f}% | < 10% |",
        f"| train from the shards: windows per epoch | {shards['windows']:,} | |",
        f"| train from Tiny Shakespeare (1 MB): peak resident memory, MB | {file['peak_kb'] / 1000:.0f} | |",
        f"| train from Tiny Shakespeare: ms per optimizer step | {file['ms_per_step']:.1f} | |",
        f"| train from Tiny Shakespeare: data wait, % of step time | {100 * file['share']:.1f}% | |",
    ]
    model = "a one-layer model" if quick else "the lm preset's default model"
    note = (
        f"{'Quick mode: too small to mean anything. ' if quick else ''}{megabytes} MB corpus, {steps} "
        f"optimizer steps of {shards['batch']} windows per run, {model}; "
        f"{os.cpu_count()} CPUs."
    )
    return "\n".join([*rows, "", note])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, project_dir, data, step_count, result_file, *model_flags = sys.argv
        worker(Path(project_dir), data, int(step_count), Path(result_file), model_flags)
    else:
        main()
