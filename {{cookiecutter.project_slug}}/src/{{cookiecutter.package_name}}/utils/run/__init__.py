"""A run's start, its output folder and its record: history, trackers, curves, the task's checks."""
