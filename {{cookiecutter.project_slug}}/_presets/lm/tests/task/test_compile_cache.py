"""torch.compile across a resume: the checkpoint carries Inductor's cache, and the resumed session uses it
instead of compiling again, on a machine whose own Inductor cache is empty, and its first step is bit for
bit the one the stopped session computed ahead (machine/compile_cache.py, training/resume_check.py)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import list_checkpoints
from {{ cookiecutter.package_name }}.utils.machine.compile_cache import ARTIFACTS, CACHE_FILE, load_cache
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from ..conftest import run_training, sessions_of, start_training, wait_for_training

# A one-layer GPT with dropout on (compiled dropout draws from the RNG a resume restores), evaluated every 4
# steps: the session that is stopped compiles the eval graph too (32 windows: one batch).
COMPILED = [
    *("--compile", "true", "--num_layers", "1", "--num_heads", "2", "--embed_dim", "32"),
    *("--block_size", "16", "--dropout", "0.1", "--eval_windows", "32", "--eval_every", "4"),
    *("--max_steps", "24", "--log_every", "2", "--checkpoint_every", "8", "--tracker", "none"),
    # Checkpoints by step alone: with max_time_lost (a checkpoint after the minutes of the first step, no
    # longer one at every early step) the resumed session still compiles its first graph anew (not understood)
    *("--max_time_lost", ""),
]
# Inductor's own log of the resumed session: each compiled graph found in its cache, or compiled anew.
CACHE_LOGS = "torch._inductor.codecache,torch._functorch._aot_autograd.autograd_cache"


@pytest.mark.slow
def test_a_compiled_run_resumed_on_an_empty_inductor_cache_loads_the_checkpoints_and_verifies_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The resumed session gets an empty Inductor cache, as on a new machine, and logs Inductor's cache hits
    # and misses. Its verified first step stands for a compiled reference run (a third compilation).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-first"))
    output_dir = tmp_path / "run"
    started = time.time()
    process = start_training(output_dir, *COMPILED)
    # Compiling from scratch first: minutes on a busy 2-core machine.
    wait_for_training(output_dir, process, since=started, step=6, timeout=900)  # trained, evaluated, compiled
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == EXIT_STOPPED, output[-3000:]
    stopped = list_checkpoints(output_dir)[-1]
    assert (stopped / CACHE_FILE).is_file() == ARTIFACTS, output[-3000:]

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-new-machine"))
    monkeypatch.setenv("TORCH_LOGS", CACHE_LOGS)
    resumed = run_training(output_dir, *COMPILED)
    output = resumed.stdout + resumed.stderr
    assert f"resuming from {stopped}" in resumed.stdout, output[-3000:]
    if ARTIFACTS:
        assert f"history: compile cache of {stopped.name} loaded (" in resumed.stdout, output[-3000:]
        assert "fx graph cache hit" in output and "AOTAutograd cache hit" in output, output[-5000:]
        assert "cache miss" not in output, [line for line in output.splitlines() if "cache miss" in line]
    else:  # one line, and the session compiles as before
        assert f"history: compile cache: torch {torch.__version__} keeps none with a run" in resumed.stdout
    verified = f"resume verified: step {int(stopped.name[5:]) + 1} as session 1 recorded it, bit for bit"
    assert verified in resumed.stdout, output[-3000:]
    assert "compile_cache" in sessions_of(output_dir)[-1]


def test_a_cache_made_for_another_gpu_and_torch_is_not_loaded_and_named_in_one_line(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step_00000008"
    checkpoint.mkdir()
    other = {"torch": "2.7.1+cu126", "device": "Tesla T4", "cuda": "12.6"}
    (checkpoint / CACHE_FILE).write_bytes(json.dumps(other).encode() + b"\nnot read")
    line = load_cache(task.Config(compile=True), torch.device("cpu"), checkpoint)
    if not ARTIFACTS:
        assert line.startswith(f"compile cache: torch {torch.__version__} keeps none with a run"), line
        return
    assert line == (
        "compile cache of step_00000008 not used: made for torch 2.7.1+cu126, device Tesla T4, cuda 12.6; "
        f"here torch {torch.__version__}, device cpu, cuda none: this session compiles from scratch"
    )
    assert load_cache(task.Config(compile=False), torch.device("cpu"), checkpoint) == ""
