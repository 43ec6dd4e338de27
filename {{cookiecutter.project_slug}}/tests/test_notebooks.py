"""notebooks/: valid Jupyter files without outputs that run the platform's launcher and show its results.

The template's own tests (tests/test_notebooks_run.py there) execute both notebooks with a real kernel.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest
import yaml

from {{ cookiecutter.package_name }}.notebook import run_training, show_metrics, show_predictions

from .conftest import PROJECT

NOTEBOOKS = {"colab": PROJECT / "notebooks" / "colab.ipynb", "kaggle": PROJECT / "notebooks" / "kaggle.ipynb"}


def code(notebook: nbformat.NotebookNode) -> str:
    return "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")


def training_call(platform: str) -> str:
    return f'run_training("{platform}", *TRAIN_ARGS)'


@pytest.mark.parametrize("platform", list(NOTEBOOKS))
def test_notebook_is_valid_nbformat_4_without_outputs(platform: str) -> None:
    """The notebook reads as nbformat v4 and passes its JSON schema; no outputs or counts are committed."""
    notebook = nbformat.read(NOTEBOOKS[platform], as_version=nbformat.NO_CONVERT)
    assert notebook.nbformat == 4
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source


@pytest.mark.parametrize("platform", list(NOTEBOOKS))
def test_notebook_runs_the_launcher_and_reads_the_configured_output(platform: str) -> None:
    """It trains with run_training (which runs scripts/run_<platform>.sh, a script that exists, and makes
    an interrupt save a checkpoint: `!bash` would not) after putting the project's src/ on sys.path, and
    shows metrics.jsonl and the exported model from the output_dir of configs/<platform>.yaml, so the
    two cannot drift apart."""
    source = code(nbformat.read(NOTEBOOKS[platform], as_version=4))
    assert "!bash" not in source
    assert 'sys.path.insert(0, os.path.join(PROJECT, "src"))' in source
    runner = "from {{ cookiecutter.package_name }}.notebook import run_training"
    assert source.index("sys.path.insert") < source.index(runner) < source.index(training_call(platform))
    assert (PROJECT / "scripts" / f"run_{platform}.sh").is_file()


@pytest.mark.parametrize("platform", list(NOTEBOOKS))
def test_notebook_shows_the_results_of_the_configured_run(platform: str) -> None:
    """After training, cells show the metrics and exported model and predict.py's rows, all of
    the output_dir of configs/<platform>.yaml: where training writes (on Colab the session's disk, which
    the run is copied to from Drive or a REMOTE_STORE when a session starts), so the two cannot drift."""
    cells = {cell.get("id"): cell.source for cell in nbformat.read(NOTEBOOKS[platform], as_version=4).cells}
    output_dir = yaml.safe_load((PROJECT / "configs" / f"{platform}.yaml").read_text())["output_dir"]
    assert f'RUN = "{output_dir.rstrip("/")}"' in cells["results"]
    assert cells["results"].rstrip().endswith("notebook.show_metrics(RUN)")
    assert cells["predict"].rstrip().endswith("notebook.show_predictions(RUN)")
    order = list(cells)
    assert order.index("train") < order.index("results") < order.index("predict")
    assert "!tail" not in cells["results"] and "!ls" not in cells["results"]  # errors where nothing is yet


@pytest.mark.parametrize("platform", list(NOTEBOOKS))
def test_notebook_takes_train_arguments_from_a_parameters_cell(platform: str) -> None:
    """TRAIN_ARGS is set in one cell tagged `parameters`, before the training cell: a user edits it there,
    and a tool (papermill, the template's tests) overrides it with a cell of its own right after it."""
    notebook = nbformat.read(NOTEBOOKS[platform], as_version=4)
    cells = list(enumerate(notebook.cells))
    tagged = [index for index, cell in cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1
    assert notebook.cells[tagged[0]].source.splitlines()[-1] == "TRAIN_ARGS = []"
    training = [index for index, cell in cells if training_call(platform) in cell.source]
    assert len(training) == 1 and tagged[0] < training[0]


def test_run_training_shows_the_launcher_output_and_raises_when_it_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Off Kaggle, scripts/run_kaggle.sh refuses to start: its message shows in the cell's output, and the
    cell fails with the exit status instead of going on to the next cell as `!bash` would."""
    for name in ("KAGGLE_KERNEL_RUN_TYPE", "ANY_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="exit status 1"):
        run_training("kaggle", "--max_steps", "1")
    output = capsys.readouterr().out
    assert "$ bash scripts/run_kaggle.sh --max_steps 1" in output
    assert "run_kaggle: ERROR: scripts/run_kaggle.sh is for Kaggle" in output


@pytest.mark.slow  # trains
def test_a_stop_returns_and_the_result_cells_show_what_the_run_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before a run, each result cell says in one line that there is nothing yet. A run stopped by its time
    budget (exit 75) returns from run_training with one line instead of raising, so "Run all" goes on;
    the result cells then show its metrics and export, and predict.py's rows from the exported model.
    (A signal or the stop button leaves no export: the template's notebook
    tests run those cells after one, in a real kernel.)"""
    for name in ("KAGGLE_KERNEL_RUN_TYPE", "COLAB_RELEASE_TAG", "COLAB_GPU", "SLURM_JOB_ID", "ANY_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SKIP_INSTALL", "1")
    run = tmp_path / "run"
    show_metrics(run), show_predictions(run)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("nothing yet: ")
    assert lines[1].startswith(f"no predictions yet: {run / 'model'} is exported when training ends")

    budget = ["--time_budget", "0.001s", "--log_every", "3", "--max_steps", "60"]
    assert run_training("local", "--output_dir", str(run), *budget) == 75
    relayed = capsys.readouterr().out
    assert "training stopped (exit 75): run this cell again to continue" in relayed
    assert re.search(r"\rtrain: +\d+%\|", relayed), relayed  # training's own bar, redrawn in the cell
    export = json.loads((run / "model" / "export.json").read_text())
    show_metrics(run)  # with curves.png, drawn when the stopped session ended (displayed: its repr here)
    shown = capsys.readouterr().out
    assert f"{run / 'model'}: " in shown and "IPython.core.display.Image object" in shown, shown
    show_predictions(run)
    shown = capsys.readouterr().out
    assert f"the model of step {export['step']}, first rows of {run / 'predictions.csv'}:" in shown, shown
    assert len(shown.split("first rows of", 1)[1].strip().splitlines()) == 6, shown  # the heading + 5 rows


@pytest.mark.slow  # trains (single_run)
def test_the_predictions_cell_uses_the_best_evaluations_model(
    single_run: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As predict.py does, the result cell predicts with best_model/ where the run evaluated."""
    run = tmp_path / "run"
    for name in ("model", "best_model"):
        shutil.copytree(single_run[0] / name, run / name)
    step = json.loads((run / "best_model" / "export.json").read_text())["step"]
    show_predictions(run)
    shown = capsys.readouterr().out
    assert f"predicting with {run / 'best_model'} into" in shown, shown
    assert f"best_model/, the model of step {step}, first rows of {run / 'predictions.csv'}:" in shown, shown


def test_readme_says_how_the_project_gets_onto_colab_and_kaggle() -> None:
    """The README's platform section gives each way onto the platforms that the notebooks then take: Drive
    (the folder the Colab notebook copies), a Kaggle dataset (found among the inputs), a git clone (the
    REPO_URL of either notebook) and the URL that opens the Colab notebook from GitHub."""
    readme = " ".join((PROJECT / "README.md").read_text().split())
    slug = "{{ cookiecutter.project_slug }}"
    cells = {
        platform: {cell.get("id"): cell.source for cell in nbformat.read(path, as_version=4).cells}
        for platform, path in NOTEBOOKS.items()
    }
    assert f"`MyDrive/{slug}`" in readme
    assert f'SOURCE = "/content/drive/MyDrive/{slug}"' in cells["colab"]["get-project"]
    url = "https://colab.research.google.com/github/<you>/<repo>/blob/main/notebooks/colab.ipynb"
    assert f"`{url}`" in readme
    assert "Dataset" in readme and "/kaggle/input/" in cells["kaggle"]["get-project"]
    for platform in NOTEBOOKS:
        get_project = cells[platform]["get-project"]
        assert 'REPO_URL = ""' in get_project, platform
        assert '["git", "clone", "--depth", "1", REPO_URL, PROJECT]' in get_project, platform
    assert readme.count("`REPO_URL`") == 2


def test_colab_notebook_mounts_drive_before_training() -> None:
    """configs/colab.yaml writes to Google Drive, so Drive is mounted in a cell before the training cell."""
    source = code(nbformat.read(NOTEBOOKS["colab"], as_version=4))
    assert source.index('drive.mount("/content/drive")') < source.index(training_call("colab"))
    # Drive uploads in the background: the last cell waits for it before the session is left.
    assert source.rindex("drive.flush_and_unmount()") > source.index(training_call("colab"))


def test_colab_notebook_hands_every_trackers_keys_to_the_training_cell() -> None:
    """Colab's secrets are readable only in the notebook kernel, not in the launcher's subprocess: the keys
    of every tracker, whichever `tracker` names, are loaded before training."""
    source = code(nbformat.read(NOTEBOOKS["colab"], as_version=4))
    training = source.index(training_call("colab"))
    assert source.index("load_secret(name)") < training
    assert source.index('"WANDB_API_KEY"') < training and source.index('"MLFLOW_TRACKING_') < training
