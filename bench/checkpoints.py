"""Checkpoint save and resume of a GPT-2-small-sized model, full and LoRA, against plain torch.save/load.

    python bench/checkpoints.py          # full mode, a few minutes; its output goes in docs/benchmarks.md
    python bench/checkpoints.py --quick  # a 2-layer model, one run each (CI runs it: checks, no figures)
    python bench/checkpoints.py --device cuda --batch 16  # on a GPU: the state there, steps of 16 x 128

On one process (the CPU unless --device cuda), through the freshly rendered project's own
`save_checkpoint` and `resume`:
- full: `GPT2LMHeadModel(GPT2Config())` (124M parameters, tied embeddings) with random weights, AdamW
  over every parameter;
- lora: the same model through peft's `get_peft_model` with rank 8 on the attention projections
  (`attn.c_attn`, `attn.c_proj`), AdamW over the adapter only, and a checkpoint that holds only the
  trainable parameters and the buffers.
Each after one optimizer step (the AdamW moments exist). A save is timed against `torch.save` + `fsync`
of the same state (model, optimizer, scheduler) to a new file, and to one file overwritten in place; a
resume against `torch.load` + `load_state_dict`. Each variant runs in a process of its own (a fresh
Accelerate state); within a rep the order of the writes turns; the figures are medians. The newest
checkpoint's size is what its folder holds on disk.

Then checkpoint_mode sync against background, side by side in the same worker: the loop's stop, the
background write, steps beside it; and background with its staging buffers allocated anew at every
checkpoint (as before persist.Staging kept them), for comparison.

The script renders the template itself; it needs requirements-dev.txt's packages (peft, transformers).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).resolve().parent.parent
VARIANTS = ("full", "lora")
LORA_TARGETS = ["attn.c_attn", "attn.c_proj"]  # GPT-2's attention projections, not the MLP's c_proj
FULL_SIZE = {}  # GPT2Config's defaults: 12 layers, width 768, 50257 tokens, 124M parameters
QUICK_SIZE = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}
MODES = ("sync", "background", "fresh")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, one run each: checks, no figures")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model trains")
    parser.add_argument("--batch", type=int, default=2, help="sequences of 128 tokens per timed step")
    parser.add_argument("--reps", type=int, default=7, help="runs per figure (their median); 1 with --quick")
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    with tempfile.TemporaryDirectory(prefix="bench-checkpoints-") as scratch:
        root = Path(scratch)
        subprocess.run(
            [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(root / "render")],
            check=True,
            capture_output=True,
        )
        project = root / "render" / "digits-classifier"
        results = {variant: worker(project, variant, reps, args, root) for variant in VARIANTS}
    print(report(results, args.quick))


def worker(project: Path, variant: str, reps: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Run one variant in a new process inside the rendered project; return its JSON result."""
    result = root / f"{variant}.json"
    arguments = [variant, str(project), str(reps), str(int(args.quick)), str(result), args.device]
    command = [sys.executable, __file__, "--worker", *arguments, str(args.batch)]
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"bench: the {variant} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


def report(results: dict[str, dict[str, Any]], quick: bool) -> str:
    import torch

    rows = [
        "| variant | checkpoint, MB | save, ms | torch.save + fsync (new file), ms | ratio | resume, ms "
        "| torch.load, ms | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, result in results.items():
        save, plain_save = statistics.median(result["save"]), statistics.median(result["torch_save_fsync"])
        load, plain_load = statistics.median(result["resume"]), statistics.median(result["torch_load"])
        trained = f"{result['trainable'] / 1e6:.2f}M of {result['parameters'] / 1e6:.1f}M parameters trained"
        rows.append(
            f"| {variant} ({trained}) | {result['bytes'] / 1e6:.1f} | {save * 1000:.0f} "
            f"| {plain_save * 1000:.0f} | {save / plain_save:.2f} | {load * 1000:.0f} "
            f"| {plain_load * 1000:.0f} | {load / plain_load:.2f} |"
        )
    full, lora = results["full"]["bytes"], results["lora"]["bytes"]
    in_place = {
        variant: statistics.median(result["torch_save_fsync_in_place"]) for variant, result in results.items()
    }
    parts = {variant: result["parts"] for variant, result in results.items()}
    notes = [
        "",
        f"{'QUICK MODE: a 2-layer model, too small for meaningful figures. ' if quick else ''}"
        f"LoRA checkpoint size: {100 * lora / full:.2f}% of the full one. Medians of "
        f"{len(results['full']['save'])} alternating runs per variant, 1 process, {os.cpu_count()} CPUs "
        f"({torch.get_num_threads()} torch threads), load average {os.getloadavg()[0]:.2f} at the end.",
        "torch.save + fsync overwriting one file in place (as bench.py's checkpoint rows do; a crash "
        "during that write loses the only copy), ms: "
        + ", ".join(f"{variant} {seconds * 1000:.0f}" for variant, seconds in in_place.items())
        + ".",
        "Reading back and hashing the newest checkpoint (the project's file_xxh3, from the page cache), ms: "
        + "; ".join(
            f"{variant}: "
            + ", ".join(f"{name} {seconds * 1000:.0f}" for name, seconds in result["hashing"].items())
            for variant, result in results.items()
        )
        + ".",
        "Save, mean of its parts, ms: "
        + "; ".join(
            f"{variant}: " + ", ".join(f"{part} {seconds * 1000:.0f}" for part, seconds in shares.items())
            for variant, shares in parts.items()
        ),
        f"python {platform.python_version()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}",
    ]
    return "\n".join(rows + notes + background_report(results))


def background_report(results: dict[str, dict[str, Any]]) -> list[str]:
    """checkpoint_mode background against sync, measured side by side in the same worker."""
    rows = [
        "",
        "| variant | loop stops, sync, ms | loop stops, background, ms | ratio "
        "| the same, buffers allocated anew, ms | background write, ms "
        "| step, ms | step during the write, ms | ratio | checkpointing share at every 100 steps, sync "
        "| background | staged copy, MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, result in results.items():
        figures = {name: statistics.median(values) for name, values in result["background"].items()}
        sync, background, step = figures["sync"], figures["background"], figures["step"]
        busy = figures.get("busy", step)  # no step fits inside a very short write
        during = len(result["background"].get("busy", [])) / len(result["background"]["background"])
        cost = background + during * max(busy - step, 0.0)  # the stop, and steps slowed beside the write
        rows.append(
            f"| {variant} | {sync * 1000:.0f} | {background * 1000:.0f} | {background / sync:.2f} "
            f"| {figures['fresh'] * 1000:.0f} | {figures['persist'] * 1000:.0f} | {step * 1000:.0f} "
            f"| {busy * 1000:.0f} | {busy / step:.2f} "
            f"| {100 * sync / (100 * step + sync):.1f}% | {100 * cost / (100 * step + cost):.1f}% "
            f"| {figures['staged_bytes'] / 1e6:.1f} |"
        )
    rows.append(
        f"Device: {results['full']['device']}, steps of {results['full']['step_tokens']} tokens. The grace "
        "window (SIGTERM to a durable checkpoint) is timed from real signals by bench/grace.py."
    )
    return rows


# --- worker: runs inside the rendered project, with its package importable


def build(variant: str, quick: bool):
    """The model in training after one optimizer step: model, optimizer, scheduler."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**(QUICK_SIZE if quick else FULL_SIZE)))
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        # GPT-2's projections are Conv1D layers, whose weights are stored transposed: fan_in_fan_out.
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, fan_in_fan_out=True)
        model = get_peft_model(model, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 64))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def sha256(path: Path) -> str:
    """What checkpoints recorded before XXH3-128, for comparison."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def worker_main(
    variant: str, project: Path, reps: int, quick: bool, result: Path, device: str, batch: int
) -> None:
    import torch
    from accelerate import Accelerator

    package = next(path.name for path in (project / "src").iterdir() if (path / "__init__.py").exists())
    checkpoint = importlib.import_module(f"{package}.utils.checkpoints.checkpoint")
    starting = importlib.import_module(f"{package}.utils.run.start")  # where a run starts: resume
    task = importlib.import_module(f"{package}.task")
    scratch = result.parent / f"checkpoints-{variant}"
    scratch.mkdir()
    config = task.Config(output_dir=str(scratch / "run"))
    accelerator = Accelerator(cpu=device == "cpu")
    model, optimizer, scheduler = accelerator.prepare(*build(variant, quick))
    checkpoint.save_trained_weights_only(accelerator)  # as train.py: frozen weights stay out

    def state_of_model(model) -> dict[str, Any]:  # the baseline saves the same weights
        frozen = checkpoint.frozen_names(model)
        return {name: value for name, value in model.state_dict().items() if name not in frozen}

    def torch_save(path: Path) -> None:
        state = {"model": state_of_model(model), "optimizer": optimizer.state_dict()}
        with path.open("wb") as file:
            torch.save({**state, "scheduler": scheduler.state_dict()}, file)
            file.flush()
            os.fsync(file.fileno())

    def torch_load(path: Path) -> None:
        loaded = torch.load(path, weights_only=True)
        model.load_state_dict(loaded["model"], strict=variant == "full")
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])

    # Where a save's time goes: each part timed by wrapping what save_checkpoint calls.
    parts = {"save_state": 0.0, "publish (fsync, checksums, rename)": 0.0, "rotation": 0.0}

    def timed(function, part: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - start

        return wrapper

    accelerator.save_state = timed(accelerator.save_state, "save_state")
    checkpoint._publish = timed(checkpoint._publish, "publish (fsync, checksums, rename)")
    checkpoint._rotate = timed(checkpoint._rotate, "rotation")
    times: dict[str, list[float]] = {
        name: [] for name in ("save", "torch_save_fsync", "torch_save_fsync_in_place", "resume", "torch_load")
    }
    for rep in range(reps):
        state = checkpoint.LoopState(step=rep + 1)
        writes = [
            ("save", lambda state=state: checkpoint.save_checkpoint(accelerator, config, state)),
            # The baseline: a new file per save, as a save that a crash cannot take the last copy from
            # must write; the one before is deleted after the rep, untimed.
            ("torch_save_fsync", lambda rep=rep: torch_save(scratch / f"plain_{rep}.pt")),
            ("torch_save_fsync_in_place", lambda: torch_save(scratch / "in_place.pt")),
        ]
        reads = [
            ("resume", lambda: starting.resume(accelerator, config)),
            ("torch_load", lambda rep=rep: torch_load(scratch / f"plain_{rep}.pt")),
        ]
        # On this shared disk the second of two large writes in a row is often the slower: the order
        # turns from rep to rep, so that no side is always second.
        order = writes[rep % 3 :] + writes[: rep % 3] + (reads if rep % 2 == 0 else reads[::-1])
        for name, action in order:
            with contextlib.redirect_stdout(io.StringIO()):
                start = time.perf_counter()
                action()
                times[name].append(time.perf_counter() - start)
        with contextlib.suppress(FileNotFoundError):
            (scratch / f"plain_{rep - 1}.pt").unlink()
    # The resume restored what was saved: trained parameters overwritten, resumed, compared.
    trained = [(name, value) for name, value in model.named_parameters() if value.requires_grad]
    saved = {name: value.clone() for name, value in trained}
    with torch.no_grad():
        for _, value in trained:
            value.add_(1.0)
    with contextlib.redirect_stdout(io.StringIO()):
        starting.resume(accelerator, config)
    for name, value in trained:
        assert torch.equal(value, saved[name]), f"{name} was not restored by resume"
    newest = checkpoint.list_checkpoints(config.output_dir)[-1]
    hashing = {}  # reading the newest checkpoint back (from the page cache) and hashing it, per checksum
    for algorithm, checksum in ((checkpoint.CHECKSUM, checkpoint.file_xxh3), ("sha256", sha256)):
        start = time.perf_counter()
        for path in newest.iterdir():
            checksum(path)
        hashing[algorithm] = time.perf_counter() - start
    newest_bytes = sum(path.stat().st_size for path in newest.iterdir())
    with contextlib.redirect_stdout(io.StringIO()):  # after: its saves rotate `newest` away
        background = background_figures(accelerator, model, optimizer, config, package, reps, quick, batch)
    output = {
        "background": background,
        "hashing": hashing,
        **times,
        "parts": {part: seconds / reps for part, seconds in parts.items()},
        "bytes": newest_bytes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "step_tokens": f"{batch} x {32 if quick else 128}",
    }
    result.write_text(json.dumps(output))


def background_figures(
    accelerator, model, optimizer, config, package: str, reps: int, quick: bool, batch: int
) -> dict:
    """checkpoint_mode background against sync, side by side on the same state: how long the loop stops for
    one checkpoint, a training step alone and while a background write runs, the staged copy's bytes."""
    import dataclasses

    import torch

    persist = importlib.import_module(f"{package}.utils.checkpoints.persist")
    checkpoint = importlib.import_module(f"{package}.utils.checkpoints.checkpoint")
    # "fresh" is background with new staging buffers at every checkpoint, as before they were kept.
    savers = {}
    for mode in MODES:
        settings = dataclasses.replace(config, checkpoint_mode="sync" if mode == "sync" else "background")
        savers[mode] = persist.Persister(accelerator, settings, lambda: None)
    shape = (batch, 32 if quick else 128)
    tokens = torch.randint(0, model.config.vocab_size, shape, device=accelerator.device)
    cuda = accelerator.device.type == "cuda"

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if cuda:  # the step's kernels are done (the loop syncs once per logging interval, not per step)
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up
    figures: dict[str, list[float]] = {name: [] for name in (*MODES, "persist", "step", "busy")}
    for rep in range(reps):
        for turn, mode in enumerate(MODES[rep % 3 :] + MODES[: rep % 3]):
            state = checkpoint.LoopState(step=100 + 3 * rep + turn)
            if mode == "fresh":
                savers[mode].staging = persist.Staging()
            start = time.perf_counter()
            savers[mode].save(state, None, {}, lambda path: None)
            figures[mode].append(time.perf_counter() - start)
            if mode == "background":  # steps while the thread writes, until it has published
                while savers[mode]._job is not None and not savers[mode]._job.done():
                    figures["busy"].append(step())
            savers[mode].wait()  # published before the next mode saves into the same folder
            if mode == "background":
                figures["persist"].append(savers[mode].last_seconds)
        figures["step"] += [step() for _ in range(2)]
    staged = persist.stage_state(accelerator, persist.Staging())
    figures["staged_bytes"] = [float(sum(_nbytes(value) for _, _, value in staged))]
    return figures


def _nbytes(value: Any) -> int:
    """Bytes a staged value holds in memory: its tensors' storage, or its serialized length."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, dict):
        return sum(_nbytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(item) for item in value)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        variant, project, reps, quick, result, device, batch = sys.argv[2:]
        worker_main(variant, Path(project), int(reps), bool(int(quick)), Path(result), device, int(batch))
    else:
        main()
