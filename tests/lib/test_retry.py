"""Retry with backoff: which errors are transient, the waits, the budget, the messages."""

from __future__ import annotations

import errno
import logging
import socket

import aiohttp
import pyarrow as pa
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from fsspec.exceptions import FSTimeoutError

from posttrain import retry as retry_mod
from posttrain.config.loader import build
from posttrain.errors import ConfigError, DataError
from posttrain.retry import RetryConfig, RetryError, call, is_transient

log = logging.getLogger("test_retry")


def client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def caused_by(error: BaseException, cause: BaseException) -> BaseException:
    """`error` raised `from cause`, as s3fs raises an OSError for a botocore ClientError."""
    error.__cause__ = cause
    return error


def request_info() -> aiohttp.RequestInfo:
    from yarl import URL
    return aiohttp.RequestInfo(URL("http://x"), "GET", {}, URL("http://x"))


TRANSIENT = [
    ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
    ConnectionResetError(errno.ECONNRESET, "reset"),
    TimeoutError("timed out"),
    socket.timeout("timed out"),
    FSTimeoutError(),
    OSError(errno.EIO, "I/O error"),
    EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
    ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    client_error(503, "SlowDown"),
    client_error(500, "InternalError"),
    client_error(429, "TooManyRequests"),
    aiohttp.ServerDisconnectedError(),
    aiohttp.ClientResponseError(request_info(), (), status=502),
    caused_by(OSError(errno.EBUSY, "SlowDown"), client_error(503, "SlowDown")),
]
PERMANENT = [
    FileNotFoundError(errno.ENOENT, "no such key"),
    PermissionError(errno.EACCES, "denied"),
    OSError(errno.ENOSPC, "disk full"),
    ValueError("bad value"),
    pa.ArrowInvalid("Parquet magic bytes not found"),
    DataError("not valid JSON", file="x.jsonl", line=3, reason="invalid_json"),
    client_error(404, "NoSuchKey"),
    client_error(403, "AccessDenied"),
    aiohttp.ClientResponseError(request_info(), (), status=404),
    # s3fs turns a 400 into OSError(EINVAL) raised from the ClientError: the cause decides
    caused_by(OSError(errno.EINVAL, "bad request"), client_error(400, "InvalidRequest")),
    caused_by(DataError("reading failed"), ConnectionResetError()),  # posttrain's own decides
]


@pytest.mark.parametrize("error", TRANSIENT, ids=lambda e: type(e).__name__)
def test_transient_errors(error):
    assert is_transient(error)


@pytest.mark.parametrize("error", PERMANENT, ids=lambda e: type(e).__name__)
def test_permanent_errors(error):
    assert not is_transient(error)


def test_defaults_wait_half_a_second_doubling_to_thirty():
    cfg = RetryConfig()
    assert cfg.max_attempts == 8
    assert [cfg.delay_s(k) for k in range(1, 8)] == [0.5, 1, 2, 4, 8, 16, 30]


@pytest.mark.parametrize("bad", [{"max_attempts": 0}, {"initial_backoff_s": -1},
                                 {"initial_backoff_s": 5, "max_backoff_s": 1},
                                 {"max_elapsed_s": 0}])
def test_config_refuses_impossible_values(bad):
    with pytest.raises(ConfigError, match="retry"):
        build(RetryConfig, bad)


def flaky(failures: list[BaseException], result="done"):
    """A function that raises `failures` one per call, then returns `result`; counts calls."""
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return result
    return fn, calls


def test_call_retries_transient_errors_with_backoff_and_warns(caplog):
    fn, calls = flaky([ConnectionRefusedError("refused")] * 3)
    slept: list[float] = []
    with caplog.at_level(logging.WARNING):
        assert call(fn, RetryConfig(), "s3://b/k", log, sleep=slept.append) == "done"
    assert len(calls) == 4 and slept == [0.5, 1, 2]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3
    assert all(m.startswith("s3://b/k: transient storage error (ConnectionRefusedError: refused)")
               for m in warnings)
    assert "attempt 2 of 8" in warnings[0] and "attempt 4 of 8" in warnings[2]


def test_call_raises_a_permanent_error_at_once(caplog):
    fn, calls = flaky([FileNotFoundError("gone")])
    with pytest.raises(FileNotFoundError):
        call(fn, RetryConfig(), "s3://b/k", log, sleep=pytest.fail)
    assert len(calls) == 1 and not caplog.records


def test_call_gives_up_after_max_attempts_naming_the_operation():
    error = ConnectionResetError("reset")
    fn, calls = flaky([error] * 10)
    slept: list[float] = []
    with pytest.raises(RetryError, match=r"^s3://b/k: gave up after 3 attempts") as e:
        call(fn, RetryConfig(max_attempts=3), "s3://b/k", log, sleep=slept.append)
    assert len(calls) == 3 and slept == [0.5, 1]
    assert e.value.attempts == 3 and e.value.last is error and e.value.__cause__ is error
    assert "ConnectionResetError: reset" in str(e.value)


def test_call_gives_up_when_the_outage_outlasts_max_elapsed(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(retry_mod.time, "monotonic", lambda: clock[0])

    def sleep(s: float) -> None:
        clock[0] += s
    fn, calls = flaky([TimeoutError()] * 10)
    # waits 1, 2, 4 (7 s); the next, 8 s, would start past 10 s after the first failure
    cfg = RetryConfig(initial_backoff_s=1, max_elapsed_s=10)
    with pytest.raises(RetryError, match="gave up after 4 attempts over 7.0 s"):
        call(fn, cfg, "op", log, sleep=sleep)
    assert len(calls) == 4


def test_one_attempt_turns_retrying_off():
    fn, calls = flaky([ConnectionRefusedError()])
    with pytest.raises(RetryError, match="gave up after 1 attempt over"):
        call(fn, RetryConfig(max_attempts=1), "op", log, sleep=pytest.fail)
    assert len(calls) == 1
