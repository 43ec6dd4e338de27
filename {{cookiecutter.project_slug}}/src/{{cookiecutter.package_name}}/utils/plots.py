"""Training curves as a picture: `<output_dir>/curves.svg`, drawn from metrics.jsonl with no tracker needed.

train.py draws it at the end of training; draw it any time, also while a run is going:

    python -m {{ cookiecutter.package_name }}.utils.plots <output_dir>

Written as SVG by hand (no plotting package to install): a browser opens it, and a notebook shows it with
`IPython.display.SVG(filename=...)`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from .tracking import metrics_path

Series = dict[str, list[tuple[int, float]]]
PANEL_WIDTH, PANEL_HEIGHT = 420, 330  # pixels: title, axis labels and legend included
LEFT, RIGHT, TOP, BOTTOM = 62, 12, 28, 58  # the plot area's margins inside a panel
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def read_series(output_dir: str | Path) -> Series:
    """Every logged metric as (step, value) pairs, in logging order."""
    series: Series = {}
    for line in metrics_path(output_dir).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # the line a running training is writing right now
            continue
        for name, value in row.items():
            if name != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(name, []).append((row["step"], value))
    return series


def ticks(low: float, high: float) -> list[float]:
    """About 5 round values (1, 2 or 5 times a power of ten apart) covering low..high."""
    step = 10 ** math.floor(math.log10((high - low) / 5))
    step *= next(m for m in (1, 2, 5, 10) if (high - low) / (step * m) <= 5)
    first = math.ceil(low / step) * step
    return [round(first + i * step, 12) for i in range(int((high - first) / step + 1e-9) + 1)]


def text(x: float, y: float, content: str, anchor: str = "middle", size: int = 11) -> str:
    return f'<text x="{x}" y="{y}" text-anchor="{anchor}" font-size="{size}">{escape(content)}</text>'


def line(xa: float, ya: float, xb: float, yb: float, color: str) -> str:
    return f'<line x1="{xa}" y1="{ya}" x2="{xb}" y2="{yb}" stroke="{color}"/>'


def panel(left: float, title: str, lines: Series) -> list[str]:
    """One panel: a frame, ticks and grid, "optimizer step" under it, one polyline per series, a legend."""
    x0, x1, y0, y1 = left + LEFT, left + PANEL_WIDTH - RIGHT, TOP, PANEL_HEIGHT - BOTTOM
    middle = (x0 + x1) / 2
    out = [text(middle, TOP - 10, title, size=13), text(middle, y1 + 30, "optimizer step")]
    out.append(f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="none" stroke="#444"/>')
    points = [point for values in lines.values() for point in values]
    if not points:
        return [*out, text(middle, (y0 + y1) / 2, "no data yet")]
    steps, values = [p[0] for p in points], [p[1] for p in points]
    s_low, s_high = min(steps), max(max(steps), min(steps) + 1)
    pad = (max(values) - min(values)) * 0.05 or abs(values[0]) * 0.05 or 1.0
    v_low, v_high = min(values) - pad, max(values) + pad

    def x(step: float) -> float:
        return round(x0 + (step - s_low) / (s_high - s_low) * (x1 - x0), 1)

    def y(value: float) -> float:
        return round(y1 - (value - v_low) / (v_high - v_low) * (y1 - y0), 1)

    for tick in ticks(s_low, s_high):
        out += [line(x(tick), y0, x(tick), y1, "#ddd"), text(x(tick), y1 + 14, f"{tick:g}")]
    for tick in ticks(v_low, v_high):
        out += [line(x0, y(tick), x1, y(tick), "#ddd"), text(x0 - 4, y(tick) + 4, f"{tick:g}", anchor="end")]
    legend_x, legend_y = x0, y1 + 44  # the legend: one row under the axis label
    for index, (name, pairs) in enumerate(lines.items()):
        color = COLORS[index % len(COLORS)]
        path = " ".join(f"{x(step)},{y(value)}" for step, value in pairs)
        out.append(f'<polyline data-series={quoteattr(name)} points="{path}" fill="none" stroke="{color}"/>')
        if len(pairs) < 30:  # few points: mark each one
            out += [f'<circle cx="{x(s)}" cy="{y(v)}" r="2.5" fill="{color}"/>' for s, v in pairs]
        out.append(line(legend_x, legend_y, legend_x + 20, legend_y, color))
        out.append(text(legend_x + 24, legend_y + 4, name, anchor="start"))
        legend_x += 40 + 7 * len(name)
    return out


def plot_metrics(output_dir: str | Path) -> Path:
    """Draw the curves of `output_dir` to `<output_dir>/curves.svg` and return its path.

    Each curve is a polyline whose `data-series` attribute names the metric (for scripts and tests).
    """
    path = metrics_path(output_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {output_dir} the output_dir of a run?")
    series = read_series(output_dir)
    # One panel per group: the losses together, then the task's other eval metrics, then the learning rate.
    other_metrics = sorted(name for name in series if name.startswith("eval/") and name != "eval/loss")
    panels = (
        ("loss", ["train/loss", "eval/loss"]),
        ("eval metrics", other_metrics),
        ("learning rate", ["train/lr"]),
    )
    width, height = PANEL_WIDTH * len(panels), PANEL_HEIGHT + 24
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" stroke-width="1.5">',
        '<rect width="100%" height="100%" fill="white"/>',
        text(width / 2, 17, Path(output_dir).name, size=14),
        '<g transform="translate(0, 24)">',
    ]
    for index, (title, names) in enumerate(panels):
        body += panel(index * PANEL_WIDTH, title, {name: series[name] for name in names if name in series})
    body += ["</g>", "</svg>", ""]
    target = Path(output_dir) / "curves.svg"
    partial = target.with_name(f".{target.name}.partial")  # renamed when whole: a viewer never sees half
    partial.write_text("\n".join(body), encoding="utf-8")
    os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw a run's training curves to <output_dir>/curves.svg.")
    parser.add_argument("output_dir", type=Path, help="the run's output_dir (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        print(plot_metrics(args.output_dir))
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None


if __name__ == "__main__":
    main()
