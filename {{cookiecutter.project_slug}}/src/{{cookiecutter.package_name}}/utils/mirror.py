"""A second copy of the run in a persistent folder (`mirror_dir`, e.g. Google Drive), kept in the background.

Colab's Drive mount is a cache that uploads later and can drop mid-session: a checkpoint written straight
into it may never arrive, and a slow upload would stall training. So output_dir is the session's local
disk, and after every checkpoint a thread of the main process copies what changed to the mirror: first
the run's files (metrics, exports, tracker logs), then the newest checkpoint into a staging folder that is
verified against the checkpoint's checksums and only then renamed. Training never waits for it, and a
failing copy never stops it: the error is reported once, the copy retried every RETRY_S seconds and after
each checkpoint, and its recovery reported. `finish` completes the copy at the end of training and after a
stop signal. Resume (runs.py) takes the newest checkpoint that verifies among output_dir and the mirror,
so a checkpoint the mirror holds only in part (the runtime died mid-upload) is skipped, and named.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list

from .checkpoint import (
    LOOP_STATE_FILE,
    STAGING_PREFIX,
    checkpoint_problem,
    checkpoint_root,
    checkpoint_step,
    list_checkpoints,
    remove_folder,
)
from .run_dir import LOCK_FILE, SET_ASIDE, FolderInUse, OutputLock, RunError, set_aside
from .runs import is_run_file, newest_readable

RETRY_S = 30.0
# The longest the end of a run waits for the last copy (a large checkpoint on a slow upload).
FINISH_TIMEOUT_S = 900.0
# Folders replaced as a whole, never file by file: a mirror must not hold half of one export.
EXPORTS = ("model", "best_model")


class MirrorError(Exception):
    """A copy that arrived but does not verify."""


class Mirror:
    """Copies output_dir to mirror_dir in the background; a no-op unless enabled (main process) and set."""

    def __init__(self, output_dir: str | Path, mirror_dir: str, keep: int, enabled: bool) -> None:
        self.source, self.target, self.keep = Path(output_dir), Path(mirror_dir), keep
        self.enabled = enabled and bool(mirror_dir)
        self._lock = OutputLock(self.target, "mirror_dir")
        self._locked = False
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._copied: dict[Path, tuple[int, int]] = {}  # file -> (size, mtime_ns) when last copied
        self._failing = ""  # the error reported, until a copy works again
        self.newest_step = -1  # the newest checkpoint the mirror holds, verified

    def start(self, run_id: str, start_over: bool) -> None:
        """Take the mirror's lock and check that it holds no other run (every process raises the main one's
        refusal), then start copying. A mirror that cannot be written now is retried, not refused."""
        outcome: list[Any] = [None]
        if self.enabled:
            try:
                self._claim(run_id, start_over)
            except RunError as error:
                outcome = [error]
        outcome = broadcast_object_list(outcome)
        if isinstance(outcome[0], RunError):
            raise outcome[0]
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="mirror", daemon=True)
            self._thread.start()

    def _claim(self, run_id: str, start_over: bool) -> None:
        try:
            for note in self._lock.acquire():
                _say(note)
            self._locked = True
        except FolderInUse:
            raise
        except RunError as error:  # cannot write there now (a mount that dropped): the thread retries
            self._report(str(error))
            # What it holds may still be read: the end of the run then names that step, not "none".
            with contextlib.suppress(OSError):
                if (held := newest_readable(self.target)) is not None and held[1] == run_id:
                    self.newest_step = held[0]
            return
        if (held := newest_readable(self.target)) is not None and held[1] != run_id:
            if not start_over:
                raise RunError(
                    f"mirror_dir {self.target} holds another run (run {held[1] or '(unnamed)'}, step "
                    f"{held[0]}): choose another mirror_dir, or pass --start_over true to set it aside"
                )
            earlier = [path for path in self.target.iterdir() if path.name not in (LOCK_FILE, SET_ASIDE)]
            _say(f"start_over: moved the mirror's earlier run to {set_aside(earlier, self.target)}")
        self.newest_step = held[0] if held is not None and held[1] == run_id else -1

    def request(self) -> None:
        """Copy what changed, soon; returns at once."""
        if self.enabled:
            self._wake.set()

    def finish(self) -> None:
        """Copy once more, wait for it (up to FINISH_TIMEOUT_S), say what the mirror holds, release it."""
        if not self.enabled or self._thread is None:
            return
        self._closing = True
        self._wake.set()
        self._thread.join(5.0)
        if self._thread.is_alive():
            _say(f"finishing the copy to {self.target} (waiting up to {FINISH_TIMEOUT_S / 60:.0f} min)")
            self._thread.join(FINISH_TIMEOUT_S)
        newest = list_checkpoints(self.source)
        local = checkpoint_step(newest[-1]) if newest else -1
        if self._failing or self._thread.is_alive() or self.newest_step < local:
            held = f"step {self.newest_step}" if self.newest_step >= 0 else "none"
            _say(
                f"WARNING: {self.target} is behind (newest verified checkpoint: {held}; output_dir: step "
                f"{local}): the run is complete in {self.source} only. Copy it yourself, or rerun to retry"
            )
        else:
            _say(f"{self.target} holds step {self.newest_step} (verified), the metrics and the exports")
        if self._locked and not self._thread.is_alive():
            self._lock.release()

    # --- the thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(RETRY_S if self._failing else None)
            self._wake.clear()
            closing = self._closing
            self._sync()
            if closing:
                return

    def _sync(self) -> None:
        # Chosen before the other files are copied, so that the mirror's metrics reach at least this step.
        readable = [path for path in list_checkpoints(self.source) if checkpoint_problem(path, False) is None]
        checkpoint = readable[-1] if readable else None
        try:
            if not self._locked:
                self._lock.acquire()
                self._locked = True
            for entry in sorted(self.source.iterdir()):
                if is_run_file(entry.name):
                    self._copy_entry(entry)
            if checkpoint is not None and checkpoint_step(checkpoint) > self.newest_step:
                self._copy_checkpoint(checkpoint)
                self._rotate()
        except FolderInUse as error:
            self._report(f"{error}; not mirroring until it is free")
            return
        except (OSError, RunError, MirrorError) as error:
            if isinstance(error, OSError) and _vanished(error, self.source):
                self._wake.set()  # local rotation or an export replaced what was being copied: again, newest
                return
            self._report(str(error))
            return
        if self._failing:
            self._failing = ""
            _say(f"{self.target} works again: step {self.newest_step} copied and verified")

    def _copy_entry(self, entry: Path) -> None:
        if entry.is_file():
            self._copy_file(entry, self.target / entry.name)
        elif entry.is_dir() and entry.name in EXPORTS:
            self._copy_export(entry)
        elif entry.is_dir():
            for path in sorted(entry.rglob("*")):
                if path.is_file():
                    self._copy_file(path, self.target / path.relative_to(self.source))

    def _copy_file(self, source: Path, target: Path) -> None:
        stat = source.stat()
        if self._copied.get(source) == (stat.st_size, stat.st_mtime_ns) and target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{STAGING_PREFIX}{target.name}")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
        self._copied[source] = (stat.st_size, stat.st_mtime_ns)

    def _copy_export(self, folder: Path) -> None:
        before = _snapshot(folder)
        copied = all(self._copied.get(path) == seen for path, seen in before.items())
        if copied and (self.target / folder.name).is_dir():
            return
        staging = self.target / f"{STAGING_PREFIX}{folder.name}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(folder, staging)
        if _snapshot(folder) != before:  # replaced by a newer export meanwhile: copy that one next time
            shutil.rmtree(staging, ignore_errors=True)
            self._wake.set()
            return
        if (self.target / folder.name).exists():
            remove_folder(self.target / folder.name)
        os.replace(staging, self.target / folder.name)
        self._copied.update(before)

    def _copy_checkpoint(self, checkpoint: Path) -> None:
        final = checkpoint_root(self.target) / checkpoint.name
        if _same_checkpoint(checkpoint, final):  # already there, e.g. the one this session resumed from
            self.newest_step = checkpoint_step(checkpoint)
            return
        staging = final.with_name(f"{STAGING_PREFIX}{final.name}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for path in sorted(checkpoint.iterdir()):
            shutil.copyfile(path, staging / path.name)
        if problem := checkpoint_problem(staging):
            shutil.rmtree(staging, ignore_errors=True)
            raise MirrorError(f"the copy of {checkpoint.name} in {self.target} does not verify: {problem}")
        if final.exists():  # a part-uploaded copy from a session that died: kept for a person to look at
            set_aside([final], self.target)
        os.replace(staging, final)
        self.newest_step = checkpoint_step(checkpoint)

    def _rotate(self) -> None:
        """Keep the mirror's newest `keep` checkpoints; remove older ones that read back whole, and this
        run's own unfinished copies. Unreadable ones stay for a person to look at."""
        readable = [
            path
            for path in list_checkpoints(self.target)
            if checkpoint_step(path) <= self.newest_step and checkpoint_problem(path, False) is None
        ]
        for path in readable[: max(0, len(readable) - self.keep)]:
            remove_folder(path)
        for staging in checkpoint_root(self.target).glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(staging, ignore_errors=True)

    def _report(self, error: str) -> None:
        if not self._failing:
            _say(
                f"WARNING: cannot copy to {self.target} ({error}): training goes on, the run is complete in "
                f"{self.source}; retrying every {RETRY_S:.0f} s and after each checkpoint"
            )
        self._failing = error


def _say(text: str) -> None:
    print(f"mirror: {text}", flush=True)


def _vanished(error: OSError, source: Path) -> bool:
    name = getattr(error, "filename", None)
    return bool(name) and Path(name).is_relative_to(source) and not Path(name).exists()


def _snapshot(folder: Path) -> dict[Path, tuple[int, int]]:
    snapshot = {}
    for path in folder.rglob("*"):
        if path.is_file():
            stat = path.stat()
            snapshot[path] = (stat.st_size, stat.st_mtime_ns)
    return snapshot


def _same_checkpoint(local: Path, copy: Path) -> bool:
    """Whether `copy` is whole and holds `local`: equal loop states list the same checksums."""
    try:
        same = (copy / LOOP_STATE_FILE).read_bytes() == (local / LOOP_STATE_FILE).read_bytes()
    except OSError:
        return False
    return same and checkpoint_problem(copy, contents=False) is None
