"""`--find_lr true`: a learning-rate range test that leaves its curve, nothing else (training/lr_find.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.utils.run.run_dir import LOCK_FILE, OutputLock

from ..conftest import assert_same_run, run_training, sessions_of
from ..task_settings import QUICK

pytestmark = pytest.mark.slow

SUGGESTION = re.compile(r"lr_find: suggested learning rate (\S+): train with --learning_rate \1; curve: (.+)")


def suggestion(stdout: str) -> tuple[float, Path]:
    lines = [match for line in stdout.splitlines() if (match := SUGGESTION.fullmatch(line))]
    assert len(lines) == 1, stdout
    return float(lines[0][1]), Path(lines[0][2])


@pytest.fixture(scope="module")
def finder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, bytes]:
    """`--find_lr true` with QUICK on 1 process, for both tests: its folder, its suggestion and its curve
    (read before the first test trains in the folder)."""
    output_dir = tmp_path_factory.mktemp("find_lr") / "run"
    rate, curve = suggestion(run_training(output_dir, *QUICK, "--find_lr", "true").stdout)
    assert curve == output_dir / "lr_find.png"
    return output_dir, rate, curve.read_bytes()


def test_find_lr_leaves_its_curve_alone_and_the_run_after_it_unchanged(
    finder: tuple[Path, float, bytes], single_run: tuple
) -> None:
    output_dir, rate, curve = finder
    assert 1e-7 < rate < 10  # inside the sweep
    assert curve.startswith(b"\x89PNG")
    # No checkpoint, config, metrics, history or tracker files: the lock (empty: free) and the curve.
    assert sorted(path.name for path in output_dir.iterdir()) == [LOCK_FILE, "lr_find.png"]
    assert (output_dir / LOCK_FILE).read_bytes() == b""
    # A run in the same folder afterwards ends bit for bit as one that never saw the finder.
    run_training(output_dir, *QUICK)
    reference, _ = single_run
    assert_same_run(output_dir, reference)
    assert len(sessions_of(output_dir)) == 1


def test_find_lr_gives_the_same_curve_on_two_processes(
    finder: tuple[Path, float, bytes], tmp_path: Path
) -> None:
    _, rate, curve = finder
    two = suggestion(run_training(tmp_path / "two", *QUICK, "--find_lr", "true", processes=2).stdout)
    assert two[0] == rate
    # The loss is averaged over the processes: the drawn curve is the one process's, pixel for pixel.
    assert two[1].read_bytes() == curve


def test_find_lr_refuses_a_folder_in_use(tmp_path: Path) -> None:
    lock = OutputLock(tmp_path)
    lock.acquire()
    try:
        result = run_training(tmp_path, "--find_lr", "true", check=False)
    finally:
        lock.release()
    assert result.returncode == 1
    assert "is in use by another run" in result.stdout + result.stderr
    assert not (tmp_path / "lr_find.png").exists()
