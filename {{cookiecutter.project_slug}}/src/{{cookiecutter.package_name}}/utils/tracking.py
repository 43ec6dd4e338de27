"""Where metrics go: always `<output_dir>/metrics.jsonl`, plus the experiment tracker chosen in the config."""

from __future__ import annotations

{% if cookiecutter.tracker != "none" %}import dataclasses
{% endif %}import errno
import importlib.util
import io
import json
{%- if cookiecutter.tracker == "mlflow" %}
import logging
{%- endif %}
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}
import os
{%- endif %}
{%- if cookiecutter.tracker == "wandb" %}
import subprocess
{%- endif %}
import sys
import threading
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from .checkpoint import LoopState
from .config import TrainConfig
from .durable import fsync_path, write_atomically
from .run_dir import {% if cookiecutter.tracker == "wandb" %}RunError, {% endif %}write_error


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

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(json.dumps({"step": step, **values}) + "\n")
        except OSError as error:  # a full disk, named as such, rather than a traceback from inside Accelerate
            raise write_error(self.path, error) from error


def metrics_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / "metrics.jsonl"


def metrics_size(output_dir: str | Path, durable: bool = False) -> int:
    """The size of metrics.jsonl; `durable`: its lines reach the disk first (a checkpoint will seal it)."""
    path = metrics_path(output_dir)
    if not path.exists():
        return 0
    if durable:
        fsync_path(path)
    return path.stat().st_size


def truncate_metrics(output_dir: str | Path, size: int, step: int) -> str | None:
    """Cut metrics.jsonl back to `size` bytes, its length at the checkpoint of `step`: what was logged after
    the checkpoint is logged again.

    A file shorter than that lost lines the checkpoint counted (a copy cut short, a disk that dropped its
    last writes). It is repaired rather than refused: cut back to its last whole line, then filled to
    `size` with one row of `step` and no values, so that every line is JSON and a later cut lands where the
    checkpoint says. Returns the warning that says what was lost, or None.
    """
    path = metrics_path(output_dir)
    held = path.stat().st_size if path.exists() else 0
    if held > size:
        with path.open("r+b") as file:
            file.truncate(size)
    if held >= size:
        return None
    data = path.read_bytes() if path.exists() else b""
    whole = data.rfind(b"\n") + 1
    filler = b'{"step": ' + str(step).encode()
    while whole and size - whole < len(filler) + 2:  # no room for the filler row: one line less
        whole = data.rfind(b"\n", 0, whole - 1) + 1
    write_atomically(path, data[:whole] + filler + b" " * (size - whole - len(filler) - 2) + b"}\n")
    return (
        f"WARNING: {path} held {held} of the {size} bytes its checkpoint of step {step} counted (a copy cut "
        f"short, or a disk that dropped its last writes): the rows in its last {size - whole} bytes are "
        "lost; it was cut back to whole lines and the run continues"
    )


def logged_rows(output_dir: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(step, values) of each line of metrics.jsonl, in the order logged."""
    path = metrics_path(output_dir)
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(row.pop("step"), row) for row in rows]


def save_curves(output_dir: str | Path, best_metric: str, best_step: int | None) -> None:
    """curves.png in output_dir, from metrics.jsonl, at a session's end (main process); a line names it. A
    failure to draw (matplotlib missing or broken, a full disk) is a warning line: the run is saved by now."""
    path = Path(output_dir) / "curves.png"
    try:
        if figure := curves_figure(logged_rows(output_dir), best_metric, best_step):
            figure.savefig(png := io.BytesIO(), format="png", dpi=80)
            write_atomically(path, png.getvalue(), durable=False)  # a kill leaves the last picture whole
            print(f"curves: {path}", flush=True)
    except Exception as error:
        print(f"WARNING: {path} not drawn: {type(error).__name__}: {error}", flush=True)


def curves_figure(rows: list[tuple[int, dict[str, Any]]], best_metric: str, best_step: int | None) -> Any:
    """A panel per metric (train/loss, then each eval metric) with its line by step; on best_metric's, a
    marker at the best evaluation. None where nothing is logged yet."""
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


def trackers(config: TrainConfig) -> list[Any]:
    """The `log_with` list for the Accelerator."""
    chosen: list[Any] = [JsonlTracker(metrics_path(config.output_dir))]
    if config.tracker != "none":
        _check_installed(config.tracker)
        chosen.append(config.tracker)
    return chosen


def start_trackers(accelerator: Accelerator, config: TrainConfig, state: LoopState, finished: bool) -> None:
    """Start the trackers: a resumed run continues its tracker run, which records the settings once.

    `finished`: the run is at its last step already, so this session logs only what it logged before.
    A full disk under a tracker, now or later, ends in the project's one line (`NamesAFullDisk`)."""
    where = Path(config.output_dir) / TRACKER_FILES.get(config.tracker, "")
    quiet_full_disk_in_threads(where)
    try:
        _start_trackers(accelerator, config, state, finished)
    except Exception as error:
        if not disk_full(error):
            raise
        # A tracker that failed to start cannot be closed either (end_training would raise over this).
        accelerator.trackers = [one for one in accelerator.trackers if isinstance(one, JsonlTracker)]
        raise write_error(where, error) from error
    accelerator.trackers = [
        tracker if isinstance(tracker, JsonlTracker | NamesAFullDisk) else NamesAFullDisk(tracker, where)
        for tracker in accelerator.trackers
    ]


# Where the tracker writes in output_dir{% if cookiecutter.tracker == "mlflow" %} (its SQLite store unless MLFLOW_TRACKING_URI names another){% endif %}.
TRACKER_FILES = {{ '{' }}{% if cookiecutter.tracker != "none" %}"{{ cookiecutter.tracker }}": "{{ {'tensorboard': 'logs', 'mlflow': 'mlflow.db', 'wandb': 'wandb'}[cookiecutter.tracker] }}"{% endif %}{{ '}' }}


def quiet_full_disk_in_threads(where: Path) -> None:
    """A tracker's own writer thread (one that writes events in the background) meeting a full disk says
    so in one line instead of its traceback: the run's next write to that disk ends the run in one line."""
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is None or not disk_full(args.exc_value):
            default(args)
            return
        thread = args.thread.name if args.thread else "a thread"
        print(f"WARNING: {thread} could not write under {where}: the disk is full", file=sys.stderr)

    threading.excepthook = hook


def disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error that caused it, is a full disk (SQLite says so in words only)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "disk is full" in str(seen) or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class NamesAFullDisk(GeneralTracker):
    """Hands everything to another tracker (`inner`), as itself; a full disk under it (an OSError, or
    SQLite's "database or disk is full") is raised as the project's one-line error, which names the free
    space."""

    requires_logging_directory = False

    def __init__(self, inner: GeneralTracker, where: Path) -> None:
        self.inner, self.where = inner, where
        super().__init__()

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def tracker(self) -> Any:
        return self.inner.tracker

    def store_init_configuration(self, values: dict) -> None:
        self._named(self.inner.store_init_configuration, values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self._named(self.inner.log, values, step=step, **kwargs)

    def finish(self) -> None:
        self._named(self.inner.finish)

    def _named(self, method: Any, *args: Any, **kwargs: Any) -> None:
        try:
            method(*args, **kwargs)
        except Exception as error:
            if not disk_full(error):
                raise
            raise write_error(self.where, error) from error


def _start_trackers(accelerator: Accelerator, config: TrainConfig, state: LoopState, finished: bool) -> None:
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
        continued = bool(state.tracker_run_id)
{%- if cookiecutter.tracker == "wandb" %}
        # Only the main process logs to wandb (Accelerate's trackers), so only it needs to decide.
        if continued and finished and accelerator.is_main_process and offline_run_complete(config, state):
            # A new session would be one more offline folder of the run, holding nothing new.
            accelerator.log_with = [tracker for tracker in accelerator.log_with if str(tracker) != "wandb"]
            print("wandb: its offline run holds every step of this finished run already: no new session")
            accelerator.init_trackers(run_name)
            return
{%- endif %}
        hparams = None if continued else dataclasses.asdict(config)
        accelerator.init_trackers(run_name, config=hparams, init_kwargs=kwargs)
        state.tracker_run_id = tracker_run_id(accelerator, config)
        if accelerator.is_main_process:
            log_each_step_once(accelerator, config, continued)
{%- if cookiecutter.tracker == "wandb" %}
            if os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
                # wandb's own closing hint names this session's folder only; a resumed run has several.
                folder = Path(config.output_dir) / "wandb"
                print(f"wandb: offline; upload every session with: wandb sync {folder}")
{%- elif cookiecutter.tracker == "mlflow" %}
            if os.environ["MLFLOW_TRACKING_URI"].startswith("sqlite:"):
                print(mlflow_viewer_hint(os.environ["MLFLOW_TRACKING_URI"]))
{%- endif %}
        return
{%- endif %}
    accelerator.init_trackers(run_name)  # metrics.jsonl alone: it records no settings (config.yaml does)
{%- if cookiecutter.tracker == "tensorboard" %}


def start_tensorboard(accelerator: Accelerator, config: TrainConfig, state: LoopState) -> None:
    """One TensorBoard run, the folder `logs/<run name>`, per training run however many sessions it takes.

    TensorBoard has no run ids: each session adds an event file to the folder, and a resumed one first
    drops what was logged after its checkpoint, which it logs again, so that every step shows once.
    Dropping works here, unlike on a tracker's server, because the files are local; and Accelerate
    flushes them at every log, so a killed session's file holds everything up to its checkpoint.
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
    # What the purge dropped, or all of it for a run that had no TensorBoard folder (another tracker before).
    tracker = accelerator.get_tracker("tensorboard")
    for step, values in logged_rows(config.output_dir):
        if step >= state.step or not continued:
            tracker.log(values, step=step)
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
        if state.tracker_run_id:  # each step once: see log_each_step_once
            kwargs["id"] = state.tracker_run_id
            if os.environ.get("WANDB_MODE") not in ("offline", "dryrun"):  # offline wandb ignores it, warning
                kwargs["resume"] = "allow"
        return {"wandb": kwargs}
{%- elif cookiecutter.tracker == "mlflow" %}
    if config.tracker == "mlflow":
        for name in MLFLOW_SECRETS:
            if source := load_secret(name):
                accelerator.print(f"mlflow: {name} from {source}")
        # MLflow logs a database error with its traceback, then raises it: the raise is what the run reports
        # (a full disk: one line, NamesAFullDisk), so the logged copy is dropped.
        logging.getLogger("mlflow.store.db.utils").addFilter(lambda record: record.levelno < logging.ERROR)
        kwargs = {"run_id": state.tracker_run_id or None}  # the same run, each step once: log_each_step_once
        # A SQLite file in the output folder unless MLFLOW_TRACKING_URI points at a server: what MLflow
        # recommends for local use (its file store is in maintenance mode), and what `mlflow ui` opens.
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            output_dir = Path(config.output_dir).resolve()
            os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///" + (output_dir / "mlflow.db").as_posix()
            kwargs["logging_dir"] = (output_dir / "mlartifacts").as_uri()  # not ./mlruns in the cwd
        return {"mlflow": kwargs}
{%- endif %}
    return {}
{%- if cookiecutter.tracker == "mlflow" %}


def mlflow_viewer_installed() -> bool:
    """Whether MLflow's web viewer is installed: full mlflow (the mlflow-ui extra) ships its built pages;
    mlflow-skinny, which the default install has, has an `mlflow ui` command that fails without them."""
    spec = importlib.util.find_spec("mlflow")
    origin = spec.origin if spec is not None else None
    return origin is not None and (Path(origin).parent / "server" / "js" / "build").is_dir()


def mlflow_viewer_hint(uri: str) -> str:
    """The line that says how to look at the run: the viewer's command, after its install where it lacks."""
    command = f"mlflow ui --backend-store-uri {uri}"
    if mlflow_viewer_installed():
        return f"mlflow: view with: {command}"
    return (
        'mlflow: view with: pip install -e ".[mlflow-ui]" (once, in the project folder: the default install '
        f"has mlflow-skinny, without the viewer), then {command}"
    )
{%- endif %}


class SkipsHeldSteps(NamesAFullDisk):
    """Passes on to a tracker the values of the steps that its run does not hold yet, and no others."""

    def __init__(
        self, inner: GeneralTracker, where: Path, held: dict[str, int], held_by_all: int = -1
    ) -> None:
        super().__init__(inner, where)
        self.held = held  # metric name -> the last step of it that the tracker's run holds
        self.held_by_all = held_by_all  # a step up to which the run holds every metric

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is None:  # not a value of a step: nothing to compare with
            super().log(values, **kwargs)
            return
        new = {
            name: value
            for name, value in values.items()
            if step > max(self.held.get(name, -1), self.held_by_all)
        }
        if new:
            super().log(new, step=step, **kwargs)
            self.held.update(dict.fromkeys(new, step))


def log_each_step_once(accelerator: Accelerator, config: TrainConfig, continued: bool) -> None:
    """Make the tracker's run show each logged step once and without a gap, however the sessions ended.

    What the run holds is asked of the tracker's own store, not inferred from metrics.jsonl: a killed
    session may have left it holding less than was sent, maybe less than the checkpoint{% if cookiecutter.tracker == "wandb" %} (wandb writes its
    files every 15 s or 32 KiB: after `kill -9` an offline session may have written nothing){% endif %}, and
    a server holds what sessions on other machines sent. So metrics.jsonl, cut back to the checkpoint,
    is replayed for what the run lacks, and values of steps that the run holds are dropped, never sent
    twice. Dropped rather than deleted after the checkpoint because {% if cookiecutter.tracker == "wandb" %}wandb, online or offline,{% else %}an MLflow server{% endif %} does not
    let a client remove logged values; resume is exact, so the values dropped are those the run has
    (with `deterministic: false` on a GPU the tracker keeps the first session's values of those steps).
    """
    tracker = accelerator.get_tracker(config.tracker)
    where = Path(config.output_dir) / TRACKER_FILES[config.tracker]
{%- if cookiecutter.tracker == "mlflow" %}
    once = SkipsHeldSteps(tracker, where, mlflow_held_steps(tracker.tracker.info.run_id) if continued else {})
{%- elif cookiecutter.tracker == "wandb" %}
    run = tracker.tracker
    # Online, wandb resumes at the step after the last one its server holds and ignores lower steps;
    # offline, it knows nothing of the earlier sessions, whose files are read instead.
    held = wandb_offline_steps(Path(config.output_dir) / "wandb", run.id) if continued else {}
    once = SkipsHeldSteps(tracker, where, held, held_by_all=run.step - 1)
{%- endif %}
    accelerator.trackers[accelerator.trackers.index(tracker)] = once
    for step, values in logged_rows(config.output_dir):
        once.log(values, step=step)
{%- if cookiecutter.tracker == "mlflow" %}


def mlflow_held_steps(run_id: str) -> dict[str, int]:
    """The last step of each metric of an MLflow run, as its store (a folder or a server) holds them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    return {
        name: max(metric.step for metric in client.get_metric_history(run_id, name))
        for name in client.get_run(run_id).data.metrics
    }
{%- elif cookiecutter.tracker == "wandb" %}


def offline_run_complete(config: TrainConfig, state: LoopState) -> bool:
    """Whether the offline files of the run hold every metric up to the step of `state`, that of the
    final evaluation and of the last train loss (logged after the last checkpoint) included."""
    if os.environ.get("WANDB_MODE") not in ("offline", "dryrun"):
        return False  # online, the server holds the run: nothing local to compare with
    held = wandb_offline_steps(Path(config.output_dir) / "wandb", state.tracker_run_id)
    names = {name for _, values in logged_rows(config.output_dir) for name in values}
    names |= {config.best_metric, *(["train/loss"] if state.loss_batches else [])}
    return all(held.get(name, -1) >= state.step for name in names)


def wandb_offline_steps(wandb_dir: Path, run_id: str) -> dict[str, int]:
    """The last step of each metric that the offline sessions of wandb run `run_id` wrote to their files."""
    held: dict[str, int] = {}
    for path in wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"):
        for step, items in wandb_history(path):
            for name in items:
                held[name] = max(held.get(name, -1), step)
    return held


def wandb_history(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(step, {name: value}) of each history record of a `.wandb` file, in the file's order.

    Read by wandb's own reader, `wandb leet inspect --json`, which stops at the end of what a killed
    session wrote. A file it cannot read stops the run, named: a resume that trusted an empty answer
    would send every step again.
    """
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    result = subprocess.run(command, capture_output=True, text=True)
    try:
        if result.returncode != 0:
            raise ValueError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no output")
        records = [json.loads(line) for line in result.stdout.splitlines()]
        return [
            (int(record["history"]["step"]["num"]), record["history"]["item"])
            for record in records
            if record["type"] == "history"
        ]
    except (ValueError, KeyError, TypeError) as error:
        raise RunError(
            f"cannot read wandb's offline file {path} with `wandb leet inspect --json` ({error}): "
            "it is how a resumed run knows which steps wandb holds; pip install -U wandb, or move the "
            "file away to resume without it (its steps are then sent again)"
        ) from error
{%- endif %}


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
