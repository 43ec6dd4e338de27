"""The tracker chosen for this project writes its logs offline, next to metrics.jsonl, and a resumed run
continues the same tracker run."""

from __future__ import annotations

{% if cookiecutter.tracker in ["wandb", "mlflow"] %}import os
{% endif %}from pathlib import Path

import pytest

from .conftest import read_metrics, run_training

pytestmark = pytest.mark.slow
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}

SECRET = "s3cr3t-value-that-must-not-leak-0123456789"
{%- endif %}


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
{%- if cookiecutter.tracker == "tensorboard" %}


def test_resumed_run_replaces_what_was_logged_after_its_checkpoint(tmp_path: Path) -> None:
    """Resuming from step 10 of a run that reached step 20: TensorBoard shows steps 15 and 20 once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output_dir = tmp_path / "run"
    args = ["--max_steps", "20", "--log_every", "5", "--checkpoint_every", "10"]
    run_training(output_dir, *args)
    run_training(output_dir, *args, "--resume", str(output_dir / "checkpoints" / "step_00000010"))
    accumulator = EventAccumulator(str(output_dir / "logs" / "run"))
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("train/loss")] == [5, 10, 15, 20]
{%- elif cookiecutter.tracker == "wandb" %}


def test_resumed_run_continues_the_same_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    output_dir = tmp_path / "run"
    run_training(output_dir, "--max_steps", "10", "--log_every", "5")
    run_training(output_dir, "--max_steps", "20", "--log_every", "5")
    runs = sorted((output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    run_ids = {path.name.rsplit("-", 1)[1] for path in runs}
    assert len(run_ids) == 1, f"two different wandb runs: {runs}"
{%- elif cookiecutter.tracker == "mlflow" %}


def test_resumed_run_continues_the_same_mlflow_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    output_dir = tmp_path / "run"
    run_training(output_dir, "--max_steps", "10", "--log_every", "5")
    run_training(output_dir, "--max_steps", "20", "--log_every", "5")
    (loss_file,) = (output_dir / "mlruns").rglob("metrics/train/loss")  # one run, not two
    assert [line.split()[2] for line in loss_file.read_text().splitlines()] == ["5", "10", "15", "20"]
{%- endif %}
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}
{%- set secret_name = "WANDB_API_KEY" if cookiecutter.tracker == "wandb" else "MLFLOW_TRACKING_TOKEN" %}


def test_kaggle_secret_is_used_and_never_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kaggle's secret store, faked by a module of the same name and interface: the key is found there,
    and appears in no output, no file of the run and no file under HOME."""
    fake = tmp_path / "fake_kaggle"
    fake.mkdir()
    (fake / "kaggle_secrets.py").write_text(
        "class UserSecretsClient:\n"
        "    def get_secret(self, name):\n"
        f"        if name == '{{ secret_name }}':\n"
        f"            return '{SECRET}'\n"
        "        raise KeyError(name)  # Kaggle's client fails for a secret that is not attached\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("{{ secret_name }}", raising=False)
{%- if cookiecutter.tracker == "wandb" %}
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # a key makes wandb go online; this machine has no network
{%- else %}
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
{%- endif %}
    output_dir = tmp_path / "run"
    result = run_training(output_dir, "--max_steps", "10", "--log_every", "5")
{%- if cookiecutter.tracker == "wandb" %}
    assert "wandb: API key from Kaggle secrets" in result.stdout
{%- else %}
    assert "mlflow: MLFLOW_TRACKING_TOKEN from Kaggle secrets" in result.stdout
{%- endif %}
    assert SECRET not in result.stdout + result.stderr
    for path in [*output_dir.rglob("*"), *(tmp_path / "home").rglob("*")]:
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"the secret was written to {path}"
{%- endif %}
