"""Retry with exponential backoff for transient storage errors: an object store down for a while.

`RetryConfig` says how many attempts an operation gets and how long to wait between them;
`is_transient` tells a failure that may pass (connection refused or reset, a timeout, a 5xx or
throttling answer) from one that will not (a missing file, a denied request, malformed content);
`Backoff` counts the failures of one operation, logs a warning naming it before each retry, and
gives up with `RetryError` once the attempts or the time are spent; `call` runs one idempotent
operation that way.

Callers retry remote storage only: an error of a local file is not expected to pass, so local
reads and writes keep failing at once.
"""

from __future__ import annotations

import errno
import http.client
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from posttrain.errors import ConfigError, PosttrainError

T = TypeVar("T")

# Files and permissions that are wrong stay wrong however often they are asked for.
_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                        FileExistsError)
# ... and so does a full or read-only disk (the prefetch cache's, say).
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENAMETOOLONG}
# S3 error codes that ask the client to slow down or come back, whatever their HTTP status.
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestLimitExceeded", "TooManyRequestsException", "InternalError",
                    "ServiceUnavailable", "OperationAborted"}
_CHAIN_LIMIT = 16


@dataclass(frozen=True)
class RetryConfig:
    """How an operation on remote storage is retried after a transient error.

    After the k-th failure the next attempt starts ``initial_backoff_s * 2**(k-1)`` seconds later
    (at most `max_backoff_s`). The operation fails after `max_attempts` attempts, or when the next
    attempt would start more than `max_elapsed_s` after the first failure. The defaults wait 0.5,
    1, 2, 4, 8, 16 and 30 s: 8 attempts that ride out about a minute of outage. ``max_attempts:
    1`` turns retrying off.
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_elapsed_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"retry.max_attempts must be at least 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ConfigError("retry: need 0 <= initial_backoff_s <= max_backoff_s, got "
                              f"{self.initial_backoff_s} and {self.max_backoff_s}")
        if self.max_elapsed_s <= 0:
            raise ConfigError(f"retry.max_elapsed_s must be positive, got {self.max_elapsed_s}")

    def delay_s(self, failures: int) -> float:
        """The wait after the `failures`-th failure (1-based) before the next attempt."""
        return min(self.initial_backoff_s * 2.0 ** (failures - 1), self.max_backoff_s)


class RetryError(PosttrainError):
    """An operation kept failing with transient errors until its retry budget was spent.

    `detail` is the message without the operation's name, for callers that put the name
    elsewhere (`DataError.file`); `last` is the final error, also chained as the cause.
    """

    def __init__(self, what: str, attempts: int, elapsed_s: float, last: BaseException):
        self.what = what
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.last = last
        self.detail = (f"gave up after {attempts} attempt{'s' * (attempts != 1)} over "
                       f"{elapsed_s:.1f} s of transient storage errors (the last "
                       f"{type(last).__name__}: {last}); is the storage endpoint reachable? "
                       "A longer outage needs a larger RetryConfig.max_attempts / max_elapsed_s")
        super().__init__(f"{what}: {self.detail}")


def is_transient(error: BaseException) -> bool:
    """Whether a storage operation that raised `error` may succeed if simply repeated.

    Transient: connection refused, reset or closed, timeouts, HTTP 5xx, 408 and 429, S3's
    throttling codes, botocore's and aiohttp's transport errors, and other `OSError`s (an I/O
    error with no more specific cause). Not transient: a missing file, a denied request, any
    other 4xx, posttrain's own errors (bad content), and everything else. The cause chain is
    read too, since fsspec backends wrap the client's error in an `OSError`.
    """
    seen: set[int] = set()
    some_os_error = False
    e: BaseException | None = error
    while e is not None and id(e) not in seen and len(seen) < _CHAIN_LIMIT:
        seen.add(id(e))
        verdict = _verdict(e)
        if verdict is not None:
            return verdict
        some_os_error |= isinstance(e, OSError)
        e = e.__cause__ or e.__context__
    return some_os_error


def _verdict(e: BaseException) -> bool | None:
    """True/False where `e` alone decides; None to look at its cause."""
    if isinstance(e, (PosttrainError, *_PERMANENT_OS_ERRORS)) or (
            isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS):
        return False
    if isinstance(e, (ConnectionError, TimeoutError, http.client.IncompleteRead)):
        return True   # the builtins; socket.timeout, asyncio's and fsspec's timeouts among them
    # A client's error can only come from a client that was imported: no import here.
    boto = sys.modules.get("botocore.exceptions")
    aiohttp = sys.modules.get("aiohttp")
    status, code = None, None
    if boto is not None and isinstance(e, boto.ClientError):
        response = e.response or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 400
        code = response.get("Error", {}).get("Code")
    elif aiohttp is not None and isinstance(e, aiohttp.ClientResponseError):
        status = e.status
    if status is not None:
        return status >= 500 or status in (408, 429) or code in _TRANSIENT_CODES
    if boto is not None and isinstance(e, (boto.ConnectionError, boto.HTTPClientError,
                                           boto.IncompleteReadError)):
        return True
    if aiohttp is not None and isinstance(e, aiohttp.ClientError):
        return True
    return None


class Backoff:
    """The failures of one operation. `failed(error)` after each transient one warns and waits,
    or raises `RetryError` when the budget is spent; `next_delay`, `wait` and `give_up` are its
    steps, for callers that must agree with others before waiting. `sleep` may be replaced by a
    wait that can be interrupted (it may raise to stop retrying)."""

    def __init__(self, cfg: RetryConfig, what: str, log: logging.Logger, *,
                 sleep: Callable[[float], None] = time.sleep):
        self.cfg = cfg
        self.what = what
        self.failures = 0
        self.elapsed_s = 0.0
        self._log = log
        self._sleep = sleep
        self._first_failure: float | None = None

    def failed(self, error: BaseException) -> None:
        delay = self.next_delay()
        if delay is None:
            raise self.give_up(error) from error
        self.wait(delay, error)

    def next_delay(self) -> float | None:
        """Count one more failure: the wait before the next attempt, None if there is none."""
        now = time.monotonic()
        if self._first_failure is None:
            self._first_failure = now
        self.failures += 1
        self.elapsed_s = now - self._first_failure
        delay = self.cfg.delay_s(self.failures)
        spent = self.elapsed_s + delay > self.cfg.max_elapsed_s
        return None if spent or self.failures >= self.cfg.max_attempts else delay

    def wait(self, delay: float, error: BaseException | None) -> None:
        """Warn, naming the operation and `error` (None: it failed elsewhere), then sleep."""
        cause = "another rank's" if error is None else f"{type(error).__name__}: {error}"
        self._log.warning("%s: transient storage error (%s); retrying in %.3g s, attempt %d of %d",
                          self.what, cause, delay, self.failures + 1, self.cfg.max_attempts)
        self._sleep(delay)

    def give_up(self, error: BaseException) -> RetryError:
        return RetryError(self.what, self.failures, self.elapsed_s, error)


def call(fn: Callable[[], T], cfg: RetryConfig, what: str, log: logging.Logger, *,
         sleep: Callable[[float], None] = time.sleep) -> T:
    """`fn()`, repeated after transient errors as `cfg` allows; `fn` must be idempotent.
    Other errors propagate at once; a spent budget raises `RetryError` naming `what`."""
    backoff = Backoff(cfg, what, log, sleep=sleep)
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            backoff.failed(e)
