"""The step's bookkeeping: what the training loop decides after each optimizer step, one method per concern
(`Bookkeeping`, called in the order train.py shows), the train loss (`TrainLoss`), why training stops
(`Ending`), and after the loop (`finish`) what the ending calls for."""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, IterableDataset

from ... import task
from ...launch import report_outcome
from ..checkpoints.checkpoint import (
    LoopState,
    checkpoint_problem,
    checkpoint_step,
    export_model,
    list_checkpoints,
    load_checkpoint,
    remove_folder,
    reseal,
)
from ..checkpoints.persist import Persister
from ..config import TrainConfig
from ..machine.compile_cache import cache_files
from ..run.history import HISTORY_FILE, History
from ..run.run_dir import RunError
from ..run.task_check import TaskModel
from ..run.tracking import metrics_size, truncate_metrics
from .progress import Progress
from .resume_check import ResumeCheck
from .signals import StopRequest
from .timing import SessionClock

SPIKE_LOGS = 5  # a logged train loss is a spike against the median of this many logged before it


@dataclass(eq=False)
class Bookkeeping:
    """The loop's decisions after each optimizer step, and the state they need between steps."""

    accelerator: Accelerator
    config: TrainConfig
    state: LoopState
    resumed_from: Path | None
    steps_per_epoch: int
    total_steps: int
    stop: StopRequest
    clock: SessionClock
    persister: Persister
    history: History

    def __post_init__(self) -> None:
        accelerator = self.accelerator
        config = self.config
        state = self.state
        clock = self.clock
        self.progress = Progress(self.total_steps, state.step, accelerator.is_main_process, clock.at_risk)
        clock.begin(state.step)  # what a kill loses is counted from here
        self.loss = TrainLoss(accelerator, state, self.progress, config)
        schedule_steps = self.steps_per_epoch * config.num_epochs
        self.end = Ending(self.stop, state, self.total_steps, schedule_steps, config.max_steps)
        self.end_of_epoch = self.streamed = False
        self.last_saved = self.resumed_from  # the newest checkpoint known to hold finite weights
        self.metrics: dict[str, float] | None = None
        history = self.history
        resumed_at = state.step if self.resumed_from is not None else None
        self.check = ResumeCheck(accelerator, history, config.output_dir, self.progress.write, resumed_at)
        if state.rollbacks and state.rollbacks[-1]["back_to"] == state.step:  # its next step is another
            self.check.verify_at = -1
        self.loader = self.train_set = None

    def epoch_batches(self, train_loader: Any, train_set: Any) -> Iterator:
        """The train batches of the epoch in progress, in its order: after a resume, those not yet seen."""
        self.streamed = isinstance(train_set, IterableDataset)
        self.loader = train_loader  # the probe's next batch (checkpoint)
        self.train_set = train_set
        return epoch_batches(train_loader, train_set, self.state, self.accelerator, self.config)

    def count(self, step_loss: torch.Tensor, skipped: bool) -> None:
        """A step done, unless fp16's scaler skipped it: not in the logged loss; many in a row: divergence."""
        state = self.state
        batch = self.config.global_batch_size
        self.check.digested(state.step)
        if skipped:
            state.skipped_in_a_row += 1
            if state.skipped_in_a_row >= self.config.fp16_skip_patience:
                skipped_steps = f"{state.skipped_in_a_row} optimizer steps in a row"
                self.end.diverged = f"fp16's loss scaler skipped {skipped_steps}"
        else:
            state.skipped_in_a_row = 0
            self.loss.add(step_loss)
        state.step += 1
        state.epoch_samples += batch
        state.samples_seen += batch
        self.end_of_epoch = state.epoch_samples == self.steps_per_epoch * batch
        if self.end_of_epoch:
            state.epoch += 1
            state.epoch_samples = 0
        self.progress.epoch = state.step / self.steps_per_epoch if self.steps_per_epoch else state.epoch

    def log(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """At votes (training/timing.py), twice a second: a stop, the checkpoint interval; the loss too."""
        logging = self.state.step % self.config.log_every == 0
        if logging or self.state.step >= self.clock.next_vote:  # the step the last vote planned (all agree)
            self.loss.vote(self.end, self.clock, scheduler, logging)
        self.progress.update()  # after the log: a progress line shows the loss just computed

    def evaluate(self, model: torch.nn.Module, forward: torch.nn.Module, eval_loader: DataLoader) -> None:
        """Every eval_every steps (else at epoch ends): metrics (`forward`), best_model/, early stopping."""
        state = self.state
        config = self.config
        due = state.step % config.eval_every == 0 if config.eval_every else self.end_of_epoch
        if self.end.diverged or not due:
            return
        metrics = evaluate(self.accelerator, forward, eval_loader, config)
        if not all(math.isfinite(value) for value in metrics.values()):
            self.end.diverged = f"the eval metrics at step {state.step} are {metrics}"
            return
        self.metrics = metrics
        self.progress.metric = f"{config.best_metric} {metrics[config.best_metric]:.4f}"
        track_best(self.accelerator, model, config, state, metrics)  # logged too
        # A signal during the evaluation (minutes, on a large eval set) is acted on now; so is early stopping.
        patience = config.early_stopping_patience and state.evals_since_best >= config.early_stopping_patience
        _, votes = self.loss.total(stop=float(bool(self.end.stop_request)), patience=float(patience))
        self.end.stopping = self.end.stopping or votes["stop"] > 0
        state.stopped_early = votes["patience"] > 0

    def after_epoch(self, model: torch.nn.Module, forward: torch.nn.Module, eval_loader: DataLoader) -> None:
        """A stream's epoch ends where it runs out: evaluated here (eval_every 0), a stop checkpointed."""
        if self.streamed and not self.config.eval_every and not self.end.now():
            self.end_of_epoch = True  # until the next step's count
            self.evaluate(model, forward, eval_loader)
            if self.end.now() and self.check.record_at != self.state.step:  # not saved at this step yet
                self.checkpoint(model, gradients=None)  # a stream's next batch is not probed

    def checkpoint(self, model: torch.nn.Module, gradients: Callable[..., Any] | None) -> None:
        """Save when due or before stopping; a session that ends with steps left first probes the next one."""
        state = self.state
        config = self.config
        self.persister.announce()  # the background save before, once published
        due = self.clock.due(state.step) or state.step in (self.total_steps, state.decay_start)
        due = due or state.stopped_early
        if self.end.diverged or not (due or self.end.stopping):
            return
        saving = time.monotonic()  # the loop's stop, which max_time_lost's checkpoints keep under 2%
        # Never a checkpoint of broken weights: it would rotate the last good one out.
        if not weights_finite(self.accelerator, model):
            self.end.diverged = f"the weights at step {state.step} are not all finite"
            self.end.good_until = state.step - 1
            return
        more = state.step < self.steps_per_epoch * config.num_epochs and not state.stopped_early
        if more and self.end.now() and not self.streamed:  # a stream's next batch is not read ahead
            batch = next(iter(self.epoch_batches(self.loader, self.train_set)))
            self.check.probe(state.step, batch, gradients, model)
        self.check.record_at = state.step
        self.last_saved = write_checkpoint(self)
        self.clock.saved(state.step, saving, self.persister.last_seconds)


def write_checkpoint(book: Bookkeeping) -> Path:
    """The checkpoint of this step, written in the background and mirrored (checkpoints/persist.py)."""
    state = book.state
    book.loss.save()  # the logging interval in progress, which a resumed run logs whole
    # The checkpoint seals this length: the lines it counts must be on the disk before it is.
    state.metrics_bytes = metrics_size(Path(book.config.output_dir), durable=book.accelerator.is_main_process)
    why = book.end.why()
    files = {HISTORY_FILE: book.history.text(state.step, why)}
    files |= cache_files(book.accelerator, book.config)  # what was compiled (machine/compile_cache.py)
    published = functools.partial(book.check.saved, state.step, why)  # before finish() names it
    return book.persister.save(state, book.resumed_from, files, published)


@dataclass
class Ending:
    """Why the session ends, once it must: each reason is set where the loop finds it."""

    stop_request: StopRequest
    state: LoopState
    total_steps: int
    schedule_steps: int  # steps_per_epoch x num_epochs; 0 for a stream, whose length is max_steps
    max_steps: int
    diverged: str = ""  # why training cannot go on: a non-finite loss, metric or weight
    good_until: int = -1  # a rollback goes back to a checkpoint of this step or before (-1: none may)
    stopping: bool = False  # a stop signal (or the clock, too late for more): checkpoint and exit
    out_of_time: bool = False  # the time budget: checkpoint, export and exit

    def now(self) -> bool:
        """Whether the loop ends (checked after every step, and before every epoch)."""
        return bool(self.diverged) or self.stopping or self.state.stopped_early or self.done()

    def done(self) -> bool:
        return self.state.step >= self.total_steps

    def why(self) -> str:
        """Why this session ends at this step, as its history records it ("" while it goes on)."""
        if self.diverged:
            return f"diverged at step {self.state.step}: {self.diverged}"
        if self.out_of_time:
            return "time budget spent"
        if self.stopping:
            return f"stopped by {self.stop_request.signal_name or 'a signal to another process'}"
        if self.state.stopped_early:
            return "early stopping"
        if self.done():
            return "max_steps reached" if 0 < self.max_steps < self.schedule_steps else "done"
        return ""


class TrainLoss:
    """The train loss since the last log, summed on the device and read back at votes (no host-device sync
    per step), with the votes that ride along. A checkpoint saves the window (the sum
    over processes, the micro-batch count): a resumed run logs the interval it stopped inside whole."""

    def __init__(self, accelerator: Accelerator, state: LoopState, progress: Progress, config: Any) -> None:
        self.accelerator = accelerator
        self.state = state
        self.progress = progress
        self.config = config
        # The main process holds the window (earlier versions saved a sum and a count per process).
        own_sum = sum(state.loss_sums) if accelerator.is_main_process else 0.0
        self.batches = state.loss_batches * len(state.loss_sums)  # micro-batches, over all processes
        # float64 (MPS has none): float32 losses add up without rounding, however processes split them
        dtype = torch.float32 if accelerator.device.type == "mps" else torch.float64
        self.sum = torch.tensor(own_sum, device=accelerator.device, dtype=dtype)

    def add(self, step_loss: torch.Tensor) -> None:
        self.sum += step_loss
        self.batches += self.accelerator.gradient_accumulation_steps * self.accelerator.num_processes

    def total(self, **votes: float) -> tuple[float, dict[str, float]]:
        """The loss summed over processes, and each of `votes` summed likewise: one sync for them all."""
        flags = torch.tensor(list(votes.values()), device=self.accelerator.device, dtype=self.sum.dtype)
        sums = torch.cat([self.sum.reshape(1), flags.reshape(-1)])
        loss, *summed = self.accelerator.reduce(sums, "sum").tolist()
        return loss, dict(zip(votes, summed, strict=True))

    def vote(self, end: Ending, clock: SessionClock, scheduler: Any, logging: bool) -> None:
        """The one host-device sync of training, at votes: the loss, with the stop vote and the main process's
        clock riding along, so that all processes stop, or checkpoint for time, at the same step, whenever
        each got its signal (training/timing.py: why one clock decides). Sets `end`'s reasons, the checkpoint
        interval and the next vote; at logging steps, logs the loss (else its window goes on)."""
        interval, late, ahead = clock.vote(self.state.step, logging)
        stop = float(bool(end.stop_request))
        loss_total, votes = self.total(stop=stop, interval=interval, late=late, ahead=ahead)
        clock.checkpoint_interval = votes["interval"]
        clock.next_vote = self.state.step + round(votes["ahead"])
        signalled = votes["stop"] > 0
        # A signal wins over the clock: the platform wants the machine back now, without exports.
        end.stopping = signalled or votes["late"] > 0
        end.out_of_time = votes["late"] > 0 and not signalled
        if not logging:
            return
        # The same sum on every process: all decide alike. A spike: against the median of the last logs.
        mean = loss_total / max(self.batches, 1)
        recent = sorted(self.state.recent_losses)
        median = recent[SPIKE_LOGS // 2] if len(recent) == SPIKE_LOGS else math.inf
        factor = self.config.loss_spike_factor
        if not math.isfinite(loss_total):
            end.diverged = f"the train loss of steps up to {self.state.step} is {loss_total}"
        elif factor and mean > factor * median:
            end.diverged = f"the train loss of steps up to {self.state.step} is {mean:.4g}, over "
            end.diverged += f"{factor:g} x {median:.4g}, the median of the last {SPIKE_LOGS} logged"
        else:
            self.log(loss_total, scheduler)
            return
        end.good_until = self.state.step - self.config.log_every  # before the logging interval

    def log(self, total: float, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Log the window's mean per micro-batch (`total`: its sum over processes), then start a new one."""
        if self.batches:
            mean_loss = total / self.batches
            self.progress.loss = mean_loss
            state = self.state
            state.recent_losses = [*state.recent_losses, mean_loss][-SPIKE_LOGS:]
            self.accelerator.log(
                {
                    "train/loss": mean_loss,
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/epoch": state.epoch,
                    "train/samples_seen": state.samples_seen,
                },
                step=state.step,
            )
        self.sum.zero_()
        self.batches = 0

    def save(self) -> None:
        """Into the loop state, which the checkpoint saves: the sum over processes, and the count."""
        loss_sum, _ = self.total()
        self.state.loss_sums = [loss_sum]
        self.state.loss_batches = self.batches


def roll_back(book: Bookkeeping) -> None:
    """After a divergence that a checkpoint from before it may undo (`good_until`), every process goes back to
    it, past the data from its position through the bad step and `rollback_margin` steps more. The window is
    in the loop state, sealed into that checkpoint at once: a kill from here on resumes as the run goes on."""
    end = book.end
    state = book.state
    config = book.config
    accelerator = book.accelerator
    if end.good_until < 0 or not config.max_rollbacks:
        return
    book.persister.wait()  # every checkpoint saved is published
    accelerator.wait_for_everyone()
    checkpoints = list_checkpoints(config.output_dir)
    before = [p for p in checkpoints if checkpoint_step(p) <= end.good_until and not checkpoint_problem(p)]
    done = len(state.rollbacks)
    if book.streamed or not before or done >= config.max_rollbacks:
        why = "not for a stream" if book.streamed else "all spent" if before else "no checkpoint before it"
        end.diverged += f"; rollback {done + 1} of max_rollbacks {config.max_rollbacks}: {why}"
        return
    bad_step = state.step
    spe = book.steps_per_epoch  # positions in the data: batches from the run's start, over epochs
    last = state.epoch * spe + state.epoch_samples // config.global_batch_size + config.rollback_margin
    loaded = load_checkpoint(accelerator, before[-1], config)
    if len(loaded.rollbacks) <= done:  # else resealed with this rollback already (killed right after)
        first = loaded.epoch * spe + loaded.epoch_samples // config.global_batch_size
        loaded.epoch = last // spe
        loaded.epoch_samples = last % spe * config.global_batch_size
        record = {"step": bad_step, "cause": end.diverged, "back_to": loaded.step, "batches": [first, last]}
        loaded.rollbacks = [*state.rollbacks, record]
    vars(state).update(vars(loaded))  # in place: the loop's parts hold it
    record = state.rollbacks[-1]
    first, last = record["batches"]
    accelerator.print(
        f"rollback {len(state.rollbacks)} of {config.max_rollbacks} at step {bad_step}: {record['cause']}; "
        f"back to step {state.step}, skipping data batches {first} to {last - 1}"
    )
    if accelerator.is_main_process:  # the rows of the abandoned steps go; the rollback's is sealed in
        truncate_metrics(config.output_dir, state.metrics_bytes, state.step)
    accelerator.log({"train/rollback": len(state.rollbacks), "train/rollback_of": bad_step}, step=state.step)
    state.metrics_bytes = metrics_size(Path(config.output_dir), durable=accelerator.is_main_process)
    for session in [*book.history.sessions, book.history.current]:  # later steps are recorded anew
        digests = session.get("after_checkpoint", {})
        session["after_checkpoint"] = {key: value for key, value in digests.items() if int(key) < state.step}
    book.history.current.setdefault("rollbacks", []).append(record)
    if accelerator.is_main_process:
        reseal(before[-1], state)
        for path in checkpoints:  # of the abandoned steps: a resume must not pick them
            if checkpoint_step(path) > state.step:
                remove_folder(path)
    accelerator.wait_for_everyone()
    book.loss = TrainLoss(accelerator, state, book.progress, config)
    end.diverged = ""
    end.good_until = -1
    book.last_saved = before[-1]
    book.metrics = None
    book.check.record_at = state.step  # its next step is recorded anew
    book.check.verify_at = -1
    book.clock.begin(state.step)
    book.progress.step = state.step


def finish(
    book: Bookkeeping,
    model: torch.nn.Module,
    forward: torch.nn.Module,
    eval_loader: DataLoader,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> bool:
    """Raise if training diverged; False if a signal or the clock stopped it (having left what a session
    that ends now should leave); True when training is done: then the last evaluation, and the exports."""
    book.progress.close()
    book.persister.wait()  # the save in flight is published before anything else is written or said
    book.history.save(book.config.output_dir, book.state.step, book.end.why())
    if book.end.diverged:
        raise RunError(diverged_message(book.end.diverged, book.config, book.last_saved))
    stopping = book.end.stopping or book.end.out_of_time
    if stopping:
        stopped(book, model)
    else:
        done(book, model, forward, eval_loader, scheduler)
    if book.accelerator.is_main_process:  # a SLURM launcher requeues a stopped run that made progress
        report_outcome("stopped" if stopping else "finished", book.progress.start_step, book.state.step)
    book.accelerator.wait_for_everyone()  # a launcher ends the others when one exits first with 75
    return not stopping


def stopped(book: Bookkeeping, model: torch.nn.Module) -> None:
    """A signal (the checkpoint only) or the clock (model/ too) stopped the session."""
    accelerator = book.accelerator
    state = book.state
    output_dir = Path(book.config.output_dir)
    if not book.end.out_of_time:
        accelerator.print(  # the last line, which the launchers show as the outcome
            f"stopped by {book.end.stop_request.signal_name or 'another process'} at step {state.step}: "
            "checkpoint saved, run the same command to continue"
        )
        return
    metrics = book.metrics  # leave what a session that ends now should leave, without an evaluation
    info = {"step": state.step, **({"eval_step": state.last_eval_step, **metrics} if metrics else {})}
    export_model(accelerator, model, book.config, output_dir / "model", info)
    if accelerator.is_main_process:
        print(f"exported {output_dir / 'model'} (step {state.step})")
        print(f"stopped for time; run again to continue: step {state.step}, {book.clock.stop_note()}")


def done(
    book: Bookkeeping,
    model: torch.nn.Module,
    forward: torch.nn.Module,
    eval_loader: DataLoader,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Training is done: the last train loss, the last evaluation (unless that step had one), the exports."""
    accelerator = book.accelerator
    config = book.config
    state = book.state
    output_dir = Path(config.output_dir)
    if book.check.verify_at == state.step:  # resumed at the end: no first step to verify
        accelerator.print(f"finished at step {state.step}: nothing to resume")
    if book.loss.batches:  # the last, partial logging interval
        loss_total, _ = book.loss.total()
        if not math.isfinite(loss_total):
            why = f"the train loss of the last steps is {loss_total}"
            raise RunError(diverged_message(why, config, book.last_saved))
        book.loss.log(loss_total, scheduler)
    metrics = book.metrics
    if metrics is None or state.last_eval_step != state.step:
        metrics = evaluate(accelerator, forward, eval_loader, config)
        if not all(math.isfinite(value) for value in metrics.values()):
            why = f"the final eval metrics are {metrics}"
            raise RunError(diverged_message(why, config, book.last_saved))
        if state.last_eval_step != state.step:  # a run resumed at its last step has logged it already
            track_best(accelerator, model, config, state, metrics)
    best = f"(best {config.best_metric} {state.best_value:.4f}, step {state.best_step})"
    best_export = output_dir / "best_model" / "export.json"
    try:  # best_model/ may not have come with the run (damaged in its copy: a warning at the start)
        best_kept = json.loads(best_export.read_text())["step"] == state.best_step
    except (OSError, ValueError, KeyError, TypeError):
        best_kept = False
    if state.stopped_early:  # why training ended before its schedule did
        accelerator.print(
            f"stopped early at step {state.step}: {config.best_metric} has not improved for "
            f"{state.evals_since_best} evaluations; best {state.best_value:.4f} at step {state.best_step}"
            + (f", exported to {output_dir / 'best_model'}/" if best_kept else "")
        )
    accelerator.print(
        f"done: {state.step} optimizer steps, {state.samples_seen} samples | "
        + " | ".join(f"{name} {value:.4f}" for name, value in metrics.items())
    )
    export_model(accelerator, model, config, output_dir / "model", {"step": state.step, **metrics})
    exported = f"exported {output_dir / 'model'} (last step)"
    if best_kept:
        accelerator.print(f"{exported} and {output_dir / 'best_model'} {best}")
    else:
        accelerator.print(f"{exported}; no best_model/ of the best evaluation {best}")


def epoch_batches(
    train_loader: Any, train_set: Any, state: LoopState, accelerator: Accelerator, config: TrainConfig
) -> Iterator:
    """The train batches of the epoch `state` is in, in its order: after a resume, those not yet seen."""
    train_loader.set_epoch(state.epoch)  # the data order of this epoch (a StreamLoader: its stream's)
    if isinstance(train_set, IterableDataset):  # a stream resumes from its own state (training/streams.py)
        yield from train_loader
        state.epoch += 1  # it ran out: the epoch is over (a map-style one ends on its count of steps)
        state.epoch_samples = 0
        return
    train_loader.dataset.set_epoch(state.epoch)  # SeededItems (training/seeding.py); Accelerate's sometimes
    batches = train_loader
    if state.epoch_samples:  # resumed inside this epoch: skip what the checkpoint already saw
        seen = state.epoch_samples // config.global_batch_size
        batches = accelerator.skip_first_batches(train_loader, seen)
        batches.set_epoch(state.epoch)
    if accelerator.device.type == "cuda" and isinstance(batches, DataLoaderShard):
        batches.device = None  # Accelerate would copy each batch when it is due, on the compute stream
        yield from copied_ahead(batches, accelerator.device)
    else:
        yield from batches


def copied_ahead(batches: Iterable, device: torch.device) -> Iterator:
    """`batches` (page-locked, on the host) on the GPU, each copied on a stream of its own while the step
    before it computes: batch k+1's copy is queued before step k's kernels and runs beside them. Not for a
    stream (StreamLoader): its saved position would count the batch read ahead."""
    copies = torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)
    ahead = None
    for batch in batches:
        compute.wait_stream(copies)  # the batch copied last is on the device before its step runs
        # Memory that the steps queued so far used may hold the next copy: it waits for them.
        copies.wait_stream(compute)
        with torch.cuda.stream(copies):
            current, ahead = ahead, send_to_device(batch, device, non_blocking=True)
        if current is not None:
            yield current
    if ahead is not None:
        compute.wait_stream(copies)
        yield ahead


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader, config: TrainConfig
) -> dict[str, float]:
    """The task's metrics over the whole eval set, the same on any number of processes: gather_for_metrics
    gives the per-sample values in dataset order, without the samples repeated to fill the last batch."""
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
    """Log the evaluation's `metrics`; export best_model/ when they beat the best so far, else count one
    more evaluation without."""
    accelerator.log(metrics, step=state.step)
    state.last_eval_step = state.step
    value = metrics[config.best_metric]
    best = state.best_value
    if best is None or (value > best if config.METRIC_GOALS[config.best_metric] == "max" else value < best):
        state.best_value = value
        state.best_step = state.step
        state.evals_since_best = 0
        # Outside checkpoints/, so rotation never removes it; predict.py --model_dir <output_dir>/best_model.
        folder = Path(config.output_dir) / "best_model"
        export_model(accelerator, model, config, folder, {"step": state.step, **metrics})
    else:
        state.evals_since_best += 1


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
