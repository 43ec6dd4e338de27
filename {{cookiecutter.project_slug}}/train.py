"""Train a model with Hugging Face Accelerate: the whole loop, top to bottom.

    python train.py [--config configs/local.yaml] [--field value ...]
    python train.py --check_task [--config ...]   # after editing task.py: its contract, nothing written
    scripts/run_local.sh | run_colab.sh | run_kaggle.sh | sbatch scripts/run_slurm.sh

Without --config, the file of the detected platform is used (configs/colab.yaml on Colab, ...).

Phases: config -> accelerator -> seeding -> data -> model -> prepare -> resume -> loop (accumulation,
logging, evaluation, checkpoints, stop on signal or time) -> export. Everything about the task (data,
batches, model, loss, metrics) comes from `task.py` in the package under src/: change that, not this loop.

Rerunning the same command continues from the newest valid checkpoint (`resume: auto`), exactly:
the resumed run ends with the same weights and logs the same losses as one that was never stopped.
Exit status: 0 when training is done; 75 when it stopped after a checkpoint, on a signal or because its
`time_budget` was nearly spent (then also with model/ exported and the curves drawn, and the last line
"stopped for time; run again to continue"); 1 with a one-line `config error:` or `error:` (a bad value,
a folder in use or holding another run, a full disk, divergence). A time stop shares 75 (EX_TEMPFAIL)
with a signal because both mean the same to whoever started the run: nothing is wrong, rerun the same
command to continue. The SLURM launcher requeues on it when the run made progress, which a time stop
always has (it is decided at a logging step, after at least one optimizer step of this session).
"""

from __future__ import annotations

import errno
import math
import os
import sys
import time
from pathlib import Path

# First only what reading the config needs (no torch): see `check_config_first`.
from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import (
    ConfigError,
    TrainConfig,
    gradient_accumulation_steps,
    load_config,
    save_config,
)
from {{ cookiecutter.package_name }}.utils.devices import detect_platform, main_process_of_launch
from {{ cookiecutter.package_name }}.utils.hardware import (
    check_output_dir,
    choose_cpu_threads,
    hide_gpus_from_cpu_run,
    launch_problems,
    mps_determinism_warnings,
    resolve_mixed_precision,
    torch_lacks_fsdp2,
)
from {{ cookiecutter.package_name }}.utils.remote import check_urls, is_url

PROJECT = Path(__file__).resolve().parent
CONFIGS = PROJECT / "configs"


def read_config(argv: list[str] | None) -> tuple[TrainConfig, Path, list[str]]:
    """The run's config, its file, and warnings about its output_dir; a ConfigError says what is wrong."""
    where = detect_platform()
    config, config_path = load_config(argv, CONFIGS / f"{where}.yaml", task.Config)
    # Relative to the project, not to the working directory: the same command finds its run from anywhere.
    # Normalised lexically, not resolved: a path through a symlink (a mounted Drive) keeps its name.
    config.output_dir = os.path.normpath(PROJECT / config.output_dir)
    if config.mirror_dir and not is_url(config.mirror_dir):  # a URL is a remote store (utils/remote.py)
        config.mirror_dir = os.path.normpath(PROJECT / config.mirror_dir)
    check_urls(config, config_path)  # no network: a protocol that cannot work, a key inside a URL
    try:
        output_warnings = check_output_dir(config.output_dir, where, config.mirror_dir)
    except ValueError as error:
        raise ConfigError(f"{config_path}: {error}") from error
    return config, config_path, output_warnings


def check_config_first() -> None:
    """`python train.py`: read the config before torch and Accelerate load (seconds), so that --help and a
    config error answer at once, and say what comes next. main() reads it again (milliseconds)."""
    try:
        _, config_path, _ = read_config(None)
    except ConfigError as error:
        sys.exit(f"config error: {error}")
    if main_process_of_launch():
        print(f"config {config_path} checked: loading PyTorch and Accelerate", flush=True)


if __name__ == "__main__":
    if "--check_task" in sys.argv[1:]:  # after editing task.py: its contract on two samples, nothing written
        from {{ cookiecutter.package_name }}.utils.task_check import command

        sys.argv.remove("--check_task")
        sys.exit(command(read_config))
    check_config_first()

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration, set_seed
from accelerate.utils.operations import send_to_device, slice_tensors
from torch.utils.data import DataLoader

from {{ cookiecutter.package_name }}.launch import report_outcome
from {{ cookiecutter.package_name }}.utils.accelerate_fixes import speed_up_accelerate
from {{ cookiecutter.package_name }}.utils.checkpoint import (
    LoopState,
    export_model,
    frozen_weights,
    resume,
    save_checkpoint,
    save_trained_weights_only,
)
from {{ cookiecutter.package_name }}.utils.memory import batch_size_candidates, fit_batch_size
from {{ cookiecutter.package_name }}.utils.mirror import Mirror, check_stores, open_mirror
from {{ cookiecutter.package_name }}.utils.plots import plot_metrics
from {{ cookiecutter.package_name }}.utils.progress import Progress
from {{ cookiecutter.package_name }}.utils.run_dir import OutputLock, RunError, claim, write_error
from {{ cookiecutter.package_name }}.utils.signals import EXIT_STOPPED, StopRequest, ignore_stop_signals
from {{ cookiecutter.package_name }}.utils.streams import StreamLoader
from {{ cookiecutter.package_name }}.utils.task_check import check_task
from {{ cookiecutter.package_name }}.utils.timing import SessionClock
from {{ cookiecutter.package_name }}.utils.tracking import (
    metrics_size,
    start_trackers,
    trackers,
    truncate_metrics,
)


def main(argv: list[str] | None = None) -> int:
    stop = StopRequest()  # first, so that a signal during start-up is not lost
    hide_gpus_from_cpu_run()  # ACCELERATE_USE_CPU=1 on a GPU machine: before anything touches CUDA
    config, config_path, output_warnings = read_config(argv)
    if unsupported := torch_lacks_fsdp2():
        raise ConfigError(unsupported)
    precision, precision_why = resolve_mixed_precision(config.mixed_precision)

    # --- setup: the Accelerator first, so that everything after it knows the world it runs in
    speed_up_accelerate()  # skips Accelerate's per-step work that cannot change a result
    accelerator = Accelerator(
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
    lock = OutputLock(config.output_dir)  # taken in train() on the main process
    # The persistent copy, written in the background by the main process; started in train().
    mirror = open_mirror(
        config.output_dir, config.mirror_dir, config.keep_checkpoints, enabled=accelerator.is_main_process
    )
    try:
        unconnected, launch_warnings = launch_problems(
            accelerator.num_processes, accelerator.distributed_type.value
        )
        if unconnected:
            raise ConfigError(unconnected)
        accelerator.gradient_accumulation_steps = gradient_accumulation_steps(
            config, accelerator.num_processes
        )
        device_warnings = mps_determinism_warnings(accelerator.device.type, config.deterministic)
        for warning in [*launch_warnings, *output_warnings, *device_warnings]:
            accelerator.print(f"WARNING: {warning}")
        finished = train(accelerator, config, config_path, stop, lock, mirror, precision_why)
        stop.ignore_from_now_on()
    finally:
        try:
            mirror.finish()  # the last checkpoint and exports reach the persistent copy, also after a crash
            accelerator.end_training()  # closes trackers and the process group, also after a crash
        finally:
            lock.release()  # after the trackers' last writes; a no-op where it was not taken
    return 0 if finished else EXIT_STOPPED


def train(
    accelerator: Accelerator,
    config: TrainConfig,
    config_path: Path,
    stop: StopRequest,
    lock: OutputLock,
    mirror: Mirror,
    precision_why: str,
) -> bool:
    """Train until done (True), or until a stop signal or the time budget was agreed on and checkpointed
    (False).

    `lock` is taken once the config and data have passed their checks, before anything is written;
    `mirror` once the run to continue is known. `precision_why`: how the mixed precision was chosen."""
    clock = SessionClock(config, accelerator.is_main_process)  # time_budget counts from here
    output_dir = Path(config.output_dir)
    accumulation = accelerator.gradient_accumulation_steps
    threads = choose_cpu_threads()
    accelerator.print(
        f"platform {detect_platform()} | config {config_path} | world size {accelerator.num_processes} | "
        f"distributed {accelerator.distributed_type.value} | device {accelerator.device} | "
        f"mixed precision {accelerator.mixed_precision} ({precision_why}) | "
        f"per-device batch {config.per_device_batch_size} x {accelerator.num_processes} processes x "
        f"{accumulation} accumulation = global batch {config.global_batch_size} | "
        f"deterministic kernels {'on' if config.deterministic else 'off'} | CPU threads {threads} | "
        f"output {output_dir}"
    )

    accelerator.print("building the datasets, the model and the optimizer")  # seconds for some tasks
    # --- seeding: different dropout per process, same data order for all (data_seed above)
    set_seed(config.seed, device_specific=True)
    # Bitwise-equal reruns and resumes on a GPU also need kernels that add in a fixed order (attention's
    # backward pass and cuBLAS do not by default). Strict: an op without such a kernel stops the run and
    # names itself, rather than quietly breaking exact resume. cuBLAS reads its setting at its first use.
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(config.deterministic)

    # --- data
    # One train batch is one process's share of an optimizer step (per_device_batch_size x accumulation
    # samples), cut into micro-batches in the loop. With drop_last, every optimizer step sees exactly
    # global_batch_size samples and an epoch has len(train_set) // global_batch_size steps on any
    # number of processes, which is what lets a checkpoint move between world sizes.
    train_set, eval_set = task.build_datasets(config)
    pin_memory = accelerator.device.type == "cuda"  # page-locked batches: faster, asynchronous copies
    # A stream (an IterableDataset) has no length: max_steps sets the length, epochs end when it runs out,
    # and its own state, saved with each checkpoint, is where a resume continues (utils/streams.py).
    stream = isinstance(train_set, torch.utils.data.IterableDataset)
    if stream:
        train_loader = StreamLoader(train_set, config, accelerator, task.collate, pin_memory)
        accelerator.register_for_checkpointing(train_loader)
    else:
        train_loader = DataLoader(
            train_set,
            batch_size=config.per_device_batch_size * accumulation,
            shuffle=True,
            drop_last=True,
            collate_fn=task.collate,
            num_workers=config.num_workers,
            worker_init_fn=ignore_stop_signals,  # a signal to the whole process group is the main process's
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(config.seed),
        )
    eval_loader = DataLoader(
        eval_set,
        batch_size=config.per_device_batch_size,
        collate_fn=task.collate,
        num_workers=config.num_workers,
        worker_init_fn=ignore_stop_signals,
        pin_memory=pin_memory,
    )
    steps_per_epoch = 0 if stream else len(train_set) // config.global_batch_size
    if steps_per_epoch == 0 and not stream:
        raise ConfigError(
            f"global_batch_size={config.global_batch_size} is larger than the training set ({len(train_set)})"
        )
    if len(eval_set) < accelerator.num_processes:  # gather_for_metrics needs a sample on every process
        raise ConfigError(
            f"the eval split has {len(eval_set)} sample(s), fewer than the {accelerator.num_processes} "
            "process(es): give it more data (for example a larger eval_fraction)"
        )
    schedule_steps = config.max_steps if stream else steps_per_epoch * config.num_epochs
    total_steps = min(schedule_steps, config.max_steps) if config.max_steps else schedule_steps
    for warning in check_task(config, train_set, eval_set):  # task.py's contract, on two samples
        accelerator.print(f"WARNING: {warning}")

    # --- the output folder: this run's alone from here on; nothing was written to it before the checks above
    check_stores(accelerator, config)  # a URL's credentials work, or one line says what to set
    claim(accelerator, lock)

    # --- model, optimizer, schedule (sized in optimizer steps, so independent of the world size)
    model = task.build_model(config)
    # Frozen parameters (a pretrained base under LoRA) stay out of the optimizer and of the checkpoints,
    # which record their hash instead: a resume must find the same ones in the model it builds.
    trained = [param for param in model.parameters() if param.requires_grad]  # listed once: clipped each step
    frozen = frozen_weights(model)
    save_trained_weights_only(accelerator)
    optimizer = torch.optim.AdamW(trained, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(config.warmup_steps, schedule_steps)
    )

    # --- prepare: wraps for DDP, shards the loaders, moves to the device, sets up autocast
    model, optimizer, scheduler, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, scheduler, train_loader, eval_loader
    )

    # --- memory and speed, opt-in: the largest per-device batch that fits, then torch.compile
    if config.auto_batch_size:
        candidates = batch_size_candidates(
            config.per_device_batch_size, config.global_batch_size, accelerator.num_processes
        )
        samples = task.collate([train_set[i] for i in range(candidates[0])])
        probe_batch = send_to_device(samples, accelerator.device)

        def train_step(size: int) -> None:
            accelerator.backward(task.loss(model, slice_tensors(probe_batch, slice(0, size))))

        config.per_device_batch_size = fit_batch_size(accelerator, model, candidates, train_step)
        accumulation = gradient_accumulation_steps(config, accelerator.num_processes)
        accelerator.gradient_accumulation_steps = accumulation
        accelerator.print(
            f"auto_batch_size: per-device batch {config.per_device_batch_size} x {accumulation} accumulation"
        )
    # The compiled module shares the prepared model's weights; checkpoints and exports use `model`.
    forward = torch.compile(model) if config.compile else model

    # --- resume: weights, optimizer, schedule and RNG from save_state; the rest from the loop state
    # Or refuse: a folder of another run, or whose checkpoints cannot be read. The newest checkpoint of
    # this run in mirror_dir or under import_from is brought in first, if newer than output_dir's.
    state, resumed_from = resume(accelerator, config, frozen)
    start_step = state.step
    mirror.start(state.run_id, config.start_over)
    if accelerator.is_main_process:
        save_config(config, output_dir / "config.yaml")  # what this run is: written once it may run
        truncate_metrics(output_dir, state.metrics_bytes)  # drop what was logged after the checkpoint
    start_trackers(accelerator, config, state, finished=state.step >= total_steps)

    # --- the loop
    # Train loss summed on the device since the last log: no host-device sync per step.
    running_loss = torch.tensor(own_loss_sum(state.loss_sums, accelerator), device=accelerator.device)
    running_batches, stopping, out_of_time, timed_checkpoint = state.loss_batches, False, False, False
    diverged = ""  # why training cannot go on: a non-finite loss, metric or weight
    last_saved = resumed_from  # the newest checkpoint known to hold finite weights
    micro_size = config.per_device_batch_size
    metrics: dict[str, float] | None = None
    progress = Progress(total_steps, state.step, enabled=accelerator.is_main_process)
    norms = running_stats_layers(model)
    # DDP starts every training forward from the main process's buffers: only its updates count there.
    # FSDP and DeepSpeed copy no buffers, so each process keeps its own statistics up to date.
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    stats_here = accelerator.is_main_process or not ddp
    while state.step < total_steps and not stopping and not state.stopped_early and not diverged:
        model.train()
        train_loader.set_epoch(state.epoch)  # the data order of this epoch
        if hasattr(train_set, "set_epoch"):
            train_set.set_epoch(state.epoch)  # its augmentation (Accelerate forwards it only sometimes)
        batches = train_loader
        # Resumed inside this epoch: skip what the checkpoint already saw (a stream starts after it anyway).
        if state.epoch_samples and not stream:
            batches = accelerator.skip_first_batches(
                train_loader, state.epoch_samples // config.global_batch_size
            )
            batches.set_epoch(state.epoch)
        for batch in batches:
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
                        layer.track_running_stats = stats_here and micro == 0
                    loss = task.loss(forward, micro_batch)
                    accelerator.backward(loss)  # divides by the accumulation steps
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(trained, config.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()

            # One optimizer step is done, unless fp16's loss scaler skipped it (overflowing gradients):
            # then neither the schedule nor the logged loss counts it.
            if accelerator.optimizer_step_was_skipped:
                state.skipped_in_a_row += 1
                if state.skipped_in_a_row >= config.fp16_skip_patience:
                    diverged = f"fp16's loss scaler skipped {state.skipped_in_a_row} optimizer steps in a row"
            else:
                state.skipped_in_a_row = 0
                scheduler.step()
                running_loss += step_loss
                running_batches += accumulation
            state.step += 1
            state.epoch_samples += config.global_batch_size
            state.samples_seen += config.global_batch_size
            end_of_epoch = state.epoch_samples == steps_per_epoch * config.global_batch_size
            if end_of_epoch:
                state.epoch += 1
                state.epoch_samples = 0

            if state.step % config.log_every == 0:
                # The one host-device sync of training, once per logging interval. The stop vote and the
                # main process's clock ride along: all processes stop, or checkpoint for time, at the same
                # step, whenever each got its signal (see utils/timing.py for why one clock decides).
                flags = torch.tensor([1.0 if stop else 0.0, *clock.at_log()], device=accelerator.device)
                totals = accelerator.reduce(torch.cat([running_loss.reshape(1), flags]), "sum")
                loss_total, votes, timed, late = totals.tolist()
                # A signal wins over the clock: the platform wants the machine back now, without exports.
                stopping, out_of_time = votes > 0 or late > 0, late > 0 and votes == 0
                timed_checkpoint = timed > 0
                if not math.isfinite(loss_total):  # the same sum on every process: all stop here
                    diverged = f"the train loss of steps up to {state.step} is {loss_total}"
                elif running_batches:
                    log_train_loss(accelerator, progress, loss_total, running_batches, state, scheduler)
                running_loss.zero_()
                running_batches = 0
            progress.update()  # after the log: a progress line shows the loss just computed
            if diverged:
                break
            if (config.eval_every and state.step % config.eval_every == 0) or (
                not config.eval_every and end_of_epoch
            ):
                metrics = evaluate(accelerator, forward, eval_loader, config)
                if not all(math.isfinite(value) for value in metrics.values()):
                    diverged = f"the eval metrics at step {state.step} are {metrics}"
                    break
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
            checkpoint_due = state.step % config.checkpoint_every == 0 or state.step == total_steps
            if checkpoint_due or timed_checkpoint or stopping or state.stopped_early:
                # Never a checkpoint of broken weights: it would rotate the last good one out.
                if not weights_finite(accelerator, model):
                    diverged = f"the weights at step {state.step} are not all finite"
                    break
                state.loss_sums = accelerator.gather(running_loss.reshape(1)).tolist()
                state.loss_batches = running_batches
                state.metrics_bytes = metrics_size(output_dir)
                saving, timed_checkpoint = time.monotonic(), False
                last_saved = save_checkpoint(accelerator, config, state, protect=resumed_from)
                clock.saved(saving)
                progress.write(f"checkpoint: step {state.step} saved to {last_saved}")
                mirror.request()
            if stopping or state.stopped_early or state.step >= total_steps:
                break
        else:
            if stream:  # it ran out: the epoch is over (a map-style epoch ends on its count of steps)
                state.epoch += 1
                state.epoch_samples = 0
    progress.close()
    if diverged:
        raise RunError(diverged_message(diverged, config, last_saved))
    if stopping and not out_of_time:
        accelerator.print(
            f"stopped by {stop.signal_name or 'another process'} at step {state.step}: checkpoint saved, "
            "run the same command to continue"
        )
        if accelerator.is_main_process:
            report_outcome("stopped", start_step, state.step)  # a SLURM launcher requeues on progress
        return False
    if out_of_time:  # leave what a session that ends now should leave, without spending on an evaluation
        info = {"step": state.step, **({"eval_step": state.last_eval_step, **metrics} if metrics else {})}
        export_model(accelerator, model, config, output_dir / "model", info)
        if accelerator.is_main_process:
            print(f"exported {output_dir / 'model'} (step {state.step}) | curves: {plot_metrics(output_dir)}")
            print(f"stopped for time; run again to continue: step {state.step}, {clock.stop_note()}")
            report_outcome("stopped", start_step, state.step)  # a SLURM launcher requeues on progress
        return False

    if state.stopped_early:
        accelerator.print(
            f"early stopping at step {state.step}: {state.evals_since_best} evaluations without a better "
            f"{config.best_metric} than {state.best_value:.4f} (step {state.best_step})"
        )

    # --- final evaluation and export
    if running_batches:  # the last, partial logging interval
        loss_total = accelerator.reduce(running_loss, "sum").item()
        if not math.isfinite(loss_total):
            why = f"the train loss of the last steps is {loss_total}"
            raise RunError(diverged_message(why, config, last_saved))
        log_train_loss(accelerator, progress, loss_total, running_batches, state, scheduler)
    if metrics is None or state.last_eval_step != state.step:
        metrics = evaluate(accelerator, forward, eval_loader, config)
        if not all(math.isfinite(value) for value in metrics.values()):
            raise RunError(diverged_message(f"the final eval metrics are {metrics}", config, last_saved))
        if state.last_eval_step != state.step:  # a run resumed at its last step has logged it already
            accelerator.log(metrics, step=state.step)
            track_best(accelerator, model, config, state, metrics)
    accelerator.print(
        f"done: {state.step} optimizer steps, {state.samples_seen} samples | "
        + " | ".join(f"{name} {value:.4f}" for name, value in metrics.items())
    )
    # Plain safetensors weights plus the config that rebuilds the model: no Accelerate needed to load.
    export_model(accelerator, model, config, output_dir / "model", {"step": state.step, **metrics})
    accelerator.print(
        f"exported {output_dir / 'model'} (last step) and {output_dir / 'best_model'} "
        f"(best {config.best_metric} {state.best_value:.4f}, step {state.best_step})"
    )
    if accelerator.is_main_process:
        print(f"curves: {plot_metrics(output_dir)}")
        report_outcome("finished", start_step, state.step)
    return True


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
    gathered: dict[str, list[torch.Tensor]] = {}
    for batch in loader:
        for name, values in accelerator.gather_for_metrics(task.eval_step(model, batch)).items():
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


def running_stats_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The normalization layers that keep running statistics (BatchNorm with track_running_stats)."""
    return [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats
    ]


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


def own_loss_sum(loss_sums: list[float], accelerator: Accelerator) -> float:
    """This process's share of the loss window saved in a checkpoint (the mean if the world size changed)."""
    if len(loss_sums) == accelerator.num_processes:
        return loss_sums[accelerator.process_index]
    return sum(loss_sums) / len(loss_sums) if loss_sums else 0.0


def warmup_cosine(warmup_steps: int, total_steps: int):
    """Linear warmup, then cosine decay to zero at `total_steps`, as a LambdaLR factor."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as error:
        sys.exit(f"config error: {error}")
    except RunError as error:
        sys.exit(f"error: {error}")
    except OSError as error:  # a write outside the checkpoint code (metrics, exports' folders, plots)
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise
        sys.exit(f"error: {write_error(Path(error.filename or '.'), error)}")
