"""Training curves as a picture: `<output_dir>/curves.png`, drawn from metrics.jsonl with no tracker needed.

train.py draws it at the end of training; draw it any time, also while a run is going:

    python -m {{ cookiecutter.package_name }}.utils.plots <output_dir>
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .tracking import metrics_path


def read_series(output_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every logged metric as (step, value) pairs, in logging order."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in metrics_path(output_dir).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # the line a running training is writing right now
            continue
        for name, value in row.items():
            if name != "step" and isinstance(value, (int, float)):
                series.setdefault(name, []).append((row["step"], value))
    return series


def plot_metrics(output_dir: str | Path) -> Path:
    """Draw the curves of `output_dir` to `<output_dir>/curves.png` and return its path.

    The PNG's "Series" text field lists what was drawn (name: number of points), for scripts and tests.
    """
    # Here, not at the top: train.py imports this module, and matplotlib takes a while to load. A Figure
    # without pyplot draws to a file with no GUI backend: nothing to configure on a server.
    from matplotlib.figure import Figure

    path = metrics_path(output_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {output_dir} the output_dir of a run?")
    series = read_series(output_dir)
    # One panel per group: the losses together, then the task's other eval metrics, then the learning rate.
    other_metrics = tuple(sorted(name for name in series if name.startswith("eval/") and name != "eval/loss"))
    panels = (
        ("loss", ("train/loss", "eval/loss")),
        ("eval metrics", other_metrics),
        ("learning rate", ("train/lr",)),
    )
    figure = Figure(figsize=(5 * len(panels), 3.6), layout="constrained")
    axes = figure.subplots(1, len(panels))
    drawn = {}
    for ax, (title, names) in zip(axes, panels, strict=True):
        for name in names:
            if name in series:
                steps, values = zip(*series[name], strict=True)
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
                drawn[name] = len(steps)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    figure.suptitle(Path(output_dir).name)
    target = Path(output_dir) / "curves.png"
    partial = target.with_name(f".{target.name}.partial")  # renamed when whole: a viewer never sees half
    series_text = ", ".join(f"{name}: {count}" for name, count in drawn.items())
    figure.savefig(partial, format="png", dpi=100, metadata={"Series": series_text})
    os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw a run's training curves to <output_dir>/curves.png.")
    parser.add_argument("output_dir", type=Path, help="the run's output_dir (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        print(plot_metrics(args.output_dir))
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None


if __name__ == "__main__":
    main()
