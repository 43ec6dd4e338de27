"""notebooks/colab.ipynb and notebooks/kaggle.ipynb run cell by cell in a real Jupyter kernel (nbclient and
ipykernel), as a user runs them, on the default render.

Stood in for, and only these, since the platforms themselves provide them:
- the /content and /kaggle roots: links to temporary folders, seen only by these tests and the kernels they
  start: the tests run in a private mount namespace whose root is the machine's, folder for folder, with
  the two links added (root is needed: CI runs as root); nothing is written at the machine's root;
- the platform's variable in the kernel's environment: COLAB_RELEASE_TAG, or KAGGLE_KERNEL_RUN_TYPE;
- Colab: `google.colab` (tests/platform_standins/: `drive.mount` makes /content/drive/MyDrive a plain folder,
  which a new session keeps as Drive does; `userdata` has no secrets). The project is uploaded to
  /content/drive/MyDrive/<slug>; a new session starts with nothing else in /content;
- Kaggle: the project uploaded as a dataset in /kaggle/input/<slug>/ (Kaggle mounts inputs read-only: every
  session must leave /kaggle/input as it found it) and an empty, writable /kaggle/working.
Not the platform's, but kept out: a GPU (there is none here: training runs on the CPU) and pip
(SKIP_INSTALL=1: the launcher must not change this venv). The notebooks run as they are, with one cell
inserted after their `parameters` cell (papermill's convention) that sets a short run's TRAIN_ARGS and
SHOW_TENSORBOARD = False: Colab's inline TensorBoard would start a server that outlives the kernel, so
that cell runs only its `else` branch here (its magics are still parsed).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import nbformat
import pytest
import yaml
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from .conftest import DEFAULT_SLUG, Render, tool

# One xdist worker for all of them: they share one private view of /content and /kaggle.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("platform_roots")]

PLATFORMS = ("colab", "kaggle")
STANDINS = Path(__file__).parent / "platform_standins"
# Few steps. The stop that an interrupt asks for happens at the loop's next vote (within a second), at a step
# that depends on the machine's pace: read from the output. That is far longer than the 0.2 s Jupyter leaves
# a `!` command before killing it. No evaluation before the end: a stopped run has no export yet.
TRAIN_ARGS = ["--max_steps", "400", "--log_every", "10", "--eval_every", "1000", "--checkpoint_every", "30"]
INTERRUPT_AFTER = "checkpoint: step 30 saved"
LAST_STEP = 400
CELL_TIMEOUT_S = 300
KAGGLE_NOTEBOOK = "train-digits"  # the notebook's slug on Kaggle: its output is attached under this name
# Linux's unshare(2), mount(2) and setns(2) flags.
CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE = 0x20000, 0x1000, 0x4000, 0x40000


@contextlib.contextmanager
def private_root(links: dict[str, Path], scratch: Path) -> Iterator[Path]:
    """This thread, and the processes it starts, see a root with the machine's folders and files bound in
    and `links` added (name -> target), in a mount namespace of their own; the machine's root is left as
    it is, and yielded (a path through /proc that reaches it). Back to the machine's namespace and root at
    the end."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(status: int, what: str) -> None:
        if status != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"{what}: {os.strerror(error)}")

    machine_namespace, machine_root = os.open("/proc/self/ns/mnt", os.O_RDONLY), os.open("/", os.O_RDONLY)
    cwd = os.getcwd()
    try:
        check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        try:
            check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
            check(libc.mount(b"tmpfs", str(scratch).encode(), b"tmpfs", 0, None), f"a tmpfs on {scratch}")
            for entry in Path("/").iterdir():
                bound = scratch / entry.name
                if entry.is_symlink():
                    bound.symlink_to(os.readlink(entry))
                    continue
                bound.mkdir() if entry.is_dir() else bound.touch()
                flags = MS_BIND | (MS_REC if entry.is_dir() else 0)
                check(
                    libc.mount(str(entry).encode(), str(bound).encode(), None, flags, None), f"bind {entry}"
                )
            for name, target in links.items():
                (scratch / name).symlink_to(target)
            os.chroot(scratch)
            os.chdir(cwd)
            yield Path(f"/proc/self/fd/{machine_root}")
        finally:
            os.fchdir(machine_root)
            os.chroot(".")
            check(libc.setns(machine_namespace, CLONE_NEWNS), "setns back to the machine's mount namespace")
            os.chdir(cwd)
    finally:
        os.close(machine_namespace)
        os.close(machine_root)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """/content and /kaggle, links to empty temporary folders that only these tests see; the folders, by
    name, and "machine": the machine's own root."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a private /content and /kaggle need Linux's mount namespaces")
    base = tmp_path_factory.mktemp("platform-roots")
    folders = {name: base / name for name in ("content", "kaggle")}
    for folder in folders.values():
        folder.mkdir()
    (base / "root").mkdir()
    with contextlib.ExitStack() as stack:
        try:
            machine = stack.enter_context(private_root(folders, base / "root"))
        except OSError as error:
            pytest.skip(f"cannot give these tests a private /content and /kaggle ({error}): root is needed")
        assert Path("/content").resolve() == folders["content"], "the private root is not in effect"
        yield {**folders, "machine": machine}


def test_the_machines_root_is_left_as_it_is(roots: dict[str, Path]) -> None:
    """The links are in these tests' own view: the machine's root has no link of theirs."""
    for name in ("content", "kaggle"):
        assert Path(f"/{name}").resolve() == roots[name]
        made = roots["machine"] / name
        assert not (made.is_symlink() and os.readlink(made) == str(roots[name])), f"/{name} was made"


def clear(root: Path) -> None:
    """Empty a platform root, as a new session finds it."""
    for child in root.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def upload(project: Path, destination: Path) -> None:
    """The project folder as a user uploads it: without caches that tests may have left in the render."""
    shutil.copytree(project, destination, ignore=shutil.ignore_patterns("__pycache__", ".*_cache"))


def tree(folder: Path) -> list[tuple[str, int, int]]:
    """Every path under `folder` with its size and modification time: any write changes it."""
    return sorted(
        (str(path.relative_to(folder)), path.lstat().st_size, path.lstat().st_mtime_ns)
        for path in folder.rglob("*")
    )


def kernel_env(platform: str, ipython_dir: Path) -> dict[str, str]:
    """This environment as the platform's kernel would have it: its variable set, no other platform's."""
    outer = ("PYTEST_", "COLAB_", "KAGGLE_", "SLURM_")
    env = {key: value for key, value in os.environ.items() if not key.startswith(outer)}
    env.pop("ANY_PLATFORM", None)
    env.pop("PYTHONPATH", None)
    # `python` in the launcher is this venv's, as the platform's is its own.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["SKIP_INSTALL"] = "1"
    env["IPYTHONDIR"] = str(ipython_dir)
    if platform == "colab":
        env["COLAB_RELEASE_TAG"] = "release-colab-stand-in"
        env["PYTHONPATH"] = str(STANDINS)
    else:
        env["KAGGLE_KERNEL_RUN_TYPE"] = "Interactive"
    return env


def text(cell: nbformat.NotebookNode) -> str:
    """What a cell showed: its streams, then its error if it raised one."""
    parts = [output.text for output in cell.outputs if output.output_type == "stream"]
    parts += [f"{output.ename}: {output.evalue}" for output in cell.outputs if output.output_type == "error"]
    return "".join(parts)


@dataclass
class Session:
    """A notebook after "Run all" in one kernel."""

    notebook: nbformat.NotebookNode

    def cell(self, cell_id: str) -> nbformat.NotebookNode:
        return next(cell for cell in self.notebook.cells if cell.get("id") == cell_id)

    def output(self, cell_id: str) -> str:
        return text(self.cell(cell_id))

    def error(self, cell_id: str) -> str | None:
        errors = [output.ename for output in self.cell(cell_id).outputs if output.output_type == "error"]
        return errors[0] if errors else None

    def ran(self, cell_id: str) -> bool:
        return self.cell(cell_id).execution_count is not None


async def run_cells(
    notebook: nbformat.NotebookNode,
    env: dict[str, str],
    cwd: Path,
    interrupt_after: str | None,
    one_by_one: bool = False,
) -> None:
    """Run the code cells in order in a new kernel, stopping at the first that fails (as "Run all" does;
    `one_by_one`: going on, as a user who runs each cell does); interrupt the training cell, as its stop
    button does, once its output shows `interrupt_after`."""
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(cwd)}}
    )
    async with client.async_setup_kernel(env=env):
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code":
                continue
            running = asyncio.ensure_future(client.async_execute_cell(cell, index))
            if interrupt_after and cell.get("id") == "train":
                deadline = time.monotonic() + CELL_TIMEOUT_S
                while interrupt_after not in text(cell):
                    if running.done() or time.monotonic() > deadline:
                        running.cancel()
                        pytest.fail(f"the training cell never showed {interrupt_after!r}:\n{text(cell)}")
                    await asyncio.sleep(0.05)
                await client.km.interrupt_kernel()  # what the stop button sends: SIGINT to the kernel
            try:
                await running
            except CellExecutionError:
                if not one_by_one:
                    return


def run_session(
    render: Render,
    platform: str,
    roots: dict[str, Path],
    interrupt_after: str | None = None,
    remote_store: str = "",
    env: dict[str, str] | None = None,
    one_by_one: bool = False,
) -> Session:
    """Run all cells of the platform's notebook in a new kernel, on the platform's folders as they are;
    `remote_store`: the notebook's REMOTE_STORE; `env`: more of the kernel's environment."""
    notebook = nbformat.read(render.path / "notebooks" / f"{platform}.ipynb", as_version=4)
    (index,) = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    parameters = f"TRAIN_ARGS = {TRAIN_ARGS!r}\nSHOW_TENSORBOARD = False\nREMOTE_STORE = {remote_store!r}"
    injected = nbformat.v4.new_code_cell(parameters)
    injected.metadata["tags"] = ["injected-parameters"]
    notebook.cells.insert(index + 1, injected)
    cwd = roots["content"] if platform == "colab" else roots["kaggle"] / "working"
    inputs = roots["kaggle"] / "input"
    before = tree(inputs) if platform == "kaggle" else None
    with tempfile.TemporaryDirectory(prefix="ipython-") as ipython_dir:
        kernel = kernel_env(platform, Path(ipython_dir)) | (env or {})
        asyncio.run(run_cells(notebook, kernel, cwd, interrupt_after, one_by_one))
    if before is not None:
        assert tree(inputs) == before, "the session wrote into /kaggle/input, which Kaggle mounts read-only"
    return Session(notebook)


def new_session(render: Render, platform: str, roots: dict[str, Path], kept: Path | None) -> None:
    """The folders a new session of the platform starts with: the uploaded project and, from `kept`, what
    the platform keeps between sessions (Colab: Drive; Kaggle, within one session: /kaggle/working)."""
    if platform == "colab":
        clear(roots["content"])
        drive = roots["content"] / "drive"
        if kept is None:
            upload(render.path, drive / "MyDrive" / render.answer("project_slug"))
        else:
            shutil.copytree(kept, drive)
    else:
        clear(roots["kaggle"])
        upload(render.path, roots["kaggle"] / "input" / render.answer("project_slug"))
        if kept is None:
            (roots["kaggle"] / "working").mkdir()
        else:
            shutil.copytree(kept, roots["kaggle"] / "working")


def output_dir(render: Render, platform: str) -> Path:
    """Where configs/<platform>.yaml puts the run (under /content or /kaggle, reached through the links)."""
    return Path(yaml.safe_load((render.path / "configs" / f"{platform}.yaml").read_text())["output_dir"])


@dataclass
class Interrupted:
    platform: str
    session: Session
    kept: Path  # what the platform keeps of it (Colab: /content/drive; Kaggle: /kaggle/working)

    @property
    def stop_step(self) -> int:
        """The step the interrupt's stop saved, as the training cell said."""
        output = self.session.output("train")
        found = re.search(r"stopped by SIGINT at step (\d+): checkpoint saved", output)
        assert found, output
        return int(found.group(1))


@pytest.fixture(scope="module", params=PLATFORMS)
def interrupted(
    request: pytest.FixtureRequest,
    render: Callable[..., Render],
    roots: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Interrupted:
    """A fresh session of the platform's notebook, its training cell interrupted after a first checkpoint."""
    platform, project = request.param, render()
    assert project.answer("project_slug") == DEFAULT_SLUG
    new_session(project, platform, roots, kept=None)
    session = run_session(project, platform, roots, interrupt_after=INTERRUPT_AFTER)
    kept = tmp_path_factory.mktemp(f"{platform}-kept") / "kept"
    shutil.copytree(roots["content"] / "drive" if platform == "colab" else roots["kaggle"] / "working", kept)
    return Interrupted(platform, session, kept)


def test_fresh_session_trains_and_an_interrupt_saves_a_checkpoint(
    interrupted: Interrupted, render: Callable[..., Render]
) -> None:
    """In a fresh session, "Run all" starts training fresh; the stop button in the training cell makes
    training save a checkpoint within a second and exit, and "Run all" goes on: every result
    cell shows what the stopped run has (its metrics; no export yet, said in one line) without an error.
    Stood in for: as in the module's docstring (the stop button: nbclient's kernel interrupt, SIGINT to
    the kernel)."""
    session, platform = interrupted.session, interrupted.platform
    output = session.output("train")
    assert f"starting fresh in {output_dir(render(), platform)}" in output, output
    assert "SIGINT received: saving a checkpoint within a second or a step, then stopping" in output, output
    stop = interrupted.stop_step
    assert 30 < stop < LAST_STEP, output
    saved = re.findall(rf"checkpoint: step {stop} saved to (\S+)", output)
    assert saved and Path(saved[0]).is_dir(), output
    assert session.error("train") is None, output
    assert "training stopped (exit 75): run this cell again to continue" in output, output
    for cell in ("results", "predict", *(("flush-drive",) if platform == "colab" else ())):
        assert session.ran(cell) and session.error(cell) is None, (cell, session.output(cell))
    results = session.output("results")
    assert f'"step": {stop // 10 * 10}' in results and "model: not exported yet" in results, results
    # Training's own bar, redrawn in the cell; after the stop, the results cell shows curves.png.
    assert re.search(r"\rtrain: +\d+%\|", output), output
    assert any("image/png" in shown.get("data", {}) for shown in session.cell("results").outputs), results
    predicted = session.output("predict").strip()
    model = output_dir(render(), platform) / "model"
    assert predicted.startswith(f"no predictions yet: {model} is exported when training ends"), predicted
    if platform == "colab":
        assert "done: the run is on Drive: /content/drive/MyDrive/" in session.output("flush-drive")


def assert_continued_to_the_end(session: Session, project: Render, platform: str, stop_step: int) -> str:
    """The training cell continued the interrupted run from the stop's checkpoint to the last step, and the
    results cell showed the last metrics and the exported model. Returns the training cell's output."""
    output = session.output("train")
    assert session.error("train") is None, output
    assert re.search(rf"resuming from \S+ \(step {stop_step},", output), output
    assert f"done: {LAST_STEP} optimizer steps" in output, output
    assert (output_dir(project, platform) / "model").is_dir()
    results = session.output("results")
    assert session.error("results") is None, results
    assert f'"step": {LAST_STEP}' in results and ".safetensors" in results, results
    assert_results_shown(session, project, platform)
    return output


def assert_results_shown(session: Session, project: Render, platform: str) -> None:
    """The cells after the results: TensorBoard's cell (Colab) parsed and skipped as told, and predict.py's
    first rows, written next to the run."""
    if platform == "colab":
        assert session.error("tensorboard") is None, session.output("tensorboard")
        assert "TensorBoard: skipped (SHOW_TENSORBOARD is False)" in session.output("tensorboard")
    predicted = session.output("predict")
    assert session.error("predict") is None, predicted
    rows = [line for line in predicted.splitlines() if line.startswith("index: ")]
    assert [row.split(" | ")[0] for row in rows] == [f"index: {index}" for index in range(5)], predicted
    assert (output_dir(project, platform) / "predictions.csv").is_file()


def test_running_all_cells_again_continues(
    interrupted: Interrupted, render: Callable[..., Render], roots: dict[str, Path]
) -> None:
    """After the interrupt, "Run all" again (Colab: in a new session, Drive kept; Kaggle: the kernel
    restarted in the same session, /kaggle/working kept) continues from the stop's checkpoint to the end,
    and the results cell shows the metrics and the exported model. Stood in for: as in the module's
    docstring."""
    project, platform = render(), interrupted.platform
    new_session(project, platform, roots, kept=interrupted.kept)
    session = run_session(project, platform, roots)
    output = assert_continued_to_the_end(session, project, platform, interrupted.stop_step)
    if platform == "colab":  # the new session's disk is empty: the run comes from its copy on Drive
        mirror = yaml.safe_load((project.path / "configs" / "colab.yaml").read_text())["mirror_dir"]
        assert f"continuing from {mirror} (step {interrupted.stop_step}," in output, output
        # The copy to Drive was complete when training ended; the last cell then flushed Drive.
        assert f"mirror: {mirror} holds step {LAST_STEP} (verified)" in output, output
        assert session.error("flush-drive") is None and "done: the run is on Drive" in session.output(
            "flush-drive"
        )


# The hops below use what configs/<platform>.yaml set for them: import_from (Kaggle: /kaggle/input) and,
# on Colab, mirror_dir (the run's copy on Drive).


@pytest.mark.parametrize("interrupted", ["kaggle"], indirect=True)
def test_new_kaggle_session_continues_the_previous_versions_output(
    interrupted: Interrupted, render: Callable[..., Render], roots: dict[str, Path]
) -> None:
    """A new Kaggle session, with the interrupted session's output attached as an input, continues that
    run in /kaggle/working by itself. Stood in for: Kaggle's "Add Input > Your Work", which mounts what
    /kaggle/working held, read-only, at /kaggle/input/<notebook>/; the rest as in the module's docstring."""
    project = render()
    new_session(project, "kaggle", roots, kept=None)
    shutil.copytree(interrupted.kept, roots["kaggle"] / "input" / KAGGLE_NOTEBOOK)
    stop = interrupted.stop_step
    output = assert_continued_to_the_end(run_session(project, "kaggle", roots), project, "kaggle", stop)
    run = output_dir(project, "kaggle").relative_to("/kaggle/working")
    assert f"continuing from /kaggle/input/{KAGGLE_NOTEBOOK}/{run} (step {stop}," in output, output


@pytest.mark.parametrize("interrupted", ["colab"], indirect=True)
def test_colab_run_uploaded_from_drive_continues_in_a_new_kaggle_session(
    interrupted: Interrupted,
    render: Callable[..., Render],
    roots: dict[str, Path],
) -> None:
    """The interrupted Colab run's folder on Drive, uploaded as a Kaggle dataset, is continued by a new
    Kaggle session (with configs/kaggle.yaml's settings). Stood in for: the upload (the folder copied to
    /kaggle/input/<dataset>/); the rest as in the module's docstring."""
    project = render()
    mirror = Path(yaml.safe_load((project.path / "configs" / "colab.yaml").read_text())["mirror_dir"])
    on_drive = interrupted.kept / mirror.relative_to("/content/drive")
    new_session(project, "kaggle", roots, kept=None)
    shutil.copytree(on_drive, roots["kaggle"] / "input" / "colab-run" / on_drive.name)
    stop = interrupted.stop_step
    output = assert_continued_to_the_end(run_session(project, "kaggle", roots), project, "kaggle", stop)
    assert f"continuing from /kaggle/input/colab-run/{on_drive.name} (step {stop}," in output, output


@pytest.fixture
def s3_store() -> Iterator[tuple[str, dict[str, str]]]:
    """A bucket on a real S3 server on 127.0.0.1 (moto's), and the environment that reaches it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            **{"aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": "us-east-1"},
        ).create_bucket(Bucket="runs")
        yield "s3://runs/digits", env
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_colab_with_a_remote_store_shows_the_run_where_it_is(
    render: Callable[..., Render], roots: dict[str, Path], s3_store: tuple[str, dict[str, str]]
) -> None:
    """Colab with REMOTE_STORE set (the keys in the kernel's environment, as export_secrets leaves them):
    the run is copied to the store, the result cells read it where training wrote it (the session's disk,
    not Drive, which holds nothing of it) and show its metrics, export and predictions, and the
    last cell's line names the store, not Drive. Stood in for: the S3 service (moto's server on 127.0.0.1);
    the rest as in the module's docstring."""
    project = render()
    store, env = s3_store
    new_session(project, "colab", roots, kept=None)
    session = run_session(project, "colab", roots, remote_store=store, env=env)
    output = session.output("train")
    assert session.error("train") is None and f"done: {LAST_STEP} optimizer steps" in output, output
    assert f"mirror: {store} holds step {LAST_STEP} (verified)" in output, output
    results = session.output("results")
    assert session.error("results") is None and f'"step": {LAST_STEP}' in results, results
    assert "model.safetensors" in results and "cannot" not in results, results
    assert_results_shown(session, project, "colab")
    last = session.output("flush-drive").strip().splitlines()[-1]
    assert last.startswith(f"done: Drive flushed; the run's copy goes to {store}"), last


def test_colab_with_a_store_it_cannot_reach_says_at_the_end_that_nothing_went_there(
    render: Callable[..., Render], roots: dict[str, Path]
) -> None:
    """REMOTE_STORE on an S3 endpoint where nothing answers: training stops at once with one line, and the
    last cell, run after it, says that no checkpoint went to the store instead of where the copy goes."""
    project = render()
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    store = "s3://runs/digits"
    new_session(project, "colab", roots, kept=None)
    session = run_session(project, "colab", roots, remote_store=store, env=env, one_by_one=True)
    assert session.error("train") == "RuntimeError", session.output("train")
    assert "cannot reach" in session.output("train"), session.output("train")
    last = session.output("flush-drive").strip().splitlines()[-1]
    assert last.startswith("done: Drive flushed; no checkpoint in ") and f"none sent to {store}" in last, last
