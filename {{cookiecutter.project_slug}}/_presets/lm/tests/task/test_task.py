"""The lm task: the quality its README states, deterministic data, a causal model, and sampled text that
depends only on the model, the seed and the prompt's index."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.data.chars import TrainWindows, load_corpus
from {{ cookiecutter.package_name }}.utils.config import load_config

from ..conftest import (
    FIGURE,
    MODEL,
    QUICK,
    assert_quoted,
    assert_same_run,
    last_eval,
    read_metrics,
    run_predict,
    run_training,
)


@pytest.mark.slow
def test_the_default_config_reaches_the_stated_loss(tmp_path: Path) -> None:
    """README and docs/task.md: configs/local.yaml, 2 epochs of 245 optimizer steps, the eval loss and
    perplexity they quote (seeded: the same on every run of a CPU, with one thread as CI runs). Uniform
    guessing over the 65 characters would be ln(65) = 4.17."""
    output_dir = tmp_path / "run"
    result = run_training(output_dir)
    assert "done: 490 optimizer steps" in result.stdout
    final = last_eval(output_dir)
    assert_quoted(final["eval/loss"], rf"eval\s+loss\s+\**{FIGURE}")
    assert_quoted(final["eval/perplexity"], rf"perplexity\s+\**{FIGURE}")
    assert final["eval/perplexity"] == pytest.approx(math.exp(final["eval/loss"]))


def test_vocabulary_is_the_sorted_characters_of_the_text(tmp_path: Path) -> None:
    config = task.Config()
    text = task.data_path(config).read_text(encoding="utf-8")
    corpus = task.corpus(config)
    assert corpus.tokenizer.chars == "".join(sorted(set(text))) and corpus.tokenizer.size == 65
    assert corpus.tokenizer.decode(corpus.ids) == text
    # Rebuilt from a copy of the file (another process, another machine): the same ids.
    copy = tmp_path / "copy.txt"
    shutil.copyfile(task.data_path(config), copy)
    again = load_corpus(copy)
    assert again.tokenizer.digest == corpus.tokenizer.digest and torch.equal(again.ids, corpus.ids)


def offsets(windows: TrainWindows, epochs: range) -> list[int]:
    """Where each epoch's tiling of the training text starts."""
    found = []
    for epoch in epochs:
        windows.set_epoch(epoch)
        found.append(windows.offset)
    return found


def test_train_windows_are_a_function_of_seed_epoch_and_index() -> None:
    config = task.Config()
    first, _ = task.build_datasets(config)
    second, _ = task.build_datasets(config)
    train_ids = task.corpus(config).ids[:1_003_854]  # the first 90% of the text
    assert len(first) == 15_684  # (1,003,854 - 1) // 64 - 1, for every epoch
    indices = [0, 7, 4_000, len(first) - 1]
    for epoch in (0, 5):
        first.set_epoch(epoch)
        second.set_epoch(9)  # whatever came before, and in whatever order items are read
        second.set_epoch(epoch)
        expected = [first[i] for i in indices]
        assert all(torch.equal(expected[k], second[i]) for k, i in reversed(list(enumerate(indices))))
        for index, window in zip(indices, expected, strict=True):
            start = index * config.block_size + first.offset  # consecutive characters of the text
            assert torch.equal(window, train_ids[start : start + config.block_size + 1])
    # The tiling shifts between epochs, by 0..63 characters drawn from (seed, epoch), and with the seed.
    assert len(set(offsets(first, range(8)))) > 1
    other, _ = task.build_datasets(task.Config(seed=config.seed + 1))
    assert offsets(other, range(8)) != offsets(first, range(8))
    assert offsets(first, range(8)) == offsets(second, range(8))


def test_eval_windows_are_fixed_disjoint_and_spread_over_the_held_out_text() -> None:
    config = task.Config()
    _, eval_set = task.build_datasets(config)
    assert len(eval_set) == config.eval_windows == 500
    starts = eval_set.starts
    assert all(b - a >= config.block_size + 1 for a, b in itertools.pairwise(starts))
    held_out = len(task.corpus(config).ids) - int(len(task.corpus(config).ids) * 0.9)
    assert starts[0] == 0 and held_out - starts[-1] < 5 * (config.block_size + 1)
    _, everything = task.build_datasets(task.Config(eval_windows=0))
    assert len(everything) == held_out // (config.block_size + 1)  # 1,716 windows


def test_the_model_is_causal() -> None:
    """Changing a character changes no prediction made before it: no position sees its future."""
    torch.manual_seed(0)
    model = task.build_model(task.Config()).eval()
    tokens = torch.randint(0, 65, (2, 64))
    changed = tokens.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 65
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :40], before[:, :40], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, 40:], before[:, 40:])


def test_an_embedding_that_the_heads_cannot_share_is_refused() -> None:
    with pytest.raises(ValueError, match="embed_dim=100 must be divisible by num_heads=3"):
        task.build_model(task.Config(embed_dim=100, num_heads=3))


def sample_in_process(model_dir: Path, prompts: list[str], *overrides: str) -> list[str]:
    """The completions of task.predict in this process, one prompt per batch, with one thread as the
    predict.py runs below (a thread count changes how matrix products are summed)."""
    config, _ = load_config(list(overrides), model_dir / "config.yaml", task.Config)
    model = task.build_model(config)
    model.load_state_dict(load_file(model_dir / "model.safetensors"))
    model.eval()
    tokenizer = task.corpus(config).tokenizer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return [
                task.predict(model, task.collate([{"index": i, "prompt": tokenizer.encode(p)}]), config)[0][
                    "completion"
                ]
                for i, p in enumerate(prompts)
            ]
    finally:
        torch.set_num_threads(threads)


PROMPTS = ["ROMEO:", "", "First Citizen:\nWe are accounted poor", "To be, or not to be" * 5, "KING", "O"]


@pytest.mark.slow
def test_predict_completes_each_prompt_as_the_model_does_in_process(
    single_run: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model_dir = single_run[0] / "model"
    source = tmp_path / "prompts.txt"
    source.write_text("\n".join(PROMPTS) + "\n")  # a line per prompt: "\n" in one splits it in two
    lines = [line for line in "\n".join(PROMPTS).splitlines() if line]  # empty lines are skipped
    output = tmp_path / "out.jsonl"
    args = ["--model_dir", str(model_dir), "--input", str(source), "--output", str(output)]
    run_predict(*args, "--format", "jsonl", "--batch_size", "4", "--sample_chars", "40")
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(lines)))
    assert [row["prompt"] for row in rows] == lines
    assert all(set(row) == {"index", "prompt", "completion"} for row in rows)
    assert all(len(row["completion"]) == 40 for row in rows)
    # The same text in this process, one prompt per batch: it depends on neither the batch nor the run.
    assert [row["completion"] for row in rows] == sample_in_process(model_dir, lines, "--sample_chars", "40")


@pytest.mark.slow
def test_eval_prompts_come_with_the_true_continuation(single_run: tuple, tmp_path: Path) -> None:
    model_dir = single_run[0] / "model"
    output = tmp_path / "eval.jsonl"
    args = ["--model_dir", str(model_dir), "--output", str(output), "--format", "jsonl"]
    run_predict(*args, "--sample_chars", "9")
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == task.NUM_EVAL_PROMPTS
    held_out = task.data_path(task.Config()).read_text()[1_003_854:]
    for row in rows:
        assert len(row["prompt"]) == 64 and len(row["completion"]) == len(row["true_continuation"]) == 9
        assert f"\n{row['prompt']}{row['true_continuation']}" in held_out  # cut at a line start


@pytest.mark.slow
def test_one_and_two_processes_write_the_same_completions(
    single_run: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5 prompts in batches of 2: 3 batches, 2 for one process and 1 for the other."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same kernels in both: a thread count changes sums
    source = tmp_path / "prompts.txt"
    source.write_text("ROMEO:\nJULIET:\nKING RICHARD III:\nWhat\nO, \n")
    files = {n: tmp_path / f"{n}.csv" for n in (1, 2)}
    for processes, output in files.items():
        args = ["--model_dir", str(single_run[0] / "model"), "--input", str(source), "--output", str(output)]
        result = run_predict(*args, "--batch_size", "2", "--sample_chars", "60", processes=processes)
        assert f"world size {processes}" in result.stdout
    assert files[1].read_bytes() == files[2].read_bytes()


@pytest.mark.slow
def test_unknown_character_names_file_line_and_character(single_run: tuple, tmp_path: Path) -> None:
    source = tmp_path / "prompts.txt"
    source.write_text("ROMEO:\n\nJuliet, ma chère\n")
    result = run_predict("--model_dir", str(single_run[0] / "model"), "--input", str(source), check=False)
    assert result.returncode == 1
    expected = f"error: {source}:3: character 'è' (column 14) is not in the vocabulary (the characters of "
    assert result.stderr.strip().splitlines()[-1].startswith(expected), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("content", ["binary", "folder", "empty"])
def test_a_bad_prompt_file_is_a_one_line_error_naming_it(
    single_run: tuple, tmp_path: Path, content: str
) -> None:
    source = tmp_path / "prompts.txt"
    expected = {
        "binary": f"{source}: not UTF-8 text (invalid start byte at byte 0); expected a UTF-8 text file",
        "folder": f"cannot read input file {source}: Is a directory",
        "empty": f"{source}: no prompts; expected a UTF-8 text file with one prompt per line",
    }[content]
    if content == "binary":
        source.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    elif content == "folder":
        source.mkdir()
    else:
        source.write_text("\n\n")
    output = tmp_path / "p.csv"
    args = ["--model_dir", str(single_run[0] / "model"), "--input", str(source), "--output", str(output)]
    result = run_predict(*args, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {expected}"), result.stderr[-2000:]
    assert not output.exists()


@pytest.mark.slow
def test_sampling_settings_change_without_refusing_the_checkpoint(single_run: tuple, tmp_path: Path) -> None:
    """sample_chars, temperature and top_k are session fields: a run with other values still resumes."""
    output_dir = tmp_path / "run"
    shutil.copytree(single_run[0], output_dir)
    result = run_training(output_dir, *QUICK, "--temperature", "0.5", "--top_k", "10", "--sample_chars", "9")
    assert "resuming from" in result.stdout
    # Greedy decoding (temperature 0) from the same model is one fixed text.
    source = tmp_path / "prompts.txt"
    source.write_text("ROMEO:\n")
    texts = []
    for seed in ("1", "2"):  # the seed only matters when drawing
        output = tmp_path / f"greedy{seed}.csv"
        args = ["--input", str(source), "--output", str(output), "--temperature", "0", "--seed", seed]
        run_predict("--model_dir", str(output_dir / "model"), *args)
        texts.append(output.read_text())
    assert texts[0] == texts[1]


@pytest.mark.slow
def test_tied_embeddings_resume_and_export_exactly(tmp_path: Path) -> None:
    """The head sharing the token embedding's tensor: the checkpoints and model.safetensors hold it under
    one name (safetensors refuses two names of one tensor); a run continued from a checkpoint ends bitwise
    as the uninterrupted one, and predict.py loads the export with the two weights still one tensor."""
    args = ["--tie_embeddings", "true", "--checkpoint_every", "5", "--log_every", "2", *MODEL]
    run_training(tmp_path / "reference", *args, "--max_steps", "12")
    output_dir = tmp_path / "run"
    run_training(output_dir, *args, "--max_steps", "7")
    resumed = run_training(output_dir, *args, "--max_steps", "12")
    assert f"resuming from {output_dir / 'checkpoints' / 'step_00000007'}" in resumed.stdout
    assert "shared tensor" not in resumed.stdout + resumed.stderr
    assert_same_run(output_dir, tmp_path / "reference")
    names = set(load_file(output_dir / "model" / "model.safetensors"))
    assert "token_embedding.weight" in names and "head.weight" not in names
    outputs = [tmp_path / f"{name}.csv" for name in ("reference", "run")]
    for name, output in zip(("reference", "run"), outputs, strict=True):
        run_predict("--model_dir", str(tmp_path / name / "model"), "--output", str(output))
    assert outputs[0].read_bytes() == outputs[1].read_bytes()


# A sitecustomize that makes a few optimizer steps take a learning rate far too high.
SPIKE_HOOK = Path(__file__).parent / "spike_hook"


@pytest.mark.slow
def test_a_loss_spike_from_a_learning_rate_too_high_is_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Optimizer steps 21 and 22 of the process take 300 times the learning rate: the loss logged at step 22
    is over loss_spike_factor 3 times the median of the 5 logged before, the run goes back to its checkpoint
    of step 20, skips that data and trains on to a loss below the one before the spike."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SPIKE_HOOK), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SPIKE_CALLS", "21-22")
    monkeypatch.setenv("SPIKE_LR_FACTOR", "300")
    args = ["--max_steps", "40", "--log_every", "2", "--checkpoint_every", "10", "--max_time_lost", ""]
    args += ["--loss_spike_factor", "3"]
    result = run_training(tmp_path / "run", *args, *MODEL)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("rollback ")]
    assert line.startswith("rollback 1 of 3 at step 22: the train loss of steps up to 22 is "), line
    assert "over 3 x " in line and "back to step 20, skipping data batches 20 to 31" in line, line
    losses = {row["step"]: row["train/loss"] for row in read_metrics(tmp_path / "run") if "train/loss" in row}
    assert max(losses.values()) == losses[2] and losses[40] < losses[20], losses
