"""A second copy of the run in `mirror_dir`, kept by a thread of the main process (docs/moving-runs.md)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import PartialState
from fsspec.implementations.local import LocalFileSystem

from ..config import TrainConfig
from ..run.run_dir import (
    LOCK_FILE,
    SET_ASIDE,
    FolderInUse,
    OutputLock,
    RemoteLease,
    RunError,
    on_main,
    set_aside,
)
from .checkpoint import (
    EXPORTS,
    LOOP_STATE_FILE,
    STAGING_PREFIX,
    checkpoint_problem,
    checkpoint_step,
    is_run_file,
    list_checkpoints,
    newest_readable,
    remote_sealed,
    remove_folder,
)
from .durable import write_atomically
from .persist import Worker
from .remote import _first_line, access_problem, is_url, load_secrets, open_store

RETRY_S = 30.0
FINISH_TIMEOUT_S = 900.0  # the longest the end of a run waits for the last copy (a slow upload)
STOP_WAIT_S = 20.0  # after SIGTERM (the machine is wanted back): the run is complete on its disk

Snapshot = dict[Path, tuple[int, int]]  # file -> (size, mtime_ns)


class MirrorError(Exception):
    """A copy that arrived but does not verify, or a store's own error."""


class Mirror:
    """Copies output_dir to mirror_dir in the background; a no-op unless enabled (main process) and set."""

    def __init__(self, output_dir: str | Path, mirror_dir: str, keep: int, enabled: bool) -> None:
        self.source = Path(output_dir)
        self.target = mirror_dir
        self.keep = keep
        self._worker = Worker("mirror", self._sync, lambda: RETRY_S if self._failing else None)
        kind = RemoteStore if is_url(mirror_dir) else Store
        self.store = kind(self.source, mirror_dir, self._worker.wake) if enabled and mirror_dir else None
        self._locked = False
        self._failing = ""  # the error reported, until a copy works again
        self.newest_step = -1  # the newest checkpoint the mirror holds, verified
        self.copy_seconds = 0.0  # the last pass that copied a checkpoint (utils/training/timing.py)

    def start(self, run_id: str, start_over: bool, step: int = -1) -> None:
        """Take the mirror's lock, check that it holds no other run (on the main process), start copying."""
        on_main(PartialState(), lambda: self.store and self._claim(self.store, run_id, start_over, step))
        if self.store is not None:
            self._worker.start()

    def _claim(self, store: Store, run_id: str, start_over: bool, step: int) -> None:
        try:
            for note in store.lock.acquire():
                _say(note)
            self._locked = True
            held = store.held()
        except FolderInUse:
            raise
        except Exception as error:  # cannot write there now (a store's own error types too): retried
            self._report(_why(error))
            # What a folder holds may still be read: the end of the run then names that step, not "none".
            with contextlib.suppress(OSError):
                if not store.remote and (held := store.held()) is not None and held[1] == run_id:
                    self.newest_step = held[0]
            return
        if held is not None and held[1] != run_id:
            if not start_over:
                raise RunError(
                    f"mirror_dir {self.target} holds another run (run {held[1] or '(unnamed)'}, step "
                    f"{held[0]}): choose another mirror_dir, or pass --start_over true to set it aside"
                )
            _say(f"start_over: moved the mirror's earlier run to {store.set_aside_earlier()}")
        self.newest_step = held[0] if held is not None and held[1] == run_id else -1
        if 0 <= step < self.newest_step:  # a branch left (--resume_from): never to be brought back
            later = [f"checkpoints/{Path(p).name}" for p in store._whole() if checkpoint_step(Path(p)) > step]
            _say(f"set aside the mirror's checkpoints after step {step} to {store._set_aside(later)}")
            self.newest_step = step

    def request(self) -> None:
        """Copy what changed, soon; returns at once."""
        if self.store is not None:
            self._worker.wake()

    def finish(self, wait_s: float = FINISH_TIMEOUT_S) -> None:
        """Copy once more, wait for it (up to `wait_s`), say what the mirror holds, release it."""
        if self.store is None or not self._worker.started:
            if self._locked and self.store is not None:  # refused at start (it holds another run)
                self.store.lock.release()
            return
        if not self._worker.close(min(5.0, wait_s)):
            _say(f"finishing the copy to {self.target} (waiting up to {wait_s:.0f} s)")
            self._worker.close(wait_s)
        newest = list_checkpoints(self.source)
        local = checkpoint_step(newest[-1]) if newest else -1
        behind = bool(self._failing) or self._worker.alive or self.newest_step < local
        _say(_held(self.target, self.source, self.newest_step, local, behind))
        if self._locked and not self._worker.alive:
            self.store.lock.release()

    def _sync(self) -> None:
        """One pass of the thread: the run's files, then the newest readable checkpoint, then rotation."""
        store = self.store
        assert store is not None
        started = time.monotonic()
        try:
            if isinstance(store.lock, RemoteLease) and store.lock.lost:  # a lease can expire, a lock cannot
                raise FolderInUse(store.lock.lost)
            # Chosen first: the mirror's metrics reach at least this step. Rotation may remove it meanwhile.
            readable = [p for p in list_checkpoints(self.source) if checkpoint_problem(p, False) is None]
            if not self._locked:
                store.lock.acquire()
                self._locked = True
            for entry in sorted(self.source.iterdir()):
                if is_run_file(entry.name):
                    store.copy_entry(entry)
            if readable and checkpoint_step(readable[-1]) > self.newest_step:
                store.copy_checkpoint(readable[-1])
                self.newest_step = checkpoint_step(readable[-1])
                store.rotate(self.newest_step, self.keep)
                self.copy_seconds = time.monotonic() - started
        except FolderInUse as error:
            self._report(f"{error}; not mirroring until it is free")
            return
        except Exception as error:  # a store's own error types (botocore's, aiohttp's, the Hub's) too
            gone = getattr(error, "filename", None) if isinstance(error, OSError) else None
            if gone and Path(gone).is_relative_to(self.source) and not Path(gone).exists():
                self._worker.wake()  # local rotation or an export replaced what was copied: again, newest
                return
            self._report(_why(error))
            return
        if self._failing:
            self._failing = ""
            _say(f"{self.target} works again: step {self.newest_step} copied and verified")

    def _report(self, error: str) -> None:
        if not self._failing:
            _say(
                f"WARNING: cannot copy to {self.target} ({error}): training goes on, the run is complete in "
                f"{self.source}; retrying every {RETRY_S:.0f} s and after each checkpoint"
            )
        self._failing = error


def check_stores(accelerator: Any, config: TrainConfig) -> None:
    """Before anything is written: every URL in mirror_dir and import_from is readable: else one line."""

    def check() -> list[str]:
        notes = []
        problems = []
        for field in ("mirror_dir", "import_from"):
            url = getattr(config, field)
            if is_url(url):
                notes += load_secrets(url)
                if problem := access_problem(url, field):
                    problems.append(problem)
        if problems:
            raise RunError("; ".join(problems))
        return notes

    for note in on_main(accelerator, check):
        accelerator.print(note)


class Store:
    """A mirror_dir that is a folder (a Drive mount, a second disk): a copy is staged, checked, renamed."""

    remote = False

    def __init__(self, source: Path, target: str, request_pass: Callable[[], None]) -> None:
        self.source = source
        self.target = target
        self.request_pass = request_pass
        if self.remote:
            self.fs, self.root = open_store(target)
            self.lock: OutputLock | RemoteLease = RemoteLease(self.fs, self.root, target)
        else:
            self.fs = LocalFileSystem(auto_mkdir=True)
            self.root = Path(target).absolute().as_posix()
            self.lock = OutputLock(target, "mirror_dir")
        self.copied: Snapshot = {}  # what was copied, as it was then

    def held(self) -> tuple[int, str] | None:
        """(step, run id) of the newest checkpoint the mirror holds whole, or None."""
        return newest_readable(Path(self.root))

    def set_aside_earlier(self) -> str:
        names = [path.rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False)]
        return self._set_aside([name for name in names if name not in (LOCK_FILE, SET_ASIDE)])

    def copy_entry(self, entry: Path) -> None:
        """A run file or folder of output_dir (metrics, an export, tracker logs), if it changed."""
        if entry.is_dir() and entry.name in EXPORTS:
            self._copy_export(entry)
            return
        for path, seen in sorted(snapshot(entry).items()):
            name = f"{self.root}/{path.relative_to(self.source).as_posix()}"
            if self.copied.get(path) == seen and (self.remote or self.fs.exists(name)):
                continue
            self._put_file(path, name)
            self.copied[path] = seen

    def _copy_export(self, folder: Path) -> None:
        before = snapshot(folder)
        final = f"{self.root}/{folder.name}"
        staging = f"{self.root}/{STAGING_PREFIX}{folder.name}"
        if all(self.copied.get(path) == seen for path, seen in before.items()) and (
            self.remote or self.fs.isdir(final)
        ):
            return
        names = self._stage({path.relative_to(folder).as_posix(): path for path in before}, staging)
        if snapshot(folder) != before:  # replaced by a newer export meanwhile: copy that one next time
            self._remove(staging)
            self.request_pass()
            return
        self._remove(final)
        self._publish(staging, final, names)
        self.copied.update(before)

    def copy_checkpoint(self, checkpoint: Path) -> None:
        """Copy, verify and publish `checkpoint`; raise MirrorError if the copy does not verify."""
        final = f"{self.root}/checkpoints/{checkpoint.name}"
        if self._holds(checkpoint, final):  # already there, e.g. the one this session resumed from
            return
        staging = f"{self.root}/checkpoints/{STAGING_PREFIX}{checkpoint.name}"
        names = self._stage({path.name: path for path in checkpoint.iterdir() if path.is_file()}, staging)
        if problem := self._verify(staging, names):
            self._remove(staging)
            raise MirrorError(f"the copy of {checkpoint.name} in {self.target} does not verify: {problem}")
        if self.fs.exists(final):  # a publication cut off in a session that died: kept for a person
            self._set_aside([f"checkpoints/{checkpoint.name}"])
        self._publish(staging, final, [*(name for name in names if name != LOOP_STATE_FILE), LOOP_STATE_FILE])

    def rotate(self, newest_step: int, keep: int) -> None:
        """Keep the newest `keep` checkpoints; remove older ones that read back whole, and unfinished ones."""
        whole = [path for path in self._whole() if checkpoint_step(Path(path)) <= newest_step]
        for path in whole[: max(0, len(whole) - keep)]:
            self._remove(path)
        for path in self.fs.glob(f"{self.root}/checkpoints/{STAGING_PREFIX}*"):
            self._remove(path)

    def _stage(self, files: dict[str, Path], staging: str) -> list[str]:
        """Copy `files` (name in `staging`: path) to the folder `staging`, emptied first; return the names."""
        self._remove(staging)
        for name in sorted(files):
            self.fs.put_file(str(files[name]), f"{staging}/{name}")
        return sorted(files)

    def _holds(self, checkpoint: Path, copy: str) -> bool:
        """Whether `copy` is whole and holds `checkpoint`: equal loop states list the same checksums."""
        try:
            seal = self.fs.cat_file(f"{copy}/{LOOP_STATE_FILE}")
        except OSError:
            return False
        same = seal == (checkpoint / LOOP_STATE_FILE).read_bytes()
        return same and (self.remote or checkpoint_problem(Path(copy), contents=False) is None)

    def _put_file(self, path: Path, name: str) -> None:
        """Through a rename: a kill leaves the old file or the new one."""
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(Path(name), path.read_bytes(), durable=False)

    def _whole(self) -> list[str]:
        """The checkpoints whose files have their recorded sizes, oldest first."""
        found = list_checkpoints(self.root)
        return [path.as_posix() for path in found if checkpoint_problem(path, False) is None]

    def _verify(self, staging: str, names: list[str]) -> str | None:
        return checkpoint_problem(Path(staging))

    def _publish(self, staging: str, final: str, names: list[str]) -> None:
        os.replace(staging, final)

    def _set_aside(self, names: list[str]) -> str:
        """Move `names` (paths inside the mirror) to `set_aside/<time>/`; return that folder."""
        return str(set_aside([Path(self.root, name) for name in names], self.root))

    def _remove(self, path: str) -> None:
        if Path(path).exists():
            remove_folder(Path(path))


class RemoteStore(Store):
    """A mirror_dir URL: a staged copy is downloaded back to be verified, then copied in place, seal last."""

    remote = True

    def held(self) -> tuple[int, str] | None:
        sealed = remote_sealed(self.fs, self.root)
        return sealed[-1] if sealed else None

    def _put_file(self, path: Path, name: str) -> None:
        self.fs.put_file(str(path), name)  # one object, replaced whole

    def _whole(self) -> list[str]:
        """The checkpoints that hold their seal, oldest first."""
        return [f"{self.root}/checkpoints/step_{step:08d}" for step, _ in remote_sealed(self.fs, self.root)]

    def _verify(self, staging: str, names: list[str]) -> str | None:
        with tempfile.TemporaryDirectory(prefix="mirror-verify-") as folder:
            for name in names:
                self.fs.get_file(f"{staging}/{name}", os.path.join(folder, name))
            return checkpoint_problem(Path(folder))

    def _publish(self, staging: str, final: str, names: list[str]) -> None:
        for name in names:  # the seal last
            self.fs.copy(f"{staging}/{name}", f"{final}/{name}")
        self._remove(staging)

    def _set_aside(self, names: list[str]) -> str:
        folder = f"{self.root}/{SET_ASIDE}/{time.strftime('%Y%m%d-%H%M%S')}"
        for name in names:
            for path in self.fs.find(f"{self.root}/{name}"):
                self.fs.copy(path, f"{folder}{path[len(self.root) :]}")
            self.fs.rm(f"{self.root}/{name}", recursive=True)
        return self.fs.unstrip_protocol(folder)

    def _remove(self, path: str) -> None:
        self.fs.invalidate_cache()
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)


def _why(error: Exception) -> str:
    names_itself = isinstance(error, OSError | RunError | MirrorError)  # a store's own types may not
    return str(error) if names_itself else f"{type(error).__name__}: {_first_line(error)}"


def snapshot(folder: Path) -> Snapshot:
    """(size, mtime) of each file under `folder`, or of `folder` itself if it is a file."""
    found = {}
    for path in [folder] if folder.is_file() else folder.rglob("*"):
        if path.is_file():
            stat = path.stat()
            found[path] = (stat.st_size, stat.st_mtime_ns)
    return found


def _held(target: str, source: Path, step: int, local: int, behind: bool) -> str:
    """What the mirror holds at the end of the run (`step`), against output_dir's newest (`local`)."""
    if not behind:  # the exports copied: the mirror's own that output_dir lacks are not vouched for
        exports = [f"{name}/" for name in EXPORTS if (source / name).is_dir()]
        return f"{target} holds step {step} (verified), " + ", ".join(["the metrics", *exports])
    held = f"step {step}" if step >= 0 else "none"
    return (
        f"WARNING: {target} is behind (newest verified checkpoint: {held}; output_dir: step {local}): the "
        f"run is complete in {source} only. Copy it yourself, or rerun to retry"
    )


def _say(text: str) -> None:
    print(f"mirror: {text}", flush=True)
