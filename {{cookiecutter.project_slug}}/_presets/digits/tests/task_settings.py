"""What the task-independent tests (conftest.py, test_guarantees.py and the others) run for this task."""

# A short real run (about a second of training on a 2-core CPU), shared by the tests that only read its
# outputs: 4 epochs of 22 optimizer steps.
QUICK = ["--num_epochs", "4", "--checkpoint_every", "20", "--keep_checkpoints", "2", "--log_every", "5"]

# A run that trains for several seconds, so that a signal sent once training has begun lands mid-run;
# dropout and the augmentation noise are on, and accumulation is 2 (per-device 32, global 64).
SIGNAL_RUN = ["--num_epochs", "8", "--hidden_size", "512", "--log_every", "5", "--checkpoint_every", "20"]

# None: 1 vs 2 processes (dropout on, one thread each) end at exactly the same eval metrics, not
# merely to rounding.
EVAL_ROUNDING_DTYPE = None
