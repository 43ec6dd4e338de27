"""Benchmark a freshly rendered project against plain PyTorch and print a markdown table.

    python bench/bench.py            # full mode, a few minutes; its output goes in docs/benchmarks.md
    python bench/bench.py --quick    # a few steps of everything (CI runs it so the script cannot rot)

What is measured, all on one CPU process:
1. optimizer steps per second of the generated train.py (progress bar, logging every 50 steps and
   the checkpoint check on; evaluation and checkpoint saves placed after the timed window) against a
   plain PyTorch loop with the same model, data, batch size, optimizer, schedule and gradient clipping,
   at a tiny and a realistic model size. Runs alternate between the two loops in one process;
   each run is timed from inside, between optimizer steps (a global optimizer step hook), so start-up,
   the final evaluation and the export are not counted. Medians over the runs, and their ratio.
2. one checkpoint save (save_checkpoint: Accelerate's save_state, RNG and loop state, fsync, atomic
   rename, rotation) and one resume against torch.save / torch.load of the same model, optimizer and
   schedule state.
3. the time from `cookiecutter` to the first optimizer step of the new project (no installs).
4. host-device synchronisations: every Tensor.item/tolist/numpy/cpu/__bool__/__float__/__int__ called
   from outside torch during training, grouped by the optimizer step it follows; and, in the same run,
   Python function calls per step of both loops (a count that the machine's speed cannot blur).

The script renders the template itself; it needs the packages of requirements-dev.txt (torch included).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
BATCH = 64  # per-device = global batch: one micro-batch per optimizer step, no accumulation
WARMUP_STEPS = 20  # optimizer steps left out of every timed window (allocator, caches, first logs)
LOG_EVERY = 50  # as Lightning's default log_every_n_steps; 10 would be 50 logs a second at the tiny size
SIZES = {"tiny": 64, "realistic": 1024}  # hidden_size of the default MLP
SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__")


# --- parent: render, start workers, print the table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps and one run each: checks, no figures")
    args = parser.parse_args()
    reps = 1 if args.quick else 11
    steps = {"tiny": 75, "realistic": 75} if args.quick else {"tiny": 1000, "realistic": 400}

    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        root = Path(scratch)
        first_step = time_to_first_step(root)
        project = root / "render" / "digits-classifier"
        loops = {size: worker(project, "loops", size, steps[size], reps) for size in SIZES}
        checkpoint = worker(project, "checkpoint", "realistic", 0, 3 if args.quick else 7)
        syncs = worker(project, "syncs", "tiny", 6 * LOG_EVERY + 5, 1)
    print(report(loops, checkpoint, syncs, first_step, reps, steps, args.quick))


def time_to_first_step(root: Path) -> dict[str, float]:
    """Seconds from starting `cookiecutter` to the end of the new project's first optimizer step."""
    start = time.time()
    run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(root / "render")],
        cwd=root,
    )
    rendered = time.time()
    project = root / "render" / "digits-classifier"
    # train.py exactly as a user runs it; the only addition is a hook that reports the first step.
    driver = (
        "import runpy, sys, time\n"
        "from torch.optim.optimizer import register_optimizer_step_post_hook\n"
        "def first(optimizer, args, kwargs):\n"
        "    print(f'FIRST_STEP {time.time()!r}', flush=True)\n"
        "    handle.remove()\n"
        "handle = register_optimizer_step_post_hook(first)\n"
        "sys.argv = ['train.py', '--config', 'configs/local.yaml', '--max_steps', '1',\n"
        "            '--output_dir', sys.argv[1]]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    output = run([sys.executable, "-c", driver, str(root / "first-run")], cwd=project, src=project / "src")
    stamp = float(next(line.split()[1] for line in output.splitlines() if line.startswith("FIRST_STEP")))
    return {"render": rendered - start, "first_step": stamp - start}


def worker(project: Path, mode: str, size: str, steps: int, reps: int) -> Any:
    """Run this script in `mode` in a new process (a clean Accelerate state) and return its JSON result."""
    result = project.parent.parent / f"{mode}-{size}.json"
    command = [sys.executable, __file__, "--worker", mode, str(project), size, str(steps), str(reps)]
    run([*command, str(result)], cwd=project, src=project / "src")
    return json.loads(result.read_text())


def run(command: list[str], cwd: Path, src: Path | None = None) -> str:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if src is not None:  # the project as `pip install -e .` would make it importable
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"bench: {' '.join(command[:2])} ... failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def report(
    loops: dict, checkpoint: dict, syncs: dict, first_step: dict, reps: int, steps: dict, quick: bool
) -> str:
    import accelerate
    import torch

    rows = ["| measurement | generated project | plain PyTorch | ratio | target |", "|---|---|---|---|---|"]
    for size, result in loops.items():
        ours, plain = statistics.median(result["template"]), statistics.median(result["plain"])
        # Each run is paired with the other loop's run next to it in time: the machine's speed drifts
        # between runs more than the loops differ, and a pair shares its drift.
        pairs = [a / b for a, b in zip(result["template"], result["plain"], strict=True)]
        spread = f" ({min(pairs):.2f} to {max(pairs):.2f})" if len(pairs) > 1 else ""
        target = 0.90 if size == "tiny" else 0.98
        rows.append(
            f"| steps/s, {size} model (hidden {SIZES[size]}, {1000 / plain:.1f} ms/step) | {ours:.1f} "
            f"| {plain:.1f} | {statistics.median(pairs):.3f}{spread} | >= {target} |"
        )
    save, torch_save = statistics.median(checkpoint["save"]), statistics.median(checkpoint["torch_save"])
    save_fsync = statistics.median(checkpoint["torch_save_fsync"])
    ours_calls, plain_calls = syncs["python_calls"], syncs["plain_python_calls"]
    load, torch_load = statistics.median(checkpoint["resume"]), statistics.median(checkpoint["torch_load"])
    rows += [
        f"| checkpoint save, ms ({checkpoint['mb']:.0f} MB of state) | {save * 1000:.0f} "
        f"| {torch_save * 1000:.0f} (torch.save) | {save / torch_save:.2f} | <= 1.2 |",
        f"| checkpoint save, ms, against torch.save + fsync | {save * 1000:.0f} | {save_fsync * 1000:.0f} "
        f"| {save / save_fsync:.2f} | |",
        f"| resume, ms | {load * 1000:.0f} | {torch_load * 1000:.0f} (torch.load) "
        f"| {load / torch_load:.2f} | |",
        f"| cookiecutter to first optimizer step, s | {first_step['first_step']:.1f} "
        f"(render {first_step['render']:.1f}) | | | |",
        f"| Python function calls per step (a count, not a time) | {ours_calls:.0f} | {plain_calls:.0f} "
        f"| {ours_calls / plain_calls:.2f} | |",
        f"| syncs outside torch per ordinary step / per logging step | {syncs['ordinary']} / "
        f"{syncs['per_log']:g} | {syncs['plain_ordinary']} / {syncs['plain_per_log']:g} | | 0 / any |",
    ]
    timed = ", ".join(f"{size} {steps[size]}" for size in SIZES)
    notes = [
        "",
        f"{'QUICK MODE: too few steps for meaningful figures. ' if quick else ''}"
        f"Loop: medians of {reps} alternating runs per loop in one process (after a warm-up pair), "
        "the ratio is the median (and range) of the ratios of neighbouring runs; "
        f"optimizer steps {timed} per run, the first "
        f"{WARMUP_STEPS} untimed, the rest cut in blocks of {LOG_EVERY} (one logging step each): a run's "
        f"speed is that of its median block; batch {BATCH}, log_every {LOG_EVERY}, "
        f"1 process on {device_name()}. "
        f"Checkpoint: median of {len(checkpoint['save'])}.",
        "Checkpoint save, mean of its parts: "
        + ", ".join(f"{part} {seconds * 1000:.0f} ms" for part, seconds in checkpoint["parts"].items())
        + " (save_state writes the same tensors as torch.save; fsync makes every file, the loop state and "
        "the folders durable before the rename publishes the checkpoint; rotation removes the oldest).",
        f"Sync call sites at logging steps: {', '.join(syncs['sites']) or 'none'}; torch-internal "
        f"calls per step (the same in both loops): {syncs['torch_internal']:g} / "
        f"{syncs['plain_torch_internal']:g}.",
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"accelerate {accelerate.__version__}, {os.cpu_count()} CPUs "
        f"({torch.get_num_threads()} torch threads), {time.strftime('%Y-%m-%d')}",
    ]
    return "\n".join(rows + notes)


def device_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# --- workers: run inside the rendered project, with its package importable


def worker_main(mode: str, project: Path, size: str, steps: int, reps: int, result: Path) -> None:
    sys.path.insert(0, str(project))  # the generated train.py
    package = next(path.name for path in (project / "src").iterdir() if (path / "__init__.py").exists())
    if mode == "loops":
        output = bench_loops(project, package, size, steps, reps)
    elif mode == "checkpoint":
        output = bench_checkpoint(project, package, reps)
    else:
        output = count_syncs(project, package, steps)
    result.write_text(json.dumps(output))


def step_times() -> tuple[list[float], object]:
    """perf_counter after every optimizer step, from a hook shared by both loops."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    stamps: list[float] = []
    handle = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: stamps.append(time.perf_counter())
    )
    return stamps, handle


def template_argv(project: Path, output_dir: Path, size: str, steps: int) -> list[str]:
    # Evaluation and checkpoint saves fall after the last step (eval_every and checkpoint_every larger
    # than the run): the timed window sees the step, the progress bar, logging and both checks.
    return [
        *("--config", str(project / "configs" / "local.yaml"), "--output_dir", str(output_dir)),
        *("--hidden_size", str(SIZES[size]), "--max_steps", str(steps), "--num_epochs", "1000"),
        *("--augment_noise", "0"),
        *("--per_device_batch_size", str(BATCH), "--global_batch_size", str(BATCH)),
        *("--log_every", str(LOG_EVERY), "--eval_every", str(10**9), "--checkpoint_every", str(10**9)),
    ]


def bench_loops(project: Path, package: str, size: str, steps: int, reps: int) -> dict[str, list[float]]:
    """Steps per second of both loops, alternating in this one process, the first pair thrown away.

    Alternating inside one process keeps what differs between processes (memory placement, a
    slow moment of this shared machine) from landing on one loop only; the first pair pays for
    lazy imports and first-use allocations.
    """
    import train  # the generated train.py

    rates: dict[str, list[float]] = {"template": [], "plain": []}
    for rep in range(reps + 1):
        for kind in ("template", "plain") if rep % 2 == 0 else ("plain", "template"):
            stamps, handle = step_times()
            if kind == "template":
                with tempfile.TemporaryDirectory() as scratch:
                    argv = template_argv(project, Path(scratch) / "run", size, steps)
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        status = train.main(argv)
                assert status == 0, f"train.main exited {status}"
            else:
                plain_loop(package, size, steps)
            handle.remove()
            assert len(stamps) == steps, f"{kind}: {len(stamps)} optimizer steps, expected {steps}"
            # Blocks of LOG_EVERY consecutive steps hold exactly one logging step each; the median
            # block ignores the bursts in which this shared machine runs slow for everybody.
            starts = range(WARMUP_STEPS, steps - LOG_EVERY, LOG_EVERY)
            rate = LOG_EVERY / statistics.median(stamps[i + LOG_EVERY] - stamps[i] for i in starts)
            if rep > 0:
                rates[kind].append(rate)
    return rates


def plain_loop(package: str, size: str, steps: int) -> None:
    """The loop a user would write by hand: same model, data order source, optimizer, schedule, clipping."""
    import torch
    import torch.nn.functional as F
    import train
    from torch.utils.data import DataLoader

    task = importlib.import_module(f"{package}.task")  # the default render: the digits preset
    config = task.Config(hidden_size=SIZES[size], num_epochs=1000, augment_noise=0.0)
    torch.manual_seed(config.seed)
    train_set, _ = task.build_datasets(config)
    loader = DataLoader(
        train_set, batch_size=BATCH, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0)
    )
    model = task.build_model(config)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    total = len(train_set) // BATCH * config.num_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train.warmup_cosine(config.warmup_steps, total))
    model.train()
    step, epoch = 0, 0
    while step < steps:
        train_set.set_epoch(epoch)
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            if step == steps:
                break
        epoch += 1


def bench_checkpoint(project: Path, package: str, reps: int) -> dict:
    """save_checkpoint/resume against torch.save/torch.load of the same model, optimizer and schedule."""
    import torch
    import torch.nn.functional as F
    import train
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    checkpoint = importlib.import_module(f"{package}.utils.checkpoint")
    task = importlib.import_module(f"{package}.task")
    scratch = project.parent.parent / "checkpoint-bench"  # inside the parent's temporary folder
    scratch.mkdir(exist_ok=True)
    config = task.Config(hidden_size=SIZES["realistic"], output_dir=str(scratch / "run"))
    accelerator = Accelerator(cpu=True)
    model = task.build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train.warmup_cosine(20, 1000))
    train_set, _ = task.build_datasets(config)
    loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, drop_last=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    inputs, labels = next(iter(loader))
    accelerator.backward(F.cross_entropy(model(inputs), labels))
    optimizer.step()  # the AdamW moments exist from here on: a checkpoint of a model in training
    scheduler.step()

    def state() -> dict:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }

    def torch_save(path: Path, fsync: bool) -> None:
        with path.open("wb") as file:
            torch.save(state(), file)
            if fsync:
                file.flush()
                os.fsync(file.fileno())

    def torch_load(path: Path) -> None:
        loaded = torch.load(path, weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])

    times: dict[str, list[float]] = {
        "save": [],
        "torch_save": [],
        "torch_save_fsync": [],
        "resume": [],
        "torch_load": [],
    }
    # Where a save's time goes: each part timed by wrapping the function save_checkpoint calls.
    parts = {"save_state": 0.0, "fsync": 0.0, "rotation": 0.0}

    def timed(function, part: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - start

        return wrapper

    accelerator.save_state = timed(accelerator.save_state, "save_state")
    checkpoint._fsync = timed(checkpoint._fsync, "fsync")
    checkpoint._write_durably = timed(checkpoint._write_durably, "fsync")
    checkpoint._rotate = timed(checkpoint._rotate, "rotation")
    plain = scratch / "plain.pt"
    for rep in range(reps):
        loop_state = checkpoint.LoopState(step=rep + 1)
        for name, action in (
            ("save", lambda state=loop_state: checkpoint.save_checkpoint(accelerator, config, state)),
            ("torch_save", lambda: torch_save(plain, fsync=False)),
            ("torch_save_fsync", lambda: torch_save(plain, fsync=True)),
            ("resume", lambda: checkpoint.resume(accelerator, config)),
            ("torch_load", lambda: torch_load(plain)),
        ):
            with contextlib.redirect_stdout(io.StringIO()):
                start = time.perf_counter()
                action()
                times[name].append(time.perf_counter() - start)
    newest = checkpoint.list_checkpoints(config.output_dir)[-1]
    checkpoint_bytes = sum(path.stat().st_size for path in newest.iterdir())
    shares = {part: seconds / reps for part, seconds in parts.items()}
    return {**times, "parts": shares, "mb": checkpoint_bytes / 1e6}


def count_syncs(project: Path, package: str, steps: int) -> dict:
    """Count the calls that copy a tensor to the host, by the optimizer step they follow.

    On a GPU each of them waits for the device. Calls made by torch itself (AdamW reads its step
    counters, which live on the host) are counted apart: a plain loop makes the same ones.
    """
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch_dir = str(Path(torch.__file__).parent)
    current = {"step": 0}
    calls: list[tuple[int, str]] = []

    def counted(name: str):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            where = caller.f_code.co_filename
            site = "torch" if where.startswith(torch_dir) else f"{Path(where).name}:{caller.f_lineno}"
            calls.append((current["step"], site))
            return original(self, *args, **kwargs)

        return original, wrapper

    def after_step(optimizer, args, kwargs) -> None:
        current["step"] += 1

    # Python and builtin function calls per step, on the training thread: unlike time, a count that
    # this machine's drifting speed cannot blur. Both loops pay the same for the counting wrappers.
    function_calls: collections.Counter[int] = collections.Counter()

    def profile(frame, event: str, arg) -> None:
        if event in ("call", "c_call"):
            function_calls[current["step"]] += 1

    def tally() -> dict:
        # Step k = from the end of optimizer step k to the end of step k+1. The steps after the last
        # complete one (checkpoint, evaluation, export) and before the first (setup) are left out.
        window = range(1, steps - 1)
        logging = [k for k in window if k % LOG_EVERY == 0]
        outside = [(k, site) for k, site in calls if k in window and site != "torch"]
        ordinary = sum(1 for k, _ in outside if k % LOG_EVERY)
        internal = sum(1 for k, site in calls if k in window and site == "torch")
        per_log = (len(outside) - ordinary) / len(logging)
        sites = sorted({site for k, site in outside})
        return {
            "ordinary": ordinary,
            "per_log": per_log,
            "sites": sites,
            "torch_internal": internal / len(window),
            "python_calls": sum(function_calls[k] for k in window) / len(window),
        }

    import train

    originals = {}
    for name in SYNC_METHODS:
        originals[name], wrapper = counted(name)
        setattr(torch.Tensor, name, wrapper)
    handle = register_optimizer_step_post_hook(after_step)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            argv = template_argv(project, Path(scratch) / "run", "tiny", steps)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                sys.setprofile(profile)
                assert train.main(argv) == 0
                sys.setprofile(None)
        ours = tally()
        calls.clear()
        function_calls.clear()
        current["step"] = 0
        sys.setprofile(profile)
        plain_loop(package, "tiny", steps)
        sys.setprofile(None)
        plain = tally()
    finally:
        sys.setprofile(None)
        handle.remove()
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return {**ours, **{f"plain_{key}": value for key, value in plain.items() if key != "sites"}}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, mode, project, size, steps, reps, result = sys.argv
        worker_main(mode, Path(project), size, int(steps), int(reps), Path(result))
    else:
        main()
