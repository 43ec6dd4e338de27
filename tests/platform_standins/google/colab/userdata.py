"""Stand-in for `google.colab.userdata`: Colab's secrets (the key icon), none of which is set in the tests."""

from __future__ import annotations


class SecretNotFoundError(Exception):
    """No secret of that name."""


class NotebookAccessError(Exception):
    """The secret exists but this notebook may not read it."""


def get(key: str) -> str:
    raise SecretNotFoundError(key)
