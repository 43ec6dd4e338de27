"""A checkpoint moves between software stacks (Colab and Kaggle ship different torch and Accelerate): written
on one, it resumes on the other, both ways, and the run's history names what changed; the resume's first
step is verified against the one the first stack computed, or differs by a measured amount that the line
puts down to the stack.

The other stack is a second environment with this project installed, whose interpreter OTHER_STACK_PYTHON
names: `.ci/stacks` in the template builds one at the lowest versions pyproject.toml allows and runs this
file from one at the newest. Skipped, saying so, where it is not set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import PROJECT, QUICK, sessions_of

OTHER = os.environ.get("OTHER_STACK_PYTHON", "")
NO_OTHER = "needs OTHER_STACK_PYTHON: another environment's python (.ci/stacks)"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OTHER, reason=NO_OTHER)]


def versions(python: str) -> dict[str, str]:
    code = "import json, torch, accelerate; print(json.dumps([torch.__version__, accelerate.__version__]))"
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    torch_version, accelerate_version = json.loads(result.stdout)
    return {"torch": torch_version, "accelerate": accelerate_version}


def train(python: str, output_dir: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(PROJECT / "src")}
    command = [python, "train.py", "--config", "configs/local.yaml", "--output_dir", str(output_dir), *QUICK]
    result = subprocess.run(
        [*command, *args], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{python}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.parametrize("first", ["other", "this"], ids=["other_then_this", "this_then_other"])
def test_a_checkpoint_resumes_on_the_other_stack_and_the_history_names_it(first: str, tmp_path: Path) -> None:
    pythons = [OTHER, sys.executable] if first == "other" else [sys.executable, OTHER]
    before, after = (versions(python) for python in pythons)
    assert before != after, f"both environments run torch and accelerate {before}"
    output_dir = tmp_path / "run"
    train(pythons[0], output_dir, "--max_steps", "10")
    resumed = train(pythons[1], output_dir)
    assert "resuming from" in resumed and "step_00000010" in resumed
    for name in ("torch", "accelerate"):
        if before[name] != after[name]:
            assert f"history: {name} {before[name]} -> {after[name]}: " in resumed, resumed
    sessions = sessions_of(output_dir)
    assert [session["versions"]["torch"] for session in sessions] == [before["torch"], after["torch"]]
    assert [session["start_step"] for session in sessions] == [0, 10]
    assert sessions[-1]["ending"] in ("done", "max_steps reached")
    (line,) = [line for line in resumed.splitlines() if line.startswith("resume ")]
    changed = [f"{name} {before[name]} -> {after[name]}" for name in before if before[name] != after[name]]
    if line.startswith("resume differs at step 11: loss "):
        assert "measured: relative difference " in line and any(change in line for change in changed), line
        assert sessions[-1]["resume"] == "differs"
    else:
        assert line == "resume verified: step 11 as session 1 recorded it, bit for bit"
        assert sessions[-1]["resume"] == "verified"
