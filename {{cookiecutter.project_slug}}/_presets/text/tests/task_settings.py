"""What the task-independent tests (conftest.py, test_guarantees.py and the others) run for this task."""

from pathlib import Path

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import load_config

PROJECT = Path(__file__).resolve().parents[1]

# What every run of this task imports besides torch and Accelerate (BERT, its tokenizer, the padding): the
# fork server (tests/forked_runs.py) imports it once, not each run (3 s of a short run's start).
IMPORTS = (
    "transformers.models.bert.modeling_bert",
    "transformers.data.data_collator",
    "transformers.tokenization_utils_fast",
)

# A short real run, shared by the tests that only read its outputs: 2 epochs of 21 optimizer steps (1,352
# training passages // 64); with the smaller BERT of tests/task/model.yaml (tests/conftest.py: QUICK).
QUICK = ["--num_epochs", "2", "--checkpoint_every", "20", "--keep_checkpoints", "2", "--log_every", "5"]

# A run that trains for several seconds, so that a signal sent once training has begun lands mid-run:
# 5 epochs, 105 optimizer steps, dropout 0.1 (the default) on, accumulation 2 (per-device 32, global 64).
SIGNAL_RUN = ["--num_epochs", "5", "--log_every", "5", "--checkpoint_every", "20"]


# Fine-tuning (tests/task/test_fine_tuning.py): a pretrained model stood in for by the tiny BERT with random
# weights and the word-level tokenizer, saved as a download is (save_pretrained); a run of 30 optimizer
# steps with dropout on and a checkpoint every 10, long enough for a signal to land mid-run.
FINE_TUNING_RUN = ["--max_steps", "30", "--log_every", "2", "--checkpoint_every", "10"]
# Full fine-tuning and LoRA, each with every guarantee.
FINE_TUNING_MODES = ("full", "lora")

# What transformers.pipeline is asked for, and an input: an exported model/ is a pipeline's model.
PIPELINE = ("text-classification", "But, soft! what light through yonder window breaks?")


def save_pretrained_model(folder: Path) -> None:
    from .conftest import MODEL

    config, _ = load_config(MODEL, PROJECT / "configs" / "local.yaml", task.Config)
    config.data_file = str(PROJECT / config.data_file)
    task.build_tokenizer(config).save_pretrained(folder)
    task.build_base(config).save_pretrained(folder)
