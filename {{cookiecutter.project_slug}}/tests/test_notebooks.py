"""notebooks/: valid Jupyter files without outputs that run the platform's launcher and show its results.

The template's own tests (tests/test_notebooks_run.py there) execute both notebooks with a real kernel.
"""

from __future__ import annotations

import nbformat
import pytest
import yaml

from {{ cookiecutter.package_name }}.notebook import run_training

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
    config = yaml.safe_load((PROJECT / "configs" / f"{platform}.yaml").read_text())
    # Colab's run lives on Drive as mirror_dir (output_dir is the session's disk): show the copy that stays.
    output_dir = (config.get("mirror_dir") or config["output_dir"]).rstrip("/")
    assert f"{output_dir}/metrics.jsonl" in source
    assert f"{output_dir}/model" in source


@pytest.mark.parametrize("platform", list(NOTEBOOKS))
def test_notebook_shows_curves_and_predictions_of_the_configured_run(platform: str) -> None:
    """After the results, cells show curves.svg inline and run predict.py on the exported model, both in
    the output_dir of configs/<platform>.yaml (on Colab the session's disk, where training writes)."""
    cells = {cell.get("id"): cell.source for cell in nbformat.read(NOTEBOOKS[platform], as_version=4).cells}
    output_dir = yaml.safe_load((PROJECT / "configs" / f"{platform}.yaml").read_text())["output_dir"]
    assert f'RUN = "{output_dir.rstrip("/")}"' in cells["curves"]
    assert 'SVG(filename=f"{RUN}/curves.svg")' in cells["curves"]
    assert '"predict.py", "--model_dir", f"{RUN}/model"' in cells["predict"]
    order = list(cells)
    assert order.index("results") < order.index("curves") < order.index("predict")


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


def test_colab_notebook_mounts_drive_before_training() -> None:
    """configs/colab.yaml writes to Google Drive, so Drive is mounted in a cell before the training cell."""
    source = code(nbformat.read(NOTEBOOKS["colab"], as_version=4))
    assert source.index('drive.mount("/content/drive")') < source.index(training_call("colab"))
    # Drive uploads in the background: the last cell waits for it before the session is left.
    assert source.rindex("drive.flush_and_unmount()") > source.index(training_call("colab"))
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}


def test_colab_notebook_hands_tracker_keys_to_the_training_cell() -> None:
    """Colab's secrets are readable only in the notebook kernel, not in the launcher's subprocess."""
    source = code(nbformat.read(NOTEBOOKS["colab"], as_version=4))
    assert source.index("os.environ[name] = userdata.get(name)") < source.index(training_call("colab"))
{%- endif %}
