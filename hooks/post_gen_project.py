"""Remove what the chosen options do not need.

Tracker code is already cut by the templates themselves; what is left here are whole files that
only exist for some answers.
"""

from pathlib import Path

LICENSE = "{{ cookiecutter.license }}"

if __name__ == "__main__":
    if LICENSE == "none":
        Path("LICENSE").unlink()
