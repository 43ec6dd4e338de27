"""The text task: the quality its README states, a deterministic tokenizer and split, predictions from a text
file, and clear messages when transformers is missing or a pretrained checkpoint cannot be had offline."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.data.texts import SPECIAL_TOKENS
from {{ cookiecutter.package_name }}.utils.config import ConfigError, load_config

from ..conftest import (
    FIGURE,
    PROJECT,
    assert_quoted,
    free_port,
    last_eval,
    read_metrics,
    run_predict,
    run_training,
)
from ..task_settings import save_pretrained_model

# Runs train.py as `python train.py` does, with transformers hidden (None in sys.modules fails its import).
WITHOUT_TRANSFORMERS = (
    "import runpy, sys; sys.modules['transformers'] = None; sys.argv = ['train.py', *sys.argv[1:]]; "
    "runpy.run_path('train.py', run_name='__main__')"
)
ONE_PER_LINE = "a UTF-8 text file with one text per line"  # what a bad input file's message asks for
TEXTS = [
    "What work's, my countrymen, in hand? where go you With bats and clubs?",
    "But, soft! what light through yonder window breaks?",
    "Now is the winter of our discontent Made glorious summer by this sun of York;",
    "Be absolute for death; either death or life Shall thereby be the sweeter.",
    "A line with wordsnobodyhasseen and unknownwords",
]


def config_in_project(*flags: str, path: Path = PROJECT / "configs" / "local.yaml") -> task.Config:
    """A config as train.py loads it in the project folder (the tests may run from another directory)."""
    config, _ = load_config([*flags], path, task.Config)
    config.data_file = str(PROJECT / config.data_file)
    return config


@pytest.mark.slow
def test_the_default_config_reaches_the_stated_accuracy(tmp_path: Path) -> None:
    """README and docs/task.md: configs/local.yaml, 315 optimizer steps, the eval accuracy and loss they quote
    and the best accuracy and its step (seeded: the same on every run of a CPU, with one thread as CI runs);
    chance is 0.25."""
    output_dir = tmp_path / "run"
    result = run_training(output_dir)
    assert "done: 315 optimizer steps" in result.stdout
    final = last_eval(output_dir)
    assert_quoted(final["eval/accuracy"], rf"eval accuracy \**{FIGURE}")
    assert_quoted(final["eval/loss"], rf"eval\s+loss\s+\**{FIGURE}")
    evaluations = [row for row in read_metrics(output_dir) if "eval/accuracy" in row]
    best = max(evaluations, key=lambda row: row["eval/accuracy"])  # the first of the best, as best_model/
    assert_quoted(best["eval/accuracy"], rf"best {FIGURE} at step")
    assert_quoted(best["step"], r"best [\d. to]+ at step (\d+)")


def test_the_tokenizer_is_rebuilt_identically() -> None:
    config = config_in_project()
    _, eval_, _ = task.read_splits(config)
    first, second = (task.build_tokenizer(config) for _ in range(2))
    assert first.get_vocab() == second.get_vocab()
    texts = [text for text, _ in eval_[:50]] + TEXTS
    assert first(texts)["input_ids"] == second(texts)["input_ids"]
    ids = first(TEXTS[1])["input_ids"]
    assert first.convert_ids_to_tokens(ids)[:4] == ["[CLS]", "but", ",", "soft"]
    assert ids[-1] == first.sep_token_id
    assert first.unk_token_id in first(TEXTS[-1])["input_ids"]  # words never seen in training


def test_vocab_size_must_leave_room_for_a_word_after_the_special_tokens() -> None:
    # task.py states their number without importing data/texts.py (which loads torch and transformers).
    with pytest.raises(ConfigError, match=rf"vocab_size={len(SPECIAL_TOKENS)} is invalid"):
        config_in_project("--vocab_size", str(len(SPECIAL_TOKENS)))
    config_in_project("--vocab_size", str(len(SPECIAL_TOKENS) + 1))


def test_the_split_depends_only_on_the_seed() -> None:
    config = config_in_project()
    train, eval_, labels = task.read_splits(config)
    assert task.read_splits(config) == (train, eval_, labels)
    assert labels == ["DUKE VINCENTIO", "GLOUCESTER", "MENENIUS", "ROMEO"]
    assert len(train) + len(eval_) == 1690 and len(eval_) == 338
    other_train, _, _ = task.read_splits(config_in_project("--seed", "7"))
    assert sorted(other_train) != sorted(train)


def test_collate_pads_to_the_longest_text_and_keeps_the_labels() -> None:
    train_set, _ = task.build_datasets(config_in_project())
    samples = [train_set[i] for i in range(5)]
    batch = task.collate(samples)
    longest = max(len(sample["input_ids"]) for sample in samples)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (5, longest)
    assert batch["labels"].tolist() == [sample["labels"] for sample in samples]
    assert batch["attention_mask"].sum(dim=1).tolist() == [len(sample["input_ids"]) for sample in samples]
    # The padding is [PAD], id 0, on the right; a cut micro-batch drops the columns that are all padding.
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()
    shortest = min(range(5), key=lambda i: len(samples[i]["input_ids"]))
    alone = task.without_padding_columns({k: v[shortest : shortest + 1] for k, v in batch.items()})
    assert torch.equal(alone["input_ids"], torch.tensor([samples[shortest]["input_ids"]]))


@pytest.mark.slow
def test_predict_on_a_text_file_writes_what_the_model_predicts(single_run: tuple, tmp_path: Path) -> None:
    model_dir = single_run[0] / "model"
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(TEXTS) + "\n")
    output = tmp_path / "predictions.csv"
    run_predict("--model_dir", str(model_dir), "--input", str(source), "--output", str(output))
    with output.open(newline="") as file:
        rows = list(csv.DictReader(file))

    config = config_in_project(path=model_dir / "config.yaml")
    model = task.build_model(config)
    model.load_state_dict(load_file(model_dir / "model.safetensors"))
    model.eval()
    with torch.no_grad():
        batch = task.collate(list(task.predict_inputs(config, source)))
        assert batch.pop("text") == TEXTS
        probs = model(**batch).logits.softmax(dim=-1)
    labels = ["DUKE VINCENTIO", "GLOUCESTER", "MENENIUS", "ROMEO"]
    assert [row["index"] for row in rows] == ["0", "1", "2", "3", "4"]  # one row per line, in order
    assert [row["text"] for row in rows] == TEXTS  # the input, as written
    # No label column: the file has none.
    assert list(rows[0]) == ["index", "text", "prediction", *[f"prob_{label}" for label in labels]]
    assert [row["prediction"] for row in rows] == [labels[i] for i in probs.argmax(dim=-1).tolist()]
    written = [float(row[f"prob_{label}"]) for row in rows for label in labels]
    assert written == pytest.approx(probs.flatten().tolist(), abs=1e-6)


@pytest.mark.slow
def test_predict_on_the_eval_split_gives_the_logged_accuracy(single_run: tuple, tmp_path: Path) -> None:
    output = tmp_path / "eval.csv"
    run_predict("--model_dir", str(single_run[0] / "model"), "--output", str(output))
    with output.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 338
    accuracy = sum(row["prediction"] == row["label"] for row in rows) / len(rows)
    assert accuracy == last_eval(single_run[0])["eval/accuracy"]
    _, eval_examples, _ = task.read_splits(config_in_project(path=single_run[0] / "model" / "config.yaml"))
    assert [(row["text"], row["label"]) for row in rows] == eval_examples  # each row's input, in order


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "input file {path} does not exist"),
        ("", "{path}: the file is empty; expected one text per line"),
        ("a text\n\nanother\n", "{path}:2: empty line; expected one text per line"),
        (
            b"caf\xe9\n",
            "{path}: not UTF-8 text (invalid continuation byte at byte 3); expected " + ONE_PER_LINE,
        ),
        (
            b"a text\nab\x00cd\n",
            "{path}:2: a NUL byte, so a binary file; expected " + ONE_PER_LINE,
        ),
        ("folder", "input {path} is a folder; expected " + ONE_PER_LINE),
    ],
    ids=["missing", "empty", "blank-line", "latin-1", "nul", "folder"],
)
def test_a_bad_input_file_names_the_file_and_the_problem(
    tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    path = tmp_path / "texts.txt"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as error:
        task.predict_inputs(config_in_project(), path)
    assert str(error.value) == message.format(path=path)


@pytest.mark.slow
def test_predict_py_reports_a_bad_input_in_one_line(single_run: tuple, tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    result = run_predict("--model_dir", str(single_run[0] / "model"), "--input", str(missing), check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: input file {missing} does not exist"


@pytest.mark.slow
def test_predict_py_reports_a_binary_input_in_one_line(single_run: tuple, tmp_path: Path) -> None:
    source = tmp_path / "texts.png"
    source.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    output = tmp_path / "p.csv"
    args = ["--model_dir", str(single_run[0] / "model"), "--input", str(source), "--output", str(output)]
    result = run_predict(*args, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    expected = f"error: {source}: not UTF-8 text (invalid start byte at byte 0); expected {ONE_PER_LINE}"
    assert result.stderr.strip().splitlines()[-1] == expected
    assert not output.exists()


def test_missing_transformers_names_the_package_and_the_pip_command(tmp_path: Path) -> None:
    command = [sys.executable, "-c", WITHOUT_TRANSFORMERS, "--output_dir", str(tmp_path / "run")]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        "this task needs transformers>=4.46, which is not installed: pip install -e ."
    ), result.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # stopped before anything was written


def test_a_pretrained_model_loads_its_weights_tokenizer_new_labels_and_dropout(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    save_pretrained_model(folder)
    config = config_in_project("--pretrained_model", str(folder), "--dropout", "0.25")
    model = task.build_model(config)
    assert model.config.hidden_dropout_prob == model.config.attention_probs_dropout_prob == 0.25
    assert model.config.id2label == {0: "DUKE VINCENTIO", 1: "GLOUCESTER", 2: "MENENIUS", 3: "ROMEO"}
    saved = load_file(folder / "model.safetensors")
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())
    loaded, built = task.build_tokenizer(config), task.build_tokenizer(config_in_project())
    assert loaded(TEXTS)["input_ids"] == built(TEXTS)["input_ids"]


@pytest.mark.slow
def test_a_pretrained_model_trains_and_predicts(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    save_pretrained_model(folder)
    output_dir = tmp_path / "run"
    result = run_training(output_dir, "--pretrained_model", str(folder), "--max_steps", "5")
    assert "done: 5 optimizer steps" in result.stdout
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(TEXTS))
    output = tmp_path / "predictions.csv"
    run_predict("--model_dir", str(output_dir / "model"), "--input", str(source), "--output", str(output))
    assert len(output.read_text().splitlines()) == 1 + len(TEXTS)


def test_a_pretrained_model_that_cannot_be_downloaded_fails_clearly(tmp_path: Path) -> None:
    """The Hub out of reach (this machine's network) and an empty cache: one line that names the checkpoint
    and says what to do, instead of a traceback or a minute of retries (the project goes offline at once,
    HF_HUB_OFFLINE, when the Hub's host does not answer)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # A Hub that does not answer on any machine, this test's own included: a closed port here.
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    command = [sys.executable, "train.py", "--config", "configs/local.yaml", "--pretrained_model"]
    command += ["bert-base-uncased", "--output_dir", str(tmp_path / "run")]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("config error: pretrained_model='bert-base-uncased' could not be loaded ("), (
        result.stderr[-2000:]
    )
    assert "needs the network" in last_line
    assert "the Hub cannot be reached from here, and it is not in the local cache" in last_line
