"""predict.py on the exported model: complete, ordered, and the same file from 1 and 2 processes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.data.digits import DATA_FILE, NUM_FEATURES
from {{ cookiecutter.package_name }}.utils.config import ConfigError, load_config

from ..conftest import last_eval, run_predict

pytestmark = pytest.mark.slow

EVAL_SIZE = 359  # 20% of 1,797 digits: odd, so 2 processes get unequal shares


def first_images(count: int) -> np.ndarray:
    """The pixels (0..16) of the first `count` images of the shipped data."""
    return np.loadtxt(DATA_FILE, delimiter=",", max_rows=count)[:, :NUM_FEATURES]


def read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    header, *rows = path.read_text().splitlines()
    return header.split(","), [row.split(",") for row in rows]


@pytest.fixture(scope="module")
def eval_predictions(single_run: tuple, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The eval split predicted by 1 and by 2 processes, in batches of 16: 23 batches, split 12 + 11."""
    model_dir = single_run[0] / "model"
    out = tmp_path_factory.mktemp("predict")
    files = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # the same kernels in both: a thread count changes sums
        for processes in (1, 2):
            files[processes] = out / f"{processes}.csv"
            args = ["--model_dir", str(model_dir), "--output", str(files[processes]), "--batch_size", "16"]
            result = run_predict(*args, processes=processes)
            assert f"world size {processes}" in result.stdout  # 2 processes really formed one group
    return files


def test_one_and_two_processes_write_the_same_file(eval_predictions: dict[int, Path]) -> None:
    assert eval_predictions[1].read_bytes() == eval_predictions[2].read_bytes()


def test_every_eval_item_once_in_order(eval_predictions: dict[int, Path]) -> None:
    header, rows = read_csv(eval_predictions[2])
    assert header == ["index", "prediction", "label", "line"] + [f"prob_{k}" for k in range(10)]
    assert [int(row[0]) for row in rows] == list(range(EVAL_SIZE))
    lines = DATA_FILE.read_text().splitlines()
    for row in rows:
        probs = [float(p) for p in row[4:]]
        assert sum(probs) == pytest.approx(1.0, abs=1e-5)
        assert int(row[1]) == int(np.argmax(probs))
        assert lines[int(row[3]) - 1].rsplit(",", 1)[1] == row[2]  # the line holds the image and its label


def test_accuracy_from_file_is_the_logged_one(single_run: tuple, eval_predictions: dict[int, Path]) -> None:
    _, rows = read_csv(eval_predictions[1])
    accuracy = sum(row[1] == row[2] for row in rows) / len(rows)
    assert accuracy == last_eval(single_run[0])["eval/accuracy"]


def test_jsonl_has_the_csv_values(single_run: tuple, eval_predictions: dict[int, Path]) -> None:
    model_dir = single_run[0] / "model"
    run_predict("--model_dir", str(model_dir), "--format", "jsonl", "--batch_size", "16")
    lines = (single_run[0] / "predictions.jsonl").read_text().splitlines()  # the default output
    header, rows = read_csv(eval_predictions[1])
    assert [json.loads(line) for line in lines] == [
        {name: json.loads(value) for name, value in zip(header, row, strict=True)} for row in rows
    ]


def test_input_file_matches_the_model_in_process(single_run: tuple, tmp_path: Path) -> None:
    model_dir = single_run[0] / "model"
    pixels = first_images(7)  # 7 rows: 2 processes get unequal shares
    source = tmp_path / "pixels.csv"
    np.savetxt(source, pixels, fmt="%d", delimiter=",")
    files = {n: tmp_path / f"{n}.csv" for n in (1, 2)}
    for processes, output in files.items():
        args = ["--model_dir", str(model_dir), "--input", str(source), "--output", str(output)]
        run_predict(*args, "--batch_size", "2", processes=processes)
    assert files[1].read_bytes() == files[2].read_bytes()

    header, rows = read_csv(files[2])
    assert header[:2] == ["index", "prediction"] and "label" not in header  # no labels in the input
    config, _ = load_config([], model_dir / "config.yaml", task.Config)
    model = task.build_model(config)
    model.load_state_dict(load_file(model_dir / "model.safetensors"))
    model.eval()
    with torch.no_grad():
        probs = model(torch.tensor(pixels / 16.0, dtype=torch.float32)).softmax(dim=-1)
    assert [int(row[1]) for row in rows] == probs.argmax(dim=-1).tolist()
    written = np.array([[float(p) for p in row[2:]] for row in rows])
    assert written == pytest.approx(probs.numpy(), abs=1e-6)


def test_bad_row_names_file_and_line(single_run: tuple, tmp_path: Path) -> None:
    source = tmp_path / "bad.csv"
    good = ",".join(["0"] * 64)
    source.write_text(f"{good}\n{good}\n{','.join(['0'] * 63)}\n")
    result = run_predict("--model_dir", str(single_run[0] / "model"), "--input", str(source), check=False)
    assert result.returncode != 0
    assert f"{source}:3: expected 64 comma-separated pixel values, got 63" in result.stderr


def assert_one_line_error(result: subprocess.CompletedProcess[str], start: str) -> None:
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {start}"), result.stderr[-2000:]


def test_a_binary_input_names_the_file_and_the_expected_format(single_run: tuple, tmp_path: Path) -> None:
    source = tmp_path / "digits.png"
    source.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    result = run_predict("--model_dir", str(single_run[0] / "model"), "--input", str(source), check=False)
    assert_one_line_error(
        result, f"{source}: not a text file (byte 0x89 at offset 0 is not UTF-8); expected a CSV"
    )
    assert "64 comma-separated pixel values" in result.stderr


def test_a_malformed_first_row_is_an_error_not_a_header(single_run: tuple, tmp_path: Path) -> None:
    """A header-less file of 5 rows whose first row has a bad cell: refused, naming line 1, rather than
    4 predictions whose indices are all one row off."""
    rows = [",".join(str(int(v)) for v in pixels) for pixels in first_images(5)]
    rows[0] = rows[0].replace("0", "O", 1)  # a letter O typed for a zero
    source = tmp_path / "pixels.csv"
    source.write_text("\n".join(rows) + "\n")
    output = tmp_path / "p.csv"
    args = ["--model_dir", str(single_run[0] / "model"), "--input", str(source), "--output", str(output)]
    result = run_predict(*args, check=False)
    assert_one_line_error(result, f"{source}:1: not a number in 'O,")
    assert not output.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("\n\n", "{path}: no rows of pixel values; expected a CSV file of 64"),
        ("1,2,x\n", "{path}:1: not a number in '1,2,x'"),
        ("pixel_0,pixel_1\n", "{path}:1: not a number in 'pixel_0,pixel_1'"),  # no header: a bad row
        (",".join(["0"] * 63) + "\n", "{path}:1: expected 64 comma-separated pixel values, got 63"),
        (b"\xff\xfe0,1\n", "{path}: not a text file (byte 0xff at offset 0 is not UTF-8); expected a CSV"),
        (None, "input {path} is a folder; expected a CSV file of 64"),
    ],
    ids=["blank", "bad-first-row", "header", "short-first-row", "utf-16", "folder"],
)
def test_read_pixels_names_the_file_and_the_problem(
    tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    path = tmp_path / "pixels.csv"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError, match="^" + re.escape(message.format(path=path))):
        task.read_pixels(path)


def test_read_pixels_skips_blank_lines_and_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "pixels.csv"
    path.write_text("\ufeff" + ",".join(["16"] * 64) + "\n\n" + ",".join(["0"] * 64) + "\n")
    assert task.read_pixels(path).tolist() == [[1.0] * 64, [0.0] * 64]
