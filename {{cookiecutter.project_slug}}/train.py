"""Train a model with Hugging Face Accelerate: the whole loop, top to bottom.

    python train.py [--config configs/local.yaml] [--field value ...]
    python train.py --check_task [--config ...]   # after editing task.py: its contract, nothing written
    scripts/run_local.sh | run_colab.sh | run_kaggle.sh | sbatch scripts/run_slurm.sh

Without --config, the detected platform's file. Everything about the task (data, batches, model, loss,
metrics) comes from `task.py` in the package under src/: change that, not this loop (else the README's
"Change the loop"). Reruns and the exit statuses (0 done, 75 stopped, 1 an error): docs/resume.md."""

from __future__ import annotations

import contextlib
import errno
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

# First only what reading the config needs (no torch): see utils/run/cli.py.
from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import ConfigError, TrainConfig, gradient_accumulation_steps, save_config
from {{ cookiecutter.package_name }}.utils.machine.hardware import (
    choose_cpu_threads,
    hide_gpus_from_cpu_run,
    launch_problem,
    resolve_mixed_precision,
)
from {{ cookiecutter.package_name }}.utils.run.cli import check_first, read_config
from {{ cookiecutter.package_name }}.utils.run.start_line import model_line, start_line

PROJECT = Path(__file__).resolve().parent

if __name__ == "__main__":
    check_first(PROJECT)  # --help, --check_task and a config error answer before torch loads

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration
from accelerate.utils.operations import slice_tensors
from torch.utils.data import DataLoader, Dataset, IterableDataset

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import (
    LoopState,
    frozen_weights,
    save_trained_weights_only,
)
from {{ cookiecutter.package_name }}.utils.checkpoints.mirror import FINISH_TIMEOUT_S, STOP_WAIT_S, Mirror, check_stores
from {{ cookiecutter.package_name }}.utils.checkpoints.persist import Persister
from {{ cookiecutter.package_name }}.utils.machine.accelerate_fixes import speed_up_accelerate
from {{ cookiecutter.package_name }}.utils.machine.compile_cache import load_cache
from {{ cookiecutter.package_name }}.utils.machine.memory import fit_batch_size
from {{ cookiecutter.package_name }}.utils.run.curves import save_curves
from {{ cookiecutter.package_name }}.utils.run.fingerprint import data_fingerprint
from {{ cookiecutter.package_name }}.utils.run.history import begin_history
from {{ cookiecutter.package_name }}.utils.run.run_dir import OutputLock, RunError, on_main, write_error
from {{ cookiecutter.package_name }}.utils.run.start import resume
from {{ cookiecutter.package_name }}.utils.run.task_check import TaskModel, build_datasets, check_task
from {{ cookiecutter.package_name }}.utils.run.tracking import start_trackers, trackers, truncate_metrics
from {{ cookiecutter.package_name }}.utils.training.loop import Bookkeeping, finish, roll_back
from {{ cookiecutter.package_name }}.utils.training.lr_find import find_lr
from {{ cookiecutter.package_name }}.utils.training.resume_check import StepDigest
from {{ cookiecutter.package_name }}.utils.training.schedule import planned_steps, schedule_factor
from {{ cookiecutter.package_name }}.utils.training.seeding import SeededItems, follow_the_sample, running_stats, seed_run
from {{ cookiecutter.package_name }}.utils.training.signals import (
    EXIT_STOPPED,
    StopRequest,
    exit_process,
    ignore_stop_signals,
)
from {{ cookiecutter.package_name }}.utils.training.streams import StreamLoader, loader_workers
from {{ cookiecutter.package_name }}.utils.training.timing import SessionClock


def main(argv: list[str] | None = None) -> int:
    stop = StopRequest()  # first, so that a signal during start-up is not lost
    hide_gpus_from_cpu_run()  # ACCELERATE_USE_CPU=1 on a GPU machine: before anything touches CUDA
    config, config_path, output_warnings = read_config(argv, PROJECT)
    precision, precision_why = resolve_mixed_precision(config.mixed_precision)

    # --- setup: the Accelerator first, so that everything after it knows the world it runs in
    speed_up_accelerate()  # skips Accelerate's per-step work that cannot change a result
    accelerator = make_accelerator(config, precision)
    lock = OutputLock(config.output_dir)  # taken in train() on the main process
    # The persistent copy, written in the background by the main process; started in train().
    mirror = Mirror(
        config.output_dir, config.mirror_dir, config.keep_checkpoints, enabled=accelerator.is_main_process
    )
    # Checkpoints: staged by the loop, written by a thread, handed to the mirror (checkpoints/persist.py).
    saver = Persister(accelerator, config, published=mirror.request)
    began: list[Bookkeeping] = []  # the session's bookkeeping, once it trains: its curves are drawn last
    try:
        if unconnected := launch_problem(accelerator.num_processes):
            raise ConfigError(unconnected)
        accelerator.gradient_accumulation_steps = gradient_accumulation_steps(
            config, accelerator.num_processes
        )
        for warning in output_warnings:
            accelerator.print(f"WARNING: {warning}")
        threads = choose_cpu_threads()  # torch's intra-op threads, for this machine's CPUs and processes
        accelerator.print(start_line(accelerator, config, config_path, precision_why, threads))
        accelerator.print("building the datasets, the model and the optimizer")  # seconds for some tasks
        finished = train(accelerator, config, stop, lock, mirror, saver, began)
        ignore_stop_signals(0)  # training is over: a late signal must not replace the exit status
    finally:
        # After a crash, an error while closing (a tracker's file on the same full disk) would hide it.
        failed = (Exception,) if sys.exc_info()[0] is not None else ()
        try:
            if began and began[0].streamed:  # its workers end, also after a crash (its state is checkpointed)
                began[0].loader.close()
            saver.join()  # a save in flight is finished, also after a crash
            # The last checkpoint and exports reach the persistent copy, also after a crash; briefly after
            # SIGTERM (the platform's: it kills soon after), not after the stop button's SIGINT.
            mirror.finish(STOP_WAIT_S if stop.signal_name == "SIGTERM" else FINISH_TIMEOUT_S)
            with contextlib.suppress(*failed):
                accelerator.end_training()  # closes trackers and the process group, also after a crash
            if began and accelerator.is_main_process:  # after a divergence too; the run is saved and copied
                save_curves(config.output_dir, config.best_metric, began[0].state.best_step)
        finally:
            lock.release()  # after the trackers' last writes; a no-op where it was not taken
    return 0 if finished else EXIT_STOPPED


def train(
    accelerator: Accelerator,
    config: TrainConfig,
    stop: StopRequest,
    lock: OutputLock,
    mirror: Mirror,
    saver: Persister,
    began: list[Bookkeeping],
) -> bool:
    """Train until done (True), or until a stop or the time budget was agreed on and checkpointed (False)."""
    clock = SessionClock(config, accelerator.is_main_process, saver, mirror)  # time_budget counts from here
    seed_run(config)  # --- seeding: the same seed everywhere, deterministic kernels (training/seeding.py)

    # --- data (build_loaders, below)
    train_set, train_loader, eval_set, steps_per_epoch, data = build_loaders(accelerator, config)
    schedule_steps = planned_steps(config, steps_per_epoch)  # the learning-rate schedule's length
    # --- the output folder: this run's alone from here on; nothing was written to it before the checks above
    check_stores(accelerator, config)  # a URL's credentials work, or one line says what to set
    for note in on_main(accelerator, lock.acquire):
        accelerator.print(note)
    # --- model, optimizer, schedule (build_model, below)
    model, trained, frozen, optimizer, scheduler = build_model(accelerator, config, schedule_steps)
    # --- prepare: wraps for DDP, shards the loaders, moves to the device, sets up autocast
    model, optimizer, scheduler, train_loader = accelerator.prepare(model, optimizer, scheduler, train_loader)
    # --- speed, opt-in: torch.compile, sharing the prepared model's weights (checkpoints, exports: `model`)
    forward = torch.compile(model) if config.compile else model
    if config.find_lr:  # a learning-rate range test, not training: lr_find.png only (training/lr_find.py)
        return find_lr(accelerator, config, optimizer, train_loader, step_gradients, model, forward)

    # --- resume: weights, optimizer, schedule and RNG from save_state; the rest from the loop state
    state, resumed_from = resume(accelerator, config, frozen, data, schedule_steps)
    fit_batch_size(accelerator, config, model, train_set, resumed_from)  # auto_batch_size (machine/memory.py)
    book = resume_session(
        accelerator, config, state, resumed_from, mirror, steps_per_epoch, schedule_steps, stop, clock, saver
    )
    eval_loader = accelerator.prepare(eval_batches(accelerator, config, eval_set))  # the per-device size now
    began.append(book)

    # --- the loop: one optimizer step per batch, then one call per decision (utils/training/loop.py)
    gradients = step_gradients(accelerator, config, model, forward, trained, book)
    while not book.end.now():
        model.train()
        for batch in book.epoch_batches(train_loader, train_set):  # after a resume: those not yet seen
            step_loss = gradients(batch)
            optimizer.step()  # after the last micro-batch, whose gradients were synced
            optimizer.zero_grad()
            # fp16's loss scaler skips a step whose gradients overflowed: the schedule does not count it.
            skipped = accelerator.optimizer_step_was_skipped
            if not skipped:
                scheduler.step()
            book.count(step_loss, skipped)  # the step, the position in the data, skipped fp16 steps
            book.log(scheduler)  # every log_every steps: train loss, and the stop and time votes
            book.evaluate(model, forward, eval_loader)  # when due: metrics, best_model/, early stopping
            book.checkpoint(model, gradients)  # when due, for time, or before a stop; never of broken weights
            if book.end.now():  # done, stopping, or diverged
                break
        roll_back(book)  # diverged: back to a checkpoint from before it, past its data, if one may
        book.after_epoch(model, forward, eval_loader)  # a stream's epoch ends where it ran out: evaluated
    # --- final evaluation and export (or, after a stop, what a session that ends now should leave)
    return finish(book, model, forward, eval_loader, scheduler)


def step_gradients(
    accelerator: Accelerator,
    config: TrainConfig,
    model: torch.nn.Module,
    forward: torch.nn.Module,
    trained: list[torch.nn.Parameter],
    book: Bookkeeping,
) -> Callable[..., torch.Tensor]:
    """The loop's step before the optimizer's: `gradients(batch, digest)` runs forward and backward over the
    batch's micro-batches of `forward` (the prepared model, or its compiled module), clips the gradients and
    returns the summed loss. The probe at a session's last checkpoint calls it too, with BatchNorm's
    statistics left alone (`tracking=False`)."""
    accumulation = accelerator.gradient_accumulation_steps
    micro_size = config.per_device_batch_size
    first_place = accelerator.process_index * accumulation  # this process's micro-batches in the global batch
    norms, stats_here = running_stats(accelerator, model)  # BatchNorm's, and whether this process's count
    # What task.loss gets: calls run `forward`, attributes come from the model build_model returned (DDP's
    # wrapper has none of them), on any number of processes.
    task_model = TaskModel(forward, accelerator.unwrap_model(model), training=True)

    def gradients(batch: object, digest: StepDigest | None = None, tracking: bool = True) -> torch.Tensor:
        # Each micro-batch draws its samples' random numbers (dropout...): training/seeding.py. The step is
        # recorded only when it is the first after a checkpoint.
        digest = digest or book.check.step_digest(book.state.step)
        step_loss = None
        for micro in range(accumulation):
            micro_batch = batch  # the whole batch is one micro-batch unless accumulating
            if accumulation > 1:
                micro_batch = slice_tensors(batch, slice(micro * micro_size, (micro + 1) * micro_size))
            with accelerator.accumulate(model):  # syncs gradients on the last micro-batch only
                # BatchNorm's running statistics follow the step's first micro-batch alone (the main
                # process's): the same samples on any number of processes with the same per-device
                # batch, so 1 and N processes end with the same statistics.
                for layer in norms:
                    layer.track_running_stats = tracking and stats_here and micro == 0
                follow_the_sample(config.seed, book.state.step, first_place + micro, accelerator.device)
                loss = task.loss(task_model, micro_batch)
                digest.add(micro_batch, loss)  # on the first step after a checkpoint only
                accelerator.backward(loss)  # divides by the accumulation steps
            exact = loss.detach().to(book.loss.sum.dtype)  # added up exactly (training/loop.py: TrainLoss)
            step_loss = exact if step_loss is None else step_loss + exact
        digest.norm = accelerator.clip_grad_norm_(trained, config.max_grad_norm)
        return step_loss

    return gradients


def make_accelerator(config: TrainConfig, precision: str) -> Accelerator:
    """The Accelerator: trackers, the output folder, the loaders' order, one optimizer step per batch."""
    return Accelerator(
        mixed_precision=precision,
        log_with=trackers(config),
        project_config=ProjectConfiguration(
            project_dir=config.output_dir, logging_dir=str(Path(config.output_dir) / "logs")
        ),
        # Every process draws the same permutation from data_seed and takes its own share of it.
        # non_blocking: batches from pinned memory (pin_memory below, on a GPU) are copied to the device
        # while it still computes the previous step.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=config.seed, non_blocking=True
        ),
        # The loader yields whole accumulation windows (see the data section), so the optimizer steps
        # after every `accumulation` micro-batches and never on a short window at the end of an epoch.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False),
        # Stepped by hand once per optimizer step: Accelerate would step it once per process.
        step_scheduler_with_optimizer=False,
    )


def resume_session(
    accelerator: Accelerator,
    config: TrainConfig,
    state: LoopState,
    resumed_from: Path | None,
    mirror: Mirror,
    steps_per_epoch: int,
    schedule_steps: int,
    stop: StopRequest,
    clock: SessionClock,
    saver: Persister,
) -> Bookkeeping:
    """The session's start from `state` (run/start.py): the mirror, the config, metrics.jsonl cut back, the
    history, the trackers; and its bookkeeping, for the schedule's steps, or max_steps if sooner."""
    mirror.start(state.run_id, config.start_over, state.step)
    if accelerator.is_main_process:
        save_config(config, Path(config.output_dir) / "config.yaml")  # what this run is, once it may run
        # Drop what was logged after the checkpoint (or repair a log cut shorter than it: one warning).
        if warning := truncate_metrics(config.output_dir, state.metrics_bytes, state.step):
            print(warning)
    history = begin_history(accelerator, config, state, resumed_from)  # prints what changed since last time
    # What the last session compiled, before the first compiled call (every process): machine/compile_cache.py
    history.note("compile_cache", load_cache(config, accelerator.device, resumed_from))
    total_steps = min(schedule_steps, config.max_steps) if config.max_steps else schedule_steps
    start_trackers(accelerator, config, state, finished=state.stopped_early or state.step >= total_steps)
    return Bookkeeping(
        accelerator, config, state, resumed_from, steps_per_epoch, total_steps, stop, clock, saver, history
    )


def build_loaders(
    accelerator: Accelerator, config: TrainConfig
) -> tuple[Dataset, DataLoader | StreamLoader, Dataset, int, dict[str, str] | None]:
    """The task's train set, the train loader, the eval set, the number of optimizer steps in an epoch (0 for
    a stream: its epoch ends when it runs out), and the data's fingerprint (on the main process).

    One train batch is one process's share of an optimizer step (per_device_batch_size x accumulation
    samples), cut into micro-batches in the loop. With drop_last, every optimizer step sees exactly
    global_batch_size samples and an epoch has len(train_set) // global_batch_size steps on any
    number of processes, which is what lets a checkpoint move between world sizes.
    """
    train_set, eval_set = build_datasets(config)  # two sets, neither empty, or one line (run/task_check.py)
    pin_memory = accelerator.device.type == "cuda"  # page-locked batches: faster, asynchronous copies
    stream = isinstance(train_set, IterableDataset)  # no length: max_steps instead (training/streams.py)
    if stream:  # its own state, saved with each checkpoint (registered), is where a resume continues
        train_loader = StreamLoader(train_set, config, accelerator, task.collate, pin_memory)
        accelerator.register_for_checkpointing(train_loader)
    else:
        order = getattr(train_set, "sampler", None)  # a set's own random order (lm: none stored per sample)
        train_loader = DataLoader(
            SeededItems(train_set, config.seed),  # its items' random numbers follow the sample
            batch_size=config.per_device_batch_size * accelerator.gradient_accumulation_steps,
            shuffle=order is None,
            sampler=order,
            drop_last=True,
            collate_fn=task.collate,
            num_workers=loader_workers(config, streamed=False),
            worker_init_fn=ignore_stop_signals,  # a signal to the whole process group is the main process's
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(config.seed),
        )
    steps_per_epoch = 0 if stream else len(train_set) // config.global_batch_size
    if steps_per_epoch == 0 and not stream:
        raise ConfigError(
            f"global_batch_size={config.global_batch_size} is larger than the training set ({len(train_set)})"
        )
    if len(eval_set) < accelerator.num_processes:  # gather_for_metrics needs a sample on every process
        raise ConfigError(
            f"the eval split has {len(eval_set)} sample(s), fewer than the {accelerator.num_processes} "
            "process(es): give it more data"
        )
    for warning in check_task(config, train_set, eval_set):  # task.py's contract, on two samples
        accelerator.print(f"WARNING: {warning}")
    # What it trains and evaluates on, which a resume must find unchanged (utils/run/fingerprint.py)
    data = data_fingerprint(train_set, eval_set) if accelerator.is_main_process else None
    return train_set, train_loader, eval_set, steps_per_epoch, data


def eval_batches(accelerator: Accelerator, config: TrainConfig, eval_set: Dataset) -> DataLoader:
    """The eval loader, in per-device batches, the last filled up from the set's start as Accelerate fills
    it on N processes (gather_for_metrics drops the fill): the same batch shapes on any process count, so no
    kernel computes a sample inside a batch of another shape (which may round it otherwise)."""
    fill = -len(eval_set) % config.per_device_batch_size
    return DataLoader(
        eval_set,
        batch_size=config.per_device_batch_size,
        sampler=[*range(len(eval_set)), *(i % len(eval_set) for i in range(fill))],
        collate_fn=task.collate,
        num_workers=loader_workers(config, streamed=False),
        worker_init_fn=ignore_stop_signals,
        pin_memory=accelerator.device.type == "cuda",
    )


def build_model(accelerator: Accelerator, config: TrainConfig, schedule_steps: int) -> tuple:
    """The task's model, its trained parameters, the frozen ones' hash, AdamW and the lr_schedule (sized in
    optimizer steps, so independent of the world size)."""
    model = task.build_model(config)
    # Frozen parameters (a pretrained base under LoRA) stay out of the optimizer and of the checkpoints,
    # which record their hash instead: a resume must find the same ones in the model it builds.
    trained = [param for param in model.parameters() if param.requires_grad]  # listed once: clipped each step
    frozen = frozen_weights(model)
    save_trained_weights_only(accelerator)
    accelerator.print(model_line(model))  # parameters, trained ones, a checkpoint's size
    optimizer = torch.optim.AdamW(trained, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_factor(config, schedule_steps))
    return model, trained, frozen, optimizer, scheduler


if __name__ == "__main__":
    try:
        status: int | str = main()
    except ConfigError as error:
        status = f"config error: {error}"
    except RunError as error:
        status = f"error: {error}"
    except RuntimeError as error:  # torch's when a loader worker died (killed for memory, often): one line
        if not str(error).startswith("DataLoader worker (pid"):
            raise
        status = f"error: {str(error).split('. ')[0]} (out of memory?): rerun the same command to continue"
    except ConnectionResetError as error:  # a loader worker killed as it handed a batch over
        if not any("utils/data" in frame.filename for frame in traceback.extract_tb(error.__traceback__)):
            raise
        status = "error: DataLoader worker died handing a batch over (out of memory?): rerun the same command"
        status += " to continue"
    except OSError as error:  # a write outside the checkpoint code (metrics, exports' folders)
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise
        status = f"error: {write_error(Path(error.filename or '.'), error)}"
    exit_process(status)  # sys.exit, without the teardown that gloo's threads can abort
