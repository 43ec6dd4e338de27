"""The trackers of the config, one or several at once whatever tracker the project was generated with, write
their logs offline, next to metrics.jsonl, and a run interrupted in any way shows in each as a run that was
never stopped."""

from __future__ import annotations

import importlib.util
{% if cookiecutter.tracker == "mlflow" %}import json
{% endif %}import os
import signal
import subprocess
{% if cookiecutter.tracker in ["wandb", "mlflow"] %}import sys
{% endif %}import time
{% if cookiecutter.tracker == "mlflow" %}import urllib.parse
import urllib.request
{% endif %}from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import list_checkpoints{% if cookiecutter.tracker == "mlflow" %}, seal{% endif %}
from {{ cookiecutter.package_name }}.utils.config import ConfigError, TrainConfig, load_config
{%- if cookiecutter.tracker == "mlflow" %}
from {{ cookiecutter.package_name }}.utils.run import tracking
{%- endif %}
{%- if cookiecutter.tracker == "wandb" %}
from {{ cookiecutter.package_name }}.utils.run.run_dir import RunError
{%- endif %}
from {{ cookiecutter.package_name }}.utils.run.tracking import TRACKER_MODULES, wandb_history{% if cookiecutter.tracker == "wandb" %}, wandb_offline_steps{% endif %}
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from .conftest import (
    PROJECT,
{%- if cookiecutter.tracker == "mlflow" %}
    free_port,
{%- endif %}
    read_metrics,
    run_training,
    start_training,
    training_command,
    wait_for_checkpoint,
    wait_for_training,
)

pytestmark = pytest.mark.slow

# A checkpoint every 10 steps and a train loss every 5: a kill at step 15 leaves a step logged after the
# newest checkpoint. Evaluations every 12 steps and at the end, whatever the task's epoch length.
STEPS = ["--max_steps", "30", "--log_every", "5", "--checkpoint_every", "10", "--eval_every", "12"]
ARGS = [*STEPS, "--tracker", "{{ cookiecutter.tracker }}"]


def installed(*trackers: str) -> bool:
    """Whether these trackers are installed (this project's extras of their names install them)."""
    modules = [module for tracker in trackers for module in TRACKER_MODULES[tracker].split()]
    return all(importlib.util.find_spec(module) for module in modules)
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}


SECRET = "s3cr3t-value-that-must-not-leak-0123456789"
{%- endif %}
{%- if cookiecutter.tracker == "none" %}


def test_tracker_writes_offline_logs(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    run_training(output_dir, "--max_steps", "10", "--log_every", "5", "--tracker", "none")
    assert [row["step"] for row in read_metrics(output_dir) if "train/loss" in row] == [5, 10]
    assert not (output_dir / "logs").exists()  # metrics.jsonl is the only log
{%- endif %}


@pytest.mark.skipif(not installed(*TRACKER_MODULES), reason="pip install -e '.[tensorboard,wandb,mlflow]'")
def test_several_trackers_at_once_each_show_a_killed_run_as_never_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tracker: tensorboard,wandb,mlflow, whatever the project was generated with (offline: no key, no
    server): killed with kill -9 after a checkpoint with a step logged after it, then resumed to its end,
    the run shows in each tracker as the same run uninterrupted: every step of every metric once, no gap,
    the same values."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # a SQLite file in output_dir
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # wandb goes offline
    args = [*STEPS, "--tracker", "tensorboard,wandb,mlflow"]
    readers = {"tensorboard": tensorboard_metrics, "wandb": wandb_metrics, "mlflow": mlflow_metrics}
    reference = tmp_path / "reference"
    run_training(reference, *args)
    expected = {name: read(reference) for name, read in readers.items()}
    for metrics in expected.values():
        assert [step for step, _ in metrics["train/loss"]] == [5, 10, 15, 20, 25, 30]
        assert metrics.keys() == {name for row in read_metrics(reference) for name in row} - {"step"}

    output_dir = tmp_path / "run"
    interrupt(output_dir, signal.SIGKILL, 15, *args)
    newest_checkpoint = int(list_checkpoints(output_dir)[-1].name[5:])
    assert read_metrics(output_dir)[-1]["step"] > newest_checkpoint, "nothing was logged after the checkpoint"
    run_training(output_dir, *args)
    assert {name: read(output_dir) for name, read in readers.items()} == expected


@pytest.mark.skipif(not installed("tensorboard", "mlflow"), reason="pip install -e '.[tensorboard,mlflow]'")
def test_a_tracker_added_to_a_resumed_run_gets_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that logged to MLflow alone, killed with kill -9, continued with tensorboard,mlflow: TensorBoard
    starts with every step logged so far, MLflow continues its run; both show what a run with both from the
    start shows."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reference = tmp_path / "reference"
    run_training(reference, *STEPS, "--tracker", "tensorboard,mlflow")
    output_dir = tmp_path / "run"
    interrupt(output_dir, signal.SIGKILL, 15, *STEPS, "--tracker", "mlflow")
    assert not (output_dir / "logs").exists()
    run_training(output_dir, *STEPS, "--tracker", "tensorboard,mlflow")
    assert tensorboard_metrics(output_dir) == tensorboard_metrics(reference)
    assert mlflow_metrics(output_dir) == mlflow_metrics(reference)


def test_a_tracker_not_installed_is_one_line_before_anything_is_written(tmp_path: Path) -> None:
    """A tracker whose package is missing (here mlflow, hidden from the run) stops the run with the one
    line that names the install command, before the output folder is touched."""
    hook = tmp_path / "hook"
    hook.mkdir()
    hidden = "".join(f"sys.modules[{module!r}] = None\n" for module in TRACKER_MODULES["mlflow"].split())
    (hook / "sitecustomize.py").write_text(f"import sys\n{hidden}")  # not importable, as if not installed
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *STEPS, "--tracker", "mlflow")
    env["PYTHONPATH"] = os.pathsep.join([str(hook), env.get("PYTHONPATH", "")])
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "config error: tracker mlflow is not installed (missing: mlflow, sqlalchemy, alembic): pip "
        'install -e ".[mlflow]" in the project folder, or leave mlflow out of tracker'
    )
    assert 'mlflow = ["mlflow-skinny>=' in (PROJECT / "pyproject.toml").read_text()  # the extra it names
    assert not output_dir.exists()


def test_tracker_takes_a_list_in_yaml_and_a_comma_separated_flag(tmp_path: Path) -> None:
    config_file = tmp_path / "config.yaml"
    config_file.write_text("tracker: [tensorboard, mlflow]\n")
    assert load_config([], config_file, TrainConfig)[0].tracker == "tensorboard,mlflow"
    assert load_config(["--tracker", "wandb,mlflow"], config_file, TrainConfig)[0].tracker == "wandb,mlflow"
    with pytest.raises(ConfigError, match="--tracker: tracker='tensorboard,mlfow' is invalid: it must be"):
        load_config(["--tracker", "tensorboard,mlfow"], config_file, TrainConfig)


def interrupt(output_dir: Path, signal_number: int, after_step: int, *args: str) -> None:
    """Start a run of `args` in `output_dir` and send it `signal_number` once it has logged `after_step`."""
    started = time.time()
    process = start_training(output_dir, *args)
    wait_for_training(output_dir, process, since=started, step=after_step)
    if signal_number == signal.SIGKILL:
        wait_for_checkpoint(output_dir, process)
    process.send_signal(signal_number)
    output, _ = process.communicate(timeout=120)
    stopped = -signal.SIGKILL if signal_number == signal.SIGKILL else EXIT_STOPPED
    assert process.returncode == stopped, output[-2000:]


def tensorboard_metrics(output_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each metric, as TensorBoard shows them: it drops what restarts purge."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = output_dir / "logs" / output_dir.name
    assert [path for path in (output_dir / "logs").rglob("*") if path.is_dir()] == [folder]  # one run
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def wandb_metrics(output_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each metric of the one wandb run, as its offline sessions' files hold them."""
    sessions = sorted((output_dir / "wandb").glob("offline-run-*"))  # one folder per session, by start time
    assert len({wandb_run_id(path) for path in sessions}) == 1, f"two wandb runs: {sessions}"
    metrics: dict[str, list[tuple[int, float]]] = {}
    for session in sessions:
        for step, items in wandb_session_history(session):
            for name, value in items.items():
                if not name.startswith("_"):  # wandb's own: _step, _runtime, _timestamp
                    metrics.setdefault(name, []).append((step, value))
    return metrics


def wandb_run_id(session: Path) -> str:
    """The run id in a session's folder name, offline-run-<date>_<time>-<id>, which wandb ends with -1 (-2,
    ...) where a session of the run started in the same second as the one before."""
    return session.name.split("-")[3]


def wandb_session_history(session: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {metric: value}) of each history record of an offline session, read by wandb's own reader."""
    (path,) = session.glob("*.wandb")
    return wandb_history(path)


def mlflow_metrics(output_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each metric of the one MLflow run, read by MLflow's client from its SQLite store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(output_dir / 'mlflow.db').as_posix()}")
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    (run,) = client.search_runs(experiments)
    history = client.get_metric_history
    return {
        name: sorted((metric.step, metric.value) for metric in history(run.info.run_id, name))
        for name in run.data.metrics
    }
{%- if cookiecutter.tracker != "none" %}
{%- if cookiecutter.tracker == "tensorboard" %}


def test_interrupted_run_shows_in_the_tracker_as_a_run_never_stopped(tmp_path: Path) -> None:
{%- else %}


def test_interrupted_run_shows_in_the_tracker_as_a_run_never_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
{%- endif %}
    """Killed with kill -9 after a checkpoint with a step logged after it, stopped by SIGTERM, finished,
    then run again once finished (it logs its last step again): the tracker holds what it holds for an
    uninterrupted run, offline, in one tracker run: every step of every metric once, no gap, the same
    values (resume is bitwise exact on the CPU)."""
{%- if cookiecutter.tracker == "wandb" %}
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: the run must go offline, not prompt
{%- elif cookiecutter.tracker == "mlflow" %}
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # no server: a SQLite file in output_dir
{%- endif %}
    reference = tmp_path / "reference"
    run_training(reference, *ARGS)
    expected = tracker_metrics(reference)
    assert [step for step, _ in expected["train/loss"]] == [5, 10, 15, 20, 25, 30]
    evaluated = next(name for name in expected if name.startswith("eval/"))  # whatever this task's are
    assert [step for step, _ in expected[evaluated]] == [12, 24, 30]
    assert expected.keys() == {name for row in read_metrics(reference) for name in row} - {"step"}

    output_dir = tmp_path / "run"
    interrupt(output_dir, signal.SIGKILL, 15, *ARGS)
    newest_checkpoint = int(list_checkpoints(output_dir)[-1].name[5:])
    assert read_metrics(output_dir)[-1]["step"] > newest_checkpoint, "nothing was logged after the checkpoint"
    interrupt(output_dir, signal.SIGTERM, 20, *ARGS)
    {% if cookiecutter.tracker in ["wandb", "mlflow"] %}finishing = {% endif %}run_training(output_dir, *ARGS)
    run_training(output_dir, *ARGS)  # finished: evaluates and exports again, logging step 30 again
    assert tracker_metrics(output_dir) == expected
{%- if cookiecutter.tracker == "tensorboard" %}
    assert_settings_recorded_once(output_dir, max_steps=30)
{%- elif cookiecutter.tracker == "wandb" %}
    # Three sessions trained; the rerun of the finished run made no fourth, empty one.
    sessions = sorted((output_dir / "wandb").glob("offline-run-*"))
    assert len(sessions) == 3, sessions
    (run_id,) = {wandb_run_id(path) for path in sessions}
    held = wandb_offline_steps(output_dir / "wandb", run_id)
    assert {name: held[name] for name in expected} == {name: 30 for name in expected}
    # The upload command that the run prints finds every session: `wandb sync --dry-run` lists them.
    (folder,) = [
        line.split("wandb sync ", 1)[1]
        for line in finishing.stdout.splitlines()
        if "upload every session with: wandb sync" in line
    ]
    command = [sys.executable, "-m", "wandb", "sync", "--dry-run", folder]
    listing = subprocess.run(command, capture_output=True, text=True, check=True, cwd=PROJECT)
    assert "Would sync 3 run(s)" in listing.stdout + listing.stderr, listing.stdout + listing.stderr
{%- elif cookiecutter.tracker == "mlflow" %}
    assert f"mlflow ui --backend-store-uri sqlite:///{(output_dir / 'mlflow.db').resolve().as_posix()}" in (
        finishing.stdout
    )
    assert not (PROJECT / "mlruns").exists()  # nothing in the working directory
{%- endif %}


def tracker_metrics(output_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each metric, in the order that the tracker shows them, read from its own files."""
{%- if cookiecutter.tracker == "tensorboard" %}
    return tensorboard_metrics(output_dir)


def assert_settings_recorded_once(output_dir: Path, max_steps: int) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    settings = [
        HParamsPluginData.FromString(value.metadata.plugin_data.content).session_start_info.hparams
        for path in sorted((output_dir / "logs" / output_dir.name).glob("events.out.tfevents.*"))
        for event in EventFileLoader(str(path)).Load()
        for value in event.summary.value
        if value.tag == "_hparams_/session_start_info"
    ]
    assert len(settings) == 1 and settings[0]["max_steps"].number_value == max_steps
{%- elif cookiecutter.tracker == "wandb" %}
    return wandb_metrics(output_dir)


def test_unreadable_wandb_file_is_named(tmp_path: Path) -> None:
    """A file wandb's reader refuses stops a resume, named, rather than reading as holding no step."""
    path = tmp_path / "offline-run-20260101_000000-abc" / "run-abc.wandb"
    path.parent.mkdir()
    path.write_bytes(b"not a wandb transaction log")
    with pytest.raises(RunError, match=f"cannot read wandb's offline file {path}"):
        wandb_offline_steps(tmp_path, "abc")
{%- elif cookiecutter.tracker == "mlflow" %}
    return mlflow_metrics(output_dir)


def mlflow_ui_installed() -> bool:
    spec = importlib.util.find_spec("mlflow")
    return spec is not None and (Path(spec.origin).parent / "server" / "js" / "build").is_dir()


@pytest.mark.skipif(
    not mlflow_ui_installed(),
    reason="mlflow's UI is not installed (mlflow-skinny has none): pip install -e '.[mlflow-ui]'",
)
def test_mlflow_ui_shows_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The viewer command that the run prints serves its metrics (on 127.0.0.1)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    output_dir = tmp_path / "run"
    result = run_training(output_dir, "--max_steps", "10", "--log_every", "5", "--tracker", "mlflow")
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("mlflow: view with: ")]
    port = free_port()
    command = [sys.executable, "-m", *line.removeprefix("mlflow: view with: ").split()]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the server's workers stop with it
    )
    try:
        page = wait_for_page(f"http://127.0.0.1:{port}/", server)
        assert "<title>MLflow</title>" in page
        api = f"http://127.0.0.1:{port}/api/2.0/mlflow"
        experiments = post(f"{api}/experiments/search", {"max_results": 100})["experiments"]
        ids = [experiment["experiment_id"] for experiment in experiments]
        (run,) = post(f"{api}/runs/search", {"experiment_ids": ids})["runs"]
        query = urllib.parse.urlencode({"run_id": run["info"]["run_id"], "metric_key": "train/loss"})
        history = json.loads(urllib.request.urlopen(f"{api}/metrics/get-history?{query}", timeout=30).read())
        assert sorted(metric["step"] for metric in history["metrics"]) == [5, 10]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_mlflow_viewer_line_says_what_to_install_where_only_mlflow_skinny_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where mlflow is mlflow-skinny (the default install: no built pages, and `mlflow ui` fails on missing
    pandas and aiohttp), the line the run prints starts with the install of this project's extra that
    brings the viewer; where the viewer is installed, it is the command alone (served above)."""
    skinny = tmp_path / "mlflow"
    (skinny / "server").mkdir(parents=True)  # mlflow-skinny's layout: a server package, no js/build
    (skinny / "__init__.py").write_text("")
    found = importlib.util.spec_from_file_location("mlflow", skinny / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: found if name == "mlflow" else None)
    line = tracking.mlflow_viewer_hint("sqlite:///runs/mlflow.db")
    assert line.startswith('mlflow: view with: pip install -e ".[mlflow-ui]" (once, in the project'), line
    assert line.endswith("then mlflow ui --backend-store-uri sqlite:///runs/mlflow.db"), line
    assert 'mlflow-ui = ["mlflow>=' in (PROJECT / "pyproject.toml").read_text()  # the extra it names
    (skinny / "server" / "js" / "build").mkdir(parents=True)  # full mlflow's layout
    alone = tracking.mlflow_viewer_hint("sqlite:///x.db")
    assert alone == "mlflow: view with: mlflow ui --backend-store-uri sqlite:///x.db"


def test_a_checkpoint_of_the_previous_version_continues_its_mlflow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The previous version saved its one tracker's run id bare (`tracker_run_id: "<id>"`): a run resumed
    from such a checkpoint continues that MLflow run, the render's tracker, each step once."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reference = tmp_path / "reference"
    run_training(reference, *ARGS)
    output_dir = tmp_path / "run"
    interrupt(output_dir, signal.SIGKILL, 15, *ARGS)
    for checkpoint in list_checkpoints(output_dir):
        path = checkpoint / "loop_state.json"
        record = json.loads(path.read_text())
        name, run_id = record["loop_state"]["tracker_run_id"].split("=")
        assert name == "mlflow" and run_id
        record["loop_state"]["tracker_run_id"] = run_id  # as the previous version wrote it
        record["seal"] = seal(record)
        path.write_text(json.dumps(record))
    run_training(output_dir, *ARGS)
    assert mlflow_metrics(output_dir) == mlflow_metrics(reference)  # one MLflow run, each step once


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def wait_for_page(url: str, server: subprocess.Popen) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, "mlflow ui exited"
        try:
            return urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlflow ui did not answer at {url}")
{%- endif %}
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
    assert "wandb: API key from Kaggle's secrets" in result.stdout
{%- else %}
    assert "mlflow: MLFLOW_TRACKING_TOKEN from Kaggle's secrets" in result.stdout
{%- endif %}
    assert SECRET not in result.stdout + result.stderr
    for path in [*output_dir.rglob("*"), *(tmp_path / "home").rglob("*")]:
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"the secret was written to {path}"
{%- endif %}
