"""A second copy of the run in a persistent folder (`mirror_dir`, e.g. Google Drive), kept in the background.

Colab's Drive mount is a cache that uploads later and can drop mid-session: a checkpoint written straight
into it may never arrive, and a slow upload would stall training. So output_dir is the session's local
disk, and after every checkpoint is published (utils/persist.py hands it on) a thread of the main process
(persist.Worker) copies what changed to the mirror: first
the run's files (metrics, exports, tracker logs), then the newest checkpoint into a staging folder that is
verified against the checkpoint's checksums and only then renamed. Training never waits for it, and a
failing copy never stops it: the error is reported once, the copy retried every RETRY_S seconds and after
each checkpoint, and its recovery reported. `finish` completes the copy at the end of training and after a
stop signal. Resume (start.py) takes the newest checkpoint that verifies among output_dir and the mirror,
so a checkpoint the mirror holds only in part (the runtime died mid-upload) is skipped, and named.

A URL as mirror_dir (s3://, hf://, gs://, utils/remote.py) keeps the same promises (utils/mirror_stores.py).
Object stores cannot rename: a checkpoint is uploaded to a staging prefix, downloaded back and verified
against its checksums (its bytes cross the network twice: the price of knowing the copy is whole), then
published by copying it (server-side on S3 and GCS) to `checkpoints/step_<N>/` with loop_state.json, the
seal that lists every file's checksum, copied last. A folder without it is a publication cut off, which
resume skips and names. Exports are staged the same way; while one is published (a few server-side
copies), its folder holds part of it. The remote run folder's lock is a lease (run_dir.RemoteLease).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list

from .checkpoint import EXPORTS, checkpoint_problem, checkpoint_step, is_run_file, list_checkpoints
from .config import TrainConfig
from .mirror_stores import FolderStore, MirrorError, RemoteStore
from .persist import Worker
from .remote import access_problem, is_url, load_secrets
from .run_dir import FolderInUse, RunError

RETRY_S = 30.0
# The longest the end of a run waits for the last copy (a large checkpoint on a slow upload).
FINISH_TIMEOUT_S = 900.0
# After SIGTERM (the platform wants the machine back), far less: the run is complete on its disk.
STOP_WAIT_S = 20.0


class Mirror:
    """Copies output_dir to mirror_dir in the background; a no-op unless enabled (main process) and set."""

    def __init__(self, output_dir: str | Path, mirror_dir: str, keep: int, enabled: bool) -> None:
        self.source, self.target, self.keep = Path(output_dir), mirror_dir, keep
        self.enabled = enabled and bool(mirror_dir)
        self._worker = Worker("mirror", self._sync, lambda: RETRY_S if self._failing else None)
        self.store: FolderStore | None = None
        if self.enabled:
            kind = RemoteStore if is_url(mirror_dir) else FolderStore
            self.store = kind(self.source, mirror_dir, again=self._worker.wake)
        self._locked = False
        self._failing = ""  # the error reported, until a copy works again
        self.newest_step = -1  # the newest checkpoint the mirror holds, verified

    def start(self, run_id: str, start_over: bool) -> None:
        """Take the mirror's lock and check that it holds no other run (every process raises the main one's
        refusal), then start copying. A mirror that cannot be written now is retried, not refused."""
        outcome: list[Any] = [None]
        if self.store is not None:
            try:
                self._claim(self.store, run_id, start_over)
            except RunError as error:
                outcome = [error]
        outcome = broadcast_object_list(outcome)
        if isinstance(outcome[0], RunError):
            raise outcome[0]
        if self.store is not None:
            self._worker.start()

    def _claim(self, store: FolderStore, run_id: str, start_over: bool) -> None:
        try:
            with store.errors():
                for note in store.lock.acquire():
                    _say(note)
            self._locked = True
        except FolderInUse:
            raise
        except (OSError, RunError, MirrorError) as error:  # cannot write there now: the thread retries
            self._report(str(error))
            # What a folder holds may still be read: the end of the run then names that step, not "none".
            with contextlib.suppress(OSError):
                if store.readable_without_lock and (held := store.held()) is not None and held[1] == run_id:
                    self.newest_step = held[0]
            return
        try:
            with store.errors():
                held = store.held()
        except (OSError, MirrorError) as error:
            self._report(str(error))
            return
        if held is not None and held[1] != run_id:
            if not start_over:
                raise RunError(
                    f"mirror_dir {self.target} holds another run (run {held[1] or '(unnamed)'}, step "
                    f"{held[0]}): choose another mirror_dir, or pass --start_over true to set it aside"
                )
            with store.errors():
                _say(f"start_over: moved the mirror's earlier run to {store.set_aside_earlier()}")
        self.newest_step = held[0] if held is not None and held[1] == run_id else -1

    def request(self) -> None:
        """Copy what changed, soon; returns at once."""
        if self.enabled:
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
        try:
            with store.errors():  # a store's own error types (a lease's calls included) as a MirrorError
                store.check()
                # Chosen before the other files are copied, so that the mirror's metrics reach at least this
                # step. Inside the try: rotation may remove a checkpoint while it is looked at.
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
        except FolderInUse as error:
            self._report(f"{error}; not mirroring until it is free")
            return
        except (OSError, RunError, MirrorError) as error:
            if isinstance(error, OSError) and _vanished(error, self.source):
                self._worker.wake()  # local rotation or an export replaced what was copied: again, newest
                return
            self._report(str(error))
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


def open_mirror(output_dir: str | Path, mirror_dir: str, keep: int, enabled: bool) -> Mirror:
    """The mirror of `mirror_dir`: a folder, or a URL of a remote store."""
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


def _vanished(error: OSError, source: Path) -> bool:
    name = getattr(error, "filename", None)
    return bool(name) and Path(name).is_relative_to(source) and not Path(name).exists()
