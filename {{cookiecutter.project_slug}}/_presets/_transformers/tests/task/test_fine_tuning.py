"""Fine-tuning a pretrained model, in full and with LoRA, keeps every guarantee. The pretrained model is a
tiny one with random weights saved with save_pretrained (tests/task_settings.py), so that transformers'
real loading path runs offline:

- with LoRA, stopped by SIGTERM or killed with kill -9 mid-run, then rerun: bitwise the same weights and
  metrics; 1 and 2 processes (dropout on) end at the same eval metrics; predict.py writes the same bytes
  on both (full fine-tuning trains as the task's default model does, whose every guarantee is
  tests/test_guarantees.py's: only its start differs, from_pretrained);
- a LoRA checkpoint holds the adapter and the head only, and a resume against other base weights is
  refused in one line, with nothing written;
- the exports load with transformers and peft's own functions: model/ (an adapter, or the whole model)
  and model/merged with from_pretrained and pipeline;
- gradient checkpointing, which a session may turn on, trains the same weights.
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.models.pretrained import HEADS
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import list_checkpoints
from {{ cookiecutter.package_name }}.utils.config import load_config
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from ..conftest import (
    assert_same_run,
    framework_warnings,
    read_metrics,
    run_predict,
    run_training,
    start_training,
    wait_for_training,
)
from ..task_settings import (
    FINE_TUNING_MODES,
    FINE_TUNING_RUN,
    PIPELINE,
    save_pretrained_model,
)

pytestmark = pytest.mark.slow

MODES = {"full": [], "lora": ["--lora_rank", "4", "--merge_lora", "true"]}
CHECKPOINT_EVERY = int(FINE_TUNING_RUN[FINE_TUNING_RUN.index("--checkpoint_every") + 1])


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pretrained") / "model"
    save_pretrained_model(folder)
    return folder


def fine_tuning(pretrained: Path, mode: str) -> list[str]:
    return ["--pretrained_model", str(pretrained), *MODES[mode], *FINE_TUNING_RUN]


@pytest.fixture(scope="session")
def references(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted run of each mode, compared with by the tests that stop or change one."""
    runs = {}
    for mode in FINE_TUNING_MODES:
        runs[mode] = tmp_path_factory.mktemp(f"reference-{mode}") / "run"
        mirror = ["--mirror_dir", str(runs[mode].with_name("mirror"))]  # a Drive folder on Colab
        run_training(runs[mode], *fine_tuning(pretrained, mode), *mirror)
    return runs


def test_stopped_then_killed_mid_run_then_rerun_ends_bitwise_identical(
    pretrained: Path, references: dict[str, Path], tmp_path: Path
) -> None:
    """SIGTERM at an arbitrary moment (a checkpoint, exit 75), the same command again, kill -9 at an
    arbitrary moment after its next checkpoint, the same command again, this time with gradient
    checkpointing (activations recomputed in the backward pass, dropout's random draws replayed): the
    uninterrupted run's weights and metrics, bit for bit."""
    output_dir = tmp_path / "run"
    args = fine_tuning(pretrained, "lora")
    for stop in (signal.SIGTERM, signal.SIGKILL):
        done = max((int(path.name[5:]) for path in list_checkpoints(output_dir)), default=0)
        started = time.time()
        process = start_training(output_dir, *args)
        # kill -9 once this session has saved a checkpoint of its own, so that the rerun resumes from it.
        saved_anew = (done // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY + 2 if stop == signal.SIGKILL else 0
        wait_for_training(output_dir, process, since=started, step=saved_anew)
        assert process.poll() is None, f"train.py ended before it got {stop.name}"
        time.sleep(random.uniform(0.0, 0.05))  # an arbitrary moment, not aligned with any step
        process.send_signal(stop)
        output, _ = process.communicate(timeout=120)
        expected = EXIT_STOPPED if stop == signal.SIGTERM else -signal.SIGKILL
        assert process.returncode == expected, output[-2000:]
        assert list_checkpoints(output_dir) and not (output_dir / "model").exists(), output[-2000:]
    resumed = run_training(output_dir, *args, "--gradient_checkpointing", "true")
    assert "resuming from" in resumed.stdout
    assert_same_run(output_dir, references["lora"])


def test_one_and_two_processes_end_at_the_same_eval_metrics(
    pretrained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # threads change the summation order of matrix products
    args = [*fine_tuning(pretrained, "lora"), "--per_device_batch_size", "32"]
    args += ["--eval_every", "10"]
    runs = {n: run_training(tmp_path / str(n), *args, processes=n) for n in (1, 2)}
    assert "x 2 processes x 1 accumulation = global batch 64" in runs[2].stdout
    assert framework_warnings(runs[1]) == [] and framework_warnings(runs[2]) == []
    evals = [[row for row in read_metrics(tmp_path / str(n)) if "eval/loss" in row] for n in (1, 2)]
    assert len(evals[0]) == 3 and evals[0] == evals[1]


def test_predict_writes_the_same_bytes_on_one_and_two_processes(
    references: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the LoRA adapter of model/ on the pretrained base, and with the merged model."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for folder in (references["lora"] / "model", references["lora"] / "model" / "merged"):
        files = {n: tmp_path / f"{folder.name}-{n}.csv" for n in (1, 2)}
        for processes, output in files.items():
            args = ["--model_dir", str(folder), "--output", str(output), "--batch_size", "5"]
            result = run_predict(*args, processes=processes)
            assert f"world size {processes}" in result.stdout
            assert framework_warnings(result) == []
        assert files[1].read_bytes() == files[2].read_bytes()


def test_a_lora_checkpoint_holds_the_adapter_and_the_head_only_also_in_the_mirror(
    pretrained: Path, references: dict[str, Path]
) -> None:
    checkpoint = list_checkpoints(references["lora"])[-1]
    with safe_open(checkpoint / "model.safetensors", framework="pt") as weights:
        names = list(weights.keys())
    assert names and all("lora_" in name or "modules_to_save" in name for name in names), names
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    assert len(optimizer["state"]) == len(names)  # AdamW's moments of exactly those
    base = sum(path.stat().st_size for path in pretrained.glob("*.safetensors"))
    assert (checkpoint / "model.safetensors").stat().st_size < base / 5
    # The mirror (Drive on Colab) holds the same small checkpoint.
    mirrored = references["lora"].with_name("mirror") / "checkpoints" / checkpoint.name
    for file in checkpoint.iterdir():
        assert (mirrored / file.name).read_bytes() == file.read_bytes(), file.name


def test_a_resume_against_other_base_weights_is_refused_with_nothing_written(
    pretrained: Path, references: dict[str, Path], tmp_path: Path
) -> None:
    output_dir = tmp_path / "run"
    shutil.copytree(references["lora"], output_dir)
    other = tmp_path / "other"
    shutil.copytree(pretrained, other)
    weights = next(other.glob("*.safetensors"))
    with safe_open(weights, framework="pt") as file:
        state = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
    # One weight of the base changed (not of the head, which is replaced): the same name, another base.
    name = next(name for name, tensor in state.items() if tensor.dim() >= 2 and not name.startswith(HEADS))
    state[name] = state[name] + 1e-3
    from safetensors.torch import save_file

    save_file(state, weights, metadata={"format": "pt"})
    before = sorted(str(path) for path in output_dir.rglob("*"))
    args = fine_tuning(other, "lora")
    result = run_training(output_dir, *args[: args.index("--max_steps")], "--max_steps", "40", check=False)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint ") and "frozen weights are" in last, result.stderr[-2000:]
    assert str(pretrained) in last and str(other) in last and "the base model it was trained" in last
    assert sorted(str(path) for path in output_dir.rglob("*")) == before
    assert read_metrics(output_dir) == read_metrics(references["lora"])


def test_the_exports_load_with_transformers_and_peft(references: dict[str, Path]) -> None:
    """model/ of full fine-tuning and model/merged load with from_pretrained and pipeline; the LoRA adapter
    of model/ loads with PeftModel.from_pretrained on the base with its new head, and predicts what the
    merged model does (up to the rounding of merging)."""
    from peft import PeftModel
    from transformers import pipeline

    lora = references["lora"] / "model"
    folders = [lora / "merged", *([references["full"] / "model"] if "full" in references else [])]
    for folder in folders:
        labels = set(task.load_export(folder, load_export_config(folder)).config.id2label.values())
        scores = pipeline(PIPELINE[0], model=str(folder), top_k=len(labels))(PIPELINE[1])
        scores = scores[0] if isinstance(scores[0], list) else scores  # per input, in some versions
        assert {row["label"] for row in scores} == labels
        assert sum(row["score"] for row in scores) == pytest.approx(1.0)
    config = load_export_config(lora)
    adapter = PeftModel.from_pretrained(task.build_base(config), lora).eval()
    merged = task.load_export(lora / "merged", config).eval()
    inputs = task.predict_inputs(config, None)
    batch = task.collate([inputs[i] for i in range(8)])
    with torch.no_grad():
        rows = [task.predict(model, batch, config) for model in (adapter, merged)]
    for from_adapter, from_merged in zip(*rows, strict=True):
        assert from_adapter == pytest.approx(from_merged, abs=1e-5)


def load_export_config(folder: Path) -> task.Config:
    return load_config([], folder / "config.yaml", task.Config)[0]
