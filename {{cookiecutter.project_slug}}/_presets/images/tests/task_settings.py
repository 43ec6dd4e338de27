"""What the task-independent tests (conftest.py, test_guarantees.py and the others) run for this task."""

from pathlib import Path

# A short real run (a few seconds of training on a 2-core CPU), shared by the tests that only read its
# outputs: 4 epochs of 12 optimizer steps, evaluated at steps 24 and 48.
QUICK = [
    *["--num_epochs", "4", "--eval_every", "24", "--checkpoint_every", "10", "--keep_checkpoints", "2"],
    *["--log_every", "5"],
]

# A run that trains for several seconds, so that a signal sent once training has begun lands mid-run;
# dropout and the augmentation (random crops, mirroring) are on: 12 epochs of 12 optimizer steps.
SIGNAL_RUN = ["--num_epochs", "12", "--log_every", "2", "--checkpoint_every", "10"]


# Fine-tuning (tests/task/test_fine_tuning.py): a pretrained model stood in for by a tiny ViT with random
# weights (32-pixel images in 8-pixel patches) and its image processor, saved as a download is
# (save_pretrained); a run of 24 optimizer steps with dropout on and a checkpoint every 10, long enough for
# a signal to land mid-run.
FINE_TUNING_RUN = ["--max_steps", "24", "--log_every", "2", "--checkpoint_every", "10"]
# LoRA, with every guarantee. Full fine-tuning goes through the same code as the text preset's, which
# proves it there, and as the CNN's (tests/test_guarantees.py).
FINE_TUNING_MODES = ("lora",)

# What transformers.pipeline is asked for, and an input: an exported model/ is a pipeline's model.
PIPELINE = ("image-classification", str(Path(__file__).resolve().parents[1] / "data/val/ring/000.png"))


def save_pretrained_model(folder: Path) -> None:
    import transformers

    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=2,  # the checkpoint's own head: train.py puts a new one in its place
    )
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    processor = transformers.ViTImageProcessor(
        size={"height": 32, "width": 32}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    processor.save_pretrained(folder)


# What every run of this task imports besides torch and Accelerate, for the fork server (tests/forked_runs.py)
# to import once: nothing more.
IMPORTS: tuple[str, ...] = ()
