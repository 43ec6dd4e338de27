"""What seeding the global generators per train item (training/seeding.py, SeededItems) costs a step of the
images preset, whose augmentation (random crops, mirroring) draws from numpy's global generator.

    python bench/item_seeds.py            # 30 steps, median of 5 rounds
    python bench/item_seeds.py --quick    # 3 steps, 1 round (CI-sized: checks, no figures)

A step is what train.py does with one batch of the loader, on one process and one thread: read and
augment its 64 images (the preset's defaults), forward, backward and AdamW. What seeding adds is
SeededItems' own work for a batch of 64 (saving and restoring the three generators, seeding them per
item), timed around items that cost nothing: timed around the images, it drowns in the noise of decoding
them (tens of ms apart from one read of a batch to the next on a busy machine). The draws themselves cost
what they cost unseeded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fingerprint import load, render  # bench/ is not a package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 round: checks, no figures")
    args = parser.parse_args()
    steps, rounds = (3, 1) if args.quick else (30, 5)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-item-seeds-") as scratch:
        project = render(Path(scratch), "images")
        task, exact = load(project, "task"), load(project, "utils.training.seeding")
        config = task.Config()
        train_set = task.build_datasets(config)[0]
        model = task.build_model(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
        batches = [[index % len(train_set) for index in range(64 * k, 64 * k + 64)] for k in range(steps)]
        free = exact.SeededItems(range(len(train_set)), config.seed)  # items that cost nothing to make
        added, step = [], []
        for _ in range(rounds):  # each batch's seeding, then its step: both under the same load
            for indices in batches:
                added.append(seconds(lambda indices=indices: free.__getitems__(indices)))
                step.append(
                    seconds(lambda indices=indices: train_step(task, model, optimizer, train_set, indices))
                )
    plain, overhead = statistics.median(step), statistics.median(added)
    print(
        f"images preset, batch 64, one thread: a step {plain * 1e3:.1f} ms; seeding its items adds "
        f"{overhead * 1e3:.2f} ms, {overhead / plain:.2%} of the step (at most 1%)"
    )


def seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def train_step(task, model, optimizer, train_set, indices: list[int]) -> None:
    batch = task.collate([train_set[index] for index in indices])
    task.loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad()


if __name__ == "__main__":
    main()
