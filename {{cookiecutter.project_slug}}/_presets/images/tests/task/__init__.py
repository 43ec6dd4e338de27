"""The tests of the example task (this preset's): its data, its model's quality, its own features.

The tests one folder up are the project's guarantees, with any task that keeps the contract of task.py.
With a task of your own, delete this folder or put the tests of your task here (README, "Bring your
own task").
"""
