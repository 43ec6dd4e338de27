"""predict.py's command line, with any task: a bad --output, a flag it does not have or a missing model is
a one-line error that names it and says what to pass, before any prediction; the default model folder is
found from any working directory, while the paths a user passes stay relative to the working directory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import load_config
from {{ cookiecutter.package_name }}.utils.machine.hardware import detect_platform

from .conftest import PROJECT, run_predict

PREDICT_FLAGS = {"--model_dir", "--last", "--input", "--output", "--format", "--batch_size", "--help"}
CONFIG_FLAGS = {f"--{field.name}" for field in dataclasses.fields(task.Config)}


def assert_one_line_error(result: subprocess.CompletedProcess[str], *names: object) -> str:
    """Exit code 1, no traceback, and a last line `error: ...` that names each of `names`; that line."""
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-2000:]
    for name in names:
        assert str(name) in last, last
    return last


def suggested_flags(message: str) -> set[str]:
    """The flags a message tells the user to pass: not the one it refuses (`has no --config`, `unknown
    argument '--inptu'`), nor `--field`, the stand-in for a config field's flag."""
    told = re.sub(r"has no --\w+|argument '[^']*'", "", message)
    return set(re.findall(r"--\w+", told)) - {"--field"}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["folder", "under-a-file", "unwritable"])
def test_an_output_that_cannot_be_written_is_refused_naming_it(
    single_run: tuple, tmp_path: Path, case: str
) -> None:
    if case == "unwritable" and os.geteuid() == 0:
        pytest.skip("root writes in any folder: permissions cannot be tested as root")
    folder = tmp_path / "out"
    folder.mkdir()
    output = {
        "folder": folder,
        "under-a-file": tmp_path / "a-file" / "p.csv",
        "unwritable": folder / "p.csv",
    }[case]
    (tmp_path / "a-file").write_text("")
    if case == "unwritable":
        folder.chmod(0o555)
    try:
        result = run_predict(
            "--model_dir", str(single_run[0] / "model"), "--output", str(output), check=False
        )
    finally:
        folder.chmod(0o755)
    last = assert_one_line_error(result, f"--output {output}")
    assert suggested_flags(last) <= PREDICT_FLAGS | CONFIG_FLAGS
    assert list(folder.iterdir()) == []  # nothing written, not even a temporary file


def test_an_output_folder_is_refused_before_anything_is_loaded(tmp_path: Path) -> None:
    """The output is checked before the model: a missing model is not what this run reports."""
    result = run_predict("--model_dir", str(tmp_path / "nowhere"), "--output", str(tmp_path), check=False)
    assert_one_line_error(result, f"--output {tmp_path} is a folder")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "configs/local.yaml"], "predict.py has no --config"),
        (["--config=configs/local.yaml"], "predict.py has no --config"),
        (["--inptu", "x.csv"], "unknown argument '--inptu' (did you mean '--input'?)"),
        (["x.csv"], "unknown argument 'x.csv'; each config field is a --field flag"),
    ],
    ids=["config", "config=", "typo", "positional"],
)
def test_a_flag_predict_py_does_not_have_is_refused_naming_its_flags(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    (tmp_path / "model").mkdir()  # its config.yaml is where the flags are read
    shutil.copy(PROJECT / "configs" / "local.yaml", tmp_path / "model" / "config.yaml")
    result = run_predict("--model_dir", str(tmp_path / "model"), *args, check=False)
    last = assert_one_line_error(result, expected)
    assert suggested_flags(last) <= PREDICT_FLAGS | CONFIG_FLAGS


@pytest.mark.parametrize("content", ["none", "empty-folder", "config-only"])
def test_a_missing_model_names_the_file_and_only_real_flags(tmp_path: Path, content: str) -> None:
    model_dir = tmp_path / "model"
    missing = model_dir
    if content != "none":
        model_dir.mkdir()
        missing = model_dir / "config.yaml"
    if content == "config-only":
        shutil.copy(PROJECT / "configs" / "local.yaml", model_dir / "config.yaml")
        missing = model_dir / "model.safetensors"
    result = run_predict("--model_dir", str(model_dir), "--output", str(tmp_path / "p.csv"), check=False)
    last = assert_one_line_error(result, missing, "--model_dir")
    assert suggested_flags(last) <= PREDICT_FLAGS
    assert not (tmp_path / "p.csv").exists()
    # Only a run that got past the checks of its command says it loads torch, at once, before doing so.
    loading = f"predicting with {model_dir} into {tmp_path / 'p.csv'}: loading PyTorch and Accelerate\n"
    assert result.stdout == (loading if content == "config-only" else "")


def copy_of_the_project(folder: Path) -> tuple[Path, Path]:
    """predict.py, configs/, src/ and data/ copied to `folder`, so that a model can be put where the default
    model folder is without touching this project's outputs/: (the copy, its default model folder)."""
    platform_config, _ = load_config([], PROJECT / "configs" / f"{detect_platform()}.yaml", task.Config)
    if Path(platform_config.output_dir).is_absolute():
        pytest.skip(f"this platform's output_dir is absolute: {platform_config.output_dir}")
    folder.mkdir()
    shutil.copy(PROJECT / "predict.py", folder)
    for name in ("configs", "src", "data"):  # data: the tasks that read their class names or text from it
        if (PROJECT / name).is_dir():
            shutil.copytree(PROJECT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder, folder / platform_config.output_dir / "model"


def predict_elsewhere(project: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """predict.py of `project` started from the working directory `cwd`."""
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(project / "predict.py"), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_default_model_dir_is_taken_from_the_project_folder(tmp_path: Path) -> None:
    """Without a model, the error names <project>/<output_dir>/model, not a folder of the working dir."""
    project, model_dir = copy_of_the_project(tmp_path / "project")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = predict_elsewhere(project, elsewhere, "--output", "p.csv")
    assert_one_line_error(result, f"model folder {model_dir} does not exist", "--model_dir")


@pytest.mark.slow
def test_the_default_model_dir_is_found_from_any_working_directory(single_run: tuple, tmp_path: Path) -> None:
    """The default model folder, <output_dir>/model, is taken from the project folder, as train.py writes it;
    --model_dir, --input and --output given by the user are taken from the working directory."""
    project, model_dir = copy_of_the_project(tmp_path / "project")
    shutil.copytree(single_run[0] / "model", model_dir)
    reference = tmp_path / "reference.csv"
    run_predict("--model_dir", str(single_run[0] / "model"), "--output", str(reference))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    result = predict_elsewhere(project, elsewhere, "--output", "p.csv")  # no --model_dir
    assert result.returncode == 0, result.stderr[-3000:]
    # --output is taken from the working directory; the rows are the model's (an image task's paths are
    # those of the copy's data).
    assert (elsewhere / "p.csv").read_text().replace(str(project), str(PROJECT)) == reference.read_text()

    # A relative --model_dir is the working directory's too: here it names no model, and the error says so.
    result = predict_elsewhere(project, elsewhere, "--model_dir", "model", "--output", "q.csv")
    assert_one_line_error(result, "model folder model does not exist")


@pytest.mark.slow
def test_the_default_model_is_the_best_evaluations_and_the_last_is_one_flag_away(
    single_run: tuple, tmp_path: Path
) -> None:
    """After a run that evaluated, predict.py takes best_model/ (early stopping's model), its first line
    saying why, as best_model/export.json records it; --last takes model/, the last step's."""
    project, model_dir = copy_of_the_project(tmp_path / "project")
    for name in ("model", "best_model"):
        shutil.copytree(single_run[0] / name, model_dir.parent / name)
    best_dir = model_dir.parent / "best_model"
    export = json.loads((best_dir / "export.json").read_text())
    metric = load_config([], best_dir / "config.yaml", task.Config)[0].best_metric
    result = predict_elsewhere(project, tmp_path, "--output", "best.csv")
    assert result.returncode == 0, result.stderr[-3000:]
    best = f"{metric} {export[metric]:.4f} at step {export['step']}, the best evaluation; --last for model/"
    assert result.stdout.startswith(f"predicting with {best_dir} ({best}"), result.stdout
    result = predict_elsewhere(project, tmp_path, "--output", "last.csv", "--last")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"predicting with {model_dir} into"), result.stdout


@pytest.mark.slow
def test_a_new_session_predicts_with_the_model_of_the_mirror(single_run: tuple, tmp_path: Path) -> None:
    """A new Colab session's disk holds no output_dir yet: the default model is the run's copy on Drive."""
    project, model_dir = copy_of_the_project(tmp_path / "project")
    config = project / "configs" / f"{detect_platform()}.yaml"
    config.write_text(f"{config.read_text()}mirror_dir: drive/run\n")
    shutil.copytree(single_run[0] / "model", project / "drive" / "run" / "model")
    result = predict_elsewhere(project, tmp_path, "--output", "p.csv")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"predicting with {project / 'drive' / 'run' / 'model'} into" in result.stdout
    assert not model_dir.exists()


@pytest.mark.slow
def test_a_predict_that_returns_one_dict_is_one_line(single_run: tuple, tmp_path: Path) -> None:
    """A task whose predict returns its first row alone (a dict, not a list of rows): one line naming
    predict and the contract, no traceback, no file."""
    project, _ = copy_of_the_project(tmp_path / "project")
    task_file = project / "src" / "{{ cookiecutter.package_name }}" / "task.py"
    task_file.write_text(
        task_file.read_text() + "\n\n_predict = predict\n\n\ndef predict(model, batch, config):\n"
        "    return _predict(model, batch, config)[0]\n"
    )
    model_dir = str(single_run[0] / "model")
    result = predict_elsewhere(project, tmp_path, "--model_dir", model_dir, "--output", "p.csv")
    assert_one_line_error(result, "predict(model, batch, config) returned a dict", "a list of")
    assert not (tmp_path / "p.csv").exists()
