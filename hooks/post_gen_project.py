"""Put the chosen task preset in place, remove what the chosen options do not need, say what to run next.

Each preset lives in `_presets/<task>/` of the template, laid out like the project: its task.py, data and
model modules, tests, its short README section (overview.md, included in README.md) and its long one
(README.md, which becomes a page under docs/). Its files move into the project (with
`_presets/_transformers/` for the presets that fine-tune Hugging Face models); the other presets go.
Tracker code is cut by the templates themselves.
"""

import shlex
import shutil
import tempfile
from pathlib import Path

LICENSE = "{{ cookiecutter.license }}"
CI = "{{ cookiecutter.ci }}"
TASK = "{{ cookiecutter.task }}"
# cruft (create, update, check, diff) renders through cookiecutter's generate_files with its commit in the
# context; for update, check and diff into a fresh temporary folder that is gone when it ends.
BY_CRUFT = "{{ cookiecutter.get('_commit', '') }}" != ""
# The presets that fine-tune Hugging Face models: they share _presets/_transformers/ (loading a pretrained
# model, LoRA, exports as Hugging Face folders, and the tests of these).
BUILT_ON_TRANSFORMERS = ("text", "images")

# A preset's README.md is its page under docs/ (the project's README.md includes its overview.md instead).
DOCS_PAGES = {Path("_presets") / TASK: Path("docs") / "task.md"}
DOCS_PAGES[Path("_presets") / "_transformers"] = Path("docs") / "pretrained.md"

# Printed after a successful render: the project README's quick start, for this folder. One thread: on a
# CPU that other programs keep busy, torch's threads wait for each other's cores (the digits quick start
# took 155 s with 2 threads and 11 s with 1 on a busy 2-core machine).
TRAIN = "OMP_NUM_THREADS=1 python train.py   # fast on busy CPUs"
NEXT_STEPS = """\
Created {project}. Next, in a virtual environment:
  cd {cd}
  pip install torch --index-url https://download.pytorch.org/whl/cpu   # no torch yet, no GPU: CPU-only build
  pip install -e .   # on Colab/Kaggle, skip the line above: the torch they ship is kept
  {train}
More in {readme}: the {task} example, other platforms, your own task."""

if __name__ == "__main__":
    if LICENSE == "none":
        Path("LICENSE").unlink()
    if CI == "none":
        shutil.rmtree(".github")
    chosen = [Path("_presets") / TASK]
    if TASK in BUILT_ON_TRANSFORMERS:
        chosen.append(Path("_presets") / "_transformers")
    for preset in chosen:
        for source in sorted(preset.rglob("*")):
            target = source.relative_to(preset)
            if target == Path("README.md"):
                target = DOCS_PAGES[preset]
            if source.is_file() and target != Path("overview.md"):  # included in README.md
                target.parent.mkdir(parents=True, exist_ok=True)
                source.replace(target)
    shutil.rmtree("_presets")
    project = Path.cwd()  # cookiecutter runs this hook in the new project folder
    readme = project / "README.md"
    in_temporary = project.parent.parent == Path(tempfile.gettempdir()).resolve()
    if BY_CRUFT and in_temporary and project.parent.name.startswith("tmp"):
        raise SystemExit(0)  # a render to compare with: its folder is nobody's next step
    cd = shlex.quote(str(project))
    print(NEXT_STEPS.format(project=project, cd=cd, readme=readme, task=TASK, train=TRAIN))
