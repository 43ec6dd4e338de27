"""The task's networks: modules that task.py's `build_model` builds from the config."""
