"""Progress output: a live bar on a terminal (a real pseudo-terminal here), plain lines at intervals
everywhere else, from the main process only; and the picture of the curves drawn at a session's end."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import struct
import sys
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import list_checkpoints
from {{ cookiecutter.package_name }}.utils.config import load_config
from {{ cookiecutter.package_name }}.utils.run.curves import curves_figure, save_curves
from {{ cookiecutter.package_name }}.utils.run.start_line import model_line
from {{ cookiecutter.package_name }}.utils.training import progress as progress_module
from {{ cookiecutter.package_name }}.utils.training.progress import Progress
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from .conftest import SIGNAL_RUN, read_metrics, start_training, wait_for_checkpoint


class Clock:
    """time.monotonic under the test's control: the interval logic is about seconds, not speed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock_ = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock_)
    return clock_


def test_off_a_terminal_plain_lines_come_at_intervals_with_step_loss_speed_and_eta(
    fake_time: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    progress = Progress(total=400, initial=100, enabled=True)  # resumed at step 100
    for _ in range(10):  # 10 steps in 2 s: too early for a line
        fake_time.now += 0.2
        progress.update()
    assert capsys.readouterr().out == ""
    progress.loss = 0.4321
    for _ in range(20):  # 5 s after the start: the first line
        fake_time.now += 0.2
        progress.update()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "\r" not in out
    assert re.fullmatch(
        r"train: step 125/400 \(31%\) \| loss 0\.4321 \| 5\.0 steps/s \| elapsed 5\.0s \| ETA 55s\n", out
    ), out
    for _ in range(100):  # 20 s more: still inside the 30 s interval
        fake_time.now += 0.2
        progress.update()
    assert capsys.readouterr().out == ""
    for _ in range(50):  # past it: one more line
        fake_time.now += 0.2
        progress.update()
    assert capsys.readouterr().out.count("train: step") == 1
    while progress.step < 400:  # the last step always gets its line
        progress.update()
    assert capsys.readouterr().out.startswith("train: step 400/400 (100%)")
    progress.write("checkpoint: step 400 saved to somewhere")
    assert capsys.readouterr().out == "checkpoint: step 400 saved to somewhere\n"


def test_slow_steps_are_shown_in_seconds_per_step(fake_time: Clock) -> None:
    progress = Progress(total=10, initial=0, enabled=True)
    fake_time.now += 40.0
    progress.update()
    assert "| 40.0 s/step | elapsed 40s | ETA 6m00s" in progress.line()


def test_with_max_time_lost_the_line_says_what_a_kill_now_would_cost(fake_time: Clock) -> None:
    progress = Progress(total=10, initial=0, enabled=True, at_risk=lambda: 40.0)
    fake_time.now += 1.0
    progress.update()
    assert "step 1/10 (10%) | at risk 40s | 1.0 steps/s" in progress.line()


def test_processes_other_than_the_main_one_print_nothing(
    fake_time: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    progress = Progress(total=5, initial=0, enabled=False)
    for _ in range(5):
        fake_time.now += 100
        progress.update()
    progress.write("checkpoint: step 5 saved")
    assert capsys.readouterr() == ("", "")


def read_to_the_end(leader: int) -> str:
    """All that was written to a pseudo-terminal whose follower is closed: the kernel hands a pty's output
    to the leader in the background, so one read may get the first frame only; EIO says it all came."""
    chunks = []
    while select.select([leader], [], [], 10)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return b"".join(chunks).decode()


def test_on_a_terminal_a_live_bar_shows_from_the_first_step_and_events_print_above_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stdout is a real pseudo-terminal (os.openpty, 100 columns): tqdm draws its bar with carriage returns
    before the first step is done, with the same parts as the plain line (the loss), and the event line."""
    fcntl = pytest.importorskip("fcntl", reason="pseudo-terminals are POSIX only")
    termios = pytest.importorskip("termios", reason="pseudo-terminals are POSIX only")
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    terminal = io.TextIOWrapper(os.fdopen(follower, "wb", buffering=0), write_through=True)
    monkeypatch.setattr(sys, "stdout", terminal)
    progress = Progress(total=3, initial=0, enabled=True)
    progress.loss = 1.5
    for _ in range(3):
        progress.update()
    progress.write("checkpoint: step 3 saved")
    progress.close()
    terminal.close()
    drawn = read_to_the_end(leader)
    assert drawn.startswith("\rtrain:   0%|") and "0/3" in drawn, drawn  # before the first step
    assert "3/3" in drawn and "loss 1.5000" in drawn and "checkpoint: step 3 saved\r\n" in drawn, drawn


def test_the_line_and_the_bar_show_the_epoch_and_the_last_evaluations_metric(fake_time: Clock) -> None:
    progress = Progress(total=10, initial=0, enabled=True)
    progress.epoch, progress.loss, progress.metric = 2.5, 0.25, "eval/accuracy 0.9777"
    fake_time.now += 1.0
    progress.update()
    shown = "train: step 1/10 (10%) | epoch 2.50 | loss 0.2500 | eval/accuracy 0.9777 | 1.0 steps/s"
    assert progress.line().startswith(shown)
    assert progress.parts() == ["epoch 2.50", "loss 0.2500", "eval/accuracy 0.9777"]  # the bar's postfix


@pytest.mark.slow  # trains (single_run)
def test_a_runs_progress_shows_its_epoch_and_last_evaluation(single_run: tuple) -> None:
    """The last step's progress line: the epoch (whole at an epoch's end, as metrics.jsonl logs it) and the
    best_metric of the last evaluation before that step, as metrics.jsonl holds it."""
    output_dir, result = single_run
    (line,) = [line for line in result.stdout.splitlines() if re.match(r"train: step \d+/\d+ \(100%\)", line)]
    rows = read_metrics(output_dir)
    last = [row for row in rows if "train/epoch" in row][-1]
    epoch = float(re.search(r"\| epoch (\d+\.\d\d) \|", line).group(1))
    assert int(epoch) == last["train/epoch"], line
    metric = load_config([], output_dir / "config.yaml", task.Config)[0].best_metric
    if earlier := [row for row in rows if metric in row and row["step"] < last["step"]]:
        assert f" | {metric} {earlier[-1][metric]:.4f}" in line, line


def test_the_model_line_counts_the_parameters_and_a_checkpoints_size() -> None:
    """A frozen base (as under LoRA) counts among the parameters, not the trained ones; a checkpoint holds the
    trained weights and AdamW's two moments (float32: 4 bytes each); a tied weight counts once."""
    base = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters
    base.requires_grad_(False)
    head = torch.nn.Linear(1000, 10)  # 10,010
    assert model_line(torch.nn.Sequential(base, head)) == (
        "model: 1.0M parameters, 10.0K trainable; a checkpoint holds about 120.1KB"
    )
    tied = torch.nn.Sequential(torch.nn.Linear(20, 20, bias=False), torch.nn.Linear(20, 20, bias=False))
    tied[1].weight = tied[0].weight
    assert model_line(tied) == "model: 400 parameters, 400 trainable; a checkpoint holds about 4.8KB"


@pytest.mark.slow  # trains (single_run)
def test_a_runs_model_line_gives_the_size_of_its_checkpoints(single_run: tuple) -> None:
    output_dir, result = single_run
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("model: ")]
    number, prefix = re.search(r"a checkpoint holds about ([\d.]+)([KMGT]?)B$", line).groups()
    estimate = float(number) * 1000 ** " KMGT".index(prefix or " ")
    newest = list_checkpoints(output_dir)[-1]
    size = sum(path.stat().st_size for path in newest.rglob("*") if path.is_file())
    # The estimate is the weights and AdamW's moments; the random states, loop state and history add a few
    # tens of KB, which only a tiny model (the own task's 4.9K parameters) notices.
    assert 0.7 * estimate < size < 1.4 * estimate + 64_000, (line, size)


def test_the_curves_have_a_line_per_metric_and_the_best_evaluation_marked() -> None:
    rows = [
        (10, {"train/loss": 2.0, "train/lr": 0.1}),
        (20, {"train/loss": 1.0, "train/lr": 0.1}),
        (20, {"eval/loss": 0.9, "eval/accuracy": 0.7}),
        (40, {"eval/loss": 0.5, "eval/accuracy": 0.9}),
        (40, {}),  # a filler row (tracking.truncate_metrics)
    ]
    panels = curves_figure(rows, "eval/accuracy", 40).axes
    assert [axes.get_title() for axes in panels] == ["train/loss", "eval/loss", "eval/accuracy"]
    lines = {
        axes.get_title(): [(line.get_label(), *line.get_data()) for line in axes.lines] for axes in panels
    }
    assert [(name, list(x), list(y)) for name, x, y in lines["train/loss"]] == [
        ("train/loss", [10, 20], [2.0, 1.0])
    ]
    assert len(lines["eval/loss"]) == 1  # no marker where the best is not this metric's
    (_, *accuracy), (best, x, y) = lines["eval/accuracy"]
    assert [list(data) for data in accuracy] == [[20, 40], [0.7, 0.9]]
    assert best == "best (step 40)" and list(x) == [40] and list(y) == [0.9]
    assert curves_figure([(5, {})], "eval/loss", None) is None  # nothing logged: nothing drawn


def test_a_failure_to_draw_the_curves_is_a_warning_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "train/loss": 2.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as where matplotlib is not installed
    save_curves(tmp_path, "eval/loss", None)
    warning = f"WARNING: {tmp_path / 'curves.png'} not drawn: ModuleNotFoundError: "
    assert capsys.readouterr().out.startswith(warning)
    assert list(tmp_path.iterdir()) == [tmp_path / "metrics.jsonl"]


@pytest.mark.slow  # trains (single_run)
def test_a_session_leaves_its_curves_as_a_png(single_run: tuple) -> None:
    from matplotlib.image import imread

    output_dir, result = single_run
    picture = imread(output_dir / "curves.png")
    assert picture.ndim == 3 and picture.shape[1] > picture.shape[0] > 100, picture.shape
    assert "WARNING" not in result.stdout
    assert result.stdout.splitlines()[-1] == f"curves: {output_dir / 'curves.png'}"  # drawn last


@pytest.mark.slow  # trains
def test_a_stopped_session_draws_its_curves_after_the_mirror_has_its_last_checkpoint(tmp_path: Path) -> None:
    """SIGTERM: the checkpoint first, then its copy in mirror_dir, then curves.png, named on the last line."""
    output_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    process = start_training(output_dir, *SIGNAL_RUN, "--mirror_dir", str(mirror))
    wait_for_checkpoint(output_dir, process)
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=300)
    assert process.returncode == EXIT_STOPPED, stdout[-3000:]
    lines = stdout.splitlines()
    assert lines[-1] == f"curves: {output_dir / 'curves.png'}", stdout[-3000:]
    held = next(index for index, line in enumerate(lines) if line.startswith(f"mirror: {mirror} holds step"))
    stopped = next(index for index, line in enumerate(lines) if line.startswith("stopped by SIGTERM at step"))
    assert stopped < held < len(lines) - 1
    assert (output_dir / "curves.png").is_file()
