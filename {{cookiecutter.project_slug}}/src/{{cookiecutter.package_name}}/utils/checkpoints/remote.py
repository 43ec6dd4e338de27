"""Remote stores for `mirror_dir` and `import_from` (docs/moving-runs.md); no torch."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig

SECRETS = {  # what each protocol's package reads from the environment
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"),
    "hf": ("HF_TOKEN",),
}
STORE_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # pyproject.toml's extra of a protocol
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_url(text: str) -> bool:
    return bool(_URL.match(text))


def protocol(url: str) -> str:
    match = _URL.match(url)
    return match.group(1).lower() if match else ""


def url_problem(url: str) -> str | None:
    """Why `url` cannot be used as a store, without touching the network; None if it can."""
    from fsspec.registry import get_filesystem_class

    if re.match(r"^[^/]*://[^/@]*:[^/@]*@", url):
        return "holds a credential: remove it from the URL and set it as a secret (see checkpoints/remote.py)"
    try:
        get_filesystem_class(protocol(url))
    except (ValueError, ImportError) as error:  # a protocol fsspec does not know; its package missing
        extra = STORE_EXTRAS.get(protocol(url))
        return f"{error}" + (f": pip install -e '.[{extra}]'" if extra else "")
    return None


def check_urls(config: TrainConfig, source: str | Path) -> None:
    """Raise a ConfigError naming `source` for a URL in mirror_dir or import_from that cannot work."""
    for name in ("mirror_dir", "import_from"):
        url = getattr(config, name)
        if is_url(url) and (problem := url_problem(url)):
            shown = re.sub(r"://[^/]*@", "://***@", url)  # never echo a credential
            raise ConfigError(f"{source}: {name}={shown}: {problem}")


def open_store(url: str) -> tuple[Any, str]:
    """(the fsspec filesystem, the path inside it) of `url`."""
    from fsspec.core import url_to_fs

    # No cached listings: another session (or this one's other thread) changes the folder meanwhile.
    fs, path = url_to_fs(url, use_listings_cache=False)
    return fs, path.rstrip("/")


def load_secrets(url: str) -> list[str]:
    """Load the secrets `url`'s protocol needs ; notes of where each came from (never a value)."""
    found: dict[str, list[str]] = {}
    for name in SECRETS.get(protocol(url), ()):
        if not os.environ.get(name) and (where := load_secret(name)):
            found.setdefault(where, []).append(name)
    return [f"credentials: {', '.join(names)} from {where}" for where, names in found.items()]


def load_secret(name: str) -> str | None:
    """Secret `name` into this process's environment from Kaggle's or Colab's; where, or None."""
    if os.environ.get(name):
        return "the environment"
    for where, read in (("Kaggle's secrets", _kaggle_secret), ("Colab's secrets", _colab_secret)):
        try:
            value = read(name)
        except Exception:  # not this platform; or absent, not granted, read outside the notebook's kernel
            continue
        if value:
            os.environ[name] = value
            return where
    return None


def export_secrets(*urls: str) -> None:
    """For a notebook cell: the URLs' secrets into the kernel's environment, which training inherits."""
    for url in urls:
        if is_url(url):
            for note in load_secrets(url):
                print(note)
            missing = [name for name in SECRETS.get(protocol(url), ())[:2] if not os.environ.get(name)]
            if missing:
                print(f"{url}: no {', '.join(missing)} in the environment or the notebook's secrets")


def _kaggle_secret(name: str) -> str | None:
    from kaggle_secrets import UserSecretsClient

    return UserSecretsClient().get_secret(name)


def _colab_secret(name: str) -> str | None:
    from google.colab import userdata
    from IPython import get_ipython

    return userdata.get(name) if get_ipython() is not None else None  # not in a launcher's subprocess


def access_problem(url: str, field: str) -> str | None:
    """One line if `url` cannot be read with the credentials at hand (asks the store once), else None."""
    parent = ""
    try:
        fs, path = open_store(url)
        # The folder itself may not exist yet (a new mirror): its parent, or the bucket, must.
        parent = fs.unstrip_protocol(path.rsplit("/", 1)[0] if "/" in path else path)
        fs.ls(parent, detail=False)
    except FileNotFoundError:
        return f"{field} {url}: {parent or url} does not exist: create it first"
    except PermissionError as error:
        return f"{field} {url}: the store refused the credentials ({_first_line(error)}): {_hint(url)}"
    except Exception as error:  # each package raises its own types (botocore, aiohttp, huggingface_hub)
        text = _first_line(error)
        if "credential" in text.lower() or "token" in text.lower():
            return f"{field} {url}: no usable credentials ({text}): {_hint(url)}"
        return f"{field} {url}: cannot reach the store ({type(error).__name__}: {text})"
    return None


def _hint(url: str) -> str:
    names = SECRETS.get(protocol(url))
    if not names:
        return "check the credentials its fsspec package reads"
    needed = " and ".join(names[:2]) if protocol(url) == "s3" else names[0]
    return f"set {needed} in the environment, or as a Colab or Kaggle secret"


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
