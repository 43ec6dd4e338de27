"""A run's history: one record per session (docs/resume.md, "The run's history"), so that nothing changes
silently between sessions. Every checkpoint holds it, sealed; the run folder's copy, rewritten at a session's
start, checkpoints and end, also knows the sessions no checkpoint saw."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import socket
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..checkpoints.durable import write_atomically
from ..config import BRANCH_SETTINGS
from ..machine.hardware import detect_platform
from ..machine.packages import declared

HISTORY_FILE = "history.json"
Record = dict[str, Any]


class History:
    """The sessions of a run before this one, and this one's record; written by the main process only."""

    def __init__(self, run_id: str, sessions: list[Record], current: Record, enabled: bool) -> None:
        self.run_id = run_id
        self.sessions = sessions
        self.current = current
        self.enabled = enabled
        self.unwritable = False  # the run folder's copy could not be replaced: said once

    def text(self, step: int, ending: str = "") -> str:
        """The history as written into a checkpoint at `step` (`ending`: why this session ends there)."""
        self.current.update(end_step=step, ending=ending)
        return json.dumps({"run": self.run_id, "sessions": [*self.sessions, self.current]}, indent=1)

    def save(self, output_dir: str | Path, step: int, ending: str = "") -> None:
        """Rewrite the run folder's copy, atomically: a kill leaves the previous one or this one."""
        try:
            if self.enabled:
                write_atomically(path := Path(output_dir) / HISTORY_FILE, self.text(step, ending))
        except OSError as error:  # read-only or immutable: one warning; the checkpoints keep the history
            if not self.unwritable:
                print(f"WARNING: {path} cannot be replaced ({error.strerror}): make it writable (chattr -i)")
            self.unwritable = True

    def note(self, key: str, line: str) -> None:
        """A fact of this session (the compile cache it loaded): kept in its record, printed once."""
        if line:
            self.current[key] = line
            if self.enabled:
                print(f"history: {line}")

    def changes(self) -> list[str]:
        """Every difference from the previous session, with its consequence (empty for a first session)."""
        if not self.sessions:
            return []
        previous = self.sessions[-1]
        killed = (
            f"session {previous['session']} has no recorded end: it was killed or crashed after its last "
            f"checkpoint (step {previous['end_step']}); the steps it trained after that are trained again"
        )
        return ([] if previous["ending"] else [killed]) + differences(previous, self.current)

    def record(self, checkpoint_step: int, digest: Record) -> None:
        """The step after the checkpoint at `checkpoint_step` (training/resume_check.py), for resumes."""
        self.current.setdefault("after_checkpoint", {})[str(checkpoint_step)] = digest

    def recorded(self, checkpoint_step: int) -> Record | None:
        """The step after that checkpoint as the earliest session that took it (or computed it) saw it."""
        for record in self.sessions:
            if str(checkpoint_step) in record.get("after_checkpoint", {}):
                return record["after_checkpoint"][str(checkpoint_step)]
        return None


def begin_history(accelerator: Any, config: Any, state: Any, resumed_from: Path | None) -> History:
    """This session's History: the sessions before it (the checkpoint's, completed by the run folder's copy)
    and its own record. Prints what changed since the previous session, writes the run folder's copy."""
    enabled = accelerator.is_main_process
    current = session_record(accelerator, config, state.step)
    sessions: list[Record] = []
    problems: list[str] = []
    if enabled and resumed_from is not None:
        sessions = read_sessions(resumed_from / HISTORY_FILE, state.run_id, current, problems)
        folder = Path(config.output_dir) / HISTORY_FILE
        sessions = merge(sessions, read_sessions(folder, state.run_id, current, problems, set_aside=True))
    current["session"] = len(sessions) + 1
    if state.branch and all(record.get("branch") != state.branch for record in sessions):
        current["branch"] = state.branch  # made by this session: --resume_from, or a wsd plan grown
    history = History(state.run_id, sessions, current, enabled)
    if problems:  # said, and kept in this session's record
        history.note("unreadable", f"{'; '.join(problems)}: this history lacks the sessions only it held")
    if enabled and sessions:
        previous = sessions[-1]
        changed = history.changes()
        ending = previous["ending"] or "no clean end"
        steps = f"steps {previous['start_step']}-{previous['end_step']}"
        summary = f"changed since session {previous['session']} ({previous['platform']}, {steps}, {ending})"
        summary = summary if differences(previous, current) else f"nothing {summary}"
        print(f"history: session {current['session']} of run {state.run_id}; {summary}")
        for line in changed:
            print(f"history: {line}")
    history.save(config.output_dir, state.step)
    return history


def session_record(accelerator: Any, config: Any, step: int) -> Record:
    """What this session is: where, on what and with which split of the global batch."""
    device = accelerator.device
    name = str(device.type)
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    if device.type == "cuda":  # and the CUDA torch was built with: its kernels' own version
        name = f"cuda ({torch.cuda.get_device_name(device)})"
        versions["cuda"] = str(torch.version.cuda)
    versions = declared_versions() | versions
    task_file, code_sha256 = code_hashes()
    return {
        "session": 0,  # numbered once the sessions before it are read
        "id": uuid.uuid4().hex[:12],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # UTC: sorts across time zones
        "start_step": step,
        "end_step": step,
        "ending": "",
        "platform": detect_platform(),
        "host": socket.gethostname(),
        "processes": accelerator.num_processes,
        "per_device_batch": config.per_device_batch_size,
        "accumulation": accelerator.gradient_accumulation_steps,
        "device": name,
        "mixed_precision": str(accelerator.mixed_precision),
        "deterministic": config.deterministic,
        "compile": config.compile,
        **{name: getattr(config, name) for name in BRANCH_SETTINGS},
        "versions": versions,
        "task_sha256": task_file,
        "code_sha256": code_sha256,
    }


def declared_versions() -> dict[str, str]:
    """The installed versions of pyproject.toml's `dependencies`, read beside src/ (the project may run
    uninstalled, with PYTHONPATH=src): the same set in every session, whatever a launch imported."""
    try:
        requirements = declared(Path(__file__).resolve().parents[4] / "pyproject.toml")
    except (OSError, AttributeError, ValueError):  # installed and run elsewhere: Python and torch only
        return {}
    versions = {}
    for name in (re.match(r"[\w.-]+", requirement)[0].lower() for requirement in requirements):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def code_hashes() -> tuple[str, str]:
    """SHA-256 of task.py, and of the whole project's code: the package's .py files and the script run."""
    package = Path(__file__).resolve().parents[2]
    files = sorted(package.rglob("*.py"))
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main and main.endswith(".py"):
        files.append(Path(main).resolve())
    code = hashlib.sha256()
    for path in files:
        code.update(f"{path.name}\0".encode() + path.read_bytes())
    return hashlib.sha256((package / "task.py").read_bytes()).hexdigest(), code.hexdigest()


def read_sessions(
    path: Path, run_id: str, like: Record, problems: list[str], set_aside: bool = False
) -> list[Record]:
    """The sessions of run `run_id` in a history file, each with its fields and those of `like` it lacks (an
    older version's). One that cannot be read, or has a field of another type, adds its line to `problems`;
    with `set_aside` (the run folder's copy: a checkpoint's is sealed) it becomes history.json.unreadable."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        sessions = [like | record for record in saved["sessions"]] if saved["run"] == run_id else []
        for record in sessions:
            bad = [key for key, value in like.items() if not isinstance(record.get(key), type(value))]
            if bad or not isinstance(record.get("after_checkpoint", {}), dict):
                raise TypeError(f"a session's {', '.join(bad) or 'after_checkpoint'} is missing or wrong")
        return sessions
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        why = f"{type(error).__name__}: {error}"
    if set_aside:
        os.replace(path, path.with_name(f"{path.name}.unreadable"))
        why += f"; kept aside as {path.name}.unreadable"
    problems.append(f"{path} cannot be read ({why})")
    return []


def merge(sessions: list[Record], folder_copy: list[Record]) -> list[Record]:
    """The checkpoint's sessions, completed by the run folder's copy: a session that went on after the
    checkpoint (its end, a divergence) and sessions that no checkpoint saw. Ordered by start."""
    merged = {record["id"]: record for record in sessions}
    for record in folder_copy:
        known = merged.get(record["id"])
        if known is None or record["end_step"] >= known["end_step"]:
            merged[record["id"]] = record
    ordered = sorted(merged.values(), key=lambda record: record["started"])
    for number, record in enumerate(ordered, 1):
        record["session"] = number
    return ordered


# What a change of each of these does to the numbers: known to change them, or perhaps (then measured).
NOT_EXACT = "not bitwise as one uninterrupted run from here on"
MEASURED = "the resume line measures whether it did"
ROUNDING = {
    "device": f"other kernels round differently: {NOT_EXACT}",
    "mixed_precision": f"the arithmetic itself changed: {NOT_EXACT}",
    "deterministic": f"on a GPU, other kernels, which may round differently: {MEASURED}",
    "compile": f"compiled kernels fuse operations and may round differently: {MEASURED}",
    **dict.fromkeys(BRANCH_SETTINGS, f"set at a branch (--resume_from): {NOT_EXACT}"),
}
DETERMINISM_OFF = f"on a GPU, some sums are then added in an order that varies: {NOT_EXACT}"


def differences(before: Record, now: Record) -> list[str]:
    """One line per difference between two sessions' records, with what it does to the numbers."""
    lines = [*_batch_change(before, now)]
    for key, why in ROUNDING.items():
        if before[key] != now[key]:
            why = DETERMINISM_OFF if key == "deterministic" and not now[key] else why
            lines.append(f"{key.replace('_', ' ')} {before[key]} -> {now[key]}: {why}")
    # The versions both recorded: those of pyproject.toml's dependencies, Python, torch and CUDA.
    for name in sorted(before["versions"].keys() & now["versions"].keys()):
        old = before["versions"][name]
        new = now["versions"][name]
        if old != new:
            why = "no effect by itself" if name == "python" else f"it may change the numbers: {MEASURED}"
            lines.append(f"{name} {old} -> {new}: {why}")
    if before["task_sha256"] != now["task_sha256"]:
        lines.append(
            f"task.py changed (sha256 {before['task_sha256'][:12]} -> {now['task_sha256'][:12]}): the data, "
            "model, loss or metrics may differ from the sessions before: one run, two experiments"
        )
    elif before["code_sha256"] != now["code_sha256"]:
        lines.append(
            f"the project's code changed (train.py or src/, sha256 {before['code_sha256'][:12]} -> "
            f"{now['code_sha256'][:12]}): the loop or the task's modules may compute differently"
        )
    return lines


def _batch_change(before: Record, now: Record) -> list[str]:
    names = {"processes": "processes", "per_device_batch": "per-device batch", "accumulation": "accumulation"}
    changed = [
        f"{shown} {before[key]} -> {now[key]}" for key, shown in names.items() if before[key] != now[key]
    ]
    if not changed:
        return []
    if before["per_device_batch"] == now["per_device_batch"]:
        kept = f"{', '.join(changed)} (per-device batch {now['per_device_batch']} kept): the same samples"
        micro = now["processes"] * now["accumulation"]  # micro-batches a step: its gradient sum's terms
        grouping = (
            "the same two gradients added, so bitwise as one uninterrupted run: the resume line says what "
            "the first step measured"
            if micro <= 2
            else f"the {micro} micro-batches' gradients added in another grouping (each process's, then "
            f"across processes), which may round otherwise: {MEASURED}"
        )
        return [f"{kept} and random numbers (they follow the samples), {grouping}"]
    return [
        f"{', '.join(changed)}: the same optimization (same global batch, same samples), but the float "
        f"rounding now differs from an uninterrupted run, and so do the random numbers (dropout: drawn per "
        f"micro-batch): {NOT_EXACT}"
    ]
