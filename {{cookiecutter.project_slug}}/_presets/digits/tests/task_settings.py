"""What the task-independent tests (conftest.py, test_guarantees.py and the others) run for this task."""

# A short real run (about a second of training on a 2-core CPU), shared by the tests that only read its
# outputs: 4 epochs of 22 optimizer steps.
QUICK = ["--num_epochs", "4", "--checkpoint_every", "20", "--keep_checkpoints", "2", "--log_every", "5"]

# A run that trains for several seconds, so that a signal sent once training has begun lands mid-run:
# 400 optimizer steps (18 epochs); dropout and the augmentation noise are on, and accumulation is 2
# (per-device 32, global 64).
SIGNAL_RUN = ["--max_steps", "400", "--log_every", "5", "--checkpoint_every", "20"]

# What every run of this task imports besides torch and Accelerate, for the fork server (tests/forked_runs.py)
# to import once: nothing more.
IMPORTS: tuple[str, ...] = ()
