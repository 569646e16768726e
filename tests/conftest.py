"""Shared test fixtures: a real S3 endpoint (moto server) for code that reads ``s3://``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
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
