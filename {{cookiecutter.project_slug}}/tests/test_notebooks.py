"""notebooks/: valid Jupyter files without outputs that run the platform's launcher and show its results."""

from __future__ import annotations

import nbformat
import pytest
import yaml

from .conftest import PROJECT

NOTEBOOKS = {"colab": PROJECT / "notebooks" / "colab.ipynb", "kaggle": PROJECT / "notebooks" / "kaggle.ipynb"}


def code(notebook: nbformat.NotebookNode) -> str:
    return "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")


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
    """It runs `!bash scripts/run_<platform>.sh` (a script that exists) and shows metrics.jsonl and the
    exported model from the output_dir of configs/<platform>.yaml, so the two cannot drift apart."""
    source = code(nbformat.read(NOTEBOOKS[platform], as_version=4))
    assert f"!bash scripts/run_{platform}.sh" in source
    assert (PROJECT / "scripts" / f"run_{platform}.sh").is_file()
    config = yaml.safe_load((PROJECT / "configs" / f"{platform}.yaml").read_text())
    # Colab's run lives on Drive as mirror_dir (output_dir is the session's disk): show the copy that stays.
    output_dir = (config.get("mirror_dir") or config["output_dir"]).rstrip("/")
    assert f"{output_dir}/metrics.jsonl" in source
    assert f"{output_dir}/model" in source


def test_colab_notebook_mounts_drive_before_training() -> None:
    """configs/colab.yaml writes to Google Drive, so Drive is mounted in a cell before the launcher's."""
    source = code(nbformat.read(NOTEBOOKS["colab"], as_version=4))
    assert source.index('drive.mount("/content/drive")') < source.index("!bash scripts/run_colab.sh")
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}


def test_colab_notebook_hands_tracker_keys_to_the_training_cell() -> None:
    """Colab's secrets are readable only in the notebook kernel, not in the launcher's subprocess."""
    source = code(nbformat.read(NOTEBOOKS["colab"], as_version=4))
    assert source.index("os.environ[name] = userdata.get(name)") < source.index("!bash scripts/run_colab.sh")
{%- endif %}
