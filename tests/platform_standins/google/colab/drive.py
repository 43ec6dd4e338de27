"""Stand-in for `google.colab.drive`: Google Drive as a plain folder.

On Colab, `mount` attaches Drive at `mountpoint` (a FUSE file system that uploads in the background), with
the user's files under `MyDrive/`. Here `MyDrive/` is an ordinary folder that the tests keep from one
session to the next, as Drive keeps files; nothing is uploaded, so there is nothing to flush.
"""

from __future__ import annotations

import os


def mount(
    mountpoint: str, force_remount: bool = False, timeout_ms: int = 120000, readonly: bool = False
) -> None:
    os.makedirs(os.path.join(mountpoint, "MyDrive"), exist_ok=True)
    print(f"Mounted at {mountpoint}")


def flush_and_unmount(timeout_ms: int = 86400000) -> None:
    # The real one waits for every pending upload, then detaches Drive; the folder stays here so that a
    # later "Run all" in the same session finds it, as it would after mounting again.
    print("Drive flushed (stand-in: nothing to upload)")
