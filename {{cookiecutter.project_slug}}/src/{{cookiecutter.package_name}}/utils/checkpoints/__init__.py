"""Checkpoints and their copies: sealed writes, the background saver, the mirror, stores."""
