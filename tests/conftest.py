"""Shared test fixtures: a real S3 endpoint (moto server) for code that reads ``s3://``, and a
proxy in front of it that a test can take down and bring back (`s3_outage`)."""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

# The tests run the checkout they live in: a second worktree (or a copy) beside an installed
# posttrain must not import the installed one. Subprocesses (spawned ranks, Ray workers, the
# CLI, Metaflow tasks) inherit the same path through PYTHONPATH.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_PATHS = [os.path.join(_CHECKOUT, "lib"), _CHECKOUT]
sys.path[:0] = [p for p in _OWN_PATHS if p not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(
    _OWN_PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                  if p and p not in _OWN_PATHS])

# The test process trains inline as a CLI process does (`posttrain.process`)
from posttrain.distributed.env import free_port  # noqa: E402
from posttrain.process import tune_cycle_collector  # noqa: E402

tune_cycle_collector()

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_START_TIMEOUT_S = 30.0


@dataclass
class S3Server:
    """A running moto S3 server with one bucket; `put` uploads and returns the object's URI."""

    endpoint: str
    bucket: str
    storage_options: dict
    client: Any = field(repr=False)

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        return f"s3://{self.bucket}/{key}"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


def _wait_until_up(proc: subprocess.Popen, endpoint: str, log_path: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered, if only with an error status
        except OSError:
            time.sleep(0.1)
    with open(log_path, errors="replace") as f:
        log = f.read()[-4000:]
    proc.kill()
    proc.wait()
    pytest.fail(f"moto server did not start at {endpoint} (exit code {proc.poll()}); is "
                f"moto[server] installed in this environment?\n--- its output ---\n{log}",
                pytrace=False)


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """A moto S3 server on 127.0.0.1 for the whole session, with AWS_* variables pointing at it."""
    boto3 = pytest.importorskip("boto3")
    port = free_port("127.0.0.1")
    endpoint = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until_up(proc, endpoint, log.name)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in {**_S3_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
                mp.setenv(key, value)
            client = boto3.client("s3", endpoint_url=endpoint)
            bucket = "posttrain-test"
            client.create_bucket(Bucket=bucket)
            yield S3Server(endpoint=endpoint, bucket=bucket, client=client, storage_options={
                "key": _S3_ENV["AWS_ACCESS_KEY_ID"], "secret": _S3_ENV["AWS_SECRET_ACCESS_KEY"],
                "endpoint_url": endpoint})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


class FlakyProxy:
    """A TCP proxy on 127.0.0.1 in front of `upstream` that a test can stop and start again.

    `stop` closes the listening socket (new connections are refused) and resets every open
    connection (the client sees RST); `start` listens again on the same port. Moto keeps its
    data in memory, so an outage of the S3 endpoint is built here instead of restarting it.
    `go_down(seconds)` returns once the proxy is down and brings it back from a timer thread;
    `outages` counts those. `storage_options` are the upstream's with the proxy's endpoint.
    """

    def __init__(self, upstream: str, storage_options: dict):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.port = free_port("127.0.0.1")   # below the ephemeral range: see start
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.storage_options = {**storage_options, "endpoint_url": self.endpoint}
        self.outages = 0
        self._lock = threading.Lock()
        self._down = threading.Event()
        self._threads: list[threading.Thread] = []
        self._restart: threading.Timer | None = None

    def start(self) -> None:
        # An outgoing connection can be handed this port as its local one only from the
        # ephemeral range, which the port is not in; so the bind only waits out a moment.
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 10
        while True:
            try:
                listener.bind(("127.0.0.1", self.port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    listener.close()
                    raise
                time.sleep(0.05)
        listener.listen(64)
        listener.settimeout(0.05)
        with self._lock:
            self._down.clear()
            self._spawn(self._accept, listener)

    def stop(self) -> None:
        """Refuse new connections and reset the open ones; returns once all are closed."""
        with self._lock:
            self._down.set()
            threads, self._threads = self._threads, []
        for t in threads:
            t.join(timeout=10)

    def go_down(self, seconds: float) -> None:
        """Stop now and start again after `seconds`, from a timer thread."""
        self.stop()
        self.outages += 1
        self._restart = threading.Timer(seconds, self.start)
        self._restart.start()

    def close(self) -> None:
        if self._restart is not None:
            self._restart.cancel()
            self._restart.join()
        self.stop()

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="s3-proxy")
        self._threads.append(t)
        t.start()

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while not self._down.is_set():
                try:
                    client, _ = listener.accept()
                except (TimeoutError, OSError):
                    continue
                with self._lock:
                    if self._down.is_set():
                        _reset(client)
                        return
                    self._spawn(self._pump, client)

    def _pump(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _reset(client)
            return
        peer = {client: upstream, upstream: client}
        receiving = set(peer)   # a side that closed its end: its FIN is passed on, not a RST
        try:
            while receiving and not self._down.is_set():
                readable, _, _ = select.select(list(receiving), [], [], 0.05)
                for src in readable:
                    data = src.recv(1 << 16)
                    if data:
                        peer[src].sendall(data)
                    else:
                        receiving.discard(src)
                        peer[src].shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            if self._down.is_set():
                _reset(client)
            else:
                client.close()
            upstream.close()


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0, so that the peer gets a RST rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


@pytest.fixture
def s3_outage(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FlakyProxy]:
    """A `FlakyProxy` in front of the session's moto server, with AWS_ENDPOINT_URL pointing at
    it for this test (its `storage_options` do too). botocore's own retries are off
    (AWS_MAX_ATTEMPTS=1), so that an outage reaches the code under test instead of being ridden
    out inside the client; s3fs's cached clients are dropped before and after, so that none
    outlives the endpoint it was made for. `s3.put` still goes to moto directly."""
    s3fs = pytest.importorskip("s3fs")
    proxy = FlakyProxy(s3.endpoint, s3.storage_options)
    proxy.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield proxy
    finally:
        proxy.close()
        s3fs.S3FileSystem.clear_instance_cache()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a test marked `slow` run first, the recipe tests (tests/steps: each file
    trains its reference runs in a module fixture, GRPO's for minutes) before the flows:
    `make test` hands whole files to parallel workers in this order, and a long file started
    last would end the run alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in slow, "steps" not in item.path.parts))


# Test files that share a session fixture too slow to build twice (tests/flows/conftest.py's
# `arithmetic_chain`: an SFT run and a GRPO run through Metaflow): one worker runs them all.
_SHARED_SCOPES = {f"tests/flows/test_{name}_flow.py": "tests/flows: arithmetic_chain"
                  for name in ("eval", "grpo", "lineage")}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, except that the files of `_SHARED_SCOPES` go to one worker."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return _SHARED_SCOPES.get(path, path)

    return SharedFixtureScheduling(config, log)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind() -> Iterator[None]:
    """Code that builds an engine in this process joins a process group of one; the next test
    module on the same pytest worker must not inherit it (it would see that group's world size
    instead of its own WORLD_SIZE)."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True, scope="session")
def _random_models_built_once(tmp_path_factory) -> Iterator[None]:
    """The random initial checkpoints (`model.init`) of this run, kept by key in one directory
    that every pytest worker and the processes they start share (POSTTRAIN_INIT_CACHE): a
    driver process then copies one instead of importing transformers' model code to build it.
    The same bytes either way (`tests/lib/train/test_engine.py`)."""
    if os.environ.get("POSTTRAIN_INIT_CACHE"):
        yield
        return
    base = tmp_path_factory.getbasetemp()
    # under pytest-xdist each worker's base is inside the run's: share the run's
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ["POSTTRAIN_INIT_CACHE"] = str(root / "random-init")
    try:
        yield
    finally:
        os.environ.pop("POSTTRAIN_INIT_CACHE", None)
