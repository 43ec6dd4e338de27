"""Checkpoints that survive kills: `<output_dir>/checkpoints/step_<N>/` holds what `save_state` writes,
`config.yaml`, `history.json` and, written last, `loop_state.json`: every other file's size and checksum,
sealed (docs/resume.md, "Kills and crashes"). start.py decides which checkpoint a run continues."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils.other import clean_state_dict_for_safetensors
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import TrainConfig, save_config
from ..run.fingerprint import file_xxh3
from ..run.run_dir import LOCK_FILE, SET_ASIDE, set_aside, write_error
from .durable import TEMPORARY_PREFIX, write_atomically
from .durable import fsync_path as _fsync
from .durable import write_durably as _write_durably

# What a failed write of a checkpoint or an export raises: torch reports a full disk as a RuntimeError,
# safetensors (the weights of a small model, the first file written) as its own SafetensorError.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)

# Accelerate logs every tied tensor it leaves out of a safetensors file, asking to check that reloading
# warns of nothing: check_weight_names makes that check on every resume, and a failed one stops the run.
logging.getLogger("accelerate.utils.other").addFilter(
    lambda record: "Removed shared tensor" not in record.getMessage()
)

LOOP_STATE_FILE = "loop_state.json"
STAGING_PREFIX = ".incomplete_"
# XXH3-128 guards against damage (a flipped bit, a cut copy), not an attacker, who could rewrite
# loop_state.json too: for that it serves as well as SHA-256, at 25 GB/s instead of 1.8 (docs/benchmarks.md).
CHECKSUM = "xxh3_128"
EXPORT_MANIFEST = "checksums.json"  # in each export: its files' sizes and checksums, written last
NOT_COPIED = (LOCK_FILE, SET_ASIDE, "checkpoints")  # with a run's files (its checkpoints go one at a time)
EXPORTS = ("model", "best_model")  # folders replaced as a whole, each verified by its checksums.json
RETIRED_KEYS = ("data_changes",)  # loop-state keys of earlier versions: skipped, so their checkpoints resume
Files = dict[str, str | bytes]  # sealed into a checkpoint with the rest: name -> text or bytes


@dataclass
class LoopState:
    """Where the loop is: what `save_state` does not record."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    epoch_samples: int = 0  # over all processes: the position in the data survives a new world size
    samples_seen: int = 0
    # The unlogged train loss, summed over all processes, and its micro-batches: the next log is exact.
    loss_sums: list[float] = field(default_factory=list)
    loss_batches: int = 0
    metrics_bytes: int = 0  # metrics.jsonl's size: a resume cuts off what was logged after it
    last_eval_step: int = -1
    skipped_in_a_row: int = 0  # fp16: optimizer steps the loss scaler skipped since the last real one
    # Best value of config.best_metric so far, its step, and evaluations since: best_model/, early stopping.
    best_value: float | None = None
    best_step: int = -1
    evals_since_best: int = 0
    stopped_early: bool = False  # a rerun of an early-stopped run trains no further
    tracker_run_id: str = ""  # "" before the tracker's first run
    run_id: str = ""  # drawn at a fresh start, kept: tells copies of this run (a mirror) from others
    # SHA-256 and source of the frozen weights (a base under LoRA) that checkpoints leave out ("" if none).
    frozen_sha256: str = ""
    frozen_from: str = ""
    # What the run trains and evaluates on (utils/run/fingerprint.py: file or sample set -> size and hash).
    data_fingerprint: dict[str, str] = field(default_factory=dict)
    recent_losses: list[float] = field(default_factory=list)  # the last logged train losses: for spikes
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # each: its step, cause, skipped window
    schedule_steps: int = 0  # the steps the learning-rate schedule is planned for (0: not recorded)
    decay_start: int = -1  # lr_schedule wsd: the step its decay begins, whose checkpoint is kept
    branch: dict[str, Any] = field(default_factory=dict)  # the last --resume_from: id, from_step, set_aside


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of the parameters that do not require gradients (tied names included)."""
    return {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}


def frozen_weights(model: torch.nn.Module) -> tuple[str, str]:
    """(SHA-256 of the frozen parameters, names, dtypes and shapes included; their source), or ("", "")."""
    frozen = sorted(frozen_names(model))
    if not frozen:
        return "", ""
    state = model.state_dict()
    digest = hashlib.sha256()
    for name in frozen:
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest(), str(getattr(model, "name_or_path", "") or type(model).__name__)


def save_trained_weights_only(accelerator: Accelerator) -> None:
    """Make every save_state leave the frozen parameters out: a LoRA checkpoint holds no copy of the base."""

    def drop_frozen(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        # Under FSDP and DeepSpeed `weights` is empty: they save the models in formats of their own.
        for model, state in zip(models, weights, strict=False):
            for name in frozen_names(model):
                state.pop(name, None)

    accelerator.register_save_state_pre_hook(drop_frozen)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Published checkpoints, oldest first, valid or not (staging folders are not listed)."""
    found = [p for p in checkpoint_root(output_dir).glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=checkpoint_step)


def checkpoint_problem(path: Path, contents: bool = True) -> str | None:
    """Why `path` cannot be resumed from, or None; `contents`: compare checksums, not only sizes."""
    try:
        record = json.loads((path / LOOP_STATE_FILE).read_text())
        loop_state(record)
        edited = record["seal"] != seal(record)
    except FileNotFoundError:
        return f"no {LOOP_STATE_FILE}: the save did not finish"
    except (TypeError, KeyError) as error:  # a field this version does not know, or lacks (the first: a seal)
        return f"{LOOP_STATE_FILE} was written by another version of this project ({error!r})"
    except (OSError, ValueError, AttributeError) as error:
        return f"{LOOP_STATE_FILE} is damaged ({error!r})"
    if edited:
        return f"{LOOP_STATE_FILE} does not match its seal: it was edited after the save"
    return files_problem(path, record["files"], contents, "the save")


def files_problem(folder: Path, files: dict[str, dict[str, Any]], contents: bool, after: str) -> str | None:
    """The first of `files` (name -> size and checksum) that `folder` does not hold as recorded, or None."""
    for name, expected in sorted(files.items()):
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, {expected['bytes']} were written"
        if contents and file_xxh3(file) != expected.get(CHECKSUM):
            return f"{name} does not match its checksum: its contents changed after {after}"
    return None


def file_records(folder: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Each of `paths` by its name under `folder`: its size and checksum, once it is on disk. A second thread
    computes the checksums from the page cache while this one waits in fsync (both release the GIL)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        checksums = pool.map(file_xxh3, paths)
        for path in paths:
            _fsync(path)
        return {
            path.relative_to(folder).as_posix(): {"bytes": path.stat().st_size, CHECKSUM: checksum}
            for path, checksum in zip(paths, checksums, strict=True)
        }


def seal(record: dict[str, Any]) -> str:
    """The SHA-256 of a loop_state.json record's loop state and file list: a same-size edit of
    `epoch_samples` would otherwise resume at another position in the data, silently."""
    body = json.dumps({"loop_state": record["loop_state"], "files": record["files"]}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def checkpoint_step(path: Path) -> int:
    return int(path.name[5:])


def newest_readable(run_folder: Path) -> tuple[int, str] | None:
    """(step, run id) of the newest checkpoint in `run_folder` whose files have their recorded sizes."""
    for path in reversed(list_checkpoints(run_folder)):
        if checkpoint_problem(path, contents=False) is None:
            return checkpoint_step(path), read_loop_state(path).run_id
    return None


def remote_sealed(store: Any, run_folder: str) -> list[tuple[int, str]]:
    """(step, run id) of the checkpoints in a remote run folder that hold their seal, oldest first."""
    store.invalidate_cache()
    sealed = []
    for path in store.glob(f"{run_folder}/checkpoints/step_*/{LOOP_STATE_FILE}"):
        step = path.split("/")[-2][5:]
        if step.isdigit():
            record = json.loads(store.cat_file(path))
            sealed.append((int(step), record.get("loop_state", {}).get("run_id", "")))
    return sorted(sealed)


def is_run_file(name: str) -> bool:
    return name not in NOT_COPIED and not name.startswith((STAGING_PREFIX, TEMPORARY_PREFIX))


def read_loop_state(path: Path) -> LoopState:
    return loop_state(json.loads((path / LOOP_STATE_FILE).read_text()))


def loop_state(record: dict[str, Any]) -> LoopState:
    return LoopState(**{key: value for key, value in record["loop_state"].items() if key not in RETIRED_KEYS})


def save_checkpoint(
    accelerator: Accelerator,
    config: TrainConfig,
    state: LoopState,
    protect: Path | None = None,
    files: Files | None = None,
) -> Path:
    """Save on every process (all at the same step), then publish by renaming on the main one. `protect`:
    kept by rotation (the checkpoint resumed from); `files` (name: text or bytes) are sealed in too."""
    final = checkpoint_root(config.output_dir) / f"step_{state.step:08d}"
    staging = fresh_staging(accelerator, final)
    try:
        accelerator.save_state(str(staging))
    except WRITE_ERRORS as error:
        raise write_error(staging, error) from error
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        try:
            _publish(config, state, staging, final, files or {})
        except OSError as error:
            raise write_error(staging, error) from error
        _rotate(config, protect=protect, latest=final)
    accelerator.wait_for_everyone()
    return final


def fresh_staging(accelerator: Accelerator, final: Path) -> Path:
    """`final`'s staging folder, on every process once an unfinished one (left by a kill) is removed."""
    staging = final.with_name(f"{STAGING_PREFIX}{final.name}")
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    return staging


def _publish(config: TrainConfig, state: LoopState, staging: Path, final: Path, extra: Files) -> None:
    """Seal the staging folder with the loop state and every file's size and checksum; rename it."""
    save_config(config, staging / "config.yaml", durable=False)
    for name, content in extra.items():  # the history's text, the compile cache's bytes
        if isinstance(content, bytes):
            (staging / name).write_bytes(content)
        else:
            (staging / name).write_text(content, encoding="utf-8")
    # The loop state is the seal: the files it vouches for are on disk before it.
    files = file_records(staging, [path for path in sorted(staging.iterdir()) if path.is_file()])
    record = {"loop_state": dataclasses.asdict(state), "files": files}
    record["seal"] = seal(record)
    _write_durably(staging / LOOP_STATE_FILE, json.dumps(record, indent=2))
    _fsync(staging)
    if final.exists():  # never overwrite: resume set newer checkpoints aside, so this one is a stranger
        set_aside([final], config.output_dir)
    os.replace(staging, final)
    _fsync(final.parent)


def export_model(
    accelerator: Accelerator, model: torch.nn.Module, config: TrainConfig, folder: Path, info: dict[str, Any]
) -> None:
    """Write the model (the task's `export`, or safetensors weights), its config and `info` to `folder`, on
    every process (a sharded model is gathered); staged and renamed, never a mix of two exports."""
    from ... import task  # the task may write a format of its own (a Hugging Face folder)

    staging = fresh_staging(accelerator, folder)
    try:
        state_dict = accelerator.get_state_dict(model)  # on every process: gathers a sharded model
        if accelerator.is_main_process and hasattr(task, "export"):
            weights = in_export_dtype(state_dict, config.export_dtype)
            task.export(accelerator.unwrap_model(model), weights, staging, config)
        elif accelerator.is_main_process:
            staging.mkdir(parents=True)
            weights = in_export_dtype(clean_state_dict_for_safetensors(state_dict), config.export_dtype)
            save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if accelerator.is_main_process:
            save_config(config, staging / "config.yaml", durable=False)
            (staging / "export.json").write_text(json.dumps(info, indent=2))
            write_manifest(staging)  # what a copy of it is verified against (start.py)
    except WRITE_ERRORS as error:
        raise write_error(staging, error) from error
    if accelerator.is_main_process:
        if folder.exists():  # this run's own earlier export (resume set an earlier run's aside)
            remove_folder(folder)
        os.replace(staging, folder)
        _fsync(folder.parent)
    accelerator.wait_for_everyone()


def in_export_dtype(state_dict: dict[str, torch.Tensor], export_dtype: str) -> dict[str, torch.Tensor]:
    """The floating-point tensors of `state_dict` in `export_dtype` ("auto": unchanged)."""
    if export_dtype == "auto":
        return state_dict
    dtype = getattr(torch, export_dtype)
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in state_dict.items()}


def write_manifest(folder: Path) -> None:
    """Write `folder`/checksums.json: the size and checksum of every file below it, once on disk."""
    paths = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != EXPORT_MANIFEST)
    files = file_records(folder, paths)
    _write_durably(folder / EXPORT_MANIFEST, json.dumps({"files": files}, indent=2, sort_keys=True))


def export_problem(folder: Path) -> str | None:
    """Why the export `folder` is not what its run wrote (a file missing, cut, changed or added), or None."""
    try:
        files: dict[str, dict[str, Any]] = json.loads((folder / EXPORT_MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {EXPORT_MANIFEST}: it cannot be verified (written by an earlier version, or cut off)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{EXPORT_MANIFEST} is damaged ({error!r})"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if unknown := sorted(present - set(files) - {EXPORT_MANIFEST}):
        return f"{unknown[0]} is not in its {EXPORT_MANIFEST}"
    return files_problem(folder, files, True, "the export")


def load_checkpoint(accelerator: Accelerator, path: Path, config: TrainConfig | None = None) -> LoopState:
    """Restore model, optimizer, scheduler, RNG and sampler from `path` on every process."""
    # load_state restores what prepare registered: called before it, it would load nothing and say nothing.
    if not accelerator._models:
        raise RuntimeError("load_checkpoint needs the prepared model: call accelerator.prepare first")
    for index, model in enumerate(accelerator._models):
        weights = path / f"model{f'_{index}' if index else ''}.safetensors"
        if weights.is_file():  # FSDP and DeepSpeed save models in formats of their own
            check_weight_names(model, weights)
    scaler = accelerator.scaler
    if scaler is not None and not (path / "scaler.pt").exists():
        # Saved without fp16 (CPU or bf16): keep the fresh scaler instead of failing to load one.
        accelerator.scaler = None
    try:
        # Not strict: the file leaves out the frozen weights (save_trained_weights_only) and, of tied
        # weights, all names but one; check_weight_names has made sure that nothing else is missing.
        accelerator.load_state(str(path), strict=False)
    finally:
        accelerator.scaler = scaler
    # Accelerate counts micro-batches for accumulation; checkpoints sit on optimizer-step boundaries,
    # so the count restarts at a window start (also when a new world size changed the accumulation).
    accelerator.step = 0
    if config is not None:  # its rate and decay over those restored: a branch may change them
        for optimizer, scheduler in zip(accelerator._optimizers, accelerator._schedulers, strict=True):
            schedule = scheduler.scheduler  # the LambdaLR in accelerate's wrapper: its factor, new peak
            peak = config.learning_rate
            schedule.base_lrs = [peak for _ in optimizer.param_groups]
            schedule._last_lr = [peak * factor(schedule.last_epoch) for factor in schedule.lr_lambdas]
            for group, rate in zip(optimizer.param_groups, schedule._last_lr, strict=True):
                group.update(lr=rate, initial_lr=peak, weight_decay=config.weight_decay)
    return read_loop_state(path)


def check_weight_names(model: torch.nn.Module, file: Path) -> None:
    """Raise unless `file` holds every trained weight of `model` (or a tied name of it), and nothing else."""
    with safe_open(file, framework="pt") as weights:
        saved = set(weights.keys())
    state = model.state_dict(keep_vars=True)
    if unknown := sorted(saved - set(state)):
        raise RuntimeError(f"{file} holds weights the model does not have: {', '.join(unknown[:5])}")
    held = {state[name].data_ptr() for name in saved}
    expected = set(state) - frozen_names(model)
    if missing := sorted(n for n in expected - saved if state[n].data_ptr() not in held):
        raise RuntimeError(f"{file} lacks trained weights of the model: {', '.join(missing[:5])}")


def _rotate(config: TrainConfig, protect: Path | None, latest: Path) -> None:
    """Keep the newest `keep_checkpoints` up to `latest`, `protect`, and the one a rollback after `latest`
    may need; remove older readable ones and stale staging folders (unreadable ones are left for a person)."""
    root = checkpoint_root(config.output_dir)
    keep = config.keep_checkpoints
    if checkpoint_problem(latest, contents=False) is not None:
        return  # the new checkpoint is not sound: nothing older may go
    older = [p for p in list_checkpoints(config.output_dir) if checkpoint_step(p) < checkpoint_step(latest)]
    readable = [path for path in older if checkpoint_problem(path, contents=False) is None]
    kept = set(readable[len(readable) - (keep - 1) :]) if keep > 1 else set()
    kept |= {protect, root / f"step_{read_loop_state(latest).decay_start:08d}"}  # resumed from; wsd's decay
    if config.max_rollbacks:  # a later step's loss goes back a log interval or more (loop.py: roll_back)
        reach = checkpoint_step(latest) + 1 - config.log_every
        kept |= set([path for path in readable if checkpoint_step(path) <= reach][-1:])
        kept |= {path for path in readable if checkpoint_step(path) > reach}
    for path in readable:
        if path not in kept:
            remove_folder(path)
    for staging in root.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(staging)


def reseal(path: Path, state: LoopState) -> None:
    """Replace the loop state of checkpoint `path` with `state` (a rollback's), sealed anew, atomically."""
    record = json.loads((path / LOOP_STATE_FILE).read_text())
    record["loop_state"] = dataclasses.asdict(state)
    record["seal"] = seal(record)
    write_atomically(path / LOOP_STATE_FILE, json.dumps(record, indent=2))


def remove_folder(path: Path) -> None:
    # Renamed out of sight first: a kill during the deletion must not leave a half-deleted step_<N>.
    doomed = path.with_name(f"{STAGING_PREFIX}removed_{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)
