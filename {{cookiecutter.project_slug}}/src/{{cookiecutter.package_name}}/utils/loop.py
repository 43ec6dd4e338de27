"""The step's bookkeeping: what the training loop decides after each optimizer step, one method per concern.

train.py builds one `Bookkeeping` before the loop, takes each epoch's batches from it (`epoch_batches`:
its order, and after a resume the batches not yet seen) and calls, after every optimizer step, in order:
`count` (the position in the data, fp16's skipped steps), `log` (the train loss, the stop and time votes),
`evaluate` (metrics, best_model/, early stopping), `checkpoint` (when due or asked for), then `stop`;
after each epoch's batches, `after_epoch` (a stream's epoch ends there).
It owns the running train loss, summed on the device and read back once per logging interval, and the
reason, if any, why training cannot go on (`diverged`: a non-finite loss, metric or weight). After the
loop, utils/finish.py says why it ended and leaves the exports: of the last step, or of a stopped session.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, IterableDataset

from .. import task
from .checkpoint import LoopState, export_model
from .config import TrainConfig
from .history import HISTORY_FILE, History
from .persist import Persister
from .progress import Progress
from .signals import StopRequest
from .task_check import TaskModel
from .timing import SessionClock
from .tracking import metrics_size


class Bookkeeping:
    """The loop's decisions after each optimizer step, and the state they need between steps."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: TrainConfig,
        state: LoopState,
        resumed_from: Path | None,
        steps_per_epoch: int,
        total_steps: int,
        stop: StopRequest,
        clock: SessionClock,
        persister: Persister,
        history: History,
    ) -> None:
        self.accelerator, self.config, self.state = accelerator, config, state
        self.resumed_from, self.steps_per_epoch, self.total_steps = resumed_from, steps_per_epoch, total_steps
        self.stop_request, self.clock, self.persister, self.history = stop, clock, persister, history
        self.start_step = state.step
        # Train loss summed on the device since the last log: no host-device sync per step.
        own_sum, self.running_batches = own_loss_window(state.loss_sums, state.loss_batches, accelerator)
        self.running_loss = torch.tensor(own_sum, device=accelerator.device)
        self.stopping = self.out_of_time = self.timed_checkpoint = self.end_of_epoch = False
        self.stream_ran_out = False  # a stream's epoch ends after its last step: known one read later
        self.diverged = ""  # why training cannot go on: a non-finite loss, metric or weight
        self.last_saved = resumed_from  # the newest checkpoint known to hold finite weights
        self.metrics: dict[str, float] | None = None
        self.progress = Progress(total_steps, state.step, enabled=accelerator.is_main_process)

    def epoch_batches(self, train_loader: Any, train_set: Any) -> Iterator:
        """The train batches of the epoch in progress, in its order: after a resume, those not yet seen."""
        state, accelerator = self.state, self.accelerator
        train_loader.set_epoch(state.epoch)  # the data order of this epoch (a StreamLoader: its stream's)
        if isinstance(train_set, IterableDataset):  # a stream resumes from its own state (utils/streams.py)
            yield from train_loader
            state.epoch += 1  # it ran out: the epoch is over (a map-style one ends on its count of steps)
            state.epoch_samples = 0
            self.stream_ran_out = True  # its end-of-epoch evaluation follows (after_epoch)
            return
        if hasattr(train_set, "set_epoch"):
            train_set.set_epoch(state.epoch)  # its augmentation (Accelerate forwards it only sometimes)
        batches = train_loader
        if state.epoch_samples:  # resumed inside this epoch: skip what the checkpoint already saw
            batches = accelerator.skip_first_batches(
                train_loader, state.epoch_samples // self.config.global_batch_size
            )
            batches.set_epoch(state.epoch)
        yield from batches

    def count(self, step_loss: torch.Tensor, skipped: bool) -> None:
        """One optimizer step is done, unless fp16's loss scaler skipped it (overflowing gradients): then
        the logged loss does not count it, and too many skipped in a row is divergence."""
        state, config = self.state, self.config
        if skipped:
            state.skipped_in_a_row += 1
            if state.skipped_in_a_row >= config.fp16_skip_patience:
                self.diverged = (
                    f"fp16's loss scaler skipped {state.skipped_in_a_row} optimizer steps in a row"
                )
        else:
            state.skipped_in_a_row = 0
            self.running_loss += step_loss
            self.running_batches += self.accelerator.gradient_accumulation_steps
        state.step += 1
        state.epoch_samples += config.global_batch_size
        state.samples_seen += config.global_batch_size
        self.end_of_epoch = state.epoch_samples == self.steps_per_epoch * config.global_batch_size
        if self.end_of_epoch:
            state.epoch += 1
            state.epoch_samples = 0

    def log(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Every log_every steps: the mean train loss, and whether to stop or checkpoint for time."""
        state, accelerator = self.state, self.accelerator
        if state.step % self.config.log_every == 0:
            # The one host-device sync of training, once per logging interval. The stop vote and the
            # main process's clock ride along: all processes stop, or checkpoint for time, at the same
            # step, whenever each got its signal (see utils/timing.py for why one clock decides).
            flags = torch.tensor(
                [1.0 if self.stop_request else 0.0, *self.clock.at_log()], device=accelerator.device
            )
            totals = accelerator.reduce(torch.cat([self.running_loss.reshape(1), flags]), "sum")
            loss_total, votes, timed, late = totals.tolist()
            # A signal wins over the clock: the platform wants the machine back now, without exports.
            self.stopping, self.out_of_time = votes > 0 or late > 0, late > 0 and votes == 0
            self.timed_checkpoint = timed > 0
            if not math.isfinite(loss_total):  # the same sum on every process: all stop here
                self.diverged = f"the train loss of steps up to {state.step} is {loss_total}"
            elif self.running_batches:
                log_train_loss(accelerator, self.progress, loss_total, self.running_batches, state, scheduler)
            self.running_loss.zero_()
            self.running_batches = 0
        self.progress.update()  # after the log: a progress line shows the loss just computed

    def evaluate(self, model: torch.nn.Module, forward: torch.nn.Module, eval_loader: DataLoader) -> None:
        """At every eval_every steps (else at each epoch's end): metrics, best_model/, early stopping.
        `forward` computes the metrics; `model` is what best_model/ exports (the same weights)."""
        state, config, accelerator = self.state, self.config, self.accelerator
        due = state.step % config.eval_every == 0 if config.eval_every else self.end_of_epoch
        if self.diverged or not due:
            return
        metrics = evaluate(accelerator, forward, eval_loader, config)
        if not all(math.isfinite(value) for value in metrics.values()):
            self.diverged = f"the eval metrics at step {state.step} are {metrics}"
            return
        self.metrics = metrics
        accelerator.log(metrics, step=state.step)
        state.last_eval_step = state.step
        track_best(accelerator, model, config, state, metrics)
        if config.early_stopping_patience:
            # Rank 0 decides (the gathered metrics are the same everywhere anyway) and
            # check_trigger, a collective, makes every process stop at this same step.
            patience_over = state.evals_since_best >= config.early_stopping_patience
            if accelerator.is_main_process and patience_over:
                accelerator.set_trigger()
            state.stopped_early = accelerator.check_trigger()

    def after_epoch(self, model: torch.nn.Module, forward: torch.nn.Module, eval_loader: DataLoader) -> None:
        """After an epoch's batches. A stream's epoch ends where it runs out, which shows only once its last
        step is done (and checkpointed, if due): with eval_every 0 it is evaluated here, as a map-style
        epoch is at its last step. A run resumed from that last step's checkpoint finds the stream
        already at its end and evaluates at the same step, as the run never stopped did."""
        ran_out, self.stream_ran_out = self.stream_ran_out, False
        if ran_out and not self.config.eval_every and not self.stop():
            self.end_of_epoch = True
            self.evaluate(model, forward, eval_loader)
            self.end_of_epoch = False

    def checkpoint(self, model: torch.nn.Module) -> None:
        """Save when due (checkpoint_every, the last step), for time, or before stopping."""
        state, config, accelerator = self.state, self.config, self.accelerator
        if self.diverged:
            return
        due = state.step % config.checkpoint_every == 0 or state.step == self.total_steps
        if not (due or self.timed_checkpoint or self.stopping or state.stopped_early):
            return
        # Never a checkpoint of broken weights: it would rotate the last good one out.
        if not weights_finite(accelerator, model):
            self.diverged = f"the weights at step {state.step} are not all finite"
            return
        state.loss_sums = accelerator.gather(self.running_loss.reshape(1)).tolist()
        state.loss_batches = self.running_batches
        # The checkpoint seals this length: the lines it counts must be on the disk before it is.
        state.metrics_bytes = metrics_size(Path(config.output_dir), durable=accelerator.is_main_process)
        saving, self.timed_checkpoint = time.monotonic(), False
        history = {HISTORY_FILE: self.history.text(state.step, self.ending())}
        # Staged and written in the background (checkpoint_mode), then mirrored: utils/persist.py.
        path = self.persister.save(state, self.resumed_from, history)
        self.history.save(config.output_dir, state.step, self.ending())
        self.clock.saved(saving)
        # The time budget keeps room for a whole save, which a stop waits for, not the loop's short pause.
        self.clock.longest_save = max(self.clock.longest_save, self.persister.last_seconds)
        self.progress.write(f"checkpoint: step {state.step} saved to {path}")
        self.last_saved = path  # published before finish() names it

    def ending(self) -> str:
        """Why this session ends at this step, as its history records it ("" while it goes on)."""
        state, config = self.state, self.config
        if self.diverged:
            return f"diverged at step {state.step}: {self.diverged}"
        if self.out_of_time:
            return "time budget spent"
        if self.stopping:
            return f"stopped by {self.stop_request.signal_name or 'a signal to another process'}"
        if state.stopped_early:
            return "early stopping"
        if state.step >= self.total_steps:
            schedule = self.steps_per_epoch * config.num_epochs  # 0 for a stream: max_steps is its length
            return "max_steps reached" if config.max_steps and config.max_steps < schedule else "done"
        return ""

    def stop(self) -> bool:
        """Whether the loop ends (checked after every step, and before every epoch)."""
        state = self.state
        return bool(self.diverged) or self.stopping or state.stopped_early or state.step >= self.total_steps


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader, config: TrainConfig
) -> dict[str, float]:
    """The task's metrics over the whole eval set: the same numbers on any number of processes.

    gather_for_metrics returns the per-sample values in dataset order and drops the samples repeated
    to give every process a full last batch; reducing once over the whole set, in that order, makes
    the result independent of how the set was split.
    """
    model.eval()
    view = TaskModel(model, accelerator.unwrap_model(model, keep_torch_compile=False))  # its attributes too
    gathered: dict[str, list[torch.Tensor]] = {}
    for batch in loader:
        for name, values in accelerator.gather_for_metrics(task.eval_step(view, batch)).items():
            gathered.setdefault(name, []).append(values)
    model.train()
    return task.metrics({name: torch.cat(parts) for name, parts in gathered.items()}, config)


def track_best(
    accelerator: Accelerator, model: torch.nn.Module, config: TrainConfig, state: LoopState, metrics: dict
) -> None:
    """Export best_model/ when `metrics` beat the best so far, else count one more evaluation without."""
    value, best = metrics[config.best_metric], state.best_value
    if best is None or (value > best if config.METRIC_GOALS[config.best_metric] == "max" else value < best):
        state.best_value, state.best_step, state.evals_since_best = value, state.step, 0
        # Outside checkpoints/, so rotation never removes it; predict.py --model_dir <output_dir>/best_model.
        folder = Path(config.output_dir) / "best_model"
        export_model(accelerator, model, config, folder, {"step": state.step, **metrics})
    else:
        state.evals_since_best += 1


def log_train_loss(
    accelerator: Accelerator,
    progress: Progress,
    loss_total: float,
    batches: int,
    state: LoopState,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Log the mean train loss per micro-batch since the last log; `loss_total` is summed over processes."""
    mean_loss = loss_total / accelerator.num_processes / batches
    progress.set_loss(mean_loss)
    accelerator.log(
        {
            "train/loss": mean_loss,
            "train/lr": scheduler.get_last_lr()[0],
            "train/epoch": state.epoch,
            "train/samples_seen": state.samples_seen,
        },
        step=state.step,
    )


def weights_finite(accelerator: Accelerator, model: torch.nn.Module) -> bool:
    """Whether every weight is finite on every process (one sync; each process checks its own shard)."""
    broken = torch.stack([~param.detach().isfinite().all() for param in model.parameters()]).any()
    return accelerator.reduce(broken.float(), "sum").item() == 0


def diverged_message(why: str, config: TrainConfig, last_saved: Path | None) -> str:
    kept = f"the last checkpoint, {last_saved}, is from before" if last_saved else "no checkpoint was written"
    return (
        f"training diverged: {why}. Nothing was saved or exported after it ({kept}). Lower learning_rate "
        f"(now {config.learning_rate:g}) or raise warmup_steps, and train in a new --output_dir or pass "
        "--start_over true"
    )


def own_loss_window(
    loss_sums: list[float], loss_batches: float, accelerator: Accelerator
) -> tuple[float, float]:
    """This process's share of the loss window saved in a checkpoint: its loss sum and micro-batch count.
    After a change of world size every process takes an equal share of the window's total, so that the
    logged mean (total / processes / count) stays the mean over every micro-batch of the window."""
    if len(loss_sums) == accelerator.num_processes:
        return loss_sums[accelerator.process_index], loss_batches
    if not loss_sums:
        return 0.0, 0
    processes = accelerator.num_processes
    return sum(loss_sums) / processes, loss_batches * len(loss_sums) / processes
