"""The end of a session, after the loop: why it ended, and what it leaves.

Diverged: one line naming the last good checkpoint (raised). Stopped by a signal: the checkpoint and
the curves, exit 75. Stopped by the time budget: model/ and the curves too, exit 75. Done (the last step,
early stopping): the last evaluation, model/ and the curves. A checkpoint still being written in the
background (utils/persist.py) is published first, whatever the ending.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ..launch import report_outcome
from .checkpoint import export_model
from .loop import Bookkeeping, diverged_message, evaluate, track_best
from .plots import best_step, plot_metrics
from .run_dir import RunError


def finish(
    book: Bookkeeping,
    model: torch.nn.Module,
    forward: torch.nn.Module,
    eval_loader: DataLoader,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> bool:
    """Raise if training diverged; False if a signal or the clock stopped it (having left what a session
    that ends now should leave); True when training is done: then the last evaluation, and the exports."""
    state, config = book.state, book.config
    book.progress.close()
    book.persister.wait()  # the save in flight is published before anything else is written or said
    book.history.save(config.output_dir, state.step, book.end.why())
    if book.end.diverged:
        raise RunError(diverged_message(book.end.diverged, config, book.last_saved))
    if book.end.stopping or book.end.out_of_time:
        return stopped(book, model)
    done(book, model, forward, eval_loader, scheduler)
    return True


def stopped(book: Bookkeeping, model: torch.nn.Module) -> bool:
    """A signal (the checkpoint only) or the clock (model/ and the curves too) stopped the session."""
    accelerator, config, state = book.accelerator, book.config, book.state
    output_dir = Path(config.output_dir)
    if not book.end.out_of_time:
        if accelerator.is_main_process:  # a SLURM launcher requeues on progress
            report_outcome("stopped", book.start_step, state.step)
            # The curves but no export: drawing takes under a second (20,000 logged steps: 0.5 s), an
            # export is as large as the model (and mirrored again) while the platform wants it back.
            with contextlib.suppress(OSError):  # a full disk: the curves can be drawn later
                print(f"curves: {plot_metrics(output_dir)}")
        accelerator.print(  # the last line, which the launchers show as the outcome
            f"stopped by {book.stop_request.signal_name or 'another process'} at step {state.step}: "
            "checkpoint saved, run the same command to continue"
        )
        return False
    metrics = book.metrics  # leave what a session that ends now should leave, without an evaluation
    info = {"step": state.step, **({"eval_step": state.last_eval_step, **metrics} if metrics else {})}
    export_model(accelerator, model, config, output_dir / "model", info)
    if accelerator.is_main_process:
        curves = plot_metrics(output_dir)
        print(f"exported {output_dir / 'model'} (step {state.step}) | curves: {curves}")
        print(f"stopped for time; run again to continue: step {state.step}, {book.clock.stop_note()}")
        report_outcome("stopped", book.start_step, state.step)  # a SLURM launcher requeues
    return False


def done(
    book: Bookkeeping,
    model: torch.nn.Module,
    forward: torch.nn.Module,
    eval_loader: DataLoader,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Training is done: the last train loss, the last evaluation (unless that step had one), the exports."""
    accelerator, config, state = book.accelerator, book.config, book.state
    output_dir = Path(config.output_dir)
    if state.stopped_early:
        accelerator.print(
            f"early stopping at step {state.step}: {state.evals_since_best} evaluations without a better "
            f"{config.best_metric} than {state.best_value:.4f} (step {state.best_step})"
        )
    if book.loss.batches:  # the last, partial logging interval
        loss_total = book.loss.total()[0]
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
            accelerator.log(metrics, step=state.step)
            track_best(accelerator, model, config, state, metrics)
    accelerator.print(
        f"done: {state.step} optimizer steps, {state.samples_seen} samples | "
        + " | ".join(f"{name} {value:.4f}" for name, value in metrics.items())
    )
    # Plain safetensors weights plus the config that rebuilds the model: no Accelerate needed to load.
    export_model(accelerator, model, config, output_dir / "model", {"step": state.step, **metrics})
    best = f"(best {config.best_metric} {state.best_value:.4f}, step {state.best_step})"
    exported = f"exported {output_dir / 'model'} (last step)"
    # best_model/ may not have been brought in with the run (damaged in its copy: a warning at the start).
    if best_step(output_dir) == state.best_step:
        accelerator.print(f"{exported} and {output_dir / 'best_model'} {best}")
    else:
        accelerator.print(f"{exported}; no best_model/ of the best evaluation {best}")
    if accelerator.is_main_process:
        print(f"curves: {plot_metrics(output_dir)}")
        report_outcome("finished", book.start_step, state.step)
