"""The run's output folder: one run at a time (`OutputLock`, `RemoteLease` for an object store), and nothing
of an earlier run lost or mixed (`set_aside`). docs/resume.md, "Never lose or mix a run"."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from ..checkpoints.durable import TEMPORARY_PREFIX
from ..config import ConfigError

LOCK_FILE = ".lock"
SET_ASIDE = "set_aside"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # a lock file whose heartbeat is older belongs to a run that is gone
LEASE_S = 120.0  # how long a remote run folder's lease (RemoteLease) lasts
LEASE_RENEW_S = 30.0  # how often it is renewed
LEASE_SETTLE_S = 2.0  # how long a session waits to read its own write back
FULL_BELOW_BYTES = 16 * 2**20  # free after a failed write: the disk was full (torch does not say so)


class RunError(Exception):
    """A problem with the run's folder, files or progress, in one line that says what to do."""


class FolderInUse(RunError):
    """Another run holds the folder's lock."""


def _holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # A requeued SLURM job keeps its id and counts its restarts: its earlier incarnation is gone.
        "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }


def _describe(holder: dict) -> str:
    return ", ".join(f"{key} {holder.get(key, '?')}" for key in ("host", "pid", "started"))


class OutputLock:
    """The exclusive right to write to one output folder; `acquire` raises RunError if another run has it."""

    def __init__(self, output_dir: str | Path, name: str = "output_dir") -> None:
        self.output_dir = Path(output_dir)
        self.name = name  # the config field, for messages
        self.path = self.output_dir / LOCK_FILE
        self._fd: int | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.created_dir = False

    def acquire(self) -> list[str]:
        """Take the lock; return notes to print (a lock taken over from a dead run)."""
        try:
            self.created_dir = not self.output_dir.exists()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                self._remove_created()
                raise write_error(self.path, error) from None
            raise RunError(
                f"cannot write to {self.name} {self.output_dir} ({error.strerror}): choose a writable one"
            ) from None
        notes = []
        locked = True
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EAGAIN):  # another run holds it
                holder = _holder_named(fd)
                os.close(fd)
                raise FolderInUse(
                    f"{self.name} {self.output_dir} is in use by another run ({_describe(holder)}): wait for "
                    "it to end, or choose another --output_dir"
                ) from None
            if error.errno not in (errno.ENOLCK, errno.ENOSYS):
                os.close(fd)
                raise
            locked = False  # this filesystem or system cannot lock
            notes.append(
                f"WARNING: the filesystem of {self.output_dir} cannot lock files: only the heartbeat of "
                f"{self.path} keeps a second run out"
            )
        previous = _read_holder(fd)
        if previous:
            if problem := self._alive_elsewhere(previous, locked):
                os.close(fd)
                raise FolderInUse(problem)
            notes.append(
                f"note: {self.path} was left by a run that is gone ({_describe(previous)}): taking it over"
            )
        text = json.dumps(_holder()).encode()
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, text)
            os.ftruncate(fd, len(text))
            os.fsync(fd)
        except OSError as error:  # a full disk: named with the output folder's free space, nothing left
            os.close(fd)
            self._remove_created()
            raise write_error(self.path, error) from None
        self._fd = fd
        self._heartbeat = threading.Thread(target=self._beat, name="output-lock-heartbeat", daemon=True)
        self._heartbeat.start()
        return notes

    def _alive_elsewhere(self, previous: dict, locked: bool) -> str | None:
        """Why the holder named in the lock file may still be running, or None if it is gone."""
        mine = _holder()
        if previous.get("host") == mine["host"]:
            # On one machine the kernel lock is exact: had the holder been alive, lockf would have failed.
            alive = not locked and psutil.pid_exists(int(previous.get("pid", 0) or 0))
        elif mine["slurm_job"] and previous.get("slurm_job") == mine["slurm_job"]:
            alive = int(previous.get("slurm_restart", 0)) >= mine["slurm_restart"]  # else: requeued, gone
        else:  # another machine, whose lock may not reach this one: only its heartbeat tells
            alive = True
        age = time.time() - os.stat(self.path).st_mtime
        if not alive or age >= STALE_AFTER_S:
            return None
        return (
            f"{self.name} {self.output_dir} was in use {age:.0f} s ago by a run on {previous.get('host')} "
            f"({_describe(previous)}); if that run is gone, rerun after {STALE_AFTER_S - age:.0f} s or "
            f"delete {self.path}; otherwise choose another --output_dir"
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # a flaky network filesystem must not kill the run
                os.utime(self.path)

    def release(self) -> None:
        """Give the lock back (a no-op if not held): the file stays, empty, meaning free."""
        if self._fd is None:
            return
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
        os.close(self._fd)  # closing drops the kernel lock
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        """Remove the folder this run made if it holds nothing but the lock (a run refused at its checks)."""
        with contextlib.suppress(OSError):
            if self.created_dir and {path.name for path in self.output_dir.iterdir()} <= {LOCK_FILE}:
                self.path.unlink(missing_ok=True)
                self.output_dir.rmdir()


class RemoteLease:
    """The exclusive right to write to a run folder in an object store (no lock, no rename): the object
    `<folder>/.lock` names its owner (a random token, host, pid) and an expiry, renewed by a thread.

    S3, GCS and the Hub read back what was just written. So: read the lease; refuse one of another session
    that has not expired; else write ours, wait LEASE_SETTLE_S and read it back: whoever finds their own
    token holds it. Of two sessions that both passed the first read, the later write wins and the earlier
    writer reads the winner's token, provided each read-then-write took under LEASE_SETTLE_S (a slower one
    tries again). A dead session's lease runs out after LEASE_S (at once on its machine), by two machines'
    clocks. A renewal that finds another owner (none for LEASE_S) marks the lease `lost`.
    """

    def __init__(self, fs: Any, folder: str, url: str, name: str = "mirror_dir") -> None:
        self.fs = fs
        self.path = f"{folder}/{LOCK_FILE}"
        self.url = url
        self.name = name  # the config field, for messages
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = ""

    def acquire(self) -> list[str]:
        """Take the lease; return notes to print (a lease taken over from a session that is gone)."""
        for _ in range(3):
            began = time.monotonic()
            notes = []
            held = self._read()
            if held and held.get("owner") != self._token:
                if problem := self._alive(held):
                    raise FolderInUse(problem)
                notes.append(
                    f"note: {self.url} was left by a session that is gone ({_describe(held)}): taking it over"
                )
            self._write()
            if time.monotonic() - began >= LEASE_SETTLE_S:
                continue  # too slow to be sure no one wrote in between: again
            time.sleep(LEASE_SETTLE_S)
            if (self._read() or {}).get("owner") != self._token:
                raise FolderInUse(
                    f"{self.name} {self.url} was taken by another session at the same moment: wait for it to "
                    f"end, or choose another --{self.name}"
                )
            self._stop.clear()
            self._renewer = threading.Thread(target=self._renew, name="remote-lease", daemon=True)
            self._renewer.start()
            return notes
        raise RunError(f"{self.name} {self.url} answers too slowly to take its lease safely: try again later")

    def _alive(self, held: dict) -> str | None:
        mine = _holder()
        if held.get("host") == mine["host"] and not psutil.pid_exists(int(held.get("pid", 0) or 0)):
            return None
        left = float(held.get("expires", 0)) - time.time()
        if left <= 0:
            return None
        return (
            f"{self.name} {self.url} is in use by another session ({_describe(held)}; its lease runs "
            f"{left:.0f} s more unless renewed): wait for it to end; if it is gone, rerun after "
            f"{left:.0f} s, or choose another --{self.name}"
        )

    def _read(self) -> dict:
        try:
            held = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return {}
        except ValueError:
            return {"host": "?", "pid": "?", "started": "? (unreadable)", "expires": time.time() + LEASE_S}
        return held if isinstance(held, dict) else {}

    def _write(self) -> None:
        record = {**_holder(), "owner": self._token, "expires": time.time() + LEASE_S}
        self.fs.pipe_file(self.path, json.dumps(record).encode())

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                held = self._read()
                if held.get("owner") != self._token:
                    self.lost = (
                        f"{self.name} {self.url} was taken over by another session ({_describe(held)}) while "
                        "this one could not renew its lease"
                    )
                    return
                self._write()
            except Exception:  # the store is unreachable for now: the mirror reports that; try again
                continue

    def release(self) -> None:
        """Give the lease back (remove it, if still ours); a no-op if not held."""
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        self._renewer = None
        with contextlib.suppress(Exception):
            if self._read().get("owner") == self._token:
                self.fs.rm_file(self.path)


def on_main(accelerator: Accelerator, decide: Callable[[], Any]) -> Any:
    """Run `decide` on the main process; return its result, or raise its RunError or ConfigError, on all."""
    outcome: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            outcome = [decide()]
        except (ConfigError, RunError) as error:
            outcome = [error]
    outcome = broadcast_object_list(outcome)
    if isinstance(outcome[0], ConfigError | RunError):
        raise outcome[0]
    return outcome[0]


def _holder_named(fd: int) -> dict:
    """The lock holder's record, given a moment: the holder writes it just after locking."""
    holder = _read_holder(fd)
    deadline = time.monotonic() + 2.0
    while not isinstance(holder.get("pid"), int) and time.monotonic() < deadline:
        time.sleep(0.05)
        holder = _read_holder(fd)
    return holder


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode()
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {"host": "?", "pid": "?", "started": "? (unreadable lock file)"}
    return holder if isinstance(holder, dict) else {}


def earlier_outputs(output_dir: str | Path) -> list[str]:
    """Names an earlier run left in `output_dir`, but the lock, set_aside/, lr_find.png, cut-off writes."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    return sorted(
        path.name
        for path in folder.iterdir()
        if path.name not in (LOCK_FILE, SET_ASIDE, "lr_find.png")
        and not path.name.startswith(TEMPORARY_PREFIX)
    )


def set_aside(paths: list[Path], output_dir: str | Path, stamp: str | None = None) -> Path:
    """Move `paths` (inside `output_dir`) to `<output_dir>/set_aside/<time>/`; return that folder."""
    folder = Path(output_dir)
    first = target = folder / SET_ASIDE / (stamp or time.strftime("%Y%m%d-%H%M%S"))
    # A second set-aside within the same second (a run killed again at once) gets a folder of its own.
    number = 1
    while target.exists():
        number += 1
        target = first.with_name(f"{first.name}-{number}")
    for path in paths:
        destination = target / path.relative_to(folder)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, destination)
    return target


def write_error(path: Path, error: BaseException) -> RunError:
    """A one-line RunError for a failed write under `path`: a full disk named as such, with its free space."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    code = getattr(error, "errno", None)
    # torch reports a full disk as a RuntimeError ("file write failed", "unexpected pos ..."): ask the disk.
    if code in (errno.ENOSPC, errno.EDQUOT) or free < FULL_BELOW_BYTES:
        what = f"the disk is full ({free / 2**20:.1f} MiB free on the filesystem of {folder})"
        fix = "free some space (or lower keep_checkpoints) or choose another --output_dir, and rerun"
    else:
        what = str(getattr(error, "strerror", None) or error).splitlines()[0]
        fix = "check that the folder is writable, or choose another --output_dir, and rerun"
    return RunError(
        f"could not write {path}: {what}; {fix}: the run continues from its last complete checkpoint"
    )
