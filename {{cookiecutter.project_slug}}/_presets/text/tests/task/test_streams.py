"""Training from streamed files (`data_files`, training/streams.py), with real runs on files written here:

- stopped by SIGTERM or killed with SIGKILL inside an epoch, the rerun crosses an epoch boundary after
  the resume and ends bitwise identical to a run never stopped;
- the loaders of 1 process and of each of 2 hold the same global batches and the same stream position;
- 2 processes (dropout on) evaluate as 1 does, and their checkpoint continued by 1 process ends with the
  weights of the 1-process run;
- a file that cannot be read stops the run with one line naming it (and the line), before anything is
  written;
- a file edited or added between sessions stops the rerun with one line naming it, before anything is
  written;
- a stream with a shuffle buffer (which cannot resume exactly) is refused in one line;
- read in 2 worker processes, a run stopped three times in a row (SIGKILL, SIGTERM, SIGKILL) across both
  epoch boundaries ends bitwise equal to one never stopped, and so do 2 processes handed to 1; another
  num_workers at resume is refused in one line; more workers than files are cut to one per file, said in
  one line;
- rows shuffled in windows move a bounded distance, and a resume inside a window draws the same order.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import itertools
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import list_checkpoints, read_loop_state
from {{ cookiecutter.package_name }}.utils.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.utils.run.run_dir import LOCK_FILE
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED
from {{ cookiecutter.package_name }}.utils.training.streams import StreamLoader

from ..conftest import (
    MODEL,
    PROJECT,
    assert_same_run,
    framework_warnings,
    read_metrics,
    run_training,
    start_training,
    training_command,
    wait_for_checkpoint,
    wait_for_training,
)

datasets = pytest.importorskip("datasets", reason="data_files streams with datasets: pip install datasets")
parquet = pytest.importorskip("pyarrow.parquet", reason="datasets brings pyarrow")

# 600 passages in 3 files: about 480 train the model, 7 optimizer steps of 64 per epoch, so 20 steps cross
# two epoch boundaries. Shuffled in windows of 100 rows: a checkpoint (every 4 x 64 rows) falls inside one.
# The guarantees' smaller BERT (task_settings.py).
ROWS, FILES = 600, 3
STEPS = ["--max_steps", "20", "--log_every", "2", "--checkpoint_every", "4", "--eval_every", "5"]
STEPS += ["--shuffle_window", "100", *MODEL]


def passages() -> list[dict[str, str]]:
    lines = (PROJECT / "data" / "shakespeare_speakers.txt").read_text(encoding="utf-8").splitlines()
    pairs = [line.split("\t", 1) for line in lines if line.strip() and not line.startswith("#")]
    return [{"label": label, "text": text} for label, text in pairs[:ROWS]]


def write_files(folder: Path, suffix: str) -> str:
    """The passages dealt into FILES files of one format; returns the glob that names them."""
    folder.mkdir(parents=True)
    rows = passages()
    for index in range(FILES):
        part, path = rows[index::FILES], folder / f"part{index}{suffix}"
        if suffix == ".parquet":
            parquet.write_table(datasets.Dataset.from_list(part).data.table, path)
        elif suffix == ".csv":
            with path.open("w", newline="", encoding="utf-8") as file:
                writer = csv.DictWriter(file, ["text", "label"])
                writer.writeheader()
                writer.writerows(part)
        else:
            path.write_text("".join(json.dumps(row) + "\n" for row in part))
    return str(folder / f"*{suffix}")


@pytest.fixture(scope="module")
def jsonl_files(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_files(tmp_path_factory.mktemp("stream") / "jsonl", ".jsonl")


@pytest.fixture(scope="module")
def reference(jsonl_files: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output_dir = tmp_path_factory.mktemp("reference") / "run"
    run_training(output_dir, "--data_files", jsonl_files, *STEPS)
    return output_dir


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill"])
def test_a_stream_stopped_inside_an_epoch_resumes_bitwise(
    stop: signal.Signals, jsonl_files: str, reference: Path, tmp_path: Path
) -> None:
    output_dir = tmp_path / "run"
    started = time.time()
    process = start_training(output_dir, "--data_files", jsonl_files, *STEPS)
    # SIGKILL after the first checkpoint (step 4), else there would be nothing to resume from.
    wait_for_training(output_dir, process, since=started, step=2 if stop == signal.SIGTERM else 6)
    if stop == signal.SIGKILL:
        wait_for_checkpoint(output_dir, process)
    assert process.poll() is None, "train.py ended before it was signalled"
    time.sleep(random.uniform(0.0, 0.05))
    process.send_signal(stop)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == (EXIT_STOPPED if stop == signal.SIGTERM else -signal.SIGKILL), output[-2000:]
    resumed_from = list_checkpoints(output_dir)[-1]
    saved = read_loop_state(resumed_from)
    assert saved.epoch_samples > 0 and saved.epoch < 2, saved  # inside an epoch, before the last boundary
    if stop == signal.SIGTERM:  # max_steps sized the schedule: another value is refused, nothing written
        metrics = (output_dir / "metrics.jsonl").read_bytes()
        args = ["--data_files", jsonl_files, *STEPS, "--max_steps", "30"]
        refused = run_training(output_dir, *args, check=False)
        assert refused.returncode == 1 and "max_steps=20, not 30" in refused.stderr, refused.stderr
        assert (output_dir / "metrics.jsonl").read_bytes() == metrics
    resumed = run_training(output_dir, "--data_files", jsonl_files, *STEPS)
    assert f"resuming from {resumed_from}" in resumed.stdout
    rows = [row for row in read_metrics(output_dir) if "train/epoch" in row and row["step"] > saved.step]
    epochs = {row["train/epoch"] for row in rows}
    assert saved.epoch + 1 in epochs, epochs  # the resumed run went through an epoch boundary
    assert framework_warnings(resumed) == []  # datasets' warning about a shuffle buffer, among others
    assert_same_run(output_dir, reference)


@pytest.mark.slow
def test_a_loader_worker_killed_ends_the_run_and_the_rerun_resumes_bitwise(
    jsonl_files: str, reference: Path, tmp_path: Path
) -> None:
    """A stream's loader worker killed with SIGKILL (as the kernel's out-of-memory killer does) after a
    checkpoint: train.py ends at once (not a hang) with one line that says so and that the rerun continues,
    not PyTorch's traceback; the rerun ends bitwise equal to a run never stopped."""
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, "--data_files", jsonl_files, *STEPS)
    started = time.time()
    process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_training(output_dir, process, since=started, step=6)
    wait_for_checkpoint(output_dir, process)
    # Every worker is killed, and so are those of a later epoch as they start: the steps left may all be
    # buffered already (an epoch is 7 steps), and the run must not finish on a new epoch's workers.
    process.send_signal(signal.SIGSTOP)
    assert kill_children(process.pid), "no loader worker to kill"
    process.send_signal(signal.SIGCONT)
    while process.poll() is None:
        kill_children(process.pid)
        time.sleep(0.02)
    err = process.communicate(timeout=120)[1].decode()
    assert process.returncode == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: DataLoader worker "), last
    assert last.endswith("(out of memory?): rerun the same command to continue"), last
    run_training(output_dir, "--data_files", jsonl_files, *STEPS)
    assert_same_run(output_dir, reference)


def kill_children(pid: int) -> list[str]:
    """SIGKILL every child process of `pid` (a stream's loader workers); their pids."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)
    return children


def stop_session(output_dir: Path, args: list[str], stop: signal.Signals, step: int) -> int:
    """Start train.py, stop it with `stop` once it has logged `step`; the step it will resume from."""
    started = time.time()
    process = start_training(output_dir, *args)
    wait_for_training(output_dir, process, since=started, step=step)
    if stop == signal.SIGKILL:
        wait_for_checkpoint(output_dir, process)
    assert process.poll() is None, "train.py ended before it was signalled"
    process.send_signal(stop)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == (EXIT_STOPPED if stop == signal.SIGTERM else -signal.SIGKILL), output[-2000:]
    return read_loop_state(list_checkpoints(output_dir)[-1]).step


@pytest.mark.slow
def test_a_stream_read_by_workers_resumes_bitwise_through_three_stops_in_a_row(
    jsonl_files: str, tmp_path: Path
) -> None:
    """2 workers read, tokenize and collate the files. Killed with SIGKILL, stopped by SIGTERM, killed
    again, each session resumed from the last one's checkpoint, the resumed sessions crossing the epoch
    boundaries at steps 7 and 14: the fourth session ends bitwise equal to a run never stopped. Another
    num_workers would deal the files otherwise (another order): refused in one line, nothing written."""
    args = ["--data_files", jsonl_files, *STEPS, "--num_workers", "2"]
    reference = tmp_path / "reference"
    run_training(reference, *args)
    output_dir = tmp_path / "run"
    resumed_from = [stop_session(output_dir, args, signal.SIGKILL, step=6)]
    metrics = (output_dir / "metrics.jsonl").read_bytes()
    refused = run_training(output_dir, *args, "--num_workers", "1", check=False)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "num_workers=2, not 1: rerun with --num_workers 2" in refused.stderr.strip().splitlines()[-1]
    assert (output_dir / "metrics.jsonl").read_bytes() == metrics
    resumed_from.append(stop_session(output_dir, args, signal.SIGTERM, step=10))
    resumed_from.append(stop_session(output_dir, args, signal.SIGKILL, step=16))
    last = run_training(output_dir, *args)
    assert f"step {resumed_from[-1]}," in last.stdout and framework_warnings(last) == []
    assert resumed_from[0] < 7 < resumed_from[1] < 14 < 16, resumed_from
    assert_same_run(output_dir, reference)


@pytest.mark.slow
def test_eval_every_0_evaluates_a_stream_at_the_end_of_each_epoch(jsonl_files: str, tmp_path: Path) -> None:
    """An epoch of a stream ends where it runs out, one read after its last step: evaluated there as a
    map-style epoch is. A run resumed from the checkpoint of an epoch's last step, taken before the stream
    was seen to run out, evaluates at that step as the run never stopped did, once."""
    output_dir = tmp_path / "run"
    args = ["--data_files", jsonl_files, "--max_steps", "20", "--log_every", "2", "--eval_every", "0"]
    args += ["--checkpoint_every", "7", "--keep_checkpoints", "5"]
    run_training(output_dir, *args)
    rows = read_metrics(output_dir)
    assert [row["step"] for row in rows if "eval/loss" in row] == [7, 14, 20], rows
    first = tmp_path / "first"
    shutil.copytree(output_dir, first)
    for checkpoint in list_checkpoints(output_dir)[1:]:  # step 7, the first epoch's last step, is left
        shutil.rmtree(checkpoint)
    resumed = run_training(output_dir, *args)
    assert "resuming from" in resumed.stdout and "step 7," in resumed.stdout
    assert_same_run(output_dir, first)


@pytest.mark.slow
def test_two_processes_train_a_stream_as_one_and_hand_it_to_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 process accumulates 2 micro-batches of 32, 2 processes take one each, each reading with 2 workers
    (the hardest hand-over: each worker's place in its files; the blocks of the in-process reader are in
    test_each_process_keeps_its_block_...). The 2-process run stops for time at its first logging step,
    step 10 (inside the second epoch), after evaluating at steps 5 and 10; 1 process continues its
    checkpoint to the end."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # threads change the summation order of matrix products
    files = write_files(tmp_path / "parquet", ".parquet")
    args = ["--data_files", files, *STEPS, "--per_device_batch_size", "32"]
    args += ["--num_workers", "2"]
    args += ["--mixed_precision", "no"]
    one = run_training(tmp_path / "one", *args)
    assert "x 1 processes x 2 accumulation = global batch 64" in one.stdout
    hop = tmp_path / "hop"
    first = run_training(hop, *args, "--log_every", "10", "--time_budget", "0.001s", processes=2, check=False)
    assert "x 2 processes x 1 accumulation = global batch 64" in first.stdout, first.stdout + first.stderr
    assert "stopped for time; run again to continue: step 10," in first.stdout, first.stdout + first.stderr
    folders = (tmp_path / "one", hop)
    evals = [[row for row in read_metrics(folder) if "eval/loss" in row] for folder in folders]
    assert [row["step"] for row in evals[1]] == [5, 10]
    assert evals[1] == evals[0][:2]  # the same numbers on 2 processes as on 1
    assert read_loop_state(list_checkpoints(hop)[-1]).epoch == 1

    second = run_training(hop, *args)
    assert "history: processes 2 -> 1, accumulation 1 -> 2 (per-device batch 32 kept)" in second.stdout
    # A stream's next batch is not read ahead at a stop (its position is in the checkpoint): no record.
    assert "resume not verified: nothing was recorded of step 11 (" in second.stdout
    assert framework_warnings(one) == framework_warnings(second) == []
    ones, hops = (load_file(folder / "model" / "model.safetensors") for folder in (tmp_path / "one", hop))
    assert [name for name in ones if not torch.equal(ones[name], hops[name])] == []
    assert [row for row in read_metrics(hop) if "eval/loss" in row] == evals[0]


def unpadded(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """Each sample of a collated batch: its token ids without padding, then its label."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"].bool(), batch["labels"].tolist()
    return [(*row[keep].tolist(), label) for row, keep, label in zip(ids, mask, labels, strict=True)]


@pytest.mark.parametrize(
    ("suffix", "workers"), [(".jsonl", 0), (".csv", 0), (".parquet", 0), (".jsonl", 2)], ids=str
)
def test_each_process_keeps_its_block_and_stands_where_one_process_does(
    suffix: str, workers: int, tmp_path: Path
) -> None:
    """The loaders of 1 process and of both ranks of 2, three steps into an epoch: each step's global batch is
    the same samples, and the stream's state (what a checkpoint holds) is the same in all three, read in
    the training process or in 2 workers."""
    config = config_for(write_files(tmp_path / "files", suffix), "--num_workers", str(workers))
    seen, states = {}, []
    for world, rank in ((1, 0), (2, 0), (2, 1)):
        train, _ = task.build_datasets(config)
        accelerator = SimpleNamespace(num_processes=world, process_index=rank, device=torch.device("cpu"))
        loader = StreamLoader(train, config, accelerator, task.collate, pin_memory=False)
        loader.set_epoch(1)
        batches = iter(loader)
        seen[world, rank] = [unpadded(next(batches)) for _ in range(3)]
        states.append(without_sample_count(loader.state_dict()))
        del batches  # its workers end
    for step in range(3):
        assert len(seen[1, 0][step]) == config.global_batch_size
        assert seen[1, 0][step] == seen[2, 0][step] + seen[2, 1][step]
    assert states[0] == states[1] == states[2]


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers"])
def test_a_shuffle_in_windows_moves_rows_a_bounded_distance_and_resumes_inside_a_window(
    workers: int, jsonl_files: str
) -> None:
    """Windows of 40 rows, global batches of 64: an epoch's rows come in another order than the files',
    each within 39 places of its place there (in the process: one sequence), and a loader stopped after 3
    batches (192 rows: inside the fifth window) and resumed from its state continues as one never stopped."""

    def epoch(window: int, state: dict | None = None, take: int = 0) -> tuple[list, dict | None]:
        config = config_for(jsonl_files, "--num_workers", str(workers), "--shuffle_window", str(window))
        train, _ = task.build_datasets(config)
        accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
        loader = StreamLoader(train, config, accelerator, task.collate, pin_memory=False)
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(1)
        rows = []
        for batch in loader:
            rows += unpadded(batch)
            if len(rows) == take * config.global_batch_size:
                return rows, loader.state_dict()
        return rows, None

    shuffled, _ = epoch(40)
    first, state = epoch(40, take=3)
    rest, _ = epoch(40, state=state)
    assert first + rest == shuffled
    if workers == 0:
        in_files, _ = epoch(0)
        assert len(shuffled) == len(in_files) and shuffled != in_files
        places: dict[tuple, list[int]] = {}
        for place, row in enumerate(in_files):
            places.setdefault(row, []).append(place)
        # The rows of the last window may come from the partial batch that the unshuffled epoch dropped.
        for place, row in enumerate(shuffled[: len(in_files) - 40]):
            assert any(abs(place - there) < 40 for there in places[row]), place


def test_a_stream_and_its_loader_pickle_for_workers_started_by_spawn(jsonl_files: str) -> None:
    """Where workers are spawned (macOS, Windows), the loader's dataset and collate are pickled to them: a
    lambda anywhere in the stream would stop the run there. The copy reads the same samples."""
    config = config_for(jsonl_files, "--num_workers", "2")
    train, _ = task.build_datasets(config)
    accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    loader = StreamLoader(train, config, accelerator, task.collate, pin_memory=False)
    share, collate = pickle.loads(pickle.dumps((loader.loader.dataset, task.collate)))
    share.set_epoch(1)
    loader.set_epoch(1)
    copied = [collate(list(itertools.islice(iter(share), 32)))]
    in_place = [task.collate(list(itertools.islice(iter(loader.loader.dataset), 32)))]
    assert [unpadded(batch) for batch in copied] == [unpadded(batch) for batch in in_place]


def without_sample_count(state: Any) -> Any:
    """A loader's state without torchdata's count of the samples this process took (per process: a stream's
    sampler yields no indices, and a resume does not use it)."""
    if isinstance(state, dict):
        return {key: without_sample_count(value) for key, value in state.items() if key != "samples_yielded"}
    return state


def test_more_workers_than_files_are_one_per_file_and_a_stream_workers_cannot_share_is_refused(
    jsonl_files: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each worker reads whole files (datasets deals them out): a worker without one would idle, so there
    are at most as many as files, said in one line (the number is saved, a resume keeps it); a stream that
    cannot be dealt would be read whole by every worker (each sample num_workers times): refused."""
    accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    config = config_for(jsonl_files, "--num_workers", "4")
    train, _ = task.build_datasets(config)
    loader = StreamLoader(train, config, accelerator, task.collate, pin_memory=False)
    assert loader.loader.num_workers == 3 and loader.state_dict()["num_workers"] == 3
    said = capsys.readouterr().out.strip().splitlines()
    assert said == [
        "num_workers 4 -> 3: each worker reads whole files and the train stream has 3; split the data into "
        "more files for more workers"
    ]

    class Own(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(9))

        state_dict = load_state_dict = set_epoch = __iter__

    with pytest.raises(ConfigError, match="num_workers=4: this Own train stream cannot be dealt among"):
        StreamLoader(Own(), config, accelerator, task.collate, pin_memory=False)


def test_auto_batch_size_on_a_stream_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auto_batch_size needs a map-style train set"):
        task.build_datasets(config_for(str(tmp_path / "never_read.jsonl"), "--auto_batch_size", "true"))


def config_for(files: str, *flags: str) -> task.Config:
    config, _ = load_config(
        ["--data_files", files, "--max_steps", "5", *flags], PROJECT / "configs" / "local.yaml", task.Config
    )
    return config


def bad_files(folder: Path, kind: str) -> tuple[str, str]:
    """Two files of which the second is bad; (their glob, what the error must say)."""
    folder.mkdir()
    good = [{"label": "a", "text": "one text"}, {"label": "b", "text": "another text"}]
    if kind == "jsonl":
        (folder / "1.jsonl").write_text("".join(json.dumps(row) + "\n" for row in good))
        (folder / "2.jsonl").write_text(json.dumps(good[0]) + "\n{'label': 'b'}\n")
        return str(folder / "*.jsonl"), f"{folder / '2.jsonl'}:2: not JSON"
    if kind == "csv":
        (folder / "1.csv").write_text("text,label\none text,a\nanother text,b\n")
        (folder / "2.csv").write_text("passage,label\nmore text,a\n")
        return str(folder / "*.csv"), f"{folder / '2.csv'}: no column 'text' (it has passage, label)"
    for name, rows in (("1", good), ("2", [{"label": row["label"], "body": row["text"]} for row in good])):
        parquet.write_table(datasets.Dataset.from_list(rows).data.table, folder / f"{name}.parquet")
    return str(folder / "*.parquet"), f"{folder / '2.parquet'}: no column 'text' (it has label, body)"


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_a_bad_file_is_named_in_one_line(kind: str, tmp_path: Path) -> None:
    files, expected = bad_files(tmp_path / kind, kind)
    with pytest.raises(ConfigError) as error:
        task.build_datasets(config_for(files))
    assert str(error.value).startswith(expected), error.value
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_bad_line_or_no_max_steps_stops_train_py_before_it_writes(tmp_path: Path) -> None:
    files, expected = bad_files(tmp_path / "jsonl", "jsonl")
    result = run_training(tmp_path / "run", "--data_files", files, "--max_steps", "5", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().startswith(f"config error: {expected}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    good = write_files(tmp_path / "good", ".jsonl")
    result = run_training(tmp_path / "run", "--data_files", good, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("config error: a streamed train set has no length"), result.stderr
    assert not (tmp_path / "run").exists()


def test_a_stream_with_a_shuffle_buffer_is_refused_in_one_line(jsonl_files: str) -> None:
    """datasets saves a stream's position, not its shuffle buffer's contents: such a stream would resume
    on other samples than an uninterrupted run (with only datasets' own warning)."""
    config = config_for(jsonl_files)
    train, _ = task.build_datasets(config)
    accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    StreamLoader(train, config, accelerator, task.collate, pin_memory=False)  # the preset's: files' order
    with pytest.raises(ConfigError, match="shuffles through a buffer of 100 samples") as error:
        StreamLoader(train.shuffle(seed=0, buffer_size=100), config, accelerator, task.collate, False)
    assert "\n" not in str(error.value)
    assert "give the task's Config a `shuffle_window: int` field" in str(error.value)  # the way out


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the lock file aside) and the SHA-256 of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def relabel_first_row(path: Path) -> None:
    """Give the file's first row another of the file's labels (the vocabulary, built from the texts alone,
    and the label set stay: the model built is the same)."""
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as file:
            rows = list(csv.DictReader(file))
    else:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    rows[0]["label"] = next(row["label"] for row in rows if row["label"] != rows[0]["label"])
    if path.suffix == ".csv":
        with path.open("w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, ["text", "label"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def refused_in_one_line(result: subprocess.CompletedProcess[str], *parts: str) -> str:
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and all(part in line for part in parts), line
    return line


CHANGING = ["--max_steps", "4", "--checkpoint_every", "2", "--log_every", "2", "--eval_every", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_files_edited_or_added_between_sessions_are_named_and_nothing_is_written(
    suffix: str, tmp_path: Path
) -> None:
    files = write_files(tmp_path / "files", suffix)
    output_dir = tmp_path / "run"
    args = ["--data_files", files, *CHANGING]
    run_training(output_dir, *args)
    before = snapshot(output_dir)
    relabel_first_row(tmp_path / "files" / f"part1{suffix}")
    line = refused_in_one_line(run_training(output_dir, *args, check=False), f"train part1{suffix} differs")
    assert "--start_over true" in line
    assert snapshot(output_dir) == before
    if suffix == ".jsonl":  # today's datasets ends an added file's resume in an IndexError
        write_files(tmp_path / "original", suffix)
        shutil.copy(tmp_path / "original" / f"part1{suffix}", tmp_path / "files" / f"part1{suffix}")
        shutil.copy(tmp_path / "original" / f"part2{suffix}", tmp_path / "files" / f"part3{suffix}")
        refused_in_one_line(run_training(output_dir, *args, check=False), f"train part3{suffix} was added")
        assert snapshot(output_dir) == before


@pytest.mark.slow
def test_a_copy_trained_on_other_data_is_refused_before_it_is_brought_in(tmp_path: Path) -> None:
    """A new session (another machine: output_dir empty) continuing from the run's mirror, on edited data."""
    files = write_files(tmp_path / "files", ".jsonl")
    output_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    args = ["--data_files", files, *CHANGING, "--mirror_dir", str(mirror)]
    run_training(output_dir, *args)
    shutil.rmtree(output_dir)
    relabel_first_row(tmp_path / "files" / "part2.jsonl")
    line = refused_in_one_line(run_training(output_dir, *args, check=False), "train part2.jsonl differs")
    assert line.startswith(f"error: the copy {mirror} (step 4, run ")
    assert "--start_over" not in line and "a --mirror_dir and --import_from that do not hold" in line
    assert snapshot(output_dir) == {}  # the lock file alone: no checkpoint brought in


@pytest.mark.slow
def test_an_early_stop_where_a_streams_epoch_runs_out_is_checkpointed(
    jsonl_files: str, tmp_path: Path
) -> None:
    """With eval_every 0 a stream is evaluated where an epoch runs out, after its last step: an early stop
    decided there is checkpointed at that step (checkpoints every 5 steps miss the epoch ends, 7, 14...), so
    that the same command again trains no further."""
    output_dir = tmp_path / "run"
    args = ["--data_files", jsonl_files, "--max_steps", "70", "--log_every", "2", "--eval_every", "0"]
    args += ["--checkpoint_every", "5", "--early_stopping_patience", "1", *MODEL]
    output = run_training(output_dir, *args).stdout
    line = next(line for line in output.splitlines() if line.startswith("stopped early at step "))
    stopped_at = int(line.split()[4].rstrip(":"))
    state = read_loop_state(list_checkpoints(output_dir)[-1])
    assert (state.step, state.stopped_early) == (stopped_at, True)
    before = (output_dir / "metrics.jsonl").read_text()
    rerun = run_training(output_dir, *args).stdout
    assert f"resuming from {list_checkpoints(output_dir)[-1]} (step {stopped_at}," in rerun
    assert line in rerun.splitlines()
    assert (output_dir / "metrics.jsonl").read_text() == before


def alive(pids: list[str]) -> list[str]:
    """Those of `pids` still running (a zombie has ended: its parent has not reaped it yet)."""
    running = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                running.append(pid)
    return running


def test_close_ends_the_workers_of_a_stream_loader(jsonl_files: str) -> None:
    """What finish() calls once training is done: the workers torchdata keeps for state_dict end."""
    config = config_for(jsonl_files, "--num_workers", "2")
    train, _ = task.build_datasets(config)
    accelerator = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    loader = StreamLoader(train, config, accelerator, task.collate, pin_memory=False)
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    others = children.read_text().split()  # the fork server of the runs, if started
    batches = iter(loader)
    next(batches)
    workers = [pid for pid in children.read_text().split() if pid not in others]
    assert len(alive(workers)) == 2, workers
    del batches
    assert len(alive(workers)) == 2  # torchdata keeps the iterator, and its workers
    loader.close()
    deadline = time.monotonic() + 30
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(workers) == []


# A sitecustomize that makes task.loss fail after $FAIL_AFTER calls, first writing the pids of the
# process's children (the stream's loader workers) to $WORKER_PIDS.
FAILING_LOSS = """import os
from pathlib import Path

from {{ cookiecutter.package_name }} import task

_loss, calls = task.loss, []


def loss(model, batch):
    calls.append(1)
    if len(calls) > int(os.environ["FAIL_AFTER"]):
        children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text()
        Path(os.environ["WORKER_PIDS"]).write_text(children)
        raise RuntimeError("the task's loss failed (a test)")
    return _loss(model, batch)


task.loss = loss
"""


@pytest.mark.slow
def test_a_run_that_crashes_mid_stream_leaves_no_loader_worker(jsonl_files: str, tmp_path: Path) -> None:
    """task.loss raises at step 4 while 2 workers read the stream: train.py ends with the error, at once,
    and its workers end with it (they ignore SIGTERM, so nothing but the loader's own end stops them)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(FAILING_LOSS)
    args = ["--data_files", jsonl_files, *STEPS, "--num_workers", "2"]
    command, env = training_command(tmp_path / "run", *args)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hook"), env.get("PYTHONPATH", "")])
    env |= {"FAIL_AFTER": "6", "WORKER_PIDS": str(tmp_path / "workers")}
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "the task's loss failed (a test)" in result.stderr
    workers = (tmp_path / "workers").read_text().split()
    assert len(workers) == 2, workers
    deadline = time.monotonic() + 30
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(workers) == [], "loader workers outlived train.py"
