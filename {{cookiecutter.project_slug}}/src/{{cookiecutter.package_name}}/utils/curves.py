"""curves.png in the run folder, drawn from metrics.jsonl at the end of every session (done, stopped, out
of time): the train loss and each eval metric against the step, the best evaluation marked."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from .durable import write_atomically
from .tracking import logged_rows

CURVES_FILE = "curves.png"


def save_curves(output_dir: str | Path, best_metric: str, best_step: int | None) -> None:
    """Draw curves.png (main process); a failure to draw is a warning line, never the run's failure."""
    path = Path(output_dir) / CURVES_FILE
    try:
        if (figure := curves_figure(logged_rows(output_dir), best_metric, best_step)) is not None:
            png = io.BytesIO()
            figure.savefig(png, format="png", dpi=80)
            write_atomically(path, png.getvalue(), durable=False)  # a kill leaves the last picture whole
    except Exception as error:  # matplotlib missing or broken, a full disk: the run itself is saved
        print(f"WARNING: {path} not drawn: {type(error).__name__}: {error}", flush=True)


def curves_figure(rows: list[tuple[int, dict[str, Any]]], best_metric: str, best_step: int | None) -> Any:
    """One panel per metric (train/loss, then each eval metric): its line, and on best_metric's panel a
    marker at the best evaluation. None where nothing is logged yet."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for step, values in rows:
        for name, value in values.items():
            if name == "train/loss" or not name.startswith("train/"):
                series.setdefault(name, ([], []))[0].append(step)
                series[name][1].append(value)
    if not series:
        return None
    from matplotlib.figure import Figure  # here only: its import takes a second; Agg, no pyplot or window

    figure = Figure(figsize=(4 * len(series), 3.2))
    figure.subplots_adjust(left=0.25 / len(series), right=1 - 0.1 / len(series), bottom=0.16, wspace=0.3)
    panels = figure.subplots(1, len(series), squeeze=False)[0]
    for axes, (name, (steps, values)) in zip(panels, series.items(), strict=True):
        axes.plot(steps, values, label=name)
        axes.set(title=name, xlabel="step")
        if name == best_metric and best_step in steps:
            axes.plot(best_step, values[steps.index(best_step)], "o", label=f"best (step {best_step})")
            axes.legend()
    return figure
