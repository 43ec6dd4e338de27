"""The tracker chosen for this project writes its logs offline, next to metrics.jsonl, and a resumed run
continues the same tracker run."""

from __future__ import annotations

{% if cookiecutter.tracker in ["wandb", "mlflow"] %}import os
{% endif %}{% if cookiecutter.tracker == "tensorboard" %}import signal
import subprocess
import time
{% endif %}from pathlib import Path

import pytest
{%- if cookiecutter.tracker == "tensorboard" %}

from {{ cookiecutter.package_name }}.utils.signals import EXIT_STOPPED

from .conftest import PROJECT, read_metrics, run_training, training_command, wait_for_training
{%- else %}

from .conftest import read_metrics, run_training
{%- endif %}

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


def test_sessions_of_a_run_form_one_tensorboard_run(tmp_path: Path) -> None:
    """Stopped by SIGTERM, finished, rerun once finished (it only re-exports), then resumed from an older
    checkpoint: one folder, the settings recorded once, every step of metrics.jsonl once, no gap."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    output_dir = tmp_path / "run"
    args = ["--max_steps", "23", "--log_every", "5", "--checkpoint_every", "10"]
    command, env = training_command(output_dir, *args)
    started = time.time()
    process = subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for_training(output_dir, process, since=started, step=5)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == EXIT_STOPPED, output[-2000:]
    run_training(output_dir, *args)  # continues to the end: the last train loss and eval are logged at 23
    run_training(output_dir, *args)  # finished: evaluates and exports again, logging step 23 again
    assert_tensorboard_shows_metrics_once(output_dir)
    run_training(output_dir, *args, "--resume", str(output_dir / "checkpoints" / "step_00000020"))
    assert_tensorboard_shows_metrics_once(output_dir)

    settings = [
        HParamsPluginData.FromString(value.metadata.plugin_data.content).session_start_info.hparams
        for path in sorted((output_dir / "logs" / "run").glob("events.out.tfevents.*"))
        for event in EventFileLoader(str(path)).Load()
        for value in event.summary.value
        if value.tag == "_hparams_/session_start_info"
    ]
    assert len(settings) == 1 and settings[0]["max_steps"].number_value == 23


def assert_tensorboard_shows_metrics_once(output_dir: Path) -> None:
    """One run folder, whose scalars are those of metrics.jsonl: every train step once, no gap."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = output_dir / "logs" / "run"
    assert [path for path in (output_dir / "logs").rglob("*") if path.is_dir()] == [folder]
    accumulator = EventAccumulator(str(folder))  # what TensorBoard shows: it drops what restarts purge
    accumulator.Reload()
    rows = read_metrics(output_dir)
    for tag in ("train/loss", "eval/loss"):
        expected = [(row["step"], row[tag]) for row in rows if tag in row]
        shown = [(event.step, event.value) for event in accumulator.Scalars(tag)]
        assert [step for step, _ in shown] == [step for step, _ in expected], tag
        assert [value for _, value in shown] == pytest.approx([value for _, value in expected], rel=1e-6)
    assert [event.step for event in accumulator.Scalars("train/loss")] == [5, 10, 15, 20, 23]
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
