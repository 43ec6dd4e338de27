"""Evaluation that does not depend on the process count, the best model, early stopping."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import load_config

from ..conftest import assert_same_run, read_metrics, run_training, sessions_of

# A sitecustomize that writes the shapes of every batch eval_step is given, one line per batch, to
# $EVAL_SHAPES.<rank>: what the kernels of a real run were asked to compute.
EVAL_SHAPES_HOOK = Path(__file__).parent / "eval_shapes_hook"

pytestmark = pytest.mark.slow


def test_two_processes_evaluate_exactly_like_one_on_an_odd_eval_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With dropout on (its masks follow the samples) and one thread per process, 2-process DDP trains the
    very same weights as one process with accumulation; the eval metrics, over a set that does not split
    evenly, are then equal."""
    _, eval_set = task.build_datasets(task.Config())
    assert len(eval_set) % 2 == 1  # the last batch is uneven: process 1 gets padding that must not count
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # threads change the summation order of matrix products
    args = ["--num_epochs", "2", "--eval_every", "11", "--mixed_precision", "no"]
    shapes = {}
    for name, processes in (("one", 1), ("two", 2)):
        monkeypatch.setenv("EVAL_SHAPES", str(tmp_path / f"{name}.shapes"))
        hooked = os.pathsep.join([str(EVAL_SHAPES_HOOK), os.environ.get("PYTHONPATH", "")])
        monkeypatch.setenv("PYTHONPATH", hooked)
        run_training(tmp_path / name, *args, processes=processes)
        recorded = [path.read_text().split() for path in tmp_path.glob(f"{name}.shapes.*")]
        shapes[name] = {line for lines in recorded for line in lines}
    # Every eval batch has one shape on any process count (the last one filled up, its fill not counted),
    # so the equality below holds on any CPU, not only where no kernel rounds another shape otherwise
    # (the batch of 2 is the task check's, before training).
    assert shapes["one"] == shapes["two"] == {"[[32,64],[32]]", "[[2,64],[2]]"}, shapes
    one, two = (tmp_path / name / "model" / "model.safetensors" for name in ("one", "two"))
    assert one.read_bytes() == two.read_bytes()
    evals = [[row for row in read_metrics(tmp_path / name) if "eval/loss" in row] for name in ("one", "two")]
    assert [row["step"] for row in evals[0]] == [11, 22, 33, 44]
    assert evals[0] == evals[1]  # float for float, not approximately


def evaluate_plainly(model_dir: Path) -> dict[str, float]:
    config, _ = load_config([], model_dir / "config.yaml", task.Config)
    model = task.build_model(config)
    model.load_state_dict(load_file(model_dir / "model.safetensors"))
    model.eval()
    inputs, labels = task.build_datasets(config)[1].tensors
    with torch.no_grad():
        logits = model(inputs)
    loss = F.cross_entropy(logits, labels, reduction="none").double().mean().item()
    return {"eval/loss": loss, "eval/accuracy": (logits.argmax(-1) == labels).sum().item() / len(labels)}


def test_best_model_holds_the_best_evaluation_and_outlives_rotation(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    run_training(
        output_dir,
        *["--max_steps", "60", "--eval_every", "5", "--checkpoint_every", "10", "--keep_checkpoints", "1"],
        *["--best_metric", "eval/loss", "--learning_rate", "0.02"],  # a high rate: the loss goes up and down
        *["--max_rollbacks", "0"],  # rotation alone: a rollback would keep the checkpoint a log interval back
    )
    evals = [row for row in read_metrics(output_dir) if "eval/loss" in row]
    best = min(evals, key=lambda row: row["eval/loss"])
    info = json.loads((output_dir / "best_model" / "export.json").read_text())
    assert info["step"] == best["step"]
    assert info["eval/loss"] == best["eval/loss"]
    # The weights are those of that evaluation: plain PyTorch gets the same numbers from them.
    plain = evaluate_plainly(output_dir / "best_model")
    assert plain["eval/accuracy"] == best["eval/accuracy"]
    assert plain["eval/loss"] == pytest.approx(best["eval/loss"], rel=1e-5)
    # Rotation keeps one checkpoint; best_model lives outside checkpoints/ and is never rotated.
    assert [path.name for path in (output_dir / "checkpoints").iterdir()] == ["step_00000060"]
    assert json.loads((output_dir / "model" / "export.json").read_text())["step"] == 60


# A learning rate too small to change any prediction: accuracy never beats the first evaluation (step 2),
# so with patience 2 training stops at step 6.
EARLY = ["--learning_rate", "1e-9", "--eval_every", "2", "--early_stopping_patience", "2"]
EARLY += ["--log_every", "2", "--checkpoint_every", "2"]


def test_early_stopping_stops_every_process_at_the_same_step_after_a_resume_too(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    result = run_training(reference, *EARLY, processes=2)
    best = json.loads((reference / "best_model" / "export.json").read_text())
    assert best["step"] == 2
    # The progress where it stopped, why, then what it left; curves.png last.
    lines = result.stdout.splitlines()
    stopped = lines.index(
        f"stopped early at step 6: eval/accuracy has not improved for 2 evaluations; best "
        f"{best['eval/accuracy']:.4f} at step 2, exported to {reference / 'best_model'}/"
    )
    assert lines[stopped - 1].startswith("train: step 6/") or lines[stopped - 2].startswith("train: step 6/")
    assert lines[stopped + 1].startswith("done: 6 optimizer steps")
    assert lines[-1] == f"curves: {reference / 'curves.png'}"
    assert max(row["step"] for row in read_metrics(reference)) == 6
    assert json.loads((reference / "model" / "export.json").read_text())["step"] == 6
    # Both processes took part in the checkpoint of step 6: each wrote its random state there.
    checkpoint = reference / "checkpoints" / "step_00000006"
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    assert sessions_of(reference)[-1]["ending"] == "early stopping"

    # Killed after the checkpoint of step 4 (one evaluation without a better accuracy): the resumed run
    # counts on from there and stops at the same step, with the same weights and metrics.
    killed = tmp_path / "killed"
    shutil.copytree(reference, killed)
    for later in ("model", "history.json", "checkpoints/step_00000006"):
        shutil.rmtree(killed / later) if (killed / later).is_dir() else (killed / later).unlink()
    assert "step_00000004" in run_training(killed, *EARLY, processes=2).stdout
    assert_same_run(killed, reference)

    # 1 process up to step 4, then 2: the same stop.
    hop = tmp_path / "hop"
    run_training(hop, *EARLY, "--max_steps", "4")
    assert "stopped early at step 6: eval/accuracy" in run_training(hop, *EARLY, processes=2).stdout
    hopped = [(row["step"], row.get("eval/accuracy")) for row in read_metrics(hop)]
    assert hopped == [(row["step"], row.get("eval/accuracy")) for row in read_metrics(reference)]

    # Running the same command again does not train on: the run is over, and says so.
    before = (hop / "metrics.jsonl").read_text()
    rerun = run_training(hop, *EARLY)
    assert rerun.stdout.splitlines()[-4].startswith("stopped early at step 6: eval/accuracy has not improved")
    assert (hop / "metrics.jsonl").read_text() == before
    assert [session["ending"] for session in sessions_of(hop)] == [
        "max_steps reached",
        "early stopping",
        "early stopping",
    ]


def test_torch_compile_trains_and_exports_plain_weights(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    result = run_training(output_dir, "--compile", "true", "--max_steps", "10", "--log_every", "5")
    assert "done: 10 optimizer steps" in result.stdout
    plain = evaluate_plainly(output_dir / "model")  # loads only if the keys have no "_orig_mod." prefix
    logged = [row for row in read_metrics(output_dir) if "eval/accuracy" in row][-1]
    assert plain["eval/accuracy"] == logged["eval/accuracy"]
