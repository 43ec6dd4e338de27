"""The task's datasets: modules that task.py's `build_datasets` and `predict_inputs` read from."""
