"""Where metrics go: output_dir/metrics.jsonl and the config's trackers, each step once (docs/trackers.md)."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from ..checkpoints.checkpoint import LoopState
from ..checkpoints.durable import fsync_path, write_atomically
from ..checkpoints.remote import load_secret
from ..config import ConfigError, TrainConfig
from .run_dir import RunError, write_error

# Where each tracker writes in output_dir, and what it imports (the project's extra of its name installs it).
TRACKER_FILES = {"tensorboard": "logs", "wandb": "wandb", "mlflow": "mlflow.db"}
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow sqlalchemy alembic"}
# Read from the platform's secrets when not in the environment; set MLFLOW_TRACKING_URI to log to a server.
MLFLOW_SECRETS = [f"MLFLOW_TRACKING_{part}" for part in ("URI", "TOKEN", "USERNAME", "PASSWORD")]
OFFLINE = ("offline", "dryrun")  # WANDB_MODE's values that write files for `wandb sync`


class JsonlTracker(GeneralTracker):
    """Appends one JSON object per `accelerator.log` call: readable with no tracker installed."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    tracker = property(lambda self: self.path)

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
    """Cut metrics.jsonl back to `size` bytes, its length at the checkpoint of `step`; a shorter file is cut
    to whole lines and filled to `size` with a row of `step` and no values: the warning is returned."""
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


def tracker_names(config: TrainConfig) -> list[str]:
    """The trackers that `config.tracker` names (`tensorboard,mlflow`): none for `none`."""
    return [name for name in dict.fromkeys(config.tracker.split(",")) if name != "none"]


def trackers(config: TrainConfig) -> list[Any]:
    """The Accelerator's `log_with`; a tracker not installed is an error here (Accelerate would drop it)."""
    for name in tracker_names(config):
        if missing := [m for m in TRACKER_MODULES[name].split() if importlib.util.find_spec(m) is None]:
            raise ConfigError(
                f"tracker {name} is not installed (missing: {', '.join(missing)}): pip install -e "
                f'".[{name}]" in the project folder, or leave {name} out of tracker'
            )
    return [JsonlTracker(metrics_path(config.output_dir)), *tracker_names(config)]


def tracker_dir(config: TrainConfig, name: str) -> Path:
    return Path(config.output_dir) / TRACKER_FILES[name]


def start_trackers(accelerator: Accelerator, config: TrainConfig, state: LoopState, finished: bool) -> None:
    """Start the trackers, each continuing its run (by its id in `state`; TensorBoard's by its folder) with
    each step once; `finished`: the run is at its last step already. A full disk ends in one line."""
    names = tracker_names(config)
    where = tracker_dir(config, names[0]) if len(names) == 1 else Path(config.output_dir)
    quiet_full_disk_in_threads(where)
    # "mlflow=<id>,wandb=<id>"; the previous version saved a bare id, of the render's tracker, its only one
    default = next(field.default for field in dataclasses.fields(config) if field.name == "tracker")
    parts = [p.split("=", 1) if "=" in p else (default, p) for p in state.tracker_run_id.split(",")]
    ids = {name: run_id for name, run_id in parts if run_id}
    try:
        kwargs = {n: setup_tracker(accelerator, config, n, ids.get(n, ""), state.step) for n in names}
        # A finished run's new wandb session would be an offline folder holding nothing new (main: it logs).
        if "wandb" in names and finished and accelerator.is_main_process and offline_done(config, state, ids):
            accelerator.log_with = [tracker for tracker in accelerator.log_with if str(tracker) != "wandb"]
            names.remove("wandb")
            print("wandb: its offline run holds every step of this finished run already: no new session")
        accelerator.init_trackers(Path(config.output_dir).name, init_kwargs=kwargs)
        state.tracker_run_id = ""
        if accelerator.is_main_process:
            for name in names:
                continued = name in ids or "purge_step" in kwargs[name]
                ids |= log_each_step_once(accelerator, config, name, continued, state.step)
            state.tracker_run_id = ",".join(f"{name}={run_id}" for name, run_id in ids.items())
    except Exception as error:
        if not disk_full(error):
            raise
        # A tracker that failed to start cannot be closed either (end_training would raise over this).
        accelerator.trackers = [one for one in accelerator.trackers if isinstance(one, JsonlTracker)]
        raise write_error(where, error) from error


def setup_tracker(accelerator: Accelerator, config: TrainConfig, name: str, run_id: str, step: int) -> dict:
    """Tracker `name`'s `init_trackers` kwargs: offline where no key says otherwise, continuing its run."""
    if name == "tensorboard":
        events = (Path(accelerator.logging_dir) / Path(config.output_dir).name).glob("events.out.tfevents.*")
        return {"purge_step": step} if any(events) else {}
    if name == "wandb":
        if source := load_secret("WANDB_API_KEY"):
            accelerator.print(f"wandb: API key from {source}")
        else:
            # Without a key wandb would prompt for one; offline, it writes a run that `wandb sync` uploads.
            os.environ.setdefault("WANDB_MODE", "offline")
            accelerator.print("wandb: no WANDB_API_KEY in the environment or the platform's secrets: offline")
        online = {} if os.environ.get("WANDB_MODE") in OFFLINE else {"resume": "allow"}  # offline: ignored
        return {"dir": config.output_dir, **({"id": run_id, **online} if run_id else {})}
    for secret in MLFLOW_SECRETS:
        if source := load_secret(secret):
            accelerator.print(f"mlflow: {secret} from {source}")
    # MLflow logs a database error with its traceback, then raises it: the raise is reported (in one line).
    logging.getLogger("mlflow.store.db.utils").addFilter(lambda record: record.levelno < logging.ERROR)
    if os.environ.get("MLFLOW_TRACKING_URI"):  # a server
        return {"run_id": run_id or None}
    output_dir = Path(config.output_dir).resolve()
    os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///" + (output_dir / "mlflow.db").as_posix()
    return {"run_id": run_id or None, "logging_dir": (output_dir / "mlartifacts").as_uri()}  # not ./mlruns


def log_each_step_once(
    accelerator: Accelerator, config: TrainConfig, name: str, continued: bool, step: int
) -> dict[str, str]:
    """Replay metrics.jsonl for the steps that tracker `name`'s store lacks, and record the settings when its
    run starts (docs/trackers.md): each step once, without a gap. Returns {name: its run id}."""
    tracker = accelerator.get_tracker(name)
    run = tracker.tracker
    held_by_all = step - 1 if continued and name == "tensorboard" else -1  # TensorBoard purged the rest
    held = mlflow_held_steps(run.info.run_id) if name == "mlflow" and continued else {}
    if name == "wandb":  # online, the server ignores the steps it holds; offline, the files are read
        held = wandb_offline_steps(tracker_dir(config, name), run.id) if continued else {}
        held_by_all = run.step - 1
    once = NamesAFullDisk(tracker, tracker_dir(config, name), held, held_by_all)
    accelerator.trackers[accelerator.trackers.index(tracker)] = once
    for logged_step, values in logged_rows(config.output_dir):
        once.log(values, step=logged_step)
    if not continued and name != "tensorboard":  # settings once: MLflow refuses to change a parameter
        once.store_init_configuration(dataclasses.asdict(config))
    elif not continued:  # in the run's folder: Accelerate would add two timestamped folders per start
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(dataclasses.asdict(config), {}):
            run.file_writer.add_summary(summary)
        run.flush()  # before training: a run stopped early has them, and does not record them again
    if name == "wandb" and os.environ.get("WANDB_MODE") in OFFLINE:
        print(f"wandb: offline; upload every session with: wandb sync {tracker_dir(config, name)}")
    if name == "mlflow" and os.environ["MLFLOW_TRACKING_URI"].startswith("sqlite:"):
        print(mlflow_viewer_hint(os.environ["MLFLOW_TRACKING_URI"]))
    return {} if name == "tensorboard" else {name: run.id if name == "wandb" else run.info.run_id}


def quiet_full_disk_in_threads(where: Path) -> None:
    """A tracker's writer thread meeting a full disk says so in one line instead of its traceback."""
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
    """Hands to `inner`, as itself, the values of steps its run lacks (`held`: metric -> its last step;
    `held_by_all`: the step up to which it holds all); a full disk under it is raised as one line."""

    requires_logging_directory = False

    def __init__(self, inner: GeneralTracker, where: Path, held: dict[str, int], held_by_all: int) -> None:
        self.inner = inner
        self.where = where
        self.held = held
        self.held_by_all = held_by_all
        super().__init__()

    name = property(lambda self: self.inner.name)
    tracker = property(lambda self: self.inner.tracker)

    def store_init_configuration(self, values: dict) -> None:
        self._named(self.inner.store_init_configuration, values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:  # else not a value of a step: nothing to compare with
            values = {k: v for k, v in values.items() if step > max(self.held.get(k, -1), self.held_by_all)}
            self.held.update(dict.fromkeys(values, step))
        if values:
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


def mlflow_viewer_hint(uri: str) -> str:
    """The viewer's command, after its install where it lacks (mlflow-skinny's `mlflow ui` fails)."""
    command = f"mlflow ui --backend-store-uri {uri}"
    spec = importlib.util.find_spec("mlflow")
    if spec and spec.origin and (Path(spec.origin).parent / "server" / "js" / "build").is_dir():
        return f"mlflow: view with: {command}"
    return (
        'mlflow: view with: pip install -e ".[mlflow-ui]" (once, in the project folder: the default install '
        f"has mlflow-skinny, without the viewer), then {command}"
    )


def mlflow_held_steps(run_id: str) -> dict[str, int]:
    """The last step of each metric of an MLflow run, as its store (a folder or a server) holds them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    metrics = client.get_run(run_id).data.metrics
    return {name: max(metric.step for metric in client.get_metric_history(run_id, name)) for name in metrics}


def offline_done(config: TrainConfig, state: LoopState, ids: dict[str, str]) -> bool:
    """Whether wandb's offline files hold every metric up to `state`'s step, the final evaluation's too."""
    if os.environ.get("WANDB_MODE") not in OFFLINE or "wandb" not in ids:
        return False  # online, the server holds the run: nothing local to compare with
    held = wandb_offline_steps(tracker_dir(config, "wandb"), ids["wandb"])
    names = {name for _, values in logged_rows(config.output_dir) for name in values}
    names |= {config.best_metric, *(["train/loss"] if state.loss_batches else [])}
    return all(held.get(name, -1) >= state.step for name in names)


def wandb_offline_steps(wandb_dir: Path, run_id: str) -> dict[str, int]:
    """The last step of each metric in the offline files of wandb run `run_id` (read by wandb's reader)."""
    held: dict[str, int] = {}
    for path in wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"):
        for step, items in wandb_history(path):
            for name in items:
                held[name] = max(held.get(name, -1), step)
    return held


def wandb_history(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(step, {name: value}) of each history record of a `.wandb` file, in the file's order."""
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    result = subprocess.run(command, capture_output=True, text=True)
    try:
        if result.returncode != 0:
            raise ValueError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no output")
        records = [json.loads(line) for line in result.stdout.splitlines()]
        history = [record["history"] for record in records if record["type"] == "history"]
        return [(int(record["step"]["num"]), record["item"]) for record in history]
    except (ValueError, KeyError, TypeError) as error:
        raise RunError(  # a resume trusting an empty answer would send every step again
            f"cannot read wandb's offline file {path} with `wandb leet inspect --json` ({error}): "
            "pip install -U wandb, or move the file away to resume without it (its steps are then sent again)"
        ) from error
