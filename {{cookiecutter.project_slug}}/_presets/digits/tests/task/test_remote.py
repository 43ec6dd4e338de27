"""A run follows its user through a remote store: a real S3 server on 127.0.0.1, reached through s3fs.

The server is moto's (`moto[server]`), started here with IAM authentication on, so that a wrong key is
refused as AWS refuses it. The client code is not patched: s3fs finds the server through
AWS_ENDPOINT_URL, which points at a small TCP relay in front of it. The relay can be stopped and started
again on its port (an outage, seen from the client exactly as a stopped server: moto itself keeps its
memory, which a restarted moto would lose) and can hold a request unanswered (a kill -9 that lands in
the middle of an upload, at a known point). hf:// is checked only as far as it can be without the Hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import LOOP_STATE_FILE, list_checkpoints
from {{ cookiecutter.package_name }}.utils.checkpoints.mirror import STOP_WAIT_S, Mirror
from {{ cookiecutter.package_name }}.utils.checkpoints.remote import export_secrets, open_store
from {{ cookiecutter.package_name }}.utils.run.run_dir import FolderInUse, RemoteLease, RunError

from ..conftest import PROJECT, assert_same_run, free_port, training_command, wait_for_training
from ..task_settings import QUICK

pytestmark = pytest.mark.slow
REGION = "us-east-1"


class Relay:
    """127.0.0.1:port -> the server's port, byte for byte. `stop`/`start` close and reopen the port;
    `hold(rule)` leaves the first request whose line satisfies rule(line, earlier lines), and every one
    after it, unanswered."""

    def __init__(self, upstream: int) -> None:
        self.upstream, self.port = upstream, free_port()
        self.lines: list[str] = []
        self.rule: Callable[[str, list[str]], bool] | None = None
        self.held = threading.Event()
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self.start()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        assert self._listener is not None
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):  # shutdown wakes the thread blocked in accept or recv
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._sockets.clear()

    def hold(self, rule: Callable[[str, list[str]], bool] | None) -> None:
        self.rule = rule
        self.held.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, requests: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if requests:
                    for line in re.findall(rb"^(?:GET|PUT|POST|DELETE|HEAD) \S+", data, re.MULTILINE):
                        text = line.decode()
                        if self.rule is not None and not self.held.is_set() and self.rule(text, self.lines):
                            self.held.set()
                        self.lines.append(text)
                    if self.held.is_set():
                        return  # neither forwarded nor answered: the client waits
                target.sendall(data)
        except OSError:
            return


@dataclass
class S3:
    """The server, its relay, a key that it accepts, and a client that bypasses the relay."""

    relay: Relay
    key: str
    secret: str
    endpoint: str
    env: dict[str, str] = field(default_factory=dict)
    client: Any = None

    def bucket(self, name: str) -> str:
        self.client.create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str) -> dict[str, bytes]:
        keys = [item["Key"] for item in self.client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        return {key: self.client.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    pytest.importorskip("s3fs", reason="s3:// needs s3fs: pip install -e '.[s3]'")
    boto3 = pytest.importorskip("boto3", reason="the tests create buckets with boto3: pip install boto3")
    pytest.importorskip("moto.server", reason="the tests' S3 server: pip install 'moto[server]'")
    port = free_port()
    # The first 3 requests (create the user, its policy, its key) need no signature; every later one does.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{port}"
        anyone = {"aws_access_key_id": "anyone", "aws_secret_access_key": "anyone", "region_name": REGION}
        iam = boto3.client("iam", endpoint_url=endpoint, **anyone)
        iam.create_user(UserName="trainer")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        relay = Relay(port)
        home = tmp_path_factory.mktemp("aws")
        store = S3(relay, key["AccessKeyId"], key["SecretAccessKey"], f"http://127.0.0.1:{relay.port}")
        store.env = {
            "AWS_ENDPOINT_URL": store.endpoint,
            "AWS_ACCESS_KEY_ID": store.key,
            "AWS_SECRET_ACCESS_KEY": store.secret,
            "AWS_DEFAULT_REGION": REGION,
            # Nothing but 127.0.0.1: no instance metadata service, no ~/.aws files.
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(home / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials"),
        }
        store.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=store.key,
            aws_secret_access_key=store.secret,
            region_name=REGION,
        )
        yield store
        relay.stop()
    finally:
        server.terminate()
        server.wait(30)


def start_training(output_dir: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    command, base = training_command(output_dir, *args)
    return subprocess.Popen(
        command, cwd=PROJECT, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run(output_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command, base = training_command(output_dir, *args)
    return subprocess.run(
        command, cwd=PROJECT, env={**base, **env}, capture_output=True, text=True, timeout=600
    )


def assert_no_credential(s3: S3, texts: list[bytes]) -> None:
    for text in texts:
        assert s3.secret.encode() not in text and s3.key.encode() not in text


def stop_mirrored_run(s3: S3, output_dir: Path, bucket: str) -> tuple[int, str]:
    """A run mirrored to s3://bucket/run, stopped by SIGTERM mid-run: its step (sealed in the bucket) and
    everything it printed."""
    process = start_training(output_dir, s3.env, *QUICK, "--mirror_dir", f"s3://{bucket}/run")
    wait_for_training(output_dir, process, time.time() - 60, step=25)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 75, out + err
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", out)
    assert stopped, out
    step = int(stopped.group(1))
    assert f"mirror: s3://{bucket}/run holds step {step} (verified)" in out, out
    return step, out + err


def test_a_run_continues_from_the_bucket_in_a_new_session(s3: S3, single_run: tuple, tmp_path: Path) -> None:
    """Mirrored to s3://bucket/run, stopped by SIGTERM, the session's disk gone: a new session with only
    import_from s3://bucket continues it and ends bitwise equal to the uninterrupted run. No file of the
    run, local or in the bucket, and no line it printed holds the key."""
    bucket = s3.bucket("continued")
    colab = tmp_path / "colab" / "run"
    step, printed = stop_mirrored_run(s3, colab, bucket)
    written = [path.read_bytes() for path in colab.rglob("*") if path.is_file()]
    shutil.rmtree(colab.parent)  # the session's disk is gone

    laptop = tmp_path / "laptop" / "run"
    result = run(
        laptop, s3.env, *QUICK, "--import_from", f"s3://{bucket}", "--mirror_dir", f"s3://{bucket}/run"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"continuing from s3://{bucket}/run (step {step}, run " in result.stdout, result.stdout
    assert_same_run(laptop, single_run[0])
    assert f"mirror: s3://{bucket}/run holds step 88 (verified)" in result.stdout
    stored = s3.objects(bucket)
    assert json.loads(stored[f"run/checkpoints/step_00000088/{LOOP_STATE_FILE}"])["loop_state"]["step"] == 88
    assert "run/.lock" not in stored  # the lease was given back
    written += [path.read_bytes() for path in laptop.rglob("*") if path.is_file()]
    printed += result.stdout + result.stderr
    assert_no_credential(s3, [*written, *stored.values(), printed.encode()])


def test_a_kill_in_the_middle_of_an_upload_is_skipped_and_named(
    s3: S3, single_run: tuple, tmp_path: Path
) -> None:
    """kill -9 while a checkpoint is published (one of its files copied, its seal not): the next session
    names the cut-off copies, continues from the one before, and ends exactly."""
    bucket = s3.bucket("killed")
    publish = re.compile(rf"PUT /{bucket}/run/checkpoints/(step_\d+)/")
    # A first session stops by SIGTERM with its checkpoint sealed in the bucket. Then the session that is
    # killed has at least one newer checkpoint to publish (its last, which the end of a run waits for),
    # however slowly its mirror starts on a loaded machine.
    first = tmp_path / "first" / "run"
    step, _ = stop_mirrored_run(s3, first, bucket)
    kept, since = f"step_{step:08d}", len(s3.relay.lines)

    def second_file_of_a_new_checkpoint(line: str, earlier: list[str]) -> bool:
        if not (match := publish.match(line)) or match.group(1) == kept:
            return False
        return [found.group(1) for text in earlier[since:] if (found := publish.match(text))] == [
            match.group(1)
        ]

    s3.relay.hold(second_file_of_a_new_checkpoint)
    try:
        process = start_training(first, s3.env, *QUICK, "--mirror_dir", f"s3://{bucket}/run")
        assert s3.relay.held.wait(300), "no checkpoint after the first was published"
        process.kill()
        process.communicate(timeout=60)
    finally:
        s3.relay.stop()  # drops the held connection
        s3.relay.hold(None)
        s3.relay.start()
    cut = [found.group(1) for text in s3.relay.lines[since:] if (found := publish.match(text))][-1]

    output_dir = tmp_path / "second" / "run"
    result = run(output_dir, s3.env, *QUICK, "--mirror_dir", f"s3://{bucket}/run")
    assert result.returncode == 0, result.stdout + result.stderr
    where = f"s3://{bucket}/run/checkpoints"
    assert f"WARNING: skipping {where}/{cut}: no {LOOP_STATE_FILE}: its upload was cut off" in result.stdout
    assert f"WARNING: skipping {where}/.incomplete_{cut}: an upload that did not finish" in result.stdout
    assert f"continuing from s3://{bucket}/run (step {int(kept[5:])}, run " in result.stdout
    assert f"mirror: note: s3://{bucket}/run was left by a session that is gone" in result.stdout
    assert_same_run(output_dir, single_run[0])
    mirror_lines = [line for line in result.stdout.splitlines() if line.startswith("mirror: ")]
    end = f"mirror: s3://{bucket}/run holds step 88 (verified), the metrics, model/, best_model/"
    assert end in mirror_lines, "\n".join(mirror_lines)
    # The cut-off copy is kept for a person to look at: in place, or set aside if it was published again.
    kept_aside = re.compile(rf"run/(set_aside/[^/]+/)?checkpoints/{cut}/")
    assert any(kept_aside.match(key) for key in s3.objects(bucket))


def test_a_sigterm_while_the_store_stops_answering_exits_soon_in_one_line(s3: S3, tmp_path: Path) -> None:
    """The S3 server stops answering mid-run (every request after that is left unanswered), then SIGTERM:
    the session exits 75 within STOP_WAIT_S and some seconds, no traceback, the mirror named behind."""
    bucket = s3.bucket("silent")
    output_dir = tmp_path / "run"
    process = start_training(output_dir, s3.env, *QUICK, "--mirror_dir", f"s3://{bucket}/run")
    try:
        wait_for_training(output_dir, process, time.time() - 60, step=25)
        s3.relay.hold(lambda line, earlier: True)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = process.communicate(timeout=600)
        took = time.monotonic() - signalled
    finally:
        s3.relay.hold(None)
    assert process.returncode == 75 and "Traceback" not in err, out[-2000:] + err[-3000:]
    assert took < STOP_WAIT_S + 30, (took, out[-2000:])
    assert f"mirror: WARNING: s3://{bucket}/run is behind" in out, out[-2000:]


def wait_for(output: pytest.CaptureFixture[str], text: str, seen: list[str]) -> None:
    deadline = time.monotonic() + 120
    while not any(text in line for line in seen):
        assert time.monotonic() < deadline, f"no {text!r} in {seen}"
        time.sleep(0.05)
        seen.extend(output.readouterr().out.splitlines())


def test_an_outage_is_reported_once_and_the_mirror_catches_up(
    s3: S3,
    single_run: tuple,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server stops answering after a checkpoint reached it, a checkpoint comes while it is away,
    then it is back: one warning, one line when it works again, and the end line says what it holds."""
    for name, value in {**s3.env, "AWS_MAX_ATTEMPTS": "1"}.items():  # fail fast instead of retrying 5 times
        monkeypatch.setenv(name, value)
    bucket = s3.bucket("outage")
    local = tmp_path / "local"
    shutil.copytree(single_run[0], local)
    newest, parked = list_checkpoints(local)[-1], tmp_path / "parked"
    newest.rename(parked)  # the session has reached step 80 only
    record = json.loads((list_checkpoints(local)[-1] / LOOP_STATE_FILE).read_text())
    mirror = Mirror(local, f"s3://{bucket}/run", keep=2, enabled=True)
    mirror.start(record["loop_state"]["run_id"], start_over=False)
    mirror.request()
    deadline = time.monotonic() + 120
    while mirror.newest_step != 80:
        assert time.monotonic() < deadline, capsys.readouterr().out
        time.sleep(0.05)

    seen: list[str] = []
    s3.relay.stop()
    parked.rename(newest)  # step 88 is saved while the server is away
    mirror.request()
    wait_for(capsys, "WARNING: cannot copy", seen)
    mirror.request()  # the next checkpoint: still failing, not reported again
    time.sleep(1.0)
    seen.extend(capsys.readouterr().out.splitlines())
    s3.relay.start()
    mirror.request()
    wait_for(capsys, "works again: step 88 copied and verified", seen)
    mirror.finish()
    seen.extend(capsys.readouterr().out.splitlines())
    assert sum("WARNING: cannot copy" in line for line in seen) == 1, seen
    assert f"mirror: s3://{bucket}/run holds step 88 (verified), the metrics, model/, best_model/" in seen
    stored = s3.objects(bucket)
    assert {key.split("/")[2] for key in stored if key.startswith("run/checkpoints/")} == {
        "step_00000080",
        "step_00000088",
    }
    assert stored["run/metrics.jsonl"] == (local / "metrics.jsonl").read_bytes()

    # Another run is refused there, and its lease given back; with start_over, this run is set aside.
    (tmp_path / "other").mkdir()
    other = Mirror(tmp_path / "other", f"s3://{bucket}/run", keep=2, enabled=True)
    with pytest.raises(RunError, match=rf"mirror_dir s3://{bucket}/run holds another run \(run "):
        other.start("another-run", start_over=False)
    other.finish()
    other = Mirror(tmp_path / "other", f"s3://{bucket}/run", keep=2, enabled=True)
    other.start("another-run", start_over=True)
    other.finish()
    assert f"mirror: start_over: moved the mirror's earlier run to s3://{bucket}/run/set_aside/" in (
        capsys.readouterr().out
    )
    moved = {key.split("/", 3)[-1] for key in s3.objects(bucket)}
    assert set(stored) - {"run/.lock"} <= {f"run/{key}" for key in moved}


@pytest.mark.parametrize("case", ["wrong secret", "no credentials"])
def test_a_refused_credential_is_one_line_before_anything_is_written(
    s3: S3, case: str, tmp_path: Path
) -> None:
    bucket = s3.bucket(case.replace(" ", "-"))
    env = {**s3.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    if case == "no credentials":
        env = {**s3.env, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    output_dir = tmp_path / "run"
    result = run(output_dir, env, *QUICK, "--mirror_dir", f"s3://{bucket}/run")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    expected = "the store refused the credentials" if case == "wrong secret" else "no usable credentials"
    assert last.startswith(f"error: mirror_dir s3://{bucket}/run: {expected}"), result.stderr
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in last
    assert "Traceback" not in result.stderr
    assert not output_dir.exists() and not s3.objects(bucket)
    assert_no_credential(s3, [(result.stdout + result.stderr).encode()])


def test_two_sessions_never_hold_one_remote_run(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sessions taking the lease at the same moment: exactly one gets it; the other is refused
    while it is held, and gets it once it is given back."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    url = f"s3://{s3.bucket('leased')}/run"
    fs, path = open_store(url)
    leases = [RemoteLease(fs, path, url), RemoteLease(fs, path, url)]
    outcomes: list[object] = [None, None]

    def take(index: int) -> None:
        try:
            outcomes[index] = leases[index].acquire()
        except FolderInUse as error:
            outcomes[index] = error

    threads = [threading.Thread(target=take, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [index for index, outcome in enumerate(outcomes) if isinstance(outcome, FolderInUse)]
    assert len(refused) == 1, outcomes
    winner, loser = leases[1 - refused[0]], leases[refused[0]]
    with pytest.raises(FolderInUse, match="is in use by another session"):
        loser.acquire()
    winner.release()
    assert loser.acquire() == []
    loser.release()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3x://bucket/run", "Protocol not known: s3x"),
        ("s3://KEY:SECRET@bucket/run", "holds a credential"),
        ("gs://bucket/run", "Please install gcsfs to access Google Storage: pip install -e '.[gcs]'"),
    ],
)
def test_a_url_that_cannot_work_is_refused_before_torch_loads(url: str, message: str, tmp_path: Path) -> None:
    """Before, `--mirror_dir s3://bucket/run` wrote a local folder named `s3:`."""
    if url.startswith("gs://") and _installed("gcsfs"):
        pytest.skip("gcsfs is installed here: its absence cannot be shown")
    result = run(tmp_path / "run", {}, "--mirror_dir", url)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("config error: ") and message in result.stderr, result.stderr
    assert "SECRET" not in result.stderr
    assert not (tmp_path / "run").exists() and not list(PROJECT.glob("s3*:"))


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_hf_urls_offline(tmp_path: Path) -> None:
    """What can be shown without the Hub: an hf:// mirror is understood (HfFileSystem, which comes with
    huggingface_hub), its token is read and never printed, and a Hub it cannot reach is one line at start,
    with nothing written. Uploads to the Hub are not tested here."""
    token = "hf_offline_test_token_0123456789"
    env = {"HF_TOKEN": token, "HF_HUB_OFFLINE": "1"}
    result = run(tmp_path / "run", env, *QUICK, "--mirror_dir", "hf://datasets/someone/runs/digits")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: mirror_dir hf://datasets/someone/runs/digits: "), result.stderr
    assert "Traceback" not in result.stderr
    assert token not in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()


def test_secrets_come_from_kaggle_when_the_environment_lacks_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Kaggle's `kaggle_secrets` (a stand-in with its interface: the real one talks to Kaggle) fills in
    what the environment lacks; the values go into the environment only, and are never printed."""
    (tmp_path / "kaggle_secrets.py").write_text(
        "class UserSecretsClient:\n"
        "    def get_secret(self, name):\n"
        "        if name == 'HF_TOKEN':\n"
        "            return 'hf_from_kaggle'\n"
        "        raise KeyError(name)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    export_secrets("hf://datasets/someone/runs", "/a/folder")
    assert os.environ["HF_TOKEN"] == "hf_from_kaggle"
    out = capsys.readouterr().out
    assert out.strip() == "credentials: HF_TOKEN from Kaggle's secrets" and "hf_from_kaggle" not in out
