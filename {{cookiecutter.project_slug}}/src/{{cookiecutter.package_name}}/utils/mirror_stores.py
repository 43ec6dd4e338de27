"""Where the mirror (utils/mirror.py) copies the run: a folder (`FolderStore`) or a store (`RemoteStore`).

Both keep the same promises: a checkpoint is staged, verified against its checksums, then published (a
rename in a folder; server-side copies with loop_state.json, the seal, last in a store that cannot
rename); rotation removes only copies that read back whole; an export is replaced only by a whole one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .checkpoint import (
    EXPORTS,
    LOOP_STATE_FILE,
    STAGING_PREFIX,
    checkpoint_problem,
    checkpoint_root,
    checkpoint_step,
    list_checkpoints,
    newest_readable,
    remote_sealed,
    remove_folder,
)
from .remote import open_store
from .run_dir import LOCK_FILE, SET_ASIDE, OutputLock, RemoteLease, RunError, set_aside

Snapshot = dict[Path, tuple[int, int]]  # file -> (size, mtime_ns)


class MirrorError(Exception):
    """A copy that arrived but does not verify."""


class FolderStore:
    """A mirror_dir that is a folder (a Drive mount, a second disk)."""

    # What it holds can be read even when its lock cannot be taken (a mount that dropped for writing).
    readable_without_lock = True

    def __init__(self, source: Path, target: str, again: Callable[[], None]) -> None:
        self.source, self.target, self.again = source, Path(target), again
        self.lock: OutputLock | RemoteLease = OutputLock(self.target, "mirror_dir")
        self.copied: Snapshot = {}  # what was copied, as it was then

    def errors(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def check(self) -> None:
        """Raise FolderInUse if another run took the mirror (a lease can expire; a file lock cannot)."""

    def held(self) -> tuple[int, str] | None:
        """(step, run id) of the newest checkpoint the mirror holds whole, or None."""
        return newest_readable(self.target)

    def set_aside_earlier(self) -> str:
        earlier = [path for path in self.target.iterdir() if path.name not in (LOCK_FILE, SET_ASIDE)]
        return str(set_aside(earlier, self.target))

    def copy_entry(self, entry: Path) -> None:
        """A run file or folder of output_dir (metrics, an export, tracker logs), if it changed."""
        if entry.is_file():
            self._copy_file(entry, entry.name)
        elif entry.is_dir() and entry.name in EXPORTS:
            self._copy_export(entry)
        elif entry.is_dir():
            for path in sorted(entry.rglob("*")):
                if path.is_file():
                    self._copy_file(path, path.relative_to(self.source).as_posix())

    def _copy_file(self, source: Path, name: str) -> None:
        stat = source.stat()
        target = self.target / name
        if self.copied.get(source) == (stat.st_size, stat.st_mtime_ns) and target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{STAGING_PREFIX}{target.name}")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
        self.copied[source] = (stat.st_size, stat.st_mtime_ns)

    def _copy_export(self, folder: Path) -> None:
        before = snapshot(folder)
        if (
            all(self.copied.get(path) == seen for path, seen in before.items())
            and (self.target / folder.name).is_dir()
        ):
            return
        staging = self.target / f"{STAGING_PREFIX}{folder.name}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(folder, staging)
        if snapshot(folder) != before:  # replaced by a newer export meanwhile: copy that one next time
            shutil.rmtree(staging, ignore_errors=True)
            self.again()
            return
        if (self.target / folder.name).exists():
            remove_folder(self.target / folder.name)
        os.replace(staging, self.target / folder.name)
        self.copied.update(before)

    def copy_checkpoint(self, checkpoint: Path) -> None:
        """Copy, verify and publish `checkpoint`; raise MirrorError if the copy does not verify."""
        final = checkpoint_root(self.target) / checkpoint.name
        if _same_checkpoint(checkpoint, final):  # already there, e.g. the one this session resumed from
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

    def rotate(self, newest_step: int, keep: int) -> None:
        """Keep the newest `keep` checkpoints; remove older ones that read back whole, and this run's own
        unfinished copies. Unreadable ones stay for a person to look at."""
        readable = [
            path
            for path in list_checkpoints(self.target)
            if checkpoint_step(path) <= newest_step and checkpoint_problem(path, False) is None
        ]
        for path in readable[: max(0, len(readable) - keep)]:
            remove_folder(path)
        for staging in checkpoint_root(self.target).glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(staging, ignore_errors=True)


class RemoteStore(FolderStore):
    """A mirror_dir that is a URL (utils/remote.py): uploads and a lease instead of copies and a file lock."""

    readable_without_lock = False

    def __init__(self, source: Path, target: str, again: Callable[[], None]) -> None:
        self.source, self.target, self.again = source, target, again  # type: ignore[assignment]
        self.copied = {}
        self.fs, self.root = open_store(target)
        self.lock = RemoteLease(self.fs, self.root, target)

    def errors(self) -> contextlib.AbstractContextManager[None]:
        return _store_errors()

    def check(self) -> None:
        self.lock.check()

    def held(self) -> tuple[int, str] | None:
        sealed = remote_sealed(self.fs, self.root)
        return sealed[-1] if sealed else None

    def set_aside_earlier(self) -> str:
        folder = f"{self.root}/{SET_ASIDE}/{time.strftime('%Y%m%d-%H%M%S')}"
        for path in self.fs.ls(self.root, detail=False):
            if path.rsplit("/", 1)[-1] not in (LOCK_FILE, SET_ASIDE):
                self._move(path, f"{folder}/{path.rsplit('/', 1)[-1]}")
        return self.fs.unstrip_protocol(folder)

    def _copy_file(self, source: Path, name: str) -> None:
        stat = source.stat()
        if self.copied.get(source) == (stat.st_size, stat.st_mtime_ns):
            return
        self.fs.put_file(str(source), f"{self.root}/{name}")  # one object, replaced whole
        self.copied[source] = (stat.st_size, stat.st_mtime_ns)

    def _copy_export(self, folder: Path) -> None:
        before = snapshot(folder)
        if all(self.copied.get(path) == seen for path, seen in before.items()):
            return
        staging, final = f"{self.root}/{STAGING_PREFIX}{folder.name}", f"{self.root}/{folder.name}"
        self._remove(staging)
        for path in sorted(before):
            self.fs.put_file(str(path), f"{staging}/{path.relative_to(folder).as_posix()}")
        if snapshot(folder) != before:  # replaced by a newer export meanwhile: copy that one next time
            self._remove(staging)
            self.again()
            return
        self._remove(final)
        for path in sorted(before):
            name = path.relative_to(folder).as_posix()
            self.fs.copy(f"{staging}/{name}", f"{final}/{name}")
        self._remove(staging)
        self.copied.update(before)

    def copy_checkpoint(self, checkpoint: Path) -> None:
        final = f"{self.root}/checkpoints/{checkpoint.name}"
        seal = f"{final}/{LOOP_STATE_FILE}"
        if self._exists(seal) and self.fs.cat_file(seal) == (checkpoint / LOOP_STATE_FILE).read_bytes():
            return  # already there, e.g. the one resumed from
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
                copy = f"the copy of {checkpoint.name} in {self.target}"
                raise MirrorError(f"{copy} does not verify: {problem}")
        if self._exists(final):  # a publication cut off in a session that died: kept for a person
            aside = f"{self.root}/{SET_ASIDE}/{time.strftime('%Y%m%d-%H%M%S')}/checkpoints"
            self._move(final, f"{aside}/{checkpoint.name}")
        for name in [*(name for name in names if name != LOOP_STATE_FILE), LOOP_STATE_FILE]:
            self.fs.copy(f"{staging}/{name}", f"{final}/{name}")
        self._remove(staging)

    def rotate(self, newest_step: int, keep: int) -> None:
        """Keep the newest `keep` sealed checkpoints; remove older sealed ones and this run's staging
        copies. A checkpoint folder without its seal stays for a person to look at."""
        sealed = [step for step, _ in remote_sealed(self.fs, self.root) if step <= newest_step]
        for step in sealed[: max(0, len(sealed) - keep)]:
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
    """A store's own exception types (botocore's, aiohttp's, the Hub's) as a MirrorError, which the mirror
    reports."""
    try:
        yield
    except (OSError, RunError, MirrorError):
        raise
    except Exception as error:
        text = str(error).strip().splitlines()
        raise MirrorError(f"{type(error).__name__}: {text[0] if text else ''}") from error


def snapshot(folder: Path) -> Snapshot:
    found = {}
    for path in folder.rglob("*"):
        if path.is_file():
            stat = path.stat()
            found[path] = (stat.st_size, stat.st_mtime_ns)
    return found


def _same_checkpoint(local: Path, copy: Path) -> bool:
    """Whether `copy` is whole and holds `local`: equal loop states list the same checksums."""
    try:
        same = (copy / LOOP_STATE_FILE).read_bytes() == (local / LOOP_STATE_FILE).read_bytes()
    except OSError:
        return False
    return same and checkpoint_problem(copy, contents=False) is None
