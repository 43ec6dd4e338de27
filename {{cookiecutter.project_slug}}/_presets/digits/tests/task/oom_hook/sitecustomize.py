"""Put on PYTHONPATH by test_train.py: task.loss runs out of memory, as a GPU would, on a batch of more than
$OOM_ABOVE samples ($OOM_ABOVE_<rank> for one process), after a forward and backward that moved the random
stream and left gradients: a try that failed must leave no trace in the run. Its loss also draws from
numpy's and Python's global generators, which the tries must leave as they found them."""

import os
import random

import numpy as np
import torch
from accelerate.utils import find_batch_size

from {{ cookiecutter.package_name }} import task

_loss = task.loss


def loss(model, batch):  # the task's own signature
    result = _loss(model, batch) * (1 + 1e-3 * (np.random.rand() + random.random()))
    rank = os.environ.get("RANK", "0")
    if find_batch_size(batch) > int(os.environ.get(f"OOM_ABOVE_{rank}", os.environ["OOM_ABOVE"])):
        result.backward()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    return result


task.loss = loss
