"""Where metrics go: always `<output_dir>/metrics.jsonl`, plus the experiment tracker chosen in the config."""

from __future__ import annotations

import importlib.util
import json
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}
import os
{%- endif %}
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker

from .config import TrainConfig


class JsonlTracker(GeneralTracker):
    """Appends one JSON object per `accelerator.log` call: readable with no tracker installed."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def tracker(self) -> Path:
        return self.path

    def store_init_configuration(self, values: dict) -> None:
        # The resolved config is written to config.yaml; metrics.jsonl holds only events.
        pass

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            file.write(json.dumps({"step": step, **values}) + "\n")


def metrics_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / "metrics.jsonl"


def metrics_size(output_dir: str | Path) -> int:
    path = metrics_path(output_dir)
    return path.stat().st_size if path.exists() else 0


def truncate_metrics(output_dir: str | Path, size: int) -> None:
    """Cut metrics.jsonl back to `size` bytes: what was logged after the checkpoint is logged again."""
    path = metrics_path(output_dir)
    if path.exists() and path.stat().st_size > size:
        with path.open("r+b") as file:
            file.truncate(size)


def trackers(config: TrainConfig) -> list[Any]:
    """The `log_with` list for the Accelerator."""
    chosen: list[Any] = [JsonlTracker(metrics_path(config.output_dir))]
    if config.tracker != "none":
        _check_installed(config.tracker)
        chosen.append(config.tracker)
    return chosen


def setup_tracker(config: TrainConfig) -> dict[str, dict[str, Any]]:
    """Make the chosen tracker work offline (environment variables) and return its `init_trackers` kwargs."""
{%- if cookiecutter.tracker == "wandb" %}
    if config.tracker == "wandb":
        # Without an API key, wandb would prompt for one; offline mode writes a run that
        # `wandb sync` uploads later.
        if not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")
        return {"wandb": {"dir": config.output_dir}}
{%- elif cookiecutter.tracker == "mlflow" %}
    if config.tracker == "mlflow":
        # A local file store unless the user points MLFLOW_TRACKING_URI at a server. MLflow 3 keeps
        # the file store only behind an explicit opt-in; it is the one backend that needs no database.
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ["MLFLOW_TRACKING_URI"] = (Path(config.output_dir) / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return {}
{%- endif %}
    return {}


def _check_installed(tracker: str) -> None:
    # Accelerate drops a tracker whose package is missing with only a warning; a run that silently
    # logs nowhere is worse than one that does not start.
    if importlib.util.find_spec(tracker) is None:
        raise RuntimeError(
            f"tracker {tracker!r} is configured but its package is not installed: "
            "pip install -e . (the project lists it), or set tracker: none"
        )
