"""The machine: hardware and threads, the batch its memory holds, Accelerate's fixes, packages."""
