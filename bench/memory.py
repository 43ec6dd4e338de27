"""Peak memory of a training step with and without gradient checkpointing, on the CPU, at a realistic shape.

    python bench/memory.py            # BERT-base shape (110 M parameters), 4 texts of 512 tokens
    python bench/memory.py --quick    # a tiny shape (CI runs it so the script cannot rot)

The template is rendered with task=text, and the model is prepared for training by the project's own
`models/pretrained.py: for_training` (which calls the model's `gradient_checkpointing_enable`), in a fresh
process per setting: each child builds the model with random weights, an AdamW over its parameters, and
runs optimizer steps on random token ids; it reports its peak resident memory (getrusage) and the time of
a step. The figures of a full run are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
SHAPES = {  # hidden size, layers, heads, texts per batch, tokens per text
    "full": (768, 12, 12, 4, 512),
    "quick": (64, 2, 2, 2, 64),
}
STEPS = 3  # the first warms up (allocations of the optimizer's state)


def child(project: Path, shape: str, checkpointing: bool) -> None:
    """One setting, in this process: print a JSON line with its peak memory and its step time."""
    sys.path.insert(0, str(project / "src"))
    import torch
    import transformers
    from bench_text.fine_tuning import FineTuningConfig
    from bench_text.models.pretrained import for_training

    hidden, layers, heads, batch, length = SHAPES[shape]
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=length,
        num_labels=4,
    )
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    model = for_training(model, FineTuningConfig(gradient_checkpointing=checkpointing)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (batch, length))
    labels = torch.randint(0, 4, (batch,))
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        model(input_ids=tokens, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    parameters = sum(p.numel() for p in model.parameters())
    print(json.dumps({"peak_mib": peak_kib / 1024, "step_s": min(times[1:]), "parameters": parameters}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape: checks, no figures")
    parser.add_argument(
        "--child", nargs=3, metavar=("PROJECT", "SHAPE", "CHECKPOINTING"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1], args.child[2] == "1")
        return
    from cookiecutter.main import cookiecutter

    shape = "quick" if args.quick else "full"
    with tempfile.TemporaryDirectory() as folder:
        context = {"task": "text", "project_name": "bench text"}
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, extra_context=context, output_dir=folder))
        results = {}
        for checkpointing in (False, True):
            command = [sys.executable, __file__, "--child", str(project), shape, str(int(checkpointing))]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results[checkpointing] = json.loads(output.strip().splitlines()[-1])
    hidden, layers, heads, batch, length = SHAPES[shape]
    off, on = results[False], results[True]
    print(
        f"BERT shape: hidden {hidden}, {layers} layers, {heads} heads, {off['parameters'] / 1e6:.1f} M "
        f"parameters; a batch of {batch} x {length} tokens; AdamW, fp32, 1 CPU process "
        f"({platform.processor() or platform.machine()}, python {platform.python_version()})"
    )
    print("| gradient_checkpointing | peak memory (RSS), MiB | step, s |")
    print("| --- | --- | --- |")
    for setting, result in (("false", off), ("true", on)):
        print(f"| {setting} | {result['peak_mib']:.0f} | {result['step_s']:.2f} |")
    print(
        f"checkpointing saves {off['peak_mib'] - on['peak_mib']:.0f} MiB of peak memory "
        f"({1 - on['peak_mib'] / off['peak_mib']:.0%}) and costs {on['step_s'] / off['step_s'] - 1:.0%} "
        "more time per step"
    )


if __name__ == "__main__":
    main()
