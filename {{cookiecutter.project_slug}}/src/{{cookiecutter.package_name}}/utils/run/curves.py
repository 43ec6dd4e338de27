"""curves.png: the metrics of metrics.jsonl by step, drawn at a session's end (docs/outputs.md)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ..checkpoints.durable import write_atomically
from .tracking import logged_rows


def save_curves(output_dir: str | Path, best_metric: str, best_step: int | None) -> None:
    """curves.png in output_dir, from metrics.jsonl, at a session's end; a failure to draw is a warning."""
    path = Path(output_dir) / "curves.png"
    try:
        if figure := curves_figure(logged_rows(output_dir), best_metric, best_step):
            figure.savefig(png := io.BytesIO(), format="png", dpi=80)
            write_atomically(path, png.getvalue(), durable=False)  # a kill leaves the last picture whole
            print(f"curves: {path}", flush=True)
    except Exception as error:
        print(f"WARNING: {path} not drawn: {type(error).__name__}: {error}", flush=True)


def curves_figure(rows: list[tuple[int, dict[str, Any]]], best_metric: str, best_step: int | None) -> Any:
    """A panel per metric by step, the best evaluation marked on best_metric's; None if nothing is logged."""
    series: dict[str, dict[int, float]] = {}
    for step, values in rows:
        for name, value in values.items():
            if name == "train/loss" or not name.startswith("train/"):
                series.setdefault(name, {})[step] = value
    if not series:
        return None
    from matplotlib.figure import Figure  # here only (a second to import); Agg, without pyplot or a window

    figure = Figure(figsize=(4 * len(series), 3.2))
    panels = figure.subplots(1, len(series), squeeze=False)[0]
    for axes, (name, points) in zip(panels, series.items(), strict=True):
        axes.plot(list(points), list(points.values()), label=name)
        axes.set(title=name, xlabel="step")
        if name == best_metric and best_step in points:
            axes.plot(best_step, points[best_step], "o", label=f"best (step {best_step})")
            axes.legend()
    return figure
