"""What the task-independent tests (conftest.py, test_guarantees.py and the others) run for this task."""

# A short real run (a few seconds of training on a 2-core CPU), shared by the tests that only read its
# outputs: 4 epochs of 12 optimizer steps, evaluated at steps 24 and 48.
QUICK = [
    *["--num_epochs", "4", "--eval_every", "24", "--checkpoint_every", "10", "--keep_checkpoints", "2"],
    *["--log_every", "5"],
]

# A run that trains for several seconds, so that a signal sent once training has begun lands mid-run;
# dropout and the augmentation (random crops, mirroring) are on: 12 epochs of 12 optimizer steps.
SIGNAL_RUN = ["--num_epochs", "12", "--log_every", "2", "--checkpoint_every", "10"]

# Dropout draws different masks on each process: off where 1 and 2 processes are compared.
SAME_ON_EVERY_PROCESS = ["--dropout", "0"]

# None: 1 vs 2 processes (dropout 0, one thread each) end at exactly the same eval metrics, not
# merely to rounding.
EVAL_ROUNDING_DTYPE = None
