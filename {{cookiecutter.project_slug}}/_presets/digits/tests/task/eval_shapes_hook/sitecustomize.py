"""Put on PYTHONPATH by test_evaluation.py: records the tensor shapes of each batch given to eval_step."""

import json
import os

import torch

from {{ cookiecutter.package_name }} import task

_eval_step = task.eval_step


def eval_step(model, batch):  # the task's own signature
    shapes = [list(leaf.shape) for leaf in torch.utils._pytree.tree_leaves(batch) if torch.is_tensor(leaf)]
    with open(f"{os.environ['EVAL_SHAPES']}.{os.environ.get('RANK', '0')}", "a") as file:
        file.write(json.dumps(shapes, separators=(",", ":")) + "\n")
    return _eval_step(model, batch)


task.eval_step = eval_step
