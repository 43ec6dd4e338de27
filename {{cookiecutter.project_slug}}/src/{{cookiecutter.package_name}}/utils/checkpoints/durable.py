"""Files that are whole or absent: what a run writes outside its checkpoints goes through here."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TEMPORARY_PREFIX = ".partial_"


def write_durably(path: Path, data: str | bytes, durable: bool = True) -> None:
    """Write `path` in place (text is UTF-8), flushed if `durable`: for a folder renamed whole."""
    with Path(path).open("wb") as file:
        file.write(data.encode("utf-8") if isinstance(data, str) else data)
        file.flush()
        if durable:
            os.fsync(file.fileno())


def write_atomically(path: Path, data: str | bytes, durable: bool = True) -> None:
    """Replace `path` with `data` in one rename (a kill leaves the old or the new); `durable`: flushed."""
    path = Path(path)
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}")
    try:
        write_durably(temporary, data, durable)
        os.replace(temporary, path)
        if durable:
            fsync_path(path.parent)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        if error.filename is None:  # write(2) and fsync(2) name no file: name the one that failed
            error.filename = str(path)
        raise


def fsync_path(path: Path) -> None:
    """Flush a file's contents, or a folder's entries (its renames), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
