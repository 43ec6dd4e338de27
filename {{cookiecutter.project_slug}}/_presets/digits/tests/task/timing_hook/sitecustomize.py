"""Put on PYTHONPATH by test_time_lost.py: a session's first optimizer step takes $FIRST_STEP_S seconds more
(as compiling a model does), and the main process appends to $TIMING_MARKS, line-buffered (a SIGKILL keeps
what was written): `start <step> <time>` as the loop starts, `step <step> <time> <at risk>` after each
step's vote, `stop <step> <seconds>` for each checkpoint's stop of the loop."""

import os
import time

from {{ cookiecutter.package_name }}.utils.training import loop, timing

_marks = open(os.environ["TIMING_MARKS"], "a", buffering=1)  # noqa: SIM115 (open while the process runs)
_init, _count, _log, _saved = (
    loop.Bookkeeping.__init__,
    loop.Bookkeeping.count,
    loop.Bookkeeping.log,
    timing.SessionClock.saved,
)
_main = os.environ.get("RANK", "0") == "0"


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.slow_first = float(os.environ.get("FIRST_STEP_S", "0"))
    if _main:
        _marks.write(f"start {self.state.step} {time.time()}\n")


def count(self, *args, **kwargs):
    time.sleep(self.slow_first)
    self.slow_first = 0.0
    _count(self, *args, **kwargs)


def log(self, *args, **kwargs):
    _log(self, *args, **kwargs)
    if _main:
        _marks.write(f"step {self.state.step} {time.time()} {self.clock.at_risk() or 0.0}\n")


def saved(self, step, *args, **kwargs):
    _saved(self, step, *args, **kwargs)
    if _main:
        _marks.write(f"stop {step} {self.stop_s}\n")


loop.Bookkeeping.__init__, loop.Bookkeeping.count, loop.Bookkeeping.log, timing.SessionClock.saved = (
    init,
    count,
    log,
    saved,
)
