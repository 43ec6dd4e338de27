"""Copies of a run in other places: find them, bring one's checkpoint into output_dir, pack a run.

A run moves between sessions and platforms as a folder (an earlier session's output_dir attached as a
Kaggle input, the Drive mirror of a Colab run) or as one packed file. start.py decides which copy, if
any, to continue (`bring_in_newest_copy`); this module finds the copies (`find_copies`, `remote_copies`)
and copies one checkpoint in, verified against its checksums, with the run's other files (metrics,
exported models, tracker logs: `import_copy`). mirror.py keeps such a copy up to date while training.

mirror_dir and import_from may be URLs of a remote store (utils/remote.py): its run folders are found in
one listing, their checkpoints downloaded and verified the same way. A checkpoint folder there without its
loop_state.json is a publication that was cut off: it is named and skipped. Packed runs (.tar) are found
in folders only.

Pack a run to move it (its newest valid checkpoint, config, metrics, exported models, tracker logs, in
one .tar file to upload as a Kaggle dataset or to Drive):

    python -m {{ cookiecutter.package_name }}.utils.runs pack <output_dir> [--to FOLDER]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .checkpoint import (
    LOOP_STATE_FILE,
    STAGING_PREFIX,
    checkpoint_problem,
    checkpoint_root,
    checkpoint_step,
    export_problem,
    list_checkpoints,
    read_loop_state,
)
from .durable import TEMPORARY_PREFIX, fsync_path
from .remote import open_store
from .run_dir import LOCK_FILE, SET_ASIDE, FolderInUse, OutputLock, RunError, set_aside

PACK_SUFFIX = ".tar"
# Run folders sit at most this deep under import_from: /kaggle/input/<dataset>/outputs/<task> is 3,
# a run folder inside an uploaded project folder on Drive is 3 or 4.
SEARCH_DEPTH = 5
# Never copied with a run: its lock, the runs set aside in it, its checkpoints (copied one at a time).
NOT_COPIED = (LOCK_FILE, SET_ASIDE, "checkpoints")
# Exported models: folders replaced as a whole, never file by file, each verified by its checksums.json.
EXPORTS = ("model", "best_model")


@dataclass
class Copy:
    """One checkpoint of a run found outside output_dir: in a run folder, or in a packed run."""

    source: Path | str  # the run folder, the .tar file, or the URL of a remote run folder
    step: int
    run_id: str
    config_yaml: str
    member: str = ""  # in a .tar: the run folder's path inside it
    store: Any = None  # a remote run folder's fsspec filesystem (source is then its URL)
    path: str = ""  # and the run folder's path in it
    problem: str = ""  # why its loop state or config cannot be read ("" if they can)
    data_fingerprint: dict[str, str] = field(default_factory=dict)  # its loop state's, checked before import

    @property
    def checkpoint(self) -> str:
        return f"checkpoints/step_{self.step:08d}"

    def __str__(self) -> str:
        return f"{self.source} (step {self.step}, run {self.run_id or '(unnamed)'})"


def with_data(copy: Copy, record: dict[str, Any]) -> Copy:
    """`copy` with the data fingerprint of its loop state record (none before fingerprints)."""
    fingerprint = record.get("loop_state", {}).get("data_fingerprint", {})
    copy.data_fingerprint = fingerprint if isinstance(fingerprint, dict) else {}
    return copy


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


def remote_copies(url: str, seen: set[Path | str], notes: list[str]) -> list[Copy]:
    """Checkpoints of the run folders at `url` or below it (SEARCH_DEPTH), from one listing; those cut
    off mid-upload are named in `notes`."""
    store, root = open_store(url)
    try:
        store.invalidate_cache()
        files = store.find(root) if store.isdir(root) else []
        folders: dict[str, dict[str, set[str]]] = {}  # run folder -> checkpoint folder name -> files
        for path in files:
            parts = path[len(root) :].strip("/").split("/")
            if len(parts) < 3 or parts[-3] != "checkpoints" or len(parts) - 3 > SEARCH_DEPTH:
                continue
            if any(part == SET_ASIDE or part.startswith(".") for part in parts[:-3]):
                continue
            run = "/".join([root, *parts[:-3]])
            folders.setdefault(run, {}).setdefault(parts[-2], set()).add(parts[-1])
        copies = []
        for run, checkpoints in sorted(folders.items()):
            if store.unstrip_protocol(run) in seen:
                continue
            seen.add(store.unstrip_protocol(run))
            for name, names in sorted(checkpoints.items()):
                where = store.unstrip_protocol(f"{run}/checkpoints/{name}")
                if name.startswith(STAGING_PREFIX):
                    notes.append(f"WARNING: skipping {where}: an upload that did not finish")
                elif not (name.startswith("step_") and name[5:].isdigit()):
                    continue
                elif LOOP_STATE_FILE not in names:
                    notes.append(f"WARNING: skipping {where}: no {LOOP_STATE_FILE}: its upload was cut off")
                else:
                    record = json.loads(store.cat_file(f"{run}/checkpoints/{name}/{LOOP_STATE_FILE}"))
                    config_yaml = store.cat_file(f"{run}/checkpoints/{name}/config.yaml").decode()
                    run_id = record.get("loop_state", {}).get("run_id", "")
                    source = store.unstrip_protocol(run)
                    copy = Copy(source, int(name[5:]), run_id, config_yaml, store=store, path=run)
                    copies.append(with_data(copy, record))
        return copies
    except (OSError, ValueError) as error:
        raise RunError(f"cannot look for copies of this run in {url}: {error}") from error


def find_copies(place: Path, seen: set[Path | str]) -> Iterator[Copy]:
    """Checkpoints of run folders and packed runs at `place` or below it, each place once (`seen`)."""
    if place.resolve() in seen:
        return
    seen.add(place.resolve())
    if place.is_file():
        if place.name.endswith(PACK_SUFFIX):
            yield from _packed_copies(place)
        return
    if (place / "checkpoints").is_dir():
        yield from _folder_copies(place)
        return
    yield from _search(place, SEARCH_DEPTH, seen)


def _search(folder: Path, depth: int, seen: set[Path | str]) -> Iterator[Copy]:
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:  # unreadable, or gone (a mount that dropped): nothing to find there
        return
    for entry in entries:
        if entry.name.startswith(".") or entry.name == SET_ASIDE:
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False) and depth > 0:
            if (path / "checkpoints").is_dir():
                if path.resolve() not in seen:
                    seen.add(path.resolve())
                    yield from _folder_copies(path)
            else:
                yield from _search(path, depth - 1, seen)
        elif entry.is_file() and entry.name.endswith(PACK_SUFFIX) and path.resolve() not in seen:
            seen.add(path.resolve())
            yield from _packed_copies(path)


def _folder_copies(run_folder: Path) -> Iterator[Copy]:
    for path in list_checkpoints(run_folder):
        try:
            record = json.loads((path / LOOP_STATE_FILE).read_text())
            config_yaml = (path / "config.yaml").read_text()
        except (OSError, ValueError) as error:  # damaged: not a copy anyone could continue, but named
            problem = f"its {LOOP_STATE_FILE} or config.yaml cannot be read ({type(error).__name__}: {error})"
            yield Copy(run_folder, checkpoint_step(path), "", "", problem=problem)
            continue
        run_id = record.get("loop_state", {}).get("run_id", "")
        yield with_data(Copy(run_folder, checkpoint_step(path), run_id, config_yaml), record)


def _packed_copies(path: Path) -> Iterator[Copy]:
    try:
        with tarfile.open(path) as tar:
            names = tar.getnames()
            for name in names:
                parts = PurePosixPath(name).parts
                if len(parts) < 3 or parts[-1] != LOOP_STATE_FILE or parts[-3] != "checkpoints":
                    continue
                if not (parts[-2].startswith("step_") and parts[-2][5:].isdigit()):
                    continue
                member = str(PurePosixPath(*parts[:-3])) if len(parts) > 3 else ""
                folder = str(PurePosixPath(*parts[:-1]))
                record = json.loads(_read_member(tar, name))
                config_yaml = _read_member(tar, f"{folder}/config.yaml").decode()
                run_id = record.get("loop_state", {}).get("run_id", "")
                yield with_data(Copy(path, int(parts[-2][5:]), run_id, config_yaml, member), record)
    except (OSError, ValueError, KeyError, tarfile.TarError):
        return  # not a packed run, or a damaged one


def _read_member(tar: tarfile.TarFile, name: str) -> bytes:
    file = tar.extractfile(name)
    if file is None:
        raise KeyError(name)
    return file.read()


def import_copy(copy: Copy, output_dir: Path, notes: list[str] | None = None) -> str | None:
    """Copy `copy`'s checkpoint into output_dir, verify it, then bring the run's other files; return why
    it could not be used (nothing of it is kept then), or None. An export (model/, best_model/) that does
    not match its checksums is not brought in: `notes` names it, and output_dir's own stays."""
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
        names = _run_names(copy)
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
    except Exception as error:
        if copy.store is None and not isinstance(error, OSError | tarfile.TarError):
            raise
        # A remote store raises its package's own types (botocore's, aiohttp's, the Hub's) as well.
        _discard([staging, *exports.values()], final.parent if made_root else None)
        return f"copying it failed ({type(error).__name__}: {error})"
    return None


def _run_names(copy: Copy) -> list[str]:
    """The top-level names of the copy's run folder that come with its checkpoint."""
    if copy.store is not None:
        tops = copy.store.ls(copy.path, detail=False)
        return sorted(name for name in (top.rsplit("/", 1)[-1] for top in tops) if is_run_file(name))
    if isinstance(copy.source, Path) and copy.source.is_dir():
        return sorted(entry.name for entry in copy.source.iterdir() if is_run_file(entry.name))
    return _packed_names(copy)


def _stage_exports(
    copy: Copy, names: list[str], output_dir: Path, notes: list[str] | None
) -> dict[str, Path]:
    """Copy the exports `names` next to output_dir's and verify each against its checksums.json; return
    those that verify (name -> staged folder). One that does not is removed and named in `notes`."""
    staged: dict[str, Path] = {}
    for name in names:
        folder = output_dir / f"{STAGING_PREFIX}{name}"
        shutil.rmtree(folder, ignore_errors=True)
        staged[name] = folder  # listed first: a failed copy is cleaned up by the caller
        _bring(copy, name, folder)
        if problem := export_problem(folder):
            shutil.rmtree(folder)
            del staged[name]
            if notes is not None:
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
    """Copy the run's file or folder `name` (relative to the run folder) to `destination`."""
    if copy.store is not None:
        source = f"{copy.path}/{name}"
        if not copy.store.isdir(source):
            copy.store.get_file(source, str(destination))
            return
        for path in copy.store.find(source):
            target = destination / path[len(source) :].strip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            copy.store.get_file(path, str(target))
    elif isinstance(copy.source, Path) and copy.source.is_dir():
        if (copy.source / name).is_dir():
            shutil.copytree(copy.source / name, destination)
        else:
            shutil.copy2(copy.source / name, destination)
    else:
        _extract(copy, name, destination)


def is_run_file(name: str) -> bool:
    return name not in NOT_COPIED and not name.startswith((STAGING_PREFIX, TEMPORARY_PREFIX))


def _packed_names(copy: Copy) -> list[str]:
    """The top-level names of the packed run folder, checkpoints and the like excluded."""
    prefix = f"{copy.member}/" if copy.member else ""
    with tarfile.open(copy.source) as tar:
        names = [name[len(prefix) :] for name in tar.getnames() if name.startswith(prefix)]
    tops = {PurePosixPath(name).parts[0] for name in names if name}
    return sorted(name for name in tops if name and is_run_file(name))


def _extract(copy: Copy, name: str, destination: Path) -> None:
    """Extract the packed run's file or folder `name` to `destination`. Only plain files and folders are
    written, and only below `destination`: a crafted archive cannot write elsewhere."""
    wanted = f"{copy.member}/{name}" if copy.member else name
    with tarfile.open(copy.source) as tar:
        for member in tar.getmembers():
            if member.name != wanted and not member.name.startswith(f"{wanted}/"):
                continue
            relative = PurePosixPath(member.name[len(wanted) :].lstrip("/"))
            if ".." in relative.parts:
                raise tarfile.TarError(f"{member.name} points outside the run folder")
            target = destination.joinpath(*relative.parts)
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None  # a regular member always has contents
                with source, target.open("wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
                os.utime(target, (member.mtime, member.mtime))


def pack(output_dir: Path, to: Path) -> Path:
    """Write `<to>/<run folder name>-step_<N>.tar`: the newest checkpoint that verifies, and the run's other
    files. Refuses while a run writes to output_dir. Returns the file."""
    output_dir = output_dir.resolve()
    if not output_dir.is_dir():
        raise RunError(f"{output_dir} is not a folder: pass a run's output_dir")
    lock: OutputLock | None = OutputLock(output_dir)
    try:
        lock.acquire()  # the run's files must not change while they are packed
    except FolderInUse:
        raise
    except RunError:
        lock = None  # a read-only folder (a Kaggle input): nobody writes to it either
    try:
        for path in reversed(list_checkpoints(output_dir)):
            if checkpoint_problem(path) is None:
                break
        else:
            raise RunError(f"no checkpoint in {checkpoint_root(output_dir)} verifies: nothing to pack")
        target = to / f"{output_dir.name}-{path.name}{PACK_SUFFIX}"
        partial = target.with_name(f"{STAGING_PREFIX}{target.name}")
        to.mkdir(parents=True, exist_ok=True)
        with tarfile.open(partial, "w") as tar:
            for entry in sorted(output_dir.iterdir()):
                if is_run_file(entry.name):
                    tar.add(entry, arcname=f"{output_dir.name}/{entry.name}")
            tar.add(path, arcname=f"{output_dir.name}/checkpoints/{path.name}")
        fsync_path(partial)  # whole on the disk before it has its name
        os.replace(partial, target)
        fsync_path(to)
        return target
    finally:
        if lock is not None:
            lock.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Move a run between platforms.")
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser(
        "pack", help="pack a run's newest valid checkpoint, config, metrics and exports into one .tar file"
    )
    packing.add_argument("output_dir", type=Path, help="the run's output_dir")
    packing.add_argument("--to", type=Path, help="the folder to write it to (default: the run's parent)")
    args = parser.parse_args(argv)
    try:
        path = pack(args.output_dir, args.to or args.output_dir.resolve().parent)
    except (RunError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"packed {path} ({path.stat().st_size / 2**20:.1f} MiB). Upload it as a Kaggle dataset or into the "
        "project's folder on Drive: a run whose import_from holds it continues from it."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
