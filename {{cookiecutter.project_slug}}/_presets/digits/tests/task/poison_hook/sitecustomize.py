"""Put on PYTHONPATH by test_rollback.py: training image $POISON_INDEX is all NaN in the epochs listed in
$POISON_EPOCHS (e.g. "1,2"), so that the step that trains on it diverges."""

import os

from {{ cookiecutter.package_name }}.data import digits

_set_epoch = digits.NoisyDigits.set_epoch


def set_epoch(self, epoch: int) -> None:
    _set_epoch(self, epoch)
    if str(epoch) in os.environ["POISON_EPOCHS"].split(","):
        self.images = self.images.clone()
        self.images[int(os.environ["POISON_INDEX"])] = float("nan")


digits.NoisyDigits.set_epoch = set_epoch
