"""The images task: the class folders, the augmentation, predictions on a folder of images, the shipped
data and its generator, the quality its README states, a clear message when Pillow is missing, and a
resume on an image folder changed since the checkpoint refused in one line naming the image."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.data import shapes
from {{ cookiecutter.package_name }}.data.image_folder import (
    augment,
    image_folder_splits,
    load_image,
    resolve,
    to_tensor,
)
from {{ cookiecutter.package_name }}.utils.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.utils.training.seeding import SeededItems

from ..conftest import FIGURE, PROJECT, assert_quoted, last_eval, run_predict, run_training

# Runs train.py as `python train.py` does, with Pillow hidden (None in sys.modules fails its import).
WITHOUT_PILLOW = (
    "import runpy, sys; sys.modules['PIL'] = None; sys.argv = ['train.py', *sys.argv[1:]]; "
    "runpy.run_path('train.py', run_name='__main__')"
)


def write_image(path: Path, size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path)


# --- the class folders


def test_class_folders_give_sorted_labels_and_sorted_files(tmp_path: Path) -> None:
    for split in ("train", "val"):
        write_image(tmp_path / split / "zebra" / "b.png", (32, 32))
        write_image(tmp_path / split / "zebra" / "a.jpg", (32, 32))
        write_image(tmp_path / split / "apple" / "nested" / "c.png", (32, 32))
        (tmp_path / split / "apple" / "notes.txt").write_text("not an image: skipped")
    classes, train_set, eval_set = image_folder_splits(str(tmp_path), 32, padding=0, flip=False)
    assert classes == ["apple", "zebra"]
    expected = [("apple/nested/c.png", 0), ("zebra/a.jpg", 1), ("zebra/b.png", 1)]
    for split, dataset in (("train", train_set), ("val", eval_set)):
        assert [(str(p.relative_to(tmp_path / split)), label) for p, label in dataset.samples] == expected


def resident_kb() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads open files and memory in /proc (Linux)")
def test_a_large_folder_is_decoded_batch_by_batch_never_held(tmp_path: Path) -> None:
    """3,072 images of 96 x 96, 340 MB as the model's float tensors: a shuffled pass of a DataLoader over
    the task's train set keeps at most one image file open and grows by far less than the decoded folder."""
    count, size = 3_072, 96
    for index in range(count):
        pixels = np.full((size, size, 3), index % 251, dtype=np.uint8)  # flat: small files, fast to write
        path = tmp_path / "train" / f"class{index % 4}" / f"{index:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path)
    for label in range(4):
        write_image(tmp_path / "val" / f"class{label}" / "0.png", (size, size))
    _, train_set, _ = image_folder_splits(str(tmp_path), size, padding=4, flip=True)
    loader = torch.utils.data.DataLoader(train_set, batch_size=64, shuffle=True, collate_fn=task.collate)
    open_files = len(os.listdir("/proc/self/fd"))
    before, peak, seen = resident_kb(), 0, 0
    for images, _ in loader:
        seen += len(images)
        peak = max(peak, resident_kb())
        assert len(os.listdir("/proc/self/fd")) <= open_files + 1  # + 1: listdir's own
    assert seen == count
    held = count * 3 * size * size * 4 // 1024  # the whole folder as float32 tensors, in kB
    assert peak - before < held // 4, f"memory grew by {(peak - before) // 1024} MB during one pass"


def test_any_size_and_colour_mode_becomes_a_square_rgb_image(tmp_path: Path) -> None:
    cases = [("wide.png", (48, 20), "RGBA"), ("grey.jpg", (32, 40), "L"), ("palette.png", (8, 8), "P")]
    for name, size, mode in cases:
        write_image(tmp_path / name, size, mode)
        image = load_image(tmp_path / name, 32)
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert to_tensor(image).shape == (3, 32, 32)


def test_folder_problems_are_config_errors_that_name_the_path(tmp_path: Path) -> None:
    def fails_with(message: str):
        return pytest.raises(ConfigError, match=re.escape(message))

    with fails_with(f"image folder {tmp_path / 'train'} does not exist"):
        image_folder_splits(str(tmp_path), 32, 0, False)
    write_image(tmp_path / "train" / "cat" / "1.png", (32, 32))
    write_image(tmp_path / "train" / "dog" / "1.png", (32, 32))
    write_image(tmp_path / "val" / "cat" / "1.png", (32, 32))
    with fails_with(f"{tmp_path / 'val'} has class folders ['cat'], expected the training set's ['cat', 'd"):
        image_folder_splits(str(tmp_path), 32, 0, False)
    (tmp_path / "val" / "dog").mkdir()
    with fails_with(f"class folder {tmp_path / 'val' / 'dog'} has no .png/.jpg/.jpeg images"):
        image_folder_splits(str(tmp_path), 32, 0, False)
    (tmp_path / "val" / "dog" / "1.png").write_text("not a PNG")
    _, _, eval_set = image_folder_splits(str(tmp_path), 32, 0, False)
    with fails_with(f"{tmp_path / 'val' / 'dog' / '1.png'}: not a readable PNG or JPEG image"):
        eval_set[1]  # read when asked for


def test_a_relative_data_dir_is_found_from_the_project_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve("data") == PROJECT / "data"
    train_set, eval_set = task.build_datasets(task.Config())
    assert (len(train_set), len(eval_set)) == (768, 200)  # shapes.IMAGES_PER_CLASS x 8 classes
    assert task.classes(task.Config()) == list(shapes.CLASSES)


# --- the augmentation


def test_augmentation_is_a_function_of_seed_epoch_and_index() -> None:
    """As the loader reads the train set: its items' draws seeded (utils/training/seeding.py)."""
    train_set = SeededItems(task.build_datasets(task.Config())[0], seed=0)
    train_set.set_epoch(3)
    first = [train_set[index][0] for index in range(8)]
    train_set.set_epoch(4)
    other_epoch = [train_set[index][0] for index in range(8)]
    train_set.set_epoch(3)
    again = [train_set[index][0] for index in reversed(range(8))][::-1]  # any order, same images
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert sum(torch.equal(a, b) for a, b in zip(first, other_epoch, strict=True)) <= 1
    reseeded = SeededItems(train_set.dataset, seed=1)
    reseeded.set_epoch(3)
    assert sum(torch.equal(a, reseeded[index][0]) for index, a in enumerate(first)) <= 1


def test_augmentation_is_a_crop_of_the_edge_padded_image_maybe_mirrored() -> None:
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    padded = np.pad(image, ((4, 4), (4, 4), (0, 0)), mode="edge")
    crops = [padded[top : top + 32, left : left + 32] for top in range(9) for left in range(9)]
    seen = set()
    np.random.seed(0)
    for index in range(200):
        out = augment(image, padding=4, flip=True)
        matches = [(k, False) for k, c in enumerate(crops) if np.array_equal(out, c)]
        matches += [(k, True) for k, c in enumerate(crops) if np.array_equal(out, c[:, ::-1])]
        assert len(matches) == 1, index
        seen.add(matches[0])
    assert len(seen) > 100  # many different crops and both mirrorings
    assert {mirrored for _, mirrored in seen} == {False, True}


def test_eval_images_are_not_augmented() -> None:
    _, eval_set = task.build_datasets(task.Config())
    path, label = eval_set.samples[7]
    image, got_label = eval_set[7]
    assert torch.equal(image, to_tensor(load_image(path, 32))) and got_label == label


def test_collate_stacks_images_and_labels_and_keeps_the_paths() -> None:
    config = task.Config()
    train_set, _ = task.build_datasets(config)
    images, labels = task.collate([train_set[index] for index in range(5)])
    assert images.shape == (5, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.tolist() == [train_set.samples[i][1] for i in range(5)]
    assert float(images.min()) >= -1 and float(images.max()) <= 1
    items = task.predict_inputs(config, None)[:3]
    images, labels, paths = task.collate(items)
    assert images.shape == (3, 3, 32, 32) and labels.shape == (3,)
    assert list(paths) == [item[2] for item in items]


# --- the shipped data


def test_the_generator_writes_the_shipped_files_byte_for_byte(tmp_path: Path) -> None:
    written = shapes.generate(tmp_path)
    shipped = sorted(path.relative_to(PROJECT / "data") for path in (PROJECT / "data").rglob("*.png"))
    assert sorted(path.relative_to(tmp_path) for path in written) == shipped
    assert all((tmp_path / name).read_bytes() == (PROJECT / "data" / name).read_bytes() for name in shipped)
    with Image.open(written[0]) as image:  # a real PNG, as Pillow reads it
        assert (image.size, image.mode) == ((32, 32), "P")


# --- predictions


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.slow
def test_eval_predictions_hold_the_logged_accuracy(single_run: tuple, tmp_path: Path) -> None:
    output = tmp_path / "eval.csv"
    run_predict("--model_dir", str(single_run[0] / "model"), "--output", str(output))
    rows = read_csv(output)
    assert list(rows[0])[:4] == ["index", "path", "prediction", "label"]
    assert list(rows[0])[4:] == [f"prob_{name}" for name in shapes.CLASSES]
    assert len(rows) == 200 and all(Path(row["path"]).parent.name == row["label"] for row in rows)
    accuracy = sum(row["prediction"] == row["label"] for row in rows) / len(rows)
    assert accuracy == last_eval(single_run[0])["eval/accuracy"]


@pytest.mark.slow
def test_a_folder_of_images_is_predicted_as_the_model_does(single_run: tuple, tmp_path: Path) -> None:
    model_dir = single_run[0] / "model"
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    # 5 shipped PNGs, one as a JPEG, one larger in a subfolder: 7 images, unequal shares for 2 processes.
    sources = sorted((PROJECT / "data" / "val").rglob("*.png"))[::25]  # one per class
    for number, source in enumerate(sources[:5]):
        (folder / f"{number}.png").write_bytes(source.read_bytes())
    Image.open(sources[5]).convert("RGB").save(folder / "5.jpg", quality=95)
    Image.open(sources[6]).convert("RGB").resize((64, 64)).save(folder / "sub" / "6.png")
    (folder / "notes.txt").write_text("not an image: skipped")
    paths = [*(folder / f"{number}.png" for number in range(5)), folder / "5.jpg", folder / "sub" / "6.png"]
    files = {n: tmp_path / f"{n}.csv" for n in (1, 2)}
    for processes, output in files.items():
        args = ["--model_dir", str(model_dir), "--input", str(folder), "--output", str(output)]
        run_predict(*args, "--batch_size", "2", processes=processes)
    assert files[1].read_bytes() == files[2].read_bytes()

    rows = read_csv(files[1])
    assert "label" not in rows[0]  # no labels for images of your own
    assert [row["path"] for row in rows] == [str(path) for path in paths]
    config, _ = load_config([], model_dir / "config.yaml", task.Config)
    model = task.build_model(config)
    model.load_state_dict(load_file(model_dir / "model.safetensors"))
    model.eval()
    images = torch.stack([to_tensor(load_image(path, 32)) for path in paths])
    with torch.no_grad():
        probs = model(images).softmax(dim=-1)
    assert [row["prediction"] for row in rows] == [shapes.CLASSES[k] for k in probs.argmax(dim=-1).tolist()]
    written = np.array([[float(row[f"prob_{name}"]) for name in shapes.CLASSES] for row in rows])
    assert written == pytest.approx(probs.numpy(), abs=1e-6)


@pytest.mark.slow
def test_bad_inputs_are_one_line_errors_that_name_the_file(single_run: tuple, tmp_path: Path) -> None:
    config = task.Config()
    with pytest.raises(ConfigError, match=re.escape(f"input {tmp_path / 'nowhere'} does not exist")):
        task.predict_inputs(config, tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: no .png, .jpg or .jpeg images in")):
        task.predict_inputs(config, tmp_path)
    write_image(tmp_path / "good.png", (32, 32))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    result = run_predict("--model_dir", str(single_run[0] / "model"), "--input", str(tmp_path), check=False)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / 'broken.png'}: not a readable PNG")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["notes.txt", "random.bin", "fake.png"])
def test_a_file_that_is_no_image_is_a_one_line_error_naming_it(
    single_run: tuple, tmp_path: Path, name: str
) -> None:
    source = tmp_path / name
    if name == "notes.txt":
        source.write_text("not an image\n")
    else:
        source.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8)))
    output = tmp_path / "p.csv"
    args = ["--model_dir", str(single_run[0] / "model"), "--input", str(source), "--output", str(output)]
    result = run_predict(*args, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {source}: not a readable PNG or JPEG image"), result.stderr[-2000:]
    assert not output.exists()


# --- quality and packages


@pytest.mark.slow
def test_the_default_config_reaches_the_stated_accuracy(tmp_path: Path) -> None:
    """README and docs/task.md: configs/local.yaml, 480 optimizer steps, the eval accuracy and loss they
    quote: inside the range measured over CPUs, thread counts and kernels (seeded: the same on every run of
    one)."""
    output_dir = tmp_path / "run"
    result = run_training(output_dir)
    assert "done: 480 optimizer steps" in result.stdout
    final = last_eval(output_dir)
    assert_quoted(final["eval/accuracy"], rf"eval accuracy \**{FIGURE}")
    assert_quoted(final["eval/loss"], rf"eval\s+loss\s+\**{FIGURE}")


def test_missing_pillow_names_the_package_and_the_pip_command(tmp_path: Path) -> None:
    command = [sys.executable, "-c", WITHOUT_PILLOW, "--output_dir", str(tmp_path / "run")]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("this task needs pillow>=9, which is not installed: pip install -e ."), (
        result.stderr[-2000:]
    )
    assert not (tmp_path / "run").exists()  # stopped before anything was written


@pytest.mark.slow
def test_an_image_replaced_between_sessions_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    """The data fingerprint of an image folder (run/fingerprint.py: the files of its (path, label) list)."""
    data, output_dir = tmp_path / "data", tmp_path / "run"
    shutil.copytree(PROJECT / "data", data)
    args = ["--data_dir", str(data), "--max_steps", "2", "--checkpoint_every", "2", "--log_every", "1"]
    run_training(output_dir, *args)
    before = {path: path.read_bytes() for path in output_dir.rglob("*") if path.is_file()}
    shutil.copy(data / "train" / "circle" / "001.png", data / "train" / "circle" / "000.png")
    result = run_training(output_dir, *args, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: checkpoint ") and "--start_over true" in line
    assert "trained on other data: train circle/000.png differs" in line
    after = {path: path.read_bytes() for path in output_dir.rglob("*") if path.is_file()}
    assert {path: data for path, data in after.items() if path.name != ".lock"} == {
        path: data for path, data in before.items() if path.name != ".lock"
    }
