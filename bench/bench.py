"""Benchmark a freshly rendered project against plain PyTorch and print a markdown table.

    python bench/bench.py            # full mode, a few minutes; its output goes in docs/benchmarks.md
    python bench/bench.py --quick    # a few steps of everything (CI runs it so the script cannot rot)

What is measured, all on one CPU process:
1. optimizer steps per second of the generated train.py (progress lines, logging every 50 steps and
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
   from outside torch during training, grouped by the optimizer step it follows (between logging steps,
   per second: the loop's votes, utils/training/timing.py); and, in the same run,
   Python function calls per step of both loops (a count that the machine's speed cannot blur).
5. data wait: the share of the generated train.py's step time spent inside next() on the batches its
   loop iterates (its train set's set_epoch included), in the default example (augmentation on, default
   model), with num_workers 0 (what its configs set) and, for comparison, 2.
6. the cost of exactness (training/seeding.py): reseeding torch's generators before each micro-batch, against
   the realistic step; and the digest of the first step after a checkpoint (each sample's hash, the loss,
   one gather), against the steps between two checkpoints of configs/local.yaml.

On a machine with CUDA (and only there), the same method also compares the two loops on the GPU in
bf16 at GPU_SIZES and in fp16 (with a loss scaler) at FP16_SIZE, and measures the data wait there;
`--gpu` runs these alone (bench/gpu.sh does). The CPU measurements hide the GPU from their
processes, so that they measure the same thing on any machine.

The script renders the template itself; it needs the packages of requirements-dev.txt (torch included).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import io
import itertools
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
# GPU mode, bf16: name -> (hidden_size, per-device = global batch). At 1024 x 64 a GPU step is little
# more than Python and kernel launches; 4096 x 512 gives the device more work per step than that.
GPU_SIZES = {"medium": (1024, 64), "large": (4096, 512)}
GPU_TARGETS = {"medium": 0.98, "large": 0.98}
# fp16 (T4s, compute 7.5, have no bf16): both loops with a GradScaler, at this size.
FP16_SIZE = "medium"
DATA_WORKERS = (0, 2)  # the digits configs' num_workers, and 2 (the images preset's colab/kaggle.yaml)
ROLLBACK_OFF = ["--max_rollbacks", "0", "--loss_spike_factor", "0"]  # the loop without rollback's checks
ROLLBACK_ON = ["--loss_spike_factor", "3"]  # and with all of them (spikes are off by default)
SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one worker process runs: how long, how large, on which device."""

    steps: int  # optimizer steps per run
    reps: int  # timed runs (per loop), after a warm-up that is thrown away
    hidden: int | None = None  # hidden_size of the MLP; None: the task's default
    batch: int = BATCH  # per-device = global batch
    gpu: bool = False  # both loops on the GPU; else on the CPU, the GPU hidden
    precision: str = "bf16"  # on the GPU: bf16, or fp16 with a loss scaler


# --- parent: render, start workers, print the table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps and one run each: checks, no figures")
    parser.add_argument(
        "--gpu", action="store_true", help="the GPU measurements alone, 3 runs of 300 steps (bench/gpu.sh)"
    )
    args = parser.parse_args()
    if args.gpu:
        if not cuda_available():
            sys.exit("bench: --gpu needs a CUDA GPU, and torch sees none here")
        with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
            project = render(Path(scratch))
            steps, reps = (75, 1) if args.quick else (300, 3)
            gpu = gpu_mode(project, steps, reps, Setup(steps, reps))
        print("\n".join(gpu_rows(gpu) + gpu_notes(gpu)))
        return
    reps = 1 if args.quick else 11
    steps = {"tiny": 75, "realistic": 75} if args.quick else {"tiny": 1000, "realistic": 400}
    wait = Setup(steps=75 if args.quick else 400, reps=1 if args.quick else 5)

    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        root = Path(scratch)
        first_step = time_to_first_step(root)
        project = root / "render" / "digits-classifier"
        loops = {
            size: worker(project, "loops", size, Setup(steps[size], reps, SIZES[size])) for size in SIZES
        }
        data_wait = worker(project, "data_wait", "cpu", wait)
        checkpoint = worker(project, "checkpoint", "realistic", Setup(0, 3 if args.quick else 7))
        syncs = worker(project, "syncs", "tiny", Setup(6 * LOG_EVERY + 5, 1, SIZES["tiny"]))
        loops["realistic"]["exact"] = worker(project, "exact", "cpu", Setup(0, reps))
        loops["tiny"]["rollback"] = worker(
            project, "rollback", "tiny", Setup(steps["tiny"], reps, SIZES["tiny"])
        )
        gpu = gpu_mode(project, 75 if args.quick else 1000, reps, wait) if cuda_available() else None
    print(report(loops, data_wait, checkpoint, syncs, first_step, gpu, reps, steps, args.quick))


def cuda_available() -> bool:
    # Imported here, after the time to first step: torch imported by this process beforehand would
    # already be in the page cache for the new project's first run.
    import torch

    return torch.cuda.is_available()


def gpu_mode(project: Path, steps: int, reps: int, wait: Setup) -> dict:
    """Both loops in bf16 at each of GPU_SIZES, and the data wait, on the GPU: the CPU mode's code."""
    loops = {
        name: worker(project, "loops", f"gpu-{name}", Setup(steps, reps, hidden, batch, gpu=True))
        for name, (hidden, batch) in GPU_SIZES.items()
    }
    hidden, batch = GPU_SIZES[FP16_SIZE]
    loops[f"{FP16_SIZE}-fp16"] = worker(
        project, "loops", "gpu-fp16", Setup(steps, reps, hidden, batch, gpu=True, precision="fp16")
    )
    data_wait = worker(project, "data_wait", "gpu", dataclasses.replace(wait, gpu=True))
    return {"loops": loops, "data_wait": data_wait, "steps": steps}


def time_to_first_step(root: Path) -> dict[str, float]:
    """Seconds from starting `cookiecutter` to the end of the new project's first optimizer step."""
    start = time.time()
    project = render(root)
    rendered = time.time()
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


def render(root: Path) -> Path:
    """The default project (digits), rendered under `root`."""
    run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(root / "render")],
        cwd=root,
    )
    return root / "render" / "digits-classifier"


def worker(project: Path, mode: str, name: str, setup: Setup) -> Any:
    """Run this script in `mode` in a new process (a clean Accelerate state) and return its JSON result."""
    result = project.parent.parent / f"{mode}-{name}.json"
    spec = json.dumps(dataclasses.asdict(setup))
    command = [sys.executable, __file__, "--worker", mode, str(project), spec, str(result)]
    # Accelerate takes a GPU when it sees one: a CPU measurement must not, also on a machine with one.
    hide_gpu = {} if setup.gpu else {"CUDA_VISIBLE_DEVICES": ""}
    run(command, cwd=project, src=project / "src", extra_env=hide_gpu)
    return json.loads(result.read_text())


def run(command: list[str], cwd: Path, src: Path | None = None, extra_env: dict | None = None) -> str:
    env = {**os.environ, "PYTHONHASHSEED": "0", **(extra_env or {})}
    if src is not None:  # the project as `pip install -e .` would make it importable
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"bench: {' '.join(command[:2])} ... failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def report(
    loops: dict,
    data_wait: dict,
    checkpoint: dict,
    syncs: dict,
    first_step: dict,
    gpu: dict | None,
    reps: int,
    steps: dict,
    quick: bool,
) -> str:
    import accelerate
    import torch

    rows = ["| measurement | generated project | plain PyTorch | ratio | target |", "|---|---|---|---|---|"]
    for size, result in loops.items():
        target = 0.90 if size == "tiny" else 0.98
        label = f"{size} model (hidden {SIZES[size]}, {plain_ms(result):.1f} ms/step)"
        rows.append(loop_row(label, result, target))
    label = "rollback and spike checks on (spikes at factor 3) against off (second column), tiny model"
    rows += [loop_row(label, loops["tiny"]["rollback"], None), *data_wait_rows(data_wait, "")]
    rows += exact_rows(loops["realistic"])
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
        f"| syncs outside torch at ordinary steps, per second / per logging step | {syncs['ordinary']:.1f} / "
        f"{syncs['per_log']:g} | {syncs['plain_ordinary']:.1f} / {syncs['plain_per_log']:g} "
        "| | 2 (votes) / any |",
    ]
    if gpu is not None:
        rows += gpu_rows(gpu)[2:]
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
        data_wait_note(data_wait),
        "Checkpoint save, mean of its parts: "
        + ", ".join(f"{part} {seconds * 1000:.0f} ms" for part, seconds in checkpoint["parts"].items())
        + " (save_state writes the same tensors as torch.save; fsync makes every file, the loop state and "
        "the folders durable before the rename publishes the checkpoint; rotation removes the oldest).",
        f"Sync call sites at logging steps: {', '.join(syncs['sites']) or 'none'}; torch-internal "
        f"calls per step (the same in both loops): {syncs['torch_internal']:g} / "
        f"{syncs['plain_torch_internal']:g}.",
    ]
    if gpu is not None:
        notes += gpu_notes(gpu)[1:]
    notes.append(
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"accelerate {accelerate.__version__}, {os.cpu_count()} CPUs "
        f"({torch.get_num_threads()} torch threads), {time.strftime('%Y-%m-%d')}"
    )
    return "\n".join(rows + notes + call_breakdown(syncs))


def gpu_rows(gpu: dict) -> list[str]:
    """The GPU mode's rows, under the table's header."""
    rows = ["| measurement | generated project | plain PyTorch | ratio | target |", "|---|---|---|---|---|"]
    for name, result in gpu["loops"].items():
        size, precision = name.split("-")[0], "fp16" if name.endswith("-fp16") else "bf16"
        hidden, batch = GPU_SIZES[size]
        size_text = f"hidden {hidden}, batch {batch} ({plain_ms(result):.1f} ms/step)"
        label = f"{result['device']}, {precision}, {size_text}"
        rows.append(loop_row(label, result, GPU_TARGETS[size]))
    return rows + data_wait_rows(gpu["data_wait"], f" on {gpu['data_wait']['device']}", target=5)


def gpu_notes(gpu: dict) -> list[str]:
    return [
        "",
        f"GPU ({gpu['data_wait']['device']}): the same method, {gpu['steps']} optimizer steps per run; "
        "the generated loop with --mixed_precision bf16 (fp16: the row says so), the plain loop with a "
        "pinned DataLoader, .to(device, non_blocking=True) and torch.autocast around forward and loss "
        "(fp16: and a torch.amp.GradScaler); per-device = global batch, 1 process; the step hook calls "
        "torch.cuda.synchronize() at block edges (both loops), so that a block is timed by the device's "
        "work, not by how fast it was queued. Data wait on the GPU: as on the CPU, with --mixed_precision "
        "bf16.",
    ]


def exact_rows(realistic: dict) -> list[str]:
    """Reseeding per micro-batch against the realistic step (of the generated loop, which includes it),
    and a recorded step's digest against one checkpoint interval (max_time_lost at most)."""
    step = 1 / statistics.median(realistic["template"])
    exact = realistic["exact"]
    reseed, digest, (interval, text) = exact["reseed"], exact["digest"], exact["max_time_lost"]
    return [
        f"| reseeding per micro-batch, us (utils/training/seeding.py) | {reseed * 1e6:.1f} | | "
        f"{reseed / step:.2%} of a realistic step | <= 1% |",
        f"| digest of the step after a checkpoint, ms (batch {BATCH}) | {digest * 1000:.2f} | | "
        f"{digest / interval:.5%} of a checkpoint interval of {text} (max_time_lost) | <= 1% |",
    ]


def call_breakdown(syncs: dict) -> list[str]:
    """Python calls per step by the line of each loop that makes them (itself or through what it calls)."""
    lines = ["", "Where the Python calls of a step come from (the line of each loop, with all it calls):", ""]
    for title, key in (("generated train.py", "by_line"), ("plain PyTorch loop", "plain_by_line")):
        lines += [f"| {title} | calls per step |", "|---|---|"]
        lines += [f"| `{text}` | {count:.1f} |" for text, count in syncs[key]]
        lines.append("")
    return lines


def plain_ms(result: dict) -> float:
    """The plain loop's median time per step, ms: what a step costs at this size."""
    return 1000 / statistics.median(result["plain"])


def loop_row(label: str, result: dict, target: float | None) -> str:
    ours, plain = statistics.median(result["template"]), statistics.median(result["plain"])
    # Each run is paired with the other loop's run next to it in time: the machine's speed drifts
    # between runs more than the loops differ, and a pair shares its drift.
    pairs = [a / b for a, b in zip(result["template"], result["plain"], strict=True)]
    spread = f" ({min(pairs):.2f} to {max(pairs):.2f})" if len(pairs) > 1 else ""
    goal = f" >= {target} " if target else " "
    return f"| steps/s, {label} | {ours:.1f} | {plain:.1f} | {statistics.median(pairs):.3f}{spread} |{goal}|"


def data_wait_rows(result: dict, where: str, target: int = 10) -> list[str]:
    """One row per num_workers: the median share (and range) of the timed window spent fetching."""
    rows = []
    for workers in DATA_WORKERS:
        shares = [100 * share for share in result["share"][str(workers)]]
        spread = f" ({min(shares):.1f} to {max(shares):.1f})" if len(shares) > 1 else ""
        ms = statistics.median(result["ms_per_step"][str(workers)])
        if workers == 0:
            name = f"default example (augmentation on, hidden {result['hidden']}, {ms:.1f} ms/step)"
            target = f" < {target}% "
        else:
            name = f"num_workers {workers}, for comparison ({ms:.1f} ms/step)"
            target = " "
        rows.append(
            f"| data wait{where}, {name}, % of step time | {statistics.median(shares):.1f}%{spread} "
            f"| | |{target}|"
        )
    return rows


def data_wait_note(result: dict) -> str:
    return (
        "Data wait: the generated train.py as is (augment_noise and hidden_size at their defaults, "
        f"configs/local.yaml, batch {BATCH}, log_every {LOG_EVERY}, evaluation and checkpoint after the "
        "window); every next() on the batches its loop iterates timed (training/loop.py's epoch_batches "
        "wrapped: the train set's set_epoch (its new noise), the fetch from the DataLoader, the start and "
        "stop of its workers, the move to the device), "
        f"summed over the steps after the first {WARMUP_STEPS}, against the wall time of those steps; "
        f"median (and range) of {len(result['share']['0'])} runs per num_workers, alternating, after a "
        f"warm-up pair, {result['steps']} optimizer steps per run. Workers start again every epoch "
        f"({result['steps_per_epoch']} steps): persistent workers would not see the dataset's set_epoch."
    )


def device_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# --- workers: run inside the rendered project, with its package importable


def worker_main(mode: str, project: Path, setup: Setup, result: Path) -> None:
    sys.path.insert(0, str(project))  # the generated train.py
    package = next(path.name for path in (project / "src").iterdir() if (path / "__init__.py").exists())
    if mode in ("loops", "rollback"):  # against the plain loop, or against the template without rollbacks
        output = bench_loops(project, package, setup, ROLLBACK_OFF if mode == "rollback" else None)
    elif mode == "data_wait":
        output = bench_data_wait(project, package, setup)
    elif mode == "checkpoint":
        output = bench_checkpoint(project, package, setup.reps)
    elif mode == "exact":
        output = bench_exact(project, package, setup.reps)
    else:
        output = count_syncs(project, package, setup.steps)
    result.write_text(json.dumps(output))


def block_edges(steps: int) -> range:
    """Indices (in the list of step times) where the timed blocks start and end.

    The first WARMUP_STEPS steps are not timed; the rest is cut in blocks of LOG_EVERY steps, each
    holding exactly one logging step.
    """
    return range(WARMUP_STEPS, steps, LOG_EVERY)


def step_times(steps: int, gpu: bool) -> tuple[list[float], object]:
    """perf_counter after every optimizer step, from a hook shared by both loops.

    On a GPU, optimizer.step() returns once its kernels are queued: at the block edges the hook waits
    for the device, so that a block is timed by the work done, not by how far ahead the queue runs.
    """
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    stamps: list[float] = []
    edges = set(block_edges(steps))

    def stamp(optimizer, args, kwargs) -> None:
        stamps.append(time.perf_counter())

    def stamp_synchronized(optimizer, args, kwargs) -> None:
        if len(stamps) in edges:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    handle = register_optimizer_step_post_hook(stamp_synchronized if gpu else stamp)
    return stamps, handle


def template_argv(
    project: Path, output_dir: Path, setup: Setup, augment: bool = False, workers: int = 0
) -> list[str]:
    # Evaluation and checkpoint saves fall after the last step (eval_every and checkpoint_every larger
    # than the run, no max_time_lost): the timed window sees the step, the progress lines, logging and both
    # checks.
    argv = [
        *("--config", str(project / "configs" / "local.yaml"), "--output_dir", str(output_dir)),
        *("--max_steps", str(setup.steps), "--num_epochs", "1000", "--num_workers", str(workers)),
        *("--per_device_batch_size", str(setup.batch), "--global_batch_size", str(setup.batch)),
        *("--log_every", str(LOG_EVERY), "--eval_every", str(10**9), "--checkpoint_every", str(10**9)),
        *("--max_time_lost", ""),
    ]
    if setup.hidden is not None:
        argv += ["--hidden_size", str(setup.hidden)]
    if not augment:  # the loop measurements: data loading must not hide the loop's own cost
        argv += ["--augment_noise", "0"]
    if setup.gpu:  # bf16: what `mixed_precision: auto` picks on compute capability 8.0 or newer
        argv += ["--mixed_precision", setup.precision]
    return argv


def run_template(argv: list[str]) -> None:
    """The generated train.py's main(), as `python train.py ARGV` runs it, quietly."""
    import train  # the generated train.py

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = train.main(argv)
    assert status == 0, f"train.main exited {status}"


def bench_loops(project: Path, package: str, setup: Setup, off: list[str] | None = None) -> dict:
    """Steps per second of both loops (with `off`: the generated one given those flags instead of the plain
    one), alternating in this one process, the first pair thrown away.

    Alternating inside one process keeps what differs between processes (memory placement, a
    slow moment of this shared machine) from landing on one loop only; the first pair pays for
    lazy imports and first-use allocations.
    """
    rates: dict[str, list[float]] = {"template": [], "plain": []}
    edges = block_edges(setup.steps)
    for rep in range(setup.reps + 1):
        for kind in ("template", "plain") if rep % 2 == 0 else ("plain", "template"):
            stamps, handle = step_times(setup.steps, setup.gpu)
            if kind == "template" or off is not None:
                with tempfile.TemporaryDirectory() as scratch:
                    flags = off if kind == "plain" else ROLLBACK_ON if off else []
                    run_template([*template_argv(project, Path(scratch) / "run", setup), *(flags or [])])
            else:
                plain_loop(package, setup)
            handle.remove()
            assert len(stamps) == setup.steps, f"{kind}: {len(stamps)} steps, expected {setup.steps}"
            # The median block ignores the bursts in which this shared machine runs slow for everybody.
            blocks = [stamps[end] - stamps[start] for start, end in itertools.pairwise(edges)]
            if rep > 0:
                rates[kind].append(LOG_EVERY / statistics.median(blocks))
    return {**rates, "device": gpu_name() if setup.gpu else "cpu"}


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def plain_loop(package: str, setup: Setup) -> None:
    """The loop a user would write by hand: same model, data order source, optimizer, schedule, clipping.

    On the GPU, what such a user adds for speed: pinned memory, copies that do not wait, autocast (and
    in fp16 the loss scaler that it needs).
    """
    import torch
    import torch.nn.functional as F
    import train
    from torch.utils.data import DataLoader

    task = importlib.import_module(f"{package}.task")  # the default render: the digits preset
    config = task.Config(hidden_size=setup.hidden, num_epochs=1000, augment_noise=0.0)
    gpu, device = setup.gpu, torch.device("cuda" if setup.gpu else "cpu")
    fp16 = gpu and setup.precision == "fp16"
    scaler, dtype = (torch.amp.GradScaler("cuda"), torch.float16) if fp16 else (None, torch.bfloat16)
    # train.main switches deterministic kernels on for the whole process (its `deterministic` option):
    # the hand-written loop runs with torch's default, as in a process of its own.
    torch.use_deterministic_algorithms(False)
    torch.manual_seed(config.seed)
    train_set, _ = task.build_datasets(config)
    loader = DataLoader(
        train_set,
        batch_size=setup.batch,
        shuffle=True,
        drop_last=True,
        collate_fn=task.collate,  # the task's, as in train.py: its batches may come stacked already
        pin_memory=gpu,
        generator=torch.Generator().manual_seed(0),
    )
    model = task.build_model(config).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    total = len(train_set) // setup.batch * config.num_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train.schedule_factor(config, total))
    model.train()
    step, epoch = 0, 0
    while step < setup.steps:
        train_set.set_epoch(epoch)
        for inputs, labels in loader:
            if gpu:
                inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=dtype):
                    loss = F.cross_entropy(model(inputs), labels)
            else:  # the batch is already where the model is, and fp32 is what the generated loop runs
                loss = F.cross_entropy(model(inputs), labels)
            if scaler is None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            if step == setup.steps:
                break
        epoch += 1


def bench_exact(project: Path, package: str, reps: int) -> dict:
    """Seconds per follow_the_sample call, and per digest of a realistic digits micro-batch (its samples'
    hashes, its loss, the gather of one process), median of `reps` rounds."""
    import torch
    import yaml
    from accelerate import Accelerator

    exact = importlib.import_module(f"{package}.utils.training.seeding")
    step_digest = importlib.import_module(f"{package}.utils.training.resume_check").StepDigest
    parse_duration = importlib.import_module(f"{package}.utils.config").parse_duration
    accelerator = Accelerator(cpu=True)
    batch = (torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,)))
    reseeds, digests = [], []
    for _ in range(reps):
        start = time.perf_counter()
        for step in range(1000):
            exact.follow_the_sample(42, step, 1, accelerator.device)
        reseeds.append((time.perf_counter() - start) / 1000)
        start = time.perf_counter()
        digest = step_digest(accelerator, True)
        digest.add(batch, torch.tensor(2.5))
        digest.norm = torch.tensor(1.5)
        digest.result()
        digests.append(time.perf_counter() - start)
    config = yaml.safe_load((project / "configs" / "local.yaml").read_text())
    return {
        "reseed": statistics.median(reseeds),
        "digest": statistics.median(digests),
        "max_time_lost": (parse_duration(config["max_time_lost"]), config["max_time_lost"]),
    }


def bench_data_wait(project: Path, package: str, setup: Setup) -> dict:
    """Share of the generated loop's timed window spent waiting for batches, per num_workers.

    The default example as a user runs it (augmentation on, default model); the runs alternate
    between the DATA_WORKERS settings in this one process, the first pair thrown away.
    """
    task = importlib.import_module(f"{package}.task")
    shares: dict[str, list[float]] = {str(workers): [] for workers in DATA_WORKERS}
    ms_per_step: dict[str, list[float]] = {str(workers): [] for workers in DATA_WORKERS}
    edges = block_edges(setup.steps)
    fetches: list[tuple[float, float]] = []
    config = task.Config()
    train_set, _ = task.build_datasets(config)
    with timed_fetches(fetches, package):
        for rep in range(setup.reps + 1):
            for workers in DATA_WORKERS if rep % 2 == 0 else DATA_WORKERS[::-1]:
                fetches.clear()
                stamps, handle = step_times(setup.steps, setup.gpu)
                with tempfile.TemporaryDirectory() as scratch:
                    argv = template_argv(project, Path(scratch) / "run", setup, augment=True, workers=workers)
                    run_template(argv)
                handle.remove()
                # The window: from the end of step WARMUP_STEPS to the last block edge; the final
                # evaluation's fetches, after it, are left out.
                start, end = stamps[edges[0]], stamps[edges[-1]]
                inside = [done - begun for begun, done in fetches if start <= begun and done <= end]
                assert len(inside) >= edges[-1] - edges[0], f"{len(inside)} fetches timed: the wrapper missed"
                if rep > 0:
                    shares[str(workers)].append(sum(inside) / (end - start))
                    ms_per_step[str(workers)].append(1000 * (end - start) / (edges[-1] - edges[0]))
    return {
        "share": shares,
        "ms_per_step": ms_per_step,
        "hidden": config.hidden_size,
        "steps": setup.steps,
        "steps_per_epoch": len(train_set) // setup.batch,
        "device": gpu_name() if setup.gpu else "cpu",
    }


@contextlib.contextmanager
def timed_fetches(fetches: list[tuple[float, float]], package: str):
    """Record (start, end) of every next() on the batches the generated loop iterates; train.py stays
    as it is.

    They come from `Bookkeeping.epoch_batches` (training/loop.py): at an epoch's first fetch it calls the
    loader's and the train set's set_epoch (new noise), then each fetch takes a batch from Accelerate's
    DataLoaderShard (which fetches from the torch DataLoader, whose workers start at an epoch's first
    fetch and stop after its last) and puts it on the device (on a GPU: queues the next one's copy).
    All of that is time the loop waits for.
    """
    bookkeeping = importlib.import_module(f"{package}.utils.training.loop").Bookkeeping
    original = bookkeeping.epoch_batches

    def timed(self, *args):
        with contextlib.closing(original(self, *args)) as batches:
            while True:
                begun = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                finally:  # the last, empty fetch of an epoch counts too: Accelerate ends the epoch there
                    fetches.append((begun, time.perf_counter()))
                yield batch

    bookkeeping.epoch_batches = timed
    try:
        yield
    finally:
        bookkeeping.epoch_batches = original


def bench_checkpoint(project: Path, package: str, reps: int) -> dict:
    """save_checkpoint/resume against torch.save/torch.load of the same model, optimizer and schedule."""
    import torch
    import torch.nn.functional as F
    import train
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    checkpoint = importlib.import_module(f"{package}.utils.checkpoints.checkpoint")
    starting = importlib.import_module(f"{package}.utils.run.start")  # where a run starts: resume
    task = importlib.import_module(f"{package}.task")
    scratch = project.parent.parent / "checkpoint-bench"  # inside the parent's temporary folder
    scratch.mkdir(exist_ok=True)
    config = task.Config(hidden_size=SIZES["realistic"], output_dir=str(scratch / "run"))
    accelerator = Accelerator(cpu=True)
    model = task.build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train.schedule_factor(config, 1000))
    train_set, _ = task.build_datasets(config)
    loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, drop_last=True, collate_fn=task.collate)
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
            ("resume", lambda: starting.resume(accelerator, config)),
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
    ended: dict[int, float] = {}  # step -> when it ended: the votes between logging steps, per second

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
        ended[current["step"]] = time.perf_counter()

    # Python and builtin function calls per step, on the training thread: unlike time, a count that
    # this machine's drifting speed cannot blur. Both loops pay the same for the counting wrappers.
    function_calls: collections.Counter[int] = collections.Counter()
    # And where they come from: (step, line of the loop's own code that made them, directly or not).
    by_line: collections.Counter[tuple[int, int]] = collections.Counter()
    loop: dict[str, Any] = {"file": "", "code": None}  # the generated loop: all of train.py

    def profile(frame, event: str, arg) -> None:
        if event in ("call", "c_call"):
            function_calls[current["step"]] += 1
            while frame is not None:
                code = frame.f_code
                if code is loop["code"] or (loop["code"] is None and code.co_filename == loop["file"]):
                    by_line[current["step"], frame.f_lineno] += 1
                    return
                if code.co_filename == __file__:
                    return  # the counting wrappers above, which both loops pay for
                frame = frame.f_back

    def tally() -> dict:
        # Step k = from the end of optimizer step k to the end of step k+1. The steps after the last
        # complete one (checkpoint, evaluation, export) and before the first (setup) are left out, and so
        # is the session's first, a vote that plans the first checkpoint (max_time_lost, training/timing.py).
        # Between logging steps the loop votes about twice a second (a stop, the checkpoint plan): one sync.
        window = range(2, steps - 1)
        logging = [k for k in window if k % LOG_EVERY == 0]
        outside = [(k, site) for k, site in calls if k in window and site != "torch"]
        ordinary = sum(1 for k, _ in outside if k % LOG_EVERY)
        internal = sum(1 for k, site in calls if k in window and site == "torch")
        per_log = (len(outside) - ordinary) / len(logging)
        sites = sorted({site for k, site in outside})
        lines: collections.Counter[int] = collections.Counter()
        for (k, line), count in by_line.items():
            if k in window:
                lines[line] += count
        source = Path(loop["file"]).read_text().splitlines()
        return {
            "by_line": [
                (source[line - 1].strip()[:100], count / len(window)) for line, count in lines.most_common(12)
            ],
            "ordinary": ordinary / (ended[steps - 1] - ended[2]),  # per second
            "per_log": per_log,
            "sites": sites,
            "torch_internal": internal / len(window),
            "python_calls": sum(function_calls[k] for k in window) / len(window),
        }

    import train

    loop["file"] = train.__file__
    originals = {}
    for name in SYNC_METHODS:
        originals[name], wrapper = counted(name)
        setattr(torch.Tensor, name, wrapper)
    handle = register_optimizer_step_post_hook(after_step)
    setup = Setup(steps, 1, SIZES["tiny"])
    try:
        with tempfile.TemporaryDirectory() as scratch:
            argv = template_argv(project, Path(scratch) / "run", setup)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                sys.setprofile(profile)
                assert train.main(argv) == 0
                sys.setprofile(None)
        ours = tally()
        calls.clear()
        ended.clear()
        function_calls.clear()
        by_line.clear()
        current["step"] = 0
        loop.update(file=__file__, code=plain_loop.__code__)
        sys.setprofile(profile)
        plain_loop(package, setup)
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
        _, _, mode, project, setup, result = sys.argv
        worker_main(mode, Path(project), Setup(**json.loads(setup)), Path(result))
    else:
        main()
