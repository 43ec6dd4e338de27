"""A second copy of the run in a persistent folder (`mirror_dir`, e.g. Google Drive), kept in the background.

Colab's Drive mount is a cache that uploads later and can drop mid-session: a checkpoint written straight
into it may never arrive, and a slow upload would stall training. So output_dir is the session's local
disk, and after every checkpoint a thread of the main process copies what changed to the mirror: first
the run's files (metrics, exports, tracker logs), then the newest checkpoint into a staging folder that is
verified against the checkpoint's checksums and only then renamed. Training never waits for it, and a
failing copy never stops it: the error is reported once, the copy retried every RETRY_S seconds and after
each checkpoint, and its recovery reported. `finish` completes the copy at the end of training and after a
stop signal. Resume (start.py) takes the newest checkpoint that verifies among output_dir and the mirror,
so a checkpoint the mirror holds only in part (the runtime died mid-upload) is skipped, and named.

A URL as mirror_dir (s3://, hf://, gs://, utils/remote.py) keeps the same promises with `RemoteMirror`.
Object stores cannot rename: a checkpoint is uploaded to a staging prefix, downloaded back and verified
against its checksums (its bytes cross the network twice: the price of knowing the copy is whole), then
published by copying it (server-side on S3 and GCS) to `checkpoints/step_<N>/` with loop_state.json, the
seal that lists every file's checksum, copied last. A folder without it is a publication cut off, which
resume skips and names. Exports are staged the same way; while one is published (a few server-side
copies), its folder holds part of it. The remote run folder's lock is a lease (run_dir.RemoteLease).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
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
from .config import TrainConfig
from .remote import access_problem, is_url, load_secrets, open_store
from .run_dir import LOCK_FILE, SET_ASIDE, FolderInUse, OutputLock, RemoteLease, RunError, set_aside
from .runs import EXPORTS, is_run_file, newest_readable, remote_sealed

RETRY_S = 30.0
# The longest the end of a run waits for the last copy (a large checkpoint on a slow upload).
FINISH_TIMEOUT_S = 900.0


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
            if self._locked:  # refused at start (the mirror holds another run): nothing was copied
                self._lock.release()
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
        try:
            # Chosen before the other files are copied, so that the mirror's metrics reach at least this
            # step. Inside the try: rotation may remove a checkpoint while it is looked at.
            readable = [
                path for path in list_checkpoints(self.source) if checkpoint_problem(path, False) is None
            ]
            checkpoint = readable[-1] if readable else None
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


def open_mirror(output_dir: str | Path, mirror_dir: str, keep: int, enabled: bool) -> Mirror:
    """The mirror of `mirror_dir`: a folder, or a URL of a remote store."""
    if is_url(mirror_dir):
        return RemoteMirror(output_dir, mirror_dir, keep, enabled)
    return Mirror(output_dir, mirror_dir, keep, enabled)


def check_stores(accelerator: Any, config: TrainConfig) -> None:
    """Before anything is written: every URL in mirror_dir and import_from can be read with the
    credentials at hand (loaded from the platform's secrets where the environment lacks them), or every
    process raises one line that says what to set. The main process asks; the others do not need them."""
    outcome: list[Any] = [[]]
    if accelerator.is_main_process:
        notes, problems = [], []
        for field in ("mirror_dir", "import_from"):
            url = getattr(config, field)
            if is_url(url):
                notes += load_secrets(url)
                if problem := access_problem(url, field):
                    problems.append(problem)
        outcome = [RunError("; ".join(problems)) if problems else notes]
    outcome = broadcast_object_list(outcome)
    if isinstance(outcome[0], RunError):
        raise outcome[0]
    for note in outcome[0]:
        accelerator.print(note)


class RemoteMirror(Mirror):
    """A Mirror whose mirror_dir is a URL: the same thread, reports and end line; uploads and a lease
    instead of copies, renames and a file lock."""

    def __init__(self, output_dir: str | Path, mirror_dir: str, keep: int, enabled: bool) -> None:
        super().__init__(output_dir, mirror_dir, keep, enabled)
        self.url = mirror_dir
        self.target = mirror_dir  # for the messages of the base class
        if self.enabled:
            self.fs, self.root = open_store(mirror_dir)
            self._lock = RemoteLease(self.fs, self.root, mirror_dir)

    def _claim(self, run_id: str, start_over: bool) -> None:
        try:
            with _store_errors():
                for note in self._lock.acquire():
                    _say(note)
            self._locked = True
        except FolderInUse:
            raise
        except (OSError, RunError, MirrorError) as error:  # unreachable now: the thread retries
            self._report(str(error))
            return
        try:
            with _store_errors():
                sealed = remote_sealed(self.fs, self.root)
        except (OSError, MirrorError) as error:
            self._report(str(error))
            return
        held = sealed[-1] if sealed else None
        if held is not None and held[1] != run_id:
            if not start_over:
                raise RunError(
                    f"mirror_dir {self.url} holds another run (run {held[1] or '(unnamed)'}, step "
                    f"{held[0]}): choose another mirror_dir, or pass --start_over true to set it aside"
                )
            folder = f"{self.root}/{SET_ASIDE}/{time.strftime('%Y%m%d-%H%M%S')}"
            for path in self.fs.ls(self.root, detail=False):
                if path.rsplit("/", 1)[-1] not in (LOCK_FILE, SET_ASIDE):
                    self._move(path, f"{folder}/{path.rsplit('/', 1)[-1]}")
            _say(f"start_over: moved the mirror's earlier run to {self.fs.unstrip_protocol(folder)}")
        self.newest_step = held[0] if held is not None and held[1] == run_id else -1

    def _sync(self) -> None:
        try:
            self._lock.check()
        except FolderInUse as error:
            self._report(f"{error}; not mirroring")
            return
        try:
            with _store_errors():  # the lease's own calls (a lease not taken at start) included
                super()._sync()
        except MirrorError as error:
            self._report(str(error))

    def _copy_entry(self, entry: Path) -> None:
        with _store_errors():
            if entry.is_file():
                self._upload(entry, f"{self.root}/{entry.name}")
            elif entry.is_dir() and entry.name in EXPORTS:
                self._upload_export(entry)
            elif entry.is_dir():
                for path in sorted(entry.rglob("*")):
                    if path.is_file():
                        self._upload(path, f"{self.root}/{path.relative_to(self.source).as_posix()}")

    def _upload(self, source: Path, target: str) -> None:
        stat = source.stat()
        if self._copied.get(source) == (stat.st_size, stat.st_mtime_ns):
            return
        self.fs.put_file(str(source), target)  # one object, replaced whole
        self._copied[source] = (stat.st_size, stat.st_mtime_ns)

    def _upload_export(self, folder: Path) -> None:
        before = _snapshot(folder)
        if all(self._copied.get(path) == seen for path, seen in before.items()):
            return
        staging, final = f"{self.root}/{STAGING_PREFIX}{folder.name}", f"{self.root}/{folder.name}"
        self._remove(staging)
        for path in sorted(before):
            self.fs.put_file(str(path), f"{staging}/{path.relative_to(folder).as_posix()}")
        if _snapshot(folder) != before:  # replaced by a newer export meanwhile: copy that one next time
            self._remove(staging)
            self._wake.set()
            return
        self._remove(final)
        for path in sorted(before):
            name = path.relative_to(folder).as_posix()
            self.fs.copy(f"{staging}/{name}", f"{final}/{name}")
        self._remove(staging)
        self._copied.update(before)

    def _copy_checkpoint(self, checkpoint: Path) -> None:
        with _store_errors():
            final = f"{self.root}/checkpoints/{checkpoint.name}"
            seal = f"{final}/{LOOP_STATE_FILE}"
            if self._exists(seal) and self.fs.cat_file(seal) == (checkpoint / LOOP_STATE_FILE).read_bytes():
                self.newest_step = checkpoint_step(checkpoint)  # already there, e.g. the one resumed from
                return
            staging = f"{self.root}/checkpoints/{STAGING_PREFIX}{checkpoint.name}"
            self._remove(staging)
            names = sorted(path.name for path in checkpoint.iterdir() if path.is_file())
            for name in names:
                self.fs.put_file(str(checkpoint / name), f"{staging}/{name}")
            with tempfile.TemporaryDirectory(prefix="mirror-verify-") as folder:
                for name in names:
                    self.fs.get_file(f"{staging}/{name}", os.path.join(folder, name))
                if problem := checkpoint_problem(Path(folder)):
                    self._remove(staging)
                    raise MirrorError(
                        f"the copy of {checkpoint.name} in {self.url} does not verify: {problem}"
                    )
            if self._exists(final):  # a publication cut off in a session that died: kept for a person
                aside = f"{self.root}/{SET_ASIDE}/{time.strftime('%Y%m%d-%H%M%S')}/checkpoints"
                self._move(final, f"{aside}/{checkpoint.name}")
            for name in [*(name for name in names if name != LOOP_STATE_FILE), LOOP_STATE_FILE]:
                self.fs.copy(f"{staging}/{name}", f"{final}/{name}")
            self._remove(staging)
            self.newest_step = checkpoint_step(checkpoint)

    def _rotate(self) -> None:
        """Keep the newest `keep` sealed checkpoints; remove older sealed ones and this run's staging
        copies. A checkpoint folder without its seal stays for a person to look at."""
        with _store_errors():
            sealed = [step for step, _ in remote_sealed(self.fs, self.root) if step <= self.newest_step]
            for step in sealed[: max(0, len(sealed) - self.keep)]:
                self._remove(f"{self.root}/checkpoints/step_{step:08d}")
            for path in self.fs.ls(f"{self.root}/checkpoints", detail=False):
                if path.rsplit("/", 1)[-1].startswith(STAGING_PREFIX):
                    self._remove(path)

    def _move(self, source: str, target: str) -> None:
        """Copy every object under `source` (a file or a folder) to `target`, then remove them."""
        for path in self.fs.find(source):
            self.fs.copy(path, f"{target}{path[len(source) :]}")
        self.fs.rm(source, recursive=True)

    def _exists(self, path: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(path)

    def _remove(self, path: str) -> None:
        if self._exists(path):
            self.fs.rm(path, recursive=True)


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """A store's own exception types (botocore's, aiohttp's, the Hub's) as a MirrorError, which the thread
    reports."""
    try:
        yield
    except (OSError, RunError, MirrorError):
        raise
    except Exception as error:
        text = str(error).strip().splitlines()
        raise MirrorError(f"{type(error).__name__}: {text[0] if text else ''}") from error


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
