"""Where a run starts: fresh, or from which checkpoint (output_dir's own, or a newer copy found elsewhere).
What is refused and why: docs/resume.md ("Never lose or mix a run"), docs/moving-runs.md."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
import torch
import yaml
from accelerate import Accelerator

from ..checkpoints.checkpoint import (
    EXPORTS,
    LOOP_STATE_FILE,
    STAGING_PREFIX,
    LoopState,
    checkpoint_problem,
    checkpoint_root,
    checkpoint_step,
    export_problem,
    is_run_file,
    list_checkpoints,
    load_checkpoint,
    newest_readable,
    read_loop_state,
)
from ..checkpoints.remote import is_url, open_store
from ..config import BRANCH_SETTINGS, ConfigError, TrainConfig, run_defining_fields, yaml_problem
from ..training.schedule import decay_start
from .fingerprint import first_difference
from .history import HISTORY_FILE
from .run_dir import SET_ASIDE, RunError, earlier_outputs, on_main, set_aside

SEARCH_DEPTH = 5  # of run folders under import_from: /kaggle/input/<dataset>/outputs/<task> is 3, Drive 3-4


def resume(
    accelerator: Accelerator,
    config: TrainConfig,
    frozen: tuple[str, str] = ("", ""),
    data: dict[str, str] | None = None,
    planned: int = 0,
) -> tuple[LoopState, Path | None]:
    """Load the checkpoint to continue (the main process decides), if any; return the loop state and where
    it came from. `frozen`: the built model's `frozen_weights`; `data`: its fingerprint (main process);
    `planned`: the steps the schedule is planned for."""
    decided = on_main(accelerator, lambda: (*decide_start(config, data, planned), uuid.uuid4().hex[:12]))
    path, notes, branch, new_run_id = decided
    for note in notes:
        accelerator.print(note)
    if path is None:
        accelerator.print(f"starting fresh in {config.output_dir} (run {new_run_id})")
        state = LoopState(run_id=new_run_id, frozen_sha256=frozen[0], frozen_from=frozen[1])
    else:
        state = load_everywhere(accelerator, path, frozen, config)
    if data is not None:  # the checkpoint's (other_data checked it), or the first one recorded
        state.data_fingerprint = dict(data)
    state.schedule_steps = planned
    state.decay_start = decay_start(config, planned)
    state.branch = branch or state.branch
    return state, path


def load_everywhere(
    accelerator: Accelerator, path: Path, frozen: tuple[str, str], config: TrainConfig
) -> LoopState:
    """Load checkpoint `path` on every process, or stop all of them with the same error."""
    saved = read_loop_state(path)
    if saved.frozen_sha256 != frozen[0]:  # read from a checksummed file: the same on every process
        raise RunError(
            f"checkpoint {path} continues a model whose frozen weights are "
            f"{describe_frozen(saved.frozen_sha256, saved.frozen_from)}, but the model built now has "
            f"{describe_frozen(*frozen)}: build the model on the base model it was trained from, or choose "
            "another --output_dir"
        )
    problem: Exception | None = None
    try:
        state = load_checkpoint(accelerator, path, config)
    except Exception as error:  # the checksums matched: a mismatch of code or versions, not of bytes
        problem = error
    # Every process must leave with the same checkpoint loaded.
    failed = accelerator.reduce(torch.tensor(int(problem is not None), device=accelerator.device), "sum")
    if isinstance(problem, RunError):  # a registered object's own refusal (a stream's max_steps): as it is
        raise problem
    if failed.item():
        why = repr(problem) if problem else "on another process"
        raise RunError(
            f"checkpoint {path} is intact but could not be loaded ({why}): continue it with the code and "
            "versions that wrote it (its history.json), or choose another --output_dir"
        )
    accelerator.print(
        f"resuming from {path} (step {state.step}, epoch {state.epoch}, {state.samples_seen} samples, "
        f"run {state.run_id or '(unnamed)'})"
    )
    return state


def other_data(path: Path | Copy, saved: dict[str, str], data: dict[str, str] | None) -> RunError | None:
    """The refusal of checkpoint `path` (or a copy elsewhere), trained on `saved`, if that is not `data`."""
    if data is None or not saved or (change := first_difference(saved, data)) is None:
        return None
    what = f"checkpoint {path}" if isinstance(path, Path) else f"the copy {path}"
    # The import finds the same copy again whatever output_dir or start_over: only its places avoid it.
    fix = "or a --mirror_dir and --import_from that do not hold this copy ('' for none)"
    if isinstance(path, Path):
        fix = "choose another --output_dir, or pass --start_over true to set it aside and start over"
    return RunError(
        f"{what} was trained on other data: {change}. Nothing was changed: give the run the data it was "
        f"trained on, {fix}"
    )


def describe_frozen(sha256: str, source: str) -> str:
    return f"{source} (sha256 {sha256[:12]})" if sha256 else "none (every weight trained)"


def decide_start(
    config: TrainConfig, data: dict[str, str] | None = None, planned: int = 0
) -> tuple[Path | None, list[str], dict[str, Any]]:
    """The checkpoint to continue (None: start fresh), the notes to print and the branch made (--resume_from,
    or a wsd schedule grown: the checkpoints after the one continued set aside); raise if none is safe."""
    notes: list[str] = []
    path = resume_point(config, data, notes) if config.resume_from else None
    if path is None:
        path, found = newest_start(config, data)
        notes += found
        grown = grown_plan(config, path, planned, notes) if path else None
        if grown is None:
            return path, notes, {}
        path = grown
    return path, notes, branch_off(config, path, notes)


def newest_start(config: TrainConfig, data: dict[str, str] | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint to continue (None: start fresh) and the notes to print; raise if neither is
    safe. Unreadable checkpoints newer than the one continued are set aside."""
    output_dir = Path(config.output_dir)
    notes = bring_in_newest_copy(config, data)
    checkpoints = list_checkpoints(output_dir)
    unreadable: list[str] = []
    for path in reversed(checkpoints):
        if problem := checkpoint_problem(path):
            unreadable.append(f"{path.name} ({problem})")
            notes.append(f"WARNING: skipping checkpoint {path}: {problem}")
            continue
        branched = _branch_in_folder(output_dir).get("from_step") == checkpoint_step(path)  # and no further
        if changed := changed_settings(path, config, branch=branched):
            refusal: Exception | None = ConfigError(
                f"{output_dir} holds a run with other settings ({changed}): rerun with its settings to "
                "continue it, choose another --output_dir, or pass --start_over true to set it aside"
            )
        else:
            refusal = other_data(path, read_loop_state(path).data_fingerprint, data)
        if refusal:
            if not config.start_over:
                raise refusal
            return None, notes + _clear_for_fresh_start(config, "other settings" if changed else "other data")
        newer = [other for other in checkpoints if checkpoint_step(other) > checkpoint_step(path)]
        if newer:
            folder = set_aside(newer, output_dir)
            names = ", ".join(other.name for other in newer)
            notes.append(f"set aside the unreadable checkpoint(s) {names} to {folder}")
        return path, notes
    if unreadable and not config.start_over:
        raise RunError(
            f"no checkpoint in {checkpoint_root(output_dir)} can be read: {'; '.join(unreadable)}. Nothing "
            "was changed: repair or move them, or pass --start_over true to set them aside and start over"
        )
    return None, notes + _clear_for_fresh_start(config, "no readable checkpoint")


def resume_point(config: TrainConfig, data: dict[str, str] | None, notes: list[str]) -> Path | None:
    """--resume_from's checkpoint (brought into output_dir), or None where this branch went on already."""
    output_dir = Path(config.output_dir)
    where = config.resume_from.rstrip("/")
    local = {checkpoint_step(path): path for path in list_checkpoints(output_dir)}
    steps = ", ".join(map(str, local)) or "none"
    bad = f"resume_from {where}: "
    fix = f"give one of output_dir's checkpoint steps ({steps}), or a checkpoint folder of this run"
    if where.isdigit():
        path = local.get(int(where))
    elif not is_url(where) and Path(where).absolute().parent == checkpoint_root(output_dir).absolute():
        path = next((known for known in local.values() if known.name == Path(where).name), None)
    else:
        path = _fetch_checkpoint(config, where, data, notes, bad + "{}: " + fix)
    if path is None:
        raise ConfigError(f"{bad}no such checkpoint: {fix}")
    if problem := checkpoint_problem(path):
        raise ConfigError(f"{bad}checkpoint {path.name} cannot be read ({problem}): {fix}")
    made = _branch_in_folder(output_dir)
    newest = read_loop_state(list_checkpoints(output_dir)[-1]).branch
    if made.get("from_step") == checkpoint_step(path) and newest.get("id") == made["id"]:
        notes.append(f"note: {bad}this branch was made already: continuing it from its newest checkpoint")
        return None
    if changed := changed_settings(path, config, branch=True):
        raise ConfigError(f"{bad}checkpoint {path.name} has other settings ({changed}): give its settings")
    if refusal := other_data(path, read_loop_state(path).data_fingerprint, data):
        raise refusal
    return path


def _fetch_checkpoint(config: TrainConfig, where: str, data: dict | None, notes: list[str], bad: str) -> Path:
    """Bring checkpoint folder `where` (a path or URL in another copy of this run) into output_dir."""
    run, _, name = where.rpartition("/checkpoints/")
    if not name[5:].isdigit() or not name.startswith("step_"):
        raise ConfigError(bad.format("not a step number nor a checkpoint folder (.../checkpoints/step_<N>)"))
    copies = [copy for copy in find_copies(run, set(), notes) if copy.checkpoint.endswith(name)]
    if not copies or copies[0].problem:
        raise ConfigError(bad.format(copies[0].problem if copies else "no readable checkpoint there"))
    newest = newest_readable(Path(config.output_dir))
    if newest is not None and copies[0].run_id != newest[1]:
        raise ConfigError(bad.format(f"it is of another run ({copies[0].run_id}; output_dir's: {newest[1]})"))
    if changed := changed_settings(copies[0].config_yaml, config, branch=True):
        raise ConfigError(bad.format(f"it has other settings ({changed})"))
    if error := other_data(copies[0], copies[0].data_fingerprint, data):
        raise error
    if problem := import_copy(copies[0], Path(config.output_dir), notes):
        raise ConfigError(bad.format(problem))
    return checkpoint_root(config.output_dir) / name


def grown_plan(config: TrainConfig, path: Path, planned: int, notes: list[str]) -> Path | None:
    """For a schedule planned anew: wsd's newest checkpoint before both plans' decay (None: `path`)."""
    saved = read_loop_state(path)  # cosine: num_epochs is refused as a setting
    stream = (path / "custom_checkpoint_0.pkl").exists()  # its registered state refuses another max_steps
    if config.lr_schedule != "wsd" or saved.schedule_steps in (0, planned) or stream:
        return None
    until = min(saved.decay_start, decay_start(config, planned))
    if checkpoint_step(path) <= until:
        return None  # the rate so far is the same in both plans
    earlier = [p for p in list_checkpoints(config.output_dir) if checkpoint_step(p) <= until]
    if not earlier or checkpoint_problem(earlier[-1]):
        raise RunError(
            f"the plan changed from {saved.schedule_steps} to {planned} steps, but no readable checkpoint "
            f"from before step {until}, where the decay began, is left: keep max_steps and num_epochs"
        )
    step = checkpoint_step(earlier[-1])
    notes.append(f"wsd, now {planned} steps planned: continuing from step {step}, before the decay")
    return earlier[-1]


def branch_off(config: TrainConfig, path: Path, notes: list[str]) -> dict[str, Any]:
    """Set aside the checkpoints after `path`, and the exports of later steps; return the branch's record."""
    output_dir = Path(config.output_dir)
    step = checkpoint_step(path)
    later = [other for other in list_checkpoints(output_dir) if checkpoint_step(other) > step]
    for name in EXPORTS:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads((output_dir / name / "export.json").read_text())["step"] > step:
                later.append(output_dir / name)
    branch = {"id": uuid.uuid4().hex[:12], "from_step": step, "set_aside": [p.name for p in later]}
    if later:
        branch["folder"] = str(set_aside(later, output_dir))
        names = ", ".join(branch["set_aside"])
        notes.append(f"branching from step {step}: set aside {names} to {branch['folder']}")
    return branch


def _branch_in_folder(output_dir: Path) -> dict[str, Any]:
    """The last branch that output_dir's history.json records, or {}."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        sessions = json.loads((output_dir / HISTORY_FILE).read_text())["sessions"]
        return next((record["branch"] for record in reversed(sessions) if "branch" in record), {})
    return {}


def _clear_for_fresh_start(config: TrainConfig, why: str) -> list[str]:
    """Notes for a fresh start in output_dir; raise if an earlier run's outputs are there without start_over.
    The same run stopped before its first checkpoint starts again; its other files are set aside."""
    output_dir = Path(config.output_dir)
    earlier = earlier_outputs(output_dir)
    if not earlier:
        return []
    saved = output_dir / "config.yaml"
    unfinished = not list_checkpoints(output_dir) and not (output_dir / "model").exists()
    if unfinished and saved.is_file() and not changed_settings(output_dir, config):
        note = f"note: {output_dir} holds this run stopped before its first checkpoint: starting it again"
        if outputs := [name for name in earlier if name != "config.yaml"]:
            folder = set_aside([output_dir / name for name in outputs], output_dir)
            note += f"; its outputs so far ({', '.join(outputs)}) moved to {folder}"
        return [note]
    if not config.start_over:
        raise ConfigError(
            f"output_dir {output_dir} holds an earlier run ({', '.join(earlier)}) that this one cannot "
            f"continue ({why}): choose another --output_dir, or pass --start_over true to move it to "
            f"{output_dir / 'set_aside'}/<time>/ and start over"
        )
    folder = set_aside([output_dir / name for name in earlier], output_dir)
    return [f"start_over: moved the earlier run ({', '.join(earlier)}) to {folder}"]


def bring_in_newest_copy(config: TrainConfig, data: dict[str, str] | None = None) -> list[str]:
    """Copy into output_dir the newest verifying checkpoint of this run (or, where it holds none, of any
    run with these settings) in mirror_dir or under import_from; return what to print. Main process only.
    Raise, writing nothing, where output_dir holds no checkpoint and no copy verifies."""
    places = [place for place in (config.mirror_dir, config.import_from) if place]
    if not places:
        return []
    output_dir = Path(config.output_dir)
    newest = newest_readable(output_dir)
    notes: list[str] = []
    candidates: list[Copy] = []
    branch = _branch_in_folder(output_dir)
    # Copies are named as the config names their places (absolute, links kept), output_dir both ways.
    seen = {str(output_dir.resolve()), str(output_dir.absolute())}
    for place in places:
        if not is_url(place) and not Path(place).exists():
            if place == config.import_from:
                notes.append(f"import_from {place} does not exist: no copies of this run looked for there")
            continue
        for copy in find_copies(place, seen, notes):
            if copy.problem:  # named, and counted as a copy that does not verify
                candidates += [copy] if newest is None or copy.step > newest[0] else []
            elif changed := changed_settings(copy.config_yaml, config):
                notes.append(f"not continuing {copy}: other settings ({changed})")
            elif newest is not None and copy.run_id != newest[1]:
                notes.append(f"not continuing {copy}: another run; output_dir holds run {newest[1] or '?'}")
            elif branch and copy.step > branch["from_step"] and copy.branch != branch["id"]:
                notes.append(f"not continuing {copy}: a branch set aside at step {branch['from_step']}")
            elif newest is None or copy.step > newest[0]:
                candidates.append(copy)
    failed = []
    for copy in sorted(candidates, key=lambda copy: copy.step, reverse=True):
        if error := other_data(copy, copy.data_fingerprint, data):
            raise error
        if problem := copy.problem or import_copy(copy, output_dir, notes):
            notes.append(f"WARNING: skipping {copy}: {problem}")
            failed.append(f"{copy}: {problem}")
            continue
        local = f"output_dir's newest is step {newest[0]}" if newest else "output_dir holds no checkpoint"
        notes.append(
            f"continuing from {copy}: the newest copy with these settings that verifies ({local}); its "
            f"checkpoint, metrics and exports were copied to {output_dir}"
        )
        return notes
    if failed and newest is None:
        raise RunError(
            f"no copy of this run verifies, so none was brought in ({'; '.join(failed)}): nothing was "
            f"written to {output_dir}; give --import_from a good copy and rerun, or --import_from '' to "
            "start fresh"
        )
    if newest is not None:
        notes.append(f"no newer copy of this run in {' or '.join(str(place) for place in places)}")
    return notes


def changed_settings(saved: Path | str, config: TrainConfig, branch: bool = False) -> str:
    """The run-defining fields that a saved config.yaml (its text, or its folder) sets otherwise, or "";
    `branch`: but BRANCH_SETTINGS, which a branch may change."""
    try:
        values = yaml.safe_load(saved if isinstance(saved, str) else (saved / "config.yaml").read_bytes())
    except (OSError, yaml.YAMLError) as error:
        why = yaml_problem(error) if isinstance(error, yaml.YAMLError) else error
        return f"its config.yaml cannot be read: {why}"
    if not isinstance(values, dict):
        return "its config.yaml is not a mapping"
    grows = config.lr_schedule == values.get("lr_schedule") == "wsd"  # a longer plan continues
    kept = [name for name in run_defining_fields(config) if not (branch and name in BRANCH_SETTINGS)]
    changes = [
        f"{name} {values.get(name)!r} -> {getattr(config, name)!r}"
        + (" (changed only by going back, with --resume_from STEP)" if name in BRANCH_SETTINGS else "")
        for name in kept
        if values.get(name) != getattr(config, name) and not (grows and name == "num_epochs")
    ]
    if any(change.startswith("num_epochs") for change in changes):
        changes.append("a cosine schedule cannot grow: train with lr_schedule: wsd for that")
    return ", ".join(changes)


@dataclass
class Copy:
    """One checkpoint of a run found outside output_dir, in a run folder, local or remote (through fsspec)."""

    source: Path | str  # the run folder, or the URL of a remote run folder
    step: int
    run_id: str
    config_yaml: str
    store: Any  # the fsspec filesystem that holds it
    path: str  # the run folder's path in it
    problem: str = ""  # why its loop state or config cannot be read ("" if they can)
    data_fingerprint: dict[str, str] = field(default_factory=dict)  # its loop state's, checked before import
    branch: str = ""  # its loop state's branch id

    @property
    def checkpoint(self) -> str:
        return f"checkpoints/step_{self.step:08d}"

    def __str__(self) -> str:
        return f"{self.source} (step {self.step}, run {self.run_id or '(unnamed)'})"

    def at(self, name: str) -> str:
        """The path in the store of the run folder's file or folder `name`."""
        return f"{self.path}/{name}" if self.path else name


def find_copies(place: str, seen: set[str], notes: list[str]) -> list[Copy]:
    """Checkpoints of the run folders at `place` (a folder or a URL) or below it, each run folder once
    (`seen`). Checkpoints cut off mid-upload are named in `notes`."""
    try:
        # A remote store lists everything below `root` in one request, but a walk (a request per folder)
        # where a depth is given; the local disk is walked only as deep as a run folder can be.
        local = (fsspec.filesystem("file"), str(Path(place).absolute()))
        store, root = open_store(place) if is_url(place) else local
        depth = None if is_url(place) else SEARCH_DEPTH + 3
        store.invalidate_cache()
        files = store.find(root, maxdepth=depth) if store.isdir(root) else [root]
    except (OSError, ValueError) as error:
        raise RunError(f"cannot look for copies of this run in {place}: {error}") from error
    folders: dict[str, dict[str, set[str]]] = {}  # run folder -> checkpoint folder name -> files
    for path in files:
        parts = path[len(root) :].strip("/").split("/")
        if len(parts) < 3 or parts[-3] != "checkpoints" or len(parts) - 3 > SEARCH_DEPTH:
            continue
        if not any(part == SET_ASIDE or part.startswith(".") for part in parts[:-3]):
            run = "/".join([root, *parts[:-3]])
            folders.setdefault(run, {}).setdefault(parts[-2], set()).add(parts[-1])
    copies = []
    for run, checkpoints in sorted(folders.items()):
        where = store.unstrip_protocol(run) if is_url(place) else Path(run)
        if str(where) in seen:
            continue
        seen.add(str(where))
        for name, names in sorted(checkpoints.items()):
            shown = f"{where}/checkpoints/{name}"
            if name.startswith(STAGING_PREFIX):
                notes.append(f"WARNING: skipping {shown}: an upload that did not finish")
            elif not (name.startswith("step_") and name[5:].isdigit()):
                continue
            elif LOOP_STATE_FILE not in names:
                notes.append(f"WARNING: skipping {shown}: no {LOOP_STATE_FILE}: its upload was cut off")
            else:
                copies.append(_read_copy(store, run, where, int(name[5:])))
    return copies


def _read_copy(store: Any, run: str, source: Path | str, step: int) -> Copy:
    """The checkpoint at `step` of the run folder `run` in `store`; a damaged one counts as not verifying."""
    copy = Copy(source, step, "", "", store, run)
    try:
        record = json.loads(store.cat_file(copy.at(f"{copy.checkpoint}/{LOOP_STATE_FILE}")))
        copy.config_yaml = store.cat_file(copy.at(f"{copy.checkpoint}/config.yaml")).decode()
    except (OSError, ValueError) as error:
        copy.problem = f"its loop_state.json or config.yaml cannot be read ({type(error).__name__}: {error})"
        return copy
    state = record.get("loop_state", {}) if isinstance(record, dict) else {}
    fingerprint = state.get("data_fingerprint", {})
    copy.run_id = state.get("run_id", "")
    copy.branch = (state.get("branch") or {}).get("id", "")
    copy.data_fingerprint = fingerprint if isinstance(fingerprint, dict) else {}
    return copy


def import_copy(copy: Copy, output_dir: Path, notes: list[str]) -> str | None:
    """Copy `copy`'s checkpoint into output_dir, verify it, then bring the run's other files (exports that
    verify); return why it could not be used (nothing of it is kept then), or None."""
    final = checkpoint_root(output_dir) / f"step_{copy.step:08d}"
    staging = final.with_name(f"{STAGING_PREFIX}{final.name}")
    made_root = not final.parent.exists()
    exports: dict[str, Path] = {}
    try:
        if staging.exists():
            shutil.rmtree(staging)  # an import of this run cut off earlier
        staging.parent.mkdir(parents=True, exist_ok=True)
        _bring(copy, copy.checkpoint, staging)
        if problem := checkpoint_problem(staging):
            _discard([staging], final.parent if made_root else None)
            return problem
        top_names = [top.rstrip("/").rsplit("/", 1)[-1] for top in copy.store.ls(copy.path, detail=False)]
        names = sorted(name for name in top_names if is_run_file(name))  # what comes with the checkpoint
        exports = _stage_exports(copy, [name for name in names if name in EXPORTS], output_dir, notes)
        others = [name for name in names if name not in EXPORTS]
        # The run's other files (metrics up to at least this checkpoint, exports, tracker logs) replace
        # output_dir's older ones, which are set aside, not deleted.
        if replaced := [output_dir / name for name in [*others, *exports] if (output_dir / name).exists()]:
            set_aside(replaced, output_dir)
        for name in others:
            _bring(copy, name, output_dir / name)
        for name, staged in exports.items():
            os.replace(staged, output_dir / name)
        if final.exists():
            set_aside([final], output_dir)
        os.replace(staging, final)
    except Exception as error:  # a remote store raises its package's own types (botocore's, the Hub's)
        _discard([staging, *exports.values()], final.parent if made_root else None)
        return f"copying it failed ({type(error).__name__}: {error})"
    return None


def _stage_exports(copy: Copy, names: list[str], output_dir: Path, notes: list[str]) -> dict[str, Path]:
    """Copy the exports `names` next to output_dir's; return those that verify (name -> staged folder).
    One that does not is removed and named in `notes`."""
    staged: dict[str, Path] = {}
    for name in names:
        folder = output_dir / f"{STAGING_PREFIX}{name}"
        shutil.rmtree(folder, ignore_errors=True)
        staged[name] = folder  # listed first: a failed copy is cleaned up by the caller
        _bring(copy, name, folder)
        if problem := export_problem(folder):
            shutil.rmtree(folder)
            del staged[name]
            notes.append(f"WARNING: not bringing in {name}/ of {copy.source}: {name}/{problem}")
    return staged


def _discard(paths: list[Path], root: Path | None) -> None:
    """Remove what a failed import staged, and the checkpoints folder it made (if still empty)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    if root is not None:
        with contextlib.suppress(OSError):
            root.rmdir()


def _bring(copy: Copy, name: str, destination: Path) -> None:
    """Copy the run's file or folder `name` to `destination`, never outside it (a crafted listing)."""
    source = copy.at(name)
    if not copy.store.isdir(source):
        copy.store.get_file(source, str(destination))
        return
    for path in copy.store.find(source):
        relative = PurePosixPath(path[len(source) :].strip("/"))
        if ".." in relative.parts:
            raise OSError(f"{path} points outside the run folder")
        target = destination.joinpath(*relative.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        copy.store.get_file(path, str(target))
