"""Train a model with Hugging Face Accelerate: the whole loop, top to bottom.

    python train.py --config configs/local.yaml [--field value ...]
    accelerate launch --num_processes 2 train.py --config configs/kaggle.yaml

Phases: config -> accelerator -> seeding -> data -> model -> prepare -> loop (accumulation,
logging, evaluation, checkpoints) -> export. The data and the model come from
`build_datasets` and `build_model` in the package under src/: replace those, not this loop.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from {{ cookiecutter.package_name }}.data import build_datasets
from {{ cookiecutter.package_name }}.models import build_model
from {{ cookiecutter.package_name }}.utils.checkpoint import LoopState, save_checkpoint
from {{ cookiecutter.package_name }}.utils.config import (
    ConfigError,
    TrainConfig,
    gradient_accumulation_steps,
    load_config,
    save_config,
)
from {{ cookiecutter.package_name }}.utils.hardware import resolve_mixed_precision
from {{ cookiecutter.package_name }}.utils.tracking import setup_tracker, trackers

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "local.yaml"


def main(argv: list[str] | None = None) -> None:
    config, config_path = load_config(argv, DEFAULT_CONFIG)

    # --- setup: the Accelerator first, so that everything after it knows the world it runs in
    accelerator = Accelerator(
        mixed_precision=resolve_mixed_precision(config.mixed_precision),
        log_with=trackers(config),
        project_config=ProjectConfiguration(
            project_dir=config.output_dir, logging_dir=str(Path(config.output_dir) / "logs")
        ),
        # Every process draws the same permutation from data_seed and takes its own share of it.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        # Stepped by hand once per optimizer step: Accelerate would step it once per process.
        step_scheduler_with_optimizer=False,
    )
    try:
        accelerator.gradient_accumulation_steps = gradient_accumulation_steps(
            config, accelerator.num_processes
        )
        train(accelerator, config, config_path)
    finally:
        accelerator.end_training()  # closes trackers and the process group, also after a crash


def train(accelerator: Accelerator, config: TrainConfig, config_path: Path) -> None:
    output_dir = Path(config.output_dir)
    accumulation = accelerator.gradient_accumulation_steps
    accelerator.print(
        f"config {config_path} | world size {accelerator.num_processes} | device {accelerator.device} | "
        f"mixed precision {accelerator.mixed_precision} | per-device batch {config.per_device_batch_size} x "
        f"{accelerator.num_processes} processes x {accumulation} accumulation = global batch "
        f"{config.global_batch_size}"
    )
    if accelerator.is_main_process:
        save_config(config, output_dir / "config.yaml")

    # --- seeding: different dropout per process, same data order for all (data_seed above)
    set_seed(config.seed, device_specific=True)

    # --- data
    train_set, eval_set = build_datasets(config)
    train_loader = DataLoader(
        train_set,
        batch_size=config.per_device_batch_size,
        shuffle=True,
        drop_last=True,  # every micro-batch full, so every optimizer step sees global_batch_size samples
        num_workers=config.num_workers,
        generator=torch.Generator().manual_seed(config.seed),
    )
    eval_loader = DataLoader(
        eval_set, batch_size=config.per_device_batch_size, num_workers=config.num_workers
    )
    batches_per_process = len(train_loader) // accelerator.num_processes
    if batches_per_process == 0:
        raise ConfigError(
            f"the training set ({len(train_set)} samples) is smaller than one step of "
            f"per_device_batch_size x processes = {config.per_device_batch_size * accelerator.num_processes}"
        )
    # A short last window still steps the optimizer: Accelerate syncs at the end of the loader.
    steps_per_epoch = math.ceil(batches_per_process / accumulation)
    total_steps = steps_per_epoch * config.num_epochs
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)

    # --- model, optimizer, schedule (sized in optimizer steps, so independent of the world size)
    model = build_model(config)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.warmup_steps, total_steps))

    # --- prepare: wraps for DDP, shards the loaders, moves to the device, sets up autocast
    model, optimizer, scheduler, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, scheduler, train_loader, eval_loader
    )

    # --- trackers (after the point where a resumed run would know its step)
    state = LoopState()
    accelerator.init_trackers(
        output_dir.name, config=dataclasses.asdict(config), init_kwargs=setup_tracker(config)
    )

    # --- the loop
    samples_per_batch = config.per_device_batch_size * accelerator.num_processes
    running_loss = torch.zeros((), device=accelerator.device)  # summed on the device: no sync per step
    running_batches = window_batches = 0
    last_eval_step = -1
    progress = tqdm(
        total=total_steps, initial=state.step, desc="train", disable=not accelerator.is_main_process
    )
    while state.step < total_steps:
        model.train()
        train_loader.set_epoch(state.epoch)
        for inputs, labels in train_loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            running_loss += loss.detach()
            running_batches += 1
            window_batches += 1
            if not accelerator.sync_gradients:
                continue

            # One optimizer step is done.
            if not accelerator.optimizer_step_was_skipped:  # fp16 overflow: the step did not happen
                scheduler.step()
            state.step += 1
            state.epoch_samples += window_batches * samples_per_batch
            state.samples_seen += window_batches * samples_per_batch
            window_batches = 0
            end_of_epoch = accelerator.gradient_state.end_of_dataloader
            if end_of_epoch:
                state.epoch += 1
                state.epoch_samples = 0
            progress.update()

            if state.step % config.log_every == 0 or state.step == total_steps:
                # The only host-device sync of the training step, once per logging interval.
                mean_loss = accelerator.reduce(running_loss, reduction="mean").item() / running_batches
                running_loss.zero_()
                running_batches = 0
                progress.set_postfix(loss=f"{mean_loss:.4f}")
                accelerator.log(
                    {
                        "train/loss": mean_loss,
                        "train/lr": scheduler.get_last_lr()[0],
                        "train/epoch": state.epoch,
                        "train/samples_seen": state.samples_seen,
                    },
                    step=state.step,
                )
            if (config.eval_every and state.step % config.eval_every == 0) or (
                not config.eval_every and end_of_epoch
            ):
                metrics = evaluate(accelerator, model, eval_loader)
                accelerator.log(metrics, step=state.step)
                last_eval_step = state.step
            if state.step % config.checkpoint_every == 0:
                save_checkpoint(accelerator, config, state)
            if state.step >= total_steps:
                break
    progress.close()

    # --- final evaluation and export
    if last_eval_step != state.step:
        metrics = evaluate(accelerator, model, eval_loader)
        accelerator.log(metrics, step=state.step)
    accelerator.print(
        f"done: {state.step} optimizer steps, {state.samples_seen} samples | "
        f"eval loss {metrics['eval/loss']:.4f} | eval accuracy {metrics['eval/accuracy']:.4f}"
    )
    accelerator.wait_for_everyone()
    # Plain safetensors weights plus the config that rebuilds the model: no Accelerate needed to load.
    accelerator.save_model(model, output_dir / "model")
    if accelerator.is_main_process:
        save_config(config, output_dir / "model" / "config.yaml")
        accelerator.print(f"exported {output_dir / 'model' / 'model.safetensors'}")


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader) -> dict[str, float]:
    """Loss and accuracy over the whole eval set, each sample counted once on any number of processes."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    correct = torch.zeros((), dtype=torch.long, device=accelerator.device)
    count = 0
    for inputs, labels in loader:
        logits = model(inputs)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        # Drops the samples that were repeated to give every process a full last batch.
        losses, predictions, labels = accelerator.gather_for_metrics((losses, logits.argmax(dim=-1), labels))
        loss_sum += losses.sum(dtype=torch.float64)
        correct += (predictions == labels).sum()
        count += labels.numel()
    model.train()
    return {"eval/loss": loss_sum.item() / count, "eval/accuracy": correct.item() / count}


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
        main()
    except ConfigError as error:
        sys.exit(f"config error: {error}")
