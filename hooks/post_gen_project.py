"""Put the chosen task preset in place and remove what the chosen options do not need.

Each preset lives in `_presets/<task>/` of the template, laid out like the project: its task.py, data and
model modules, tests and README section. Its files move into the project; the other presets go.
Tracker code is cut by the templates themselves.
"""

import shutil
from pathlib import Path

LICENSE = "{{ cookiecutter.license }}"
TASK = "{{ cookiecutter.task }}"

if __name__ == "__main__":
    if LICENSE == "none":
        Path("LICENSE").unlink()
    chosen = Path("_presets") / TASK
    for source in sorted(chosen.rglob("*")):
        target = source.relative_to(chosen)
        if source.is_file() and target != Path("README.md"):  # README.md is included in README.md
            target.parent.mkdir(parents=True, exist_ok=True)
            source.replace(target)
    shutil.rmtree("_presets")
