"""What the task-independent tests run for tests/own_task/task.py (see its docstring)."""

# 2 epochs of 24 optimizer steps (1,536 training rows // 64): a second or two of training.
QUICK = ["--num_epochs", "2", "--checkpoint_every", "20", "--keep_checkpoints", "2", "--log_every", "5"]

# Several seconds of training, so that a signal sent once training has begun lands mid-run; the input
# jitter is on.
SIGNAL_RUN = ["--num_epochs", "20", "--log_every", "5", "--checkpoint_every", "100"]

# What every run of this task imports besides torch and Accelerate, for the fork server (tests/forked_runs.py)
# to import once: nothing more.
IMPORTS: tuple[str, ...] = ()
