"""The tracker chosen for this project writes its logs offline, next to metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import read_metrics, run_training

pytestmark = pytest.mark.slow


def test_tracker_writes_offline_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
{%- if cookiecutter.tracker == "wandb" %}
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: the run must go offline, not prompt
{%- elif cookiecutter.tracker == "mlflow" %}
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # no server: a local file store
{%- endif %}
    output_dir = tmp_path / "run"
    run_training(output_dir, "--max_steps", "10", "--log_every", "5", "--tracker", "{{ cookiecutter.tracker }}")
    assert [row["step"] for row in read_metrics(output_dir) if "train/loss" in row] == [5, 10]
{%- if cookiecutter.tracker == "tensorboard" %}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # The scalars; accelerate writes the hyperparameters to a sub-folder of their own.
    (events,) = (output_dir / "logs").glob("*/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("train/loss")] == [5, 10]
{%- elif cookiecutter.tracker == "wandb" %}
    (run_dir,) = (output_dir / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("*.wandb")), "offline run has no data file"
{%- elif cookiecutter.tracker == "mlflow" %}
    (loss_file,) = (output_dir / "mlruns").rglob("metrics/train/loss")
    assert [line.split()[2] for line in loss_file.read_text().splitlines()] == ["5", "10"]
{%- else %}
    # tracker none: metrics.jsonl is the only log.
    assert not (output_dir / "logs").exists()
{%- endif %}
