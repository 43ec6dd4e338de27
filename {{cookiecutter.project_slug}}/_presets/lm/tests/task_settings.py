"""What the task-independent tests (conftest.py, test_guarantees.py and the others) run for this task."""

# The default GPT at half its width and depth: every layer kind, multi-head attention and the loop's
# guarantees as in the default, in half a run's time (QUICK in a fresh interpreter, one thread: 12 s, not
# 24). The stated loss is tested with the default model (tests/task/test_task.py).
MODEL = ["--num_layers", "2", "--embed_dim", "64"]

# A short real run, shared by the tests that only read its outputs: 20 optimizer steps of 64 windows, a
# checkpoint every 10, one evaluation at the end.
QUICK = [
    *["--max_steps", "20", "--checkpoint_every", "10", "--keep_checkpoints", "2", "--log_every", "5"],
    *MODEL,
]

# A run of 40 steps, so that a signal sent once training has begun lands mid-run; accumulation is 2
# (per-device 32, global 64), dropout on (the default has none). A stop takes effect at the next logging
# step: every 2 steps.
SIGNAL_RUN = ["--max_steps", "40", "--log_every", "2", "--checkpoint_every", "10", "--dropout", "0.1", *MODEL]

# What every run of this task imports besides torch and Accelerate, for the fork server (tests/forked_runs.py)
# to import once: nothing more.
IMPORTS: tuple[str, ...] = ()
