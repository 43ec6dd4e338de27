"""Token shards (python -m <package>.prepare, then data_file: the folder): what they hold, bad data, and the
guarantees of test_guarantees.py on the shard path, with 3 shards of a small corpus:

- kill -9 and SIGTERM mid-epoch, each resume crossing an epoch boundary, then the same command: bitwise
  equal to a run never stopped;
- 1 and 2 processes end at the same eval metrics (dropout 0.1), the 2-process run continued mid-epoch by
  1 process (a hop 2 -> 1);
- shards prepared again from another text (another vocabulary, or the same characters in another order)
  stop a resume with one line naming the vocabulary or the first shard that differs, before anything is
  written; start_over sets the run aside and starts over on them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.data.chars import WindowOrder
from {{ cookiecutter.package_name }}.prepare import SEPARATOR
from {{ cookiecutter.package_name }}.prepare import main as prepare
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import list_checkpoints
from {{ cookiecutter.package_name }}.utils.config import ConfigError
from {{ cookiecutter.package_name }}.utils.run.run_dir import LOCK_FILE
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from ..conftest import (
    PROJECT,
    assert_same_run,
    read_metrics,
    run_training,
    start_training,
    wait_for_checkpoint,
    wait_for_training,
)

SHAKESPEARE = PROJECT / "data" / "tinyshakespeare.txt"
# 28,000 characters in shards of 10,000 tokens: 3 shards. The first 25,200 train: 392 windows of 64, an
# epoch of 6 optimizer steps of 64 windows. The held-out 2,800 give 43 eval windows.
SMALL_TEXT, STEPS_PER_EPOCH = 28_000, 6
# 3 epochs (18 steps) of a smaller model than the task's, checkpoints every 4 steps, evaluations every 5.
RUN = [*["--num_epochs", "3", "--num_layers", "2", "--embed_dim", "64", "--eval_windows", "0"]]
RUN += ["--log_every", "1", "--checkpoint_every", "4", "--eval_every", "5"]


def prepare_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.prepare", *args]
    return subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)


def one_line_error(result: subprocess.CompletedProcess[str], *parts: str) -> str:
    assert result.returncode == 1, (
        f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(("error: ", "config error: ")), line
    for part in parts:
        assert part in line, f"{part!r} not in: {line}"
    return line


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first SMALL_TEXT characters of Tiny Shakespeare as 3 shards."""
    folder = tmp_path_factory.mktemp("small")
    (folder / "small.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:SMALL_TEXT], encoding="utf-8")
    prepare(
        ["--input", str(folder / "small.txt"), "--output", str(folder / "tokens"), "--shard_tokens", "10000"]
    )
    return folder / "tokens"


def test_shards_of_the_shipped_text_hold_its_ids_and_train_on_the_same_windows(tmp_path: Path) -> None:
    output = tmp_path / "tokens"
    result = prepare_cli("--input", str(SHAKESPEARE), "--output", str(output), "--shard_tokens", "400000")
    assert result.returncode == 0, result.stderr[-3000:]
    # Plain lines, one per pass at least, no carriage-return frames of a bar.
    assert "\r" not in result.stdout + result.stderr
    assert "prepare: vocabulary 1.1/1.1 MB (100%)" in result.stdout
    assert "prepare: tokenize 1.1/1.1 MB (100%)" in result.stdout
    meta = json.loads((output / "meta.json").read_text())
    assert [shard["tokens"] for shard in meta["shards"]] == [400_000, 400_000, 315_394]
    assert sorted(path.name for path in output.iterdir()) == [
        "meta.json",
        "shard_000000.bin",
        "shard_000001.bin",
        "shard_000002.bin",
    ]
    assert not list(tmp_path.glob(".*"))  # no staging folder left behind
    text, shards = task.corpus(task.Config()), task.corpus(task.Config(data_file=str(output)))
    assert shards.tokenizer.chars == text.tokenizer.chars and shards.tokenizer.digest == text.tokenizer.digest
    assert torch.equal(shards.ids[:], text.ids)
    # The same windows, those that cross from one shard into the next included.
    from_file, from_shards = (
        task.build_datasets(task.Config()),
        task.build_datasets(task.Config(data_file=str(output))),
    )
    for epoch in (0, 3):
        from_file[0].set_epoch(epoch)
        from_shards[0].set_epoch(epoch)
        assert len(from_shards[0]) == len(from_file[0]) == 15_684
        crossing = 400_000 // 64 - 1  # the window around the first shard boundary
        for index in (0, crossing, crossing + 1, len(from_file[0]) - 1):
            assert torch.equal(from_shards[0][index], from_file[0][index])
        # Hundreds of reads in random order: past the reopening of the memory maps (REOPEN_AFTER).
        for index in torch.randperm(len(from_file[0]), generator=torch.Generator().manual_seed(epoch))[:300]:
            assert torch.equal(from_shards[0][int(index)], from_file[0][int(index)])
    assert all(torch.equal(from_shards[1][i], from_file[1][i]) for i in range(len(from_file[1])))


@pytest.mark.skipif(
    not (importlib.util.find_spec("tokenizers") and importlib.util.find_spec("pyarrow")),
    reason="needs the data extra: pip install -e '.[data]' (tokenizers, pyarrow)",
)
def test_jsonl_and_parquet_documents_with_a_byte_level_bpe(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = SHAKESPEARE.read_text(encoding="utf-8")[:60_000].split("\n\n")
    documents = [*lines[:150], "émoji 🙂 and tabs\t", *lines[150:]]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"id": i, "text": doc}) + "\n" for i, doc in enumerate(documents[:200]))
    )
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": documents[200:], "n": list(range(len(documents) - 200))}), parquet)
    output = tmp_path / "tokens"
    args = ["--tokenizer", "bpe", "--vocab_size", "500", "--shard_tokens", "5000"]
    result = prepare_cli("--input", str(jsonl), str(parquet), "--output", str(output), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    corpus = task.corpus(task.Config(data_file=str(output)))
    assert corpus.tokenizer.size == 500
    assert len(json.loads((output / "meta.json").read_text())["shards"]) >= 3
    # Byte-level: every character encodes, and the ids decode back to the documents, a blank line between.
    assert corpus.tokenizer.decode(corpus.ids[:]) == SEPARATOR.join(documents)
    assert len(corpus.ids) < len(SEPARATOR.join(documents)) / 2  # merges: far fewer ids than characters


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak memory from Linux's /proc")
def test_prepare_streams_a_large_file_in_bounded_memory(tmp_path: Path) -> None:
    """48 MB of text: a reader of the whole file would hold it as str and its ids (several hundred MB)."""
    big = tmp_path / "big.txt"
    text = SHAKESPEARE.read_text(encoding="utf-8")
    with big.open("w", encoding="utf-8") as file:
        for _ in range(43):
            file.write(text)
    # VmHWM: the peak resident memory of this process image (ru_maxrss would include pytest's, kept by exec).
    measure = (
        "import runpy, sys; sys.argv = ['prepare', *sys.argv[1:]]; "
        "runpy.run_module('{{ cookiecutter.package_name }}.prepare', run_name='__main__'); "
        "print([line for line in open('/proc/self/status') if line.startswith('VmHWM')][0])"
    )
    command = [sys.executable, "-c", measure, "--input", str(big), "--output", str(tmp_path / "t")]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    peak_kb = int(result.stdout.split("VmHWM:")[1].split()[0])
    assert json.loads((tmp_path / "t" / "meta.json").read_text())["tokens"] == 43 * len(text)
    assert peak_kb < 200_000, f"prepare peaked at {peak_kb / 1000:.0f} MB for a 48 MB input"


def test_the_window_order_is_a_new_permutation_each_epoch_in_memory_that_does_not_grow() -> None:
    """train.py takes a set's own `sampler`: the windows' WindowOrder, computed index by index. Accelerate's
    sampler would hold 40 bytes per window for the epoch (400 MB at 10 million windows, a 640 M-token corpus
    in windows of 64); this one holds less than a megabyte while it runs through them."""
    for size in (1, 2, 3, 1000, STEPS_PER_EPOCH * 64, 100_003):
        order = WindowOrder(size, seed=42)
        order.set_epoch(3)
        assert sorted(order) == list(range(size)), size
    order = WindowOrder(15_684, seed=42)
    first, again = list(order), list(WindowOrder(15_684, seed=42))
    order.set_epoch(1)
    assert first == again and list(order) != first
    assert list(WindowOrder(15_684, seed=7)) != first
    tracemalloc.start()
    for _ in itertools.islice(WindowOrder(10_000_000, seed=0), 1_000_000):
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000, f"{peak} bytes"
    train, _ = task.build_datasets(task.Config())
    assert isinstance(train.sampler, WindowOrder) and len(train.sampler) == len(train)


@pytest.mark.parametrize("case", ["not json", "no field", "no column", "output exists", "no text"])
def test_bad_input_to_prepare_is_one_line_and_writes_nothing(tmp_path: Path, case: str) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "tokens"
    source.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": "three"\n')
    expected = [f"{source}:4: not JSON (", "one JSON object per line"]
    if case == "no field":
        source.write_text('{"text": "one"}\n{"body": "two"}\n')
        expected = [f"{source}:2: no text field 'text'", "--text_field"]
    elif case == "no column":
        pytest.importorskip("pyarrow", reason="parquet needs pyarrow (the data extra)")
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = tmp_path / "in.parquet"
        pq.write_table(pa.table({"body": ["a", "b"], "n": [1, 2]}), source)
        expected = [f"{source} has no column 'text' (its columns: body, n)", "--text_field"]
    elif case == "output exists":
        source.write_text('{"text": "one"}\n')
        output.mkdir()
        (output / "mine.txt").write_text("kept")
        expected = [f"--output {output} exists", "name another one"]
    elif case == "no text":
        source = tmp_path / "in.txt"
        source.write_text("")
        expected = ["holds no text"]
    one_line_error(prepare_cli("--input", str(source), "--output", str(output)), *expected)
    if case == "output exists":
        assert [path.name for path in output.iterdir()] == ["mine.txt"]
    else:
        assert not output.exists()
    assert not list(tmp_path.glob(".tokens.incomplete-*"))


@pytest.mark.parametrize("damage", ["empty", "truncated", "same size"])
def test_a_damaged_shard_is_named_before_anything_is_written(
    small: Path, tmp_path: Path, damage: str
) -> None:
    tokens = tmp_path / "tokens"
    shutil.copytree(small, tokens)
    shard = tokens / "shard_000001.bin"
    data = shard.read_bytes()
    expected = {
        "empty": f"shard {shard} has 0 bytes, meta.json says 20000: truncated or replaced",
        "truncated": f"shard {shard} has 19998 bytes, meta.json says 20000: truncated or replaced",
        "same size": f"shard {shard} does not match its checksum in meta.json",
    }[damage]
    shard.write_bytes(
        {"empty": b"", "truncated": data[:-2], "same size": bytes([data[0] ^ 1]) + data[1:]}[damage]
    )
    with pytest.raises(ConfigError) as caught:
        task.corpus(task.Config(data_file=str(tokens)))
    assert f"data_file: {expected}" in str(caught.value) and "prepare the folder again" in str(caught.value)
    if damage == "truncated":  # and as train.py says it: one line, before anything is written
        output_dir = tmp_path / "run"
        result = run_training(output_dir, "--data_file", str(tokens), "--max_steps", "2", check=False)
        assert one_line_error(result, expected).startswith(f"config error: data_file: {expected}")
        assert not output_dir.exists()


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the lock file aside) and the SHA-256 of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def prepare_again(tokens: Path, text: str, suffix: str) -> None:
    """Replace the folder `tokens` by the shards of `text`, given to prepare.py as a .txt or .parquet file."""
    source = tokens.with_name(f"source{suffix}")
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [text]}), source)
    else:
        source.write_text(text, encoding="utf-8")
    if tokens.exists():
        shutil.rmtree(tokens)
    prepare(["--input", str(source), "--output", str(tokens), "--shard_tokens", "10000"])


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".txt", ".parquet"])
def test_a_vocabulary_other_than_the_checkpoints_is_blamed_on_the_data_before_anything_is_written(
    tmp_path: Path, suffix: str
) -> None:
    """Prepared again from an edited text with as many characters ('a' became 'é'): same shapes, other ids.
    The run's data fingerprint names the vocabulary, not the code or the versions."""
    if suffix == ".parquet":
        pytest.importorskip("pyarrow", reason="parquet needs pyarrow (the data extra)")
    tokens, output_dir = tmp_path / "tokens", tmp_path / "run"
    text = SHAKESPEARE.read_text(encoding="utf-8")[:SMALL_TEXT]
    prepare_again(tokens, text, suffix)
    run_training(output_dir, "--data_file", str(tokens), "--max_steps", "2", "--checkpoint_every", "2")
    before = snapshot(output_dir)
    prepare_again(tokens, text.replace("a", "é"), suffix)
    result = run_training(
        output_dir, "--data_file", str(tokens), "--max_steps", "4", "--checkpoint_every", "2", check=False
    )
    line = one_line_error(result, "was trained on other data: train vocabulary differs")
    assert "code and versions" not in line and "--start_over true" in line
    assert snapshot(output_dir) == before


@pytest.mark.slow
def test_shards_prepared_again_from_another_text_are_named_and_set_aside_only_on_purpose(
    tmp_path: Path,
) -> None:
    """The same characters (so the same vocabulary) in another order: the first shard differs."""
    tokens, output_dir = tmp_path / "tokens", tmp_path / "run"
    text = SHAKESPEARE.read_text(encoding="utf-8")[:SMALL_TEXT]
    prepare_again(tokens, text, ".txt")
    args = ["--data_file", str(tokens), *RUN, "--max_steps", "4", "--checkpoint_every", "2"]
    run_training(output_dir, *args)
    before = snapshot(output_dir)
    lines = text.splitlines(keepends=True)
    prepare_again(tokens, "".join(lines[len(lines) // 2 :] + lines[: len(lines) // 2]), ".txt")
    line = one_line_error(run_training(output_dir, *args, check=False), "train shard_000000.bin differs")
    assert line.startswith(f"error: checkpoint {list_checkpoints(output_dir)[-1]} was trained on other data")
    assert snapshot(output_dir) == before
    # Start over on the new data, on purpose: the run is set aside whole.
    result = run_training(output_dir, *args, "--start_over", "true")
    assert "start_over: moved the earlier run (" in result.stdout and "starting fresh" in result.stdout
    (aside,) = (output_dir / "set_aside").iterdir()
    assert snapshot(aside) == before


def interrupt(output_dir: Path, args: list[str], signal_number: int, after_step: int) -> int:
    """Start a run, send it `signal_number` once it has logged `after_step`; return its newest checkpoint."""
    started = time.time()
    process = start_training(output_dir, *args)
    wait_for_training(output_dir, process, since=started, step=after_step)
    if signal_number == signal.SIGKILL:
        wait_for_checkpoint(output_dir, process)
    process.send_signal(signal_number)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == (-signal.SIGKILL if signal_number == signal.SIGKILL else EXIT_STOPPED), (
        output[-2000:]
    )
    return int(list_checkpoints(output_dir)[-1].name[5:])


@pytest.mark.slow
def test_kill_9_and_sigterm_mid_epoch_then_rerun_ends_bitwise_identical(small: Path, tmp_path: Path) -> None:
    args = ["--data_file", str(small), "--max_steps", "14", "--dropout", "0.1", *RUN]
    reference = tmp_path / "reference"
    run_training(reference, *args)
    output_dir = tmp_path / "run"
    killed_at = interrupt(output_dir, args, signal.SIGKILL, after_step=5)
    # The resume restarts inside an epoch and crosses its end: step 4 (epoch 0) unless the background
    # write of that checkpoint was published only after step 8's.
    assert killed_at in (4, 8)
    stopped_at = interrupt(output_dir, args, signal.SIGTERM, after_step=8)
    assert stopped_at % STEPS_PER_EPOCH and stopped_at < 12  # mid-epoch; the rerun crosses step 12's boundary
    resumed = run_training(output_dir, *args)
    assert f"step_{stopped_at:08d}" in resumed.stdout
    assert_same_run(output_dir, reference)


@pytest.mark.slow
def test_one_and_two_processes_then_a_hop_to_one_end_at_the_same_eval_metrics(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-device 32 of a global 64. 2 processes train 8 steps (into epoch 1), then 1 process continues to
    14 (crossing into epoch 2): the evaluations at 5 (2 processes), 10 and 14 (1 process, after the hop)
    are those of one process all along. The final evaluation of the 8-step session was logged after its
    last checkpoint, so the resumed run cuts it from the log."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # threads change the summation order of matrix products
    args = [
        "--data_file",
        str(small),
        "--dropout",
        "0.1",
        "--mixed_precision",
        "no",
        "--per_device_batch_size",
        "32",
        *RUN,
    ]
    run_training(tmp_path / "one", *args, "--max_steps", "14")
    two = run_training(tmp_path / "hop", *args, "--max_steps", "8", processes=2)
    assert "x 2 processes x 1 accumulation = global batch 64" in two.stdout
    hop = run_training(tmp_path / "hop", *args, "--max_steps", "14")
    assert "resuming from" in hop.stdout and "x 1 processes x 2 accumulation" in hop.stdout
    evals = [[row for row in read_metrics(tmp_path / name) if "eval/loss" in row] for name in ("one", "hop")]
    assert [row["step"] for row in evals[0]] == [5, 10, 14]
    assert evals[1] == evals[0]  # exactly: TWO_PROCESS_EVAL_TOLERANCE is 0 for this task
