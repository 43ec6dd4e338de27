"""Training curves as a picture: `<output_dir>/curves.svg`, drawn from metrics.jsonl with no tracker needed.

train.py draws it at the end of training; draw it any time, also while a run is going:

    python -m {{ cookiecutter.package_name }}.utils.plots <output_dir> [--loss_axis linear]

Panels side by side, on one step axis: the train and eval loss (a log axis by default: a loss falls by
orders of magnitude, and on a linear axis everything after the first steps lies flat near 0), the task's
other eval metrics, the learning rate; a dashed line at the step of best_model/. Written as SVG by hand,
not with matplotlib: nothing to install, the same picture on every platform, sharp at any size, and a
browser opens it (a notebook shows it with `IPython.display.SVG(filename=...)`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from .durable import write_atomically
from .tracking import metrics_path

Series = dict[str, list[tuple[int, float]]]
PANEL_WIDTH, PANEL_HEIGHT = 440, 360  # pixels: title, axis labels and legend included
LEFT, RIGHT, TOP, BOTTOM = 84, 16, 34, 78  # the plot area's margins inside a panel
FONT = 15  # pixels; the picture is about 1,300 wide, so that text stays readable when it is scaled down
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


def log_ticks(low: float, high: float) -> list[float]:
    """Round values for a log axis over low..high (> 0): 1, 2 and 5 times the powers of ten, or more
    mantissas where the range spans less than a decade, or linear ticks where even those are too few."""
    for mantissas in ((1,), (1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        found = [
            round(m * 10**exponent, 12)
            for exponent in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            for m in mantissas
            if low <= m * 10**exponent <= high
        ]
        if 3 <= len(found) <= 8 or (len(found) > 8 and mantissas == (1,)):
            return found[:: max(1, len(found) // 8 + (len(found) % 8 > 0))]
    return [tick for tick in ticks(low, high) if tick > 0]


def text(
    x: float, y: float, content: str, anchor: str = "middle", size: int = FONT, rotate: bool = False
) -> str:
    turn = f' transform="rotate(-90 {x} {y})"' if rotate else ""
    return f'<text x="{x}" y="{y}" text-anchor="{anchor}" font-size="{size}"{turn}>{escape(content)}</text>'


def line(xa: float, ya: float, xb: float, yb: float, color: str, dashed: bool = False) -> str:
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    return f'<line x1="{xa}" y1="{ya}" x2="{xb}" y2="{yb}" stroke="{color}"{dash}/>'


def panel(
    left: float, title: str, y_label: str, lines: Series, steps: tuple[int, int], log: bool, best: int | None
) -> list[str]:
    """One panel: a frame, ticks and grid, both axis labels, one polyline per series, a legend, and a
    dashed line at step `best`. `steps`: the x range that all panels share; `log`: a log y axis."""
    x0, x1, y0, y1 = left + LEFT, left + PANEL_WIDTH - RIGHT, TOP, PANEL_HEIGHT - BOTTOM
    middle = (x0 + x1) / 2
    out = [text(middle, TOP - 12, title, size=FONT + 2), text(middle, y1 + 40, "optimizer step")]
    out.append(f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="none" stroke="#444"/>')
    values = [value for pairs in lines.values() for _, value in pairs]
    if not values:
        return [*out, text(middle, (y0 + y1) / 2, "no data yet")]
    log = log and min(values) > 0  # a log axis needs positive values
    scale: Callable[[float], float] = math.log10 if log else float
    out.append(text(left + 18, (y0 + y1) / 2, y_label + (" (log scale)" if log else ""), rotate=True))
    low, high = scale(min(values)), scale(max(values))
    pad = (high - low) * 0.05 or abs(low) * 0.05 or 1.0
    v_low, v_high = low - pad, high + pad
    s_low, s_high = steps

    def x(step: float) -> float:
        return round(x0 + (step - s_low) / (s_high - s_low) * (x1 - x0), 1)

    def y(value: float) -> float:
        return round(y1 - (scale(value) - v_low) / (v_high - v_low) * (y1 - y0), 1)

    for tick in ticks(s_low, s_high):
        out += [line(x(tick), y0, x(tick), y1, "#ddd"), text(x(tick), y1 + 18, f"{tick:g}", size=FONT - 1)]
    for tick in log_ticks(10**v_low, 10**v_high) if log else ticks(v_low, v_high):
        label = text(x0 - 5, y(tick) + 5, f"{tick:g}", anchor="end", size=FONT - 1)
        out += [line(x0, y(tick), x1, y(tick), "#ddd"), label]
    legend_x, legend_y = x0, y1 + 62  # the legend: one row under the axis label
    drawn = []  # every polyline's points, in pixels: the best marker's label keeps off them
    for index, (name, pairs) in enumerate(lines.items()):
        color = COLORS[index % len(COLORS)]
        drawn.append([(x(step), y(value)) for step, value in pairs])
        path = " ".join(f"{x(step)},{y(value)}" for step, value in pairs)
        out.append(f'<polyline data-series={quoteattr(name)} points="{path}" fill="none" stroke="{color}"/>')
        if len(pairs) < 30:  # few points: mark each one
            out += [f'<circle cx="{x(s)}" cy="{y(v)}" r="3" fill="{color}"/>' for s, v in pairs]
        out.append(line(legend_x, legend_y - 5, legend_x + 22, legend_y - 5, color))
        out.append(text(legend_x + 27, legend_y, name, anchor="start"))
        legend_x += 45 + 8.5 * len(name)
    if best is not None:
        out.append(best_marker(best, x(best), (x0, x1, y0, y1), drawn))
    return out


def best_marker(best: int, at: float, frame: tuple[float, float, float, float], drawn: list) -> str:
    """The dashed line at the best step, and its label on a white ground in the corner next to the line
    that no curve crosses (the one crossed least if every corner is), so that it hides none of them."""
    x0, x1, y0, y1 = frame
    content = f"best: {best}"
    wide, high = round(0.6 * (FONT - 2) * len(content) + 6, 1), FONT + 2  # about the text's size
    corners = [
        (left, top)
        for top in (y0 + 2, y1 - high - 2)
        for left in (at - wide - 2, at + 2)
        if x0 <= left and left + wide <= x1
    ] or [(at - wide - 2, y0 + 2)]
    left, top = min(corners, key=lambda corner: crossings((*corner, wide, high), drawn))
    ground = f'<rect x="{round(left, 1)}" y="{round(top, 1)}" width="{wide}" height="{high}" fill="white"/>'
    label = text(round(left + wide - 3, 1), round(top + high - 3, 1), content, anchor="end", size=FONT - 2)
    marker = line(at, y0, at, y1, "#555", dashed=True)
    return f'<g data-best-step="{best}">{marker}{ground}{label}</g>'


def crossings(box: tuple[float, float, float, float], drawn: list) -> int:
    """How many segments of the polylines `drawn` pass through `box` (left, top, width, height), with a
    margin of 3 pixels: a line's width, a point's dot."""
    left, top, right, bottom = box[0] - 3, box[1] - 3, box[0] + box[2] + 3, box[1] + box[3] + 3
    count = 0
    for points in drawn:
        for (xa, ya), (xb, yb) in zip(points, points[1:] or points, strict=False):  # one point: itself
            low, high = 0.0, 1.0  # Liang-Barsky: the part of the segment inside the box
            sides = ((xa - xb, xa - left), (xb - xa, right - xa), (ya - yb, ya - top), (yb - ya, bottom - ya))
            for p, q in sides:
                if p == 0:
                    low, high = (low, high) if q >= 0 else (1.0, 0.0)
                elif p < 0:
                    low = max(low, q / p)
                else:
                    high = min(high, q / p)
            count += low <= high
    return count


def repeats_the_loss(values: list[tuple[int, float]], loss: list[tuple[int, float]]) -> bool:
    """Whether a metric is exp(eval/loss) at every step (a perplexity): the loss panel shows it already."""
    by_step = dict(loss)
    return all(
        step in by_step and math.isclose(value, math.exp(by_step[step]), rel_tol=1e-6)
        for step, value in values
    )


def best_step(output_dir: Path) -> int | None:
    """The step of the model in best_model/, if there is one."""
    try:
        return int(json.loads((output_dir / "best_model" / "export.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or being replaced right now
        return None


def plot_metrics(output_dir: str | Path, loss_axis: str = "log") -> Path:
    """Draw the curves of `output_dir` to `<output_dir>/curves.svg` and return its path.

    Each curve is a polyline whose `data-series` attribute names the metric (for scripts and tests).
    `loss_axis`: "log" or "linear", the scale of the loss panel's y axis.
    """
    path = metrics_path(output_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {output_dir} the output_dir of a run?")
    series = read_series(output_dir)
    eval_loss = series.get("eval/loss", [])
    other_metrics = sorted(
        name
        for name in series
        if name.startswith("eval/") and name != "eval/loss" and not repeats_the_loss(series[name], eval_loss)
    )
    # One panel per group: the losses together, then the task's other eval metrics, then the learning rate.
    panels = [("loss", "loss", ["train/loss", "eval/loss"], loss_axis == "log")]
    if other_metrics:
        label = " / ".join(name.removeprefix("eval/") for name in other_metrics)
        panels.append(("eval metrics", label, other_metrics, False))
    panels.append(("learning rate", "learning rate", ["train/lr"], False))
    steps = [step for pairs in series.values() for step, _ in pairs] or [0]
    shared = min(steps), max(max(steps), min(steps) + 1)
    best = best_step(Path(output_dir))
    width, height = PANEL_WIDTH * len(panels), PANEL_HEIGHT + 30
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" stroke-width="2">',
        '<rect width="100%" height="100%" fill="white"/>',
        text(width / 2, 21, Path(output_dir).name, size=FONT + 3),
        '<g transform="translate(0, 30)">',
    ]
    for index, (title, y_label, names, log) in enumerate(panels):
        lines = {name: series[name] for name in names if name in series}
        body += panel(index * PANEL_WIDTH, title, y_label, lines, shared, log, best)
    body += ["</g>", "</svg>", ""]
    target = Path(output_dir) / "curves.svg"
    write_atomically(target, "\n".join(body))  # a viewer, or a rerun, never sees half of it
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw a run's training curves to <output_dir>/curves.svg.")
    parser.add_argument("output_dir", type=Path, help="the run's output_dir (holds metrics.jsonl)")
    parser.add_argument(
        "--loss_axis",
        choices=["log", "linear"],
        default="log",
        help="the loss panel's scale (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        print(plot_metrics(args.output_dir, args.loss_axis))
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None


if __name__ == "__main__":
    main()
