"""Where metrics go: always `<output_dir>/metrics.jsonl`, plus the experiment tracker chosen in the config."""

from __future__ import annotations

{% if cookiecutter.tracker != "none" %}import dataclasses
{% endif %}import importlib.util
import json
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}
import os
{%- endif %}
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from .checkpoint import LoopState
from .config import TrainConfig
from .run_dir import write_error


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
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(json.dumps({"step": step, **values}) + "\n")
        except OSError as error:  # a full disk, named as such, rather than a traceback from inside Accelerate
            raise write_error(self.path, error) from error


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


def start_trackers(accelerator: Accelerator, config: TrainConfig, state: LoopState) -> None:
    """Start the trackers: a resumed run continues its tracker run, which records the settings once."""
{%- if cookiecutter.tracker == "tensorboard" %}
    if config.tracker == "tensorboard":
        start_tensorboard(accelerator, config, state)
        return
{%- endif %}
    run_name = Path(config.output_dir).name
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}
    if config.tracker != "none":
        kwargs = setup_tracker(accelerator, config, state)
{%- if cookiecutter.tracker == "mlflow" %}
        # A continued tracker run keeps the settings it started with: MLflow refuses to change a logged
        # parameter, and max_steps, say, may differ between sessions. Each checkpoint holds its config.yaml.
{%- else %}
        # A continued tracker run keeps the settings it started with: max_steps, say, may differ between
        # sessions. Each checkpoint holds its config.yaml.
{%- endif %}
        hparams = None if state.tracker_run_id else dataclasses.asdict(config)
        accelerator.init_trackers(run_name, config=hparams, init_kwargs=kwargs)
        state.tracker_run_id = tracker_run_id(accelerator, config)
        return
{%- endif %}
    accelerator.init_trackers(run_name)  # metrics.jsonl alone: it records no settings (config.yaml does)
{%- if cookiecutter.tracker == "tensorboard" %}


def start_tensorboard(accelerator: Accelerator, config: TrainConfig, state: LoopState) -> None:
    """One TensorBoard run, the folder `logs/<run name>`, per training run however many sessions it takes.

    TensorBoard has no run ids: each session adds an event file to the folder, and a resumed one first
    drops what was logged after its checkpoint, which it logs again, so that every step shows once.
    TensorBoard drops whole steps, and a run logs at its checkpoint's step after saving it too (the
    last train loss): the checkpoint's step is dropped and written again from metrics.jsonl, cut back
    to the checkpoint already. Accelerate would write the settings to two new timestamped folders at
    every start: they go to the run's folder instead, once.
    """
    run_name = Path(config.output_dir).name
    continued = any((Path(accelerator.logging_dir) / run_name).glob("events.out.tfevents.*"))
    accelerator.init_trackers(
        run_name, init_kwargs={"tensorboard": {"purge_step": state.step}} if continued else {}
    )
    if not accelerator.is_main_process:
        return
    metrics = metrics_path(config.output_dir)
    if continued and metrics.exists():
        tracker = accelerator.get_tracker("tensorboard")
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if row.pop("step") == state.step:
                tracker.log(row, step=state.step)
    if not continued:
        from torch.utils.tensorboard.summary import hparams

        writer = accelerator.get_tracker("tensorboard", unwrap=True)
        for summary in hparams(dataclasses.asdict(config), {}):
            writer.file_writer.add_summary(summary)
        writer.flush()  # before training: a run stopped early has them, and does not record them again
{%- endif %}

{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}


def setup_tracker(accelerator: Accelerator, config: TrainConfig, state: LoopState) -> dict[str, Any]:
    """Make the chosen tracker work offline and continue the run of `state`; return `init_trackers` kwargs."""
{%- if cookiecutter.tracker == "wandb" %}
    if config.tracker == "wandb":
        source = load_secret("WANDB_API_KEY")
        if source:
            accelerator.print(f"wandb: API key from {source}")
        else:
            # Without a key wandb would prompt for one; offline, it writes a run that `wandb sync` uploads.
            os.environ.setdefault("WANDB_MODE", "offline")
            accelerator.print("wandb: no WANDB_API_KEY in the environment or the platform's secrets: offline")
        kwargs: dict[str, Any] = {"dir": config.output_dir}
        if state.tracker_run_id:
            # wandb ignores steps it already has: those logged after the checkpoint keep their first values.
            kwargs.update(id=state.tracker_run_id, resume="allow")
        return {"wandb": kwargs}
{%- elif cookiecutter.tracker == "mlflow" %}
    if config.tracker == "mlflow":
        for name in MLFLOW_SECRETS:
            if source := load_secret(name):
                accelerator.print(f"mlflow: {name} from {source}")
        # A local file store unless MLFLOW_TRACKING_URI points at a server. MLflow 3 keeps the file
        # store only behind an explicit opt-in; it is the one backend that needs no database.
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ["MLFLOW_TRACKING_URI"] = (Path(config.output_dir) / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # A resumed run logs into the same MLflow run; steps logged after the checkpoint appear twice.
        return {"mlflow": {"run_id": state.tracker_run_id or None}}
{%- endif %}
    return {}


def tracker_run_id(accelerator: Accelerator, config: TrainConfig) -> str:
    """The tracker's run id, saved in checkpoints so that a resumed run continues that run."""
{%- if cookiecutter.tracker == "wandb" %}
    if config.tracker == "wandb" and accelerator.is_main_process:
        return accelerator.get_tracker("wandb", unwrap=True).id
{%- elif cookiecutter.tracker == "mlflow" %}
    if config.tracker == "mlflow" and accelerator.is_main_process:
        return accelerator.get_tracker("mlflow", unwrap=True).info.run_id
{%- endif %}
    return ""
{%- if cookiecutter.tracker == "mlflow" %}


# Read from the platform's secrets when not in the environment; set MLFLOW_TRACKING_URI to log to a server.
MLFLOW_SECRETS = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
)
{%- endif %}


def load_secret(name: str) -> str | None:
    """Make secret `name` available to this process; return where it was found, or None.

    Looked up in the environment, then in Kaggle's secrets (Add-ons > Secrets), then in Colab's
    (the key icon; readable only inside the notebook kernel, so notebooks/colab.ipynb exports it for
    the launcher). The value goes into this process's environment only: never to a file or a log.
    """
    if os.environ.get(name):
        return "the environment"
    for source, read in (("Kaggle secrets", _kaggle_secret), ("Colab secrets", _colab_secret)):
        try:
            value = read(name)
        except Exception:  # not that platform, secret not attached, or access refused: try the next
            continue
        if value:
            os.environ[name] = value
            return source
    return None


def _kaggle_secret(name: str) -> str | None:
    from kaggle_secrets import UserSecretsClient

    return UserSecretsClient().get_secret(name)


def _colab_secret(name: str) -> str | None:
    from google.colab import userdata
    from IPython import get_ipython

    if get_ipython() is None:  # a launcher's subprocess: userdata would need the kernel
        return None
    return userdata.get(name)
{%- endif %}


def _check_installed(tracker: str) -> None:
    # Accelerate drops a tracker whose package is missing with only a warning; a run that silently
    # logs nowhere is worse than one that does not start.
    if importlib.util.find_spec(tracker) is None:
        raise RuntimeError(
            f"tracker {tracker!r} is configured but its package is not installed: "
            "pip install -e . (the project lists it), or set tracker: none"
        )
