"""The lm preset against nanoGPT's own train.py: the same data, model, batch, steps, schedule and precision.

    python bench/nanogpt.py                      # on a GPU: nanoGPT's char-level Shakespeare config, bf16
    python bench/nanogpt.py --quick              # the same model for 300 steps (bench/gpu.sh runs it)
    python bench/nanogpt.py --device cpu --quick # a small model on the CPU, fp32

nanoGPT is not part of this repository. Put a checkout in `.nanogpt/` at the repository's root (git ignores
it), or name one with `--nanogpt PATH`:

    git clone https://github.com/karpathy/nanoGPT .nanogpt
    git --git-dir=PATH/TO/A/MIRROR archive HEAD | tar -x -C .nanogpt   # or export a mirror you have

Nothing is downloaded at run time. The script renders the template with the lm preset and takes the text
that the preset ships (data/tinyshakespeare.txt, the file nanoGPT's data/shakespeare_char/prepare.py
downloads); it writes nanoGPT's train.bin, val.bin and meta.pkl from it into a scratch folder as that
prepare.py defines them (the sorted characters as ids, the first 90% to train), which is the preset's own
vocabulary and split. Then it runs, one at a time, nanoGPT's train.py (a subprocess, with
config/train_shakespeare_char.py and command-line overrides) and the preset's train.py, each in eager mode
and with torch.compile, at the same model size (nanoGPT with bias=True, the preset with tied embeddings:
the same parameters but the preset's output bias), batch, block size, steps, peak learning rate, warmup,
cosine decay to 0 over the same steps (nanoGPT's min_lr set to 0, the preset's schedule), dropout, weight
decay, gradient clipping and precision (bf16 on a GPU, fp32 on the CPU); both evaluate at the same steps.
Left as each has it: nanoGPT's AdamW beta2 0.99 (the preset's is torch's 0.999) and its weight decay of
matrices only (the preset decays every parameter); nanoGPT estimates the validation loss on eval_iters
random batches (and the train loss on as many), the preset on as many windows spread evenly over the
held-out text (all of them when there are fewer); the preset's deterministic kernels are off, as nanoGPT's.

Measured from outside, the same way for both: the time each line of nanoGPT's output and each row of the
preset's metrics.jsonl appears, counted from the start of its process (start-up and compilation included).
tokens/s: the tokens of the steps between two logged steps over the time between them, summed over every
such interval except the first and those with an evaluation (and its checkpoint) inside. Time to loss:
when the first evaluation at or below nanoGPT's final validation loss (of the same compile setting) was
logged. The targets are the preset's tokens/s >= 1.0x nanoGPT's and its time to that loss <= 0.75x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
DEFAULT_CHECKOUT = TEMPLATE / ".nanogpt"
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
TOKENS_TARGET, TIME_TARGET = 1.0, 0.75
POLL_S = 0.005  # how often the preset's metrics.jsonl is looked at


@dataclasses.dataclass(frozen=True)
class Setting:
    layers: int
    heads: int
    width: int
    block: int
    batch: int
    steps: int
    eval_every: int
    eval_iters: int  # nanoGPT's random batches per estimate; the preset reads as many fixed windows
    log_every: int
    learning_rate: float
    warmup: int
    dropout: float


# config/train_shakespeare_char.py as it is (5,000 steps); quick: its model for 300 steps. On the CPU, the
# small model of nanoGPT's README for CPUs (4 x 4 x 128, block 64, batch 12) and a quick one smaller still.
SETTINGS = {
    ("cuda", False): Setting(6, 6, 384, 256, 64, 5000, 250, 200, 10, 1e-3, 100, 0.2),
    ("cuda", True): Setting(6, 6, 384, 256, 64, 300, 100, 20, 10, 1e-3, 30, 0.2),
    ("cpu", False): Setting(4, 4, 128, 64, 12, 2000, 250, 20, 10, 1e-3, 100, 0.0),
    ("cpu", True): Setting(2, 2, 64, 32, 12, 100, 50, 10, 5, 1e-3, 10, 0.0),
}
OVERRIDES = {  # flag -> Setting field
    "layers": int, "heads": int, "width": int, "block": int, "batch": int,
    "steps": int, "eval_every": int, "eval_iters": int, "log_every": int,
}  # fmt: skip


@dataclasses.dataclass
class Run:
    """One training process: its output lines and metrics rows, each with the second it appeared (counted
    from the process's start); then its logged steps and evaluations read from them."""

    lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    rows: list[tuple[float, dict]] = dataclasses.field(default_factory=list)
    steps: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (s, optimizer steps done)
    evals: list[tuple[float, int, float]] = dataclasses.field(default_factory=list)  # (s, after step, loss)
    ended: float = 0.0  # seconds from its start to its exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, default=DEFAULT_CHECKOUT, help="a checkout of nanoGPT")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if present")
    parser.add_argument("--quick", action="store_true", help="a short version (a minute or two on a GPU)")
    parser.add_argument("--compile", choices=("both", "false", "true"), default="both", help="which modes")
    for name in OVERRIDES:
        parser.add_argument(f"--{name}", type=int, default=None, help="instead of the setting's")
    args = parser.parse_args()
    checkout = args.nanogpt.expanduser().resolve()
    if missing := [name for name in NANOGPT_FILES if not (checkout / name).is_file()]:
        sys.exit(
            f"error: {checkout} is not a nanoGPT checkout (no {', '.join(missing)}): "
            f"git clone https://github.com/karpathy/nanoGPT {checkout}, or give --nanogpt PATH"
        )
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA GPU here: give --device cpu")
    setting = dataclasses.replace(
        SETTINGS[device, args.quick],
        **{name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None},
    )
    modes = {"both": (False, True), "false": (False,), "true": (True,)}[args.compile]
    with tempfile.TemporaryDirectory(prefix="bench-nanogpt-") as scratch:
        root = Path(scratch)
        project = render(root / "render")
        data, per_epoch = prepare(
            project / "data" / "tinyshakespeare.txt", root / "shakespeare_char", setting
        )
        epochs = math.ceil(setting.steps / per_epoch)  # the preset's schedule spans whole epochs
        results = {}
        for compiled in modes:
            nano = run_nanogpt(
                checkout, data, root / f"nanogpt-{compiled}", setting, device, compiled, epochs * per_epoch
            )
            preset = run_preset(project, root / f"preset-{compiled}", setting, device, compiled, epochs)
            results[compiled] = (nano, preset)
    print(report(results, setting, device, epochs * per_epoch, checkout))


def render(into: Path) -> Path:
    """The lm preset, rendered as a user does (its hook's advice to the user is not printed here)."""
    command = [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(into), "task=lm"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: cookiecutter failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return into / "char-gpt"


def prepare(text_file: Path, folder: Path, setting: Setting) -> tuple[Path, int]:
    """nanoGPT's shakespeare_char files from the preset's text; and the preset's optimizer steps per epoch
    at this block and batch (data/chars.py: windows of block + 1 that tile the first 90% with room for an
    offset of up to a block), which sizes its schedule."""
    import numpy as np

    text = text_file.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {char: number for number, char in enumerate(chars)}
    ids = np.array([index[char] for char in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    folder.mkdir(parents=True)
    ids[:cut].tofile(folder / "train.bin")
    ids[cut:].tofile(folder / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": index}
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    windows = (cut - 1) // setting.block - 1
    return folder, windows // setting.batch


def run_nanogpt(
    checkout: Path, data: Path, out: Path, setting: Setting, device: str, compiled: bool, schedule: int
) -> Run:
    """nanoGPT's train.py from its own folder (it reads configurator.py and config/ there); `dataset` is an
    absolute path, which its os.path.join('data', dataset) keeps, so nothing is written into the checkout.
    Its cosine ends at lr_decay_iters: the preset's schedule (whole epochs), of which both train `steps`."""
    overrides = {
        "device": device,
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "compile": compiled,
        "out_dir": str(out),
        "dataset": str(data),
        "n_layer": setting.layers,
        "n_head": setting.heads,
        "n_embd": setting.width,
        "block_size": setting.block,
        "batch_size": setting.batch,
        "bias": True,
        "dropout": float(setting.dropout),
        "learning_rate": setting.learning_rate,
        "warmup_iters": setting.warmup,
        "max_iters": setting.steps,
        "lr_decay_iters": schedule,
        "min_lr": 0.0,
        "eval_interval": setting.eval_every,
        "eval_iters": setting.eval_iters,
        "log_interval": setting.log_every,
    }
    command = [sys.executable, str(checkout / "train.py"), "config/train_shakespeare_char.py"]
    command += [f"--{key}={value}" for key, value in overrides.items()]
    run = timed("nanoGPT's train.py", command, checkout, environment(device), metrics=None)
    for seconds, line in run.lines:
        # "iter N: loss ..." follows optimizer step N + 1; "step N: train loss ..., val loss ..." is the
        # evaluation after N steps.
        if match := re.match(r"iter (\d+): loss ", line):
            run.steps.append((seconds, int(match.group(1)) + 1))
        elif match := re.match(r"step (\d+): train loss [0-9.]+, val loss ([0-9.]+)", line):
            run.evals.append((seconds, int(match.group(1)), float(match.group(2))))
    return run


def run_preset(project: Path, out: Path, setting: Setting, device: str, compiled: bool, epochs: int) -> Run:
    """The rendered project's train.py with the same settings; its steps and evaluations are the rows of
    its metrics.jsonl, timed as they appear."""
    flags = {
        "output_dir": str(out),
        "mixed_precision": "bf16" if device == "cuda" else "no",
        "compile": str(compiled).lower(),
        "deterministic": "false",
        "num_layers": setting.layers,
        "num_heads": setting.heads,
        "embed_dim": setting.width,
        "tie_embeddings": "true",
        "block_size": setting.block,
        "per_device_batch_size": setting.batch,
        "global_batch_size": setting.batch,
        "dropout": setting.dropout,
        "learning_rate": setting.learning_rate,
        "warmup_steps": setting.warmup,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "num_epochs": epochs,
        "max_steps": setting.steps,
        "eval_every": setting.eval_every,
        "eval_windows": setting.eval_iters * setting.batch,  # nanoGPT's val windows (at most all there are)
        "log_every": setting.log_every,
        "checkpoint_every": setting.eval_every,
        "max_time_lost": "",  # checkpoints at evaluations only, as nanoGPT's
        "tracker": "none",
    }
    command = [sys.executable, "train.py", "--config", "configs/local.yaml"]
    for key, value in flags.items():
        command += [f"--{key}", str(value)]
    env = environment(device) | {"PYTHONPATH": str(project / "src")}
    run = timed("the preset's train.py", command, project, env, metrics=out / "metrics.jsonl")
    for seconds, row in run.rows:
        if "train/loss" in row:
            run.steps.append((seconds, row["step"]))
        if "eval/loss" in row:
            run.evals.append((seconds, row["step"], row["eval/loss"]))
    return run


def environment(device: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device == "cpu":  # both on the CPU on any machine, with the same threads
        env |= {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"}
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads()))
    return env


def cpu_threads() -> int:
    """OMP_NUM_THREADS, else torch's own default (nanoGPT's threads; the preset would choose its own)."""
    import torch

    return int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())


def timed(name: str, command: list[str], cwd: Path, env: dict[str, str], metrics: Path | None) -> Run:
    """Run `command` to its end, noting when each line of its output and each row it appends to `metrics`
    appeared (the file is polled every POLL_S)."""
    run, started = Run(), time.monotonic()
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def read() -> None:
        for line in process.stdout:
            run.lines.append((time.monotonic() - started, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    offset = 0
    while True:
        exited = process.poll() is not None
        size = metrics.stat().st_size if metrics is not None and metrics.exists() else 0
        if size < offset:  # cut back: a resumed run drops the rows logged after its checkpoint
            offset = 0
        if metrics is not None and size > offset:
            with metrics.open("rb") as file:
                file.seek(offset)
                chunk = file.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a row being written waits for the next poll
            offset += len(complete)
            now = time.monotonic() - started
            run.rows += [(now, json.loads(line)) for line in complete.splitlines()]
        if exited:
            break
        time.sleep(POLL_S)
    reader.join()
    run.ended = time.monotonic() - started
    if process.returncode != 0:
        tail = "\n".join(line for _, line in run.lines[-40:])
        sys.exit(f"error: {name} exited with status {process.returncode}; its last lines:\n{tail}")
    return run


def tokens_per_second(run: Run, setting: Setting) -> float:
    """Tokens trained between consecutive logged steps over the time between them, summed over every such
    interval but the first (allocator and caches warm up) and those holding an evaluation (and the
    preset's checkpoint, at the same steps)."""
    tokens = seconds = 0.0
    for (start, first), (end, last) in list(zip(run.steps, run.steps[1:], strict=False))[1:]:
        if any(first <= step < last for _, step, _ in run.evals):
            continue
        tokens += (last - first) * setting.batch * setting.block
        seconds += end - start
    if not seconds:
        sys.exit(f"error: too few logged steps to time ({len(run.steps)}): give more --steps")
    return tokens / seconds


def time_to(run: Run, loss: float) -> float | None:
    """Seconds from the start of the process to the first evaluation at or below `loss`."""
    return next((seconds for seconds, _, value in run.evals if value <= loss), None)


def report(
    results: dict[bool, tuple[Run, Run]], setting: Setting, device: str, schedule: int, checkout: Path
) -> str:
    import torch

    if device == "cuda":
        where = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), bf16"
    else:
        where = f"the CPU ({platform.machine()}, {cpu_threads()} threads), fp32"
    lines = [
        f"nanoGPT's train.py ({checkout}) and the lm preset's, on {where}, torch {torch.__version__}:",
        f"{setting.layers} layers x {setting.heads} heads x {setting.width}, block {setting.block}, batch "
        f"{setting.batch}, {setting.steps} steps (cosine to 0 over {schedule}), peak learning rate "
        f"{setting.learning_rate:g} after {setting.warmup} warmup steps, dropout {setting.dropout:g}, "
        f"evaluated every {setting.eval_every} steps on {setting.eval_iters} batches (nanoGPT: random, "
        "and as many of the train text; the preset: spread evenly)",
        "",
        "| torch.compile | tokens/s nanoGPT | tokens/s preset | ratio (target >= 1.0) "
        "| final val loss nanoGPT | final val loss preset "
        "| s to nanoGPT's final loss: nanoGPT | preset | ratio (target <= 0.75) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for compiled, (nano, preset) in results.items():
        if not nano.evals or not preset.evals:
            sys.exit("error: a run logged no evaluation: give --steps >= --eval_every")
        rates = tokens_per_second(nano, setting), tokens_per_second(preset, setting)
        target = nano.evals[-1][2]
        reached = time_to(nano, target), time_to(preset, target)
        speed = verdict(rates[1] / rates[0], rates[1] / rates[0] >= TOKENS_TARGET)
        if reached[1] is None:
            seconds, ratio = "not reached", "-"
        else:
            seconds = f"{reached[1]:.1f}"
            ratio = verdict(reached[1] / reached[0], reached[1] / reached[0] <= TIME_TARGET)
        lines.append(
            f"| {'on' if compiled else 'off'} | {rates[0]:,.0f} | {rates[1]:,.0f} | {speed} "
            f"| {target:.4f} | {preset.evals[-1][2]:.4f} | {reached[0]:.1f} | {seconds} | {ratio} |"
        )
    lines.append("")
    for compiled, pair in results.items():
        for name, run in zip(("nanoGPT", "preset"), pair, strict=True):
            (first, step), last = run.steps[0], run.evals[-1][0]
            lines.append(
                f"{name}, compile {'on' if compiled else 'off'}: step {step} logged at {first:.1f} s, "
                f"the last evaluation at {last:.1f} s, exit at {run.ended:.1f} s"
            )
    return "\n".join(lines)


def verdict(ratio: float, met: bool) -> str:
    return f"{ratio:.2f}x ({'met' if met else 'not met'})"


if __name__ == "__main__":
    main()
