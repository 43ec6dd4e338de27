"""What the task-independent tests (conftest.py, test_guarantees.py and the others) run for this task."""

# A short real run, shared by the tests that only read its outputs: 20 optimizer steps of 64 windows, a
# checkpoint every 10, one evaluation at the end; with the smaller GPT of tests/task/model.yaml
# (tests/conftest.py: QUICK).
QUICK = ["--max_steps", "20", "--checkpoint_every", "10", "--keep_checkpoints", "2", "--log_every", "5"]

# A run of 40 steps, so that a signal sent once training has begun lands mid-run; accumulation is 2
# (per-device 32, global 64), dropout on (tests/task/model.yaml). A stop takes effect at the next logging
# step: every 2 steps.
SIGNAL_RUN = ["--max_steps", "40", "--log_every", "2", "--checkpoint_every", "10"]

# What every run of this task imports besides torch and Accelerate, for the fork server (tests/forked_runs.py)
# to import once: nothing more.
IMPORTS: tuple[str, ...] = ()
