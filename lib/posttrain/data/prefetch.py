"""Prefetch remote files into a size-capped local cache, ahead of the reader.

For data that does not fit on the machine: a background thread downloads the next few files of
a stream (in reading order) into a private directory whose bytes on disk, partial downloads
included, never exceed `CacheConfig.max_bytes`; each file is deleted once read. Local files,
and remote files larger than the cap, are read directly instead. A download that fails with a
transient error starts again after a backoff (`posttrain.retry`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

import fsspec

from posttrain.config.data import CacheConfig
from posttrain.errors import DataError
from posttrain.retry import RetryConfig, RetryError
from posttrain.retry import call as retry_call

log = logging.getLogger(__name__)

_LOCAL_PROTOCOLS = ("file", "local")
_COPY_CHUNK_BYTES = 1 << 20


def is_local(uri: str) -> bool:
    return fsspec.utils.get_protocol(uri) in _LOCAL_PROTOCOLS


def filesystem(uri: str, storage_options: dict | None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and in-filesystem path of `uri`; options go to remote filesystems only."""
    options = {} if is_local(uri) else dict(storage_options or {})
    return fsspec.core.url_to_fs(uri, **options)


class _Stopped(Exception):
    """The prefetcher was closed while its thread waited or downloaded."""


@dataclass
class _Fetched:
    local_path: str | None  # None: read the original file directly
    size: int = 0
    error: BaseException | None = None


class Prefetcher:
    """Downloads the upcoming remote files of one stream into a private, size-capped directory.

    The thread fetches files strictly in reading order, at most `prefetch_files` ahead of the
    one being read, and reserves a file's size before downloading it, so the bytes on disk
    (partial downloads included) never exceed `max_bytes`. A file larger than the cap, or a
    local one, is marked to be read directly. Since the reader releases a file before asking
    for the next, and each cached file fits the cap alone, the thread can always progress.
    """

    def __init__(self, uris: list[str], start: int, cache: CacheConfig,
                 storage_options: dict | None, retry: RetryConfig = RetryConfig()):
        self._uris = uris
        self._retry = retry
        self._max_bytes = cache.max_bytes
        self._ahead = cache.prefetch_files
        self._storage_options = storage_options
        if cache.dir is not None:
            os.makedirs(cache.dir, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="posttrain-prefetch-", dir=cache.dir)
        self.stats = {"downloaded": 0, "streamed_direct": 0, "peak_bytes": 0}
        self._cond = threading.Condition()
        self._fetched: dict[int, _Fetched] = {}
        self._reading = start
        self._reserved = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, args=(start,), daemon=True,
                                        name="posttrain-prefetch")
        self._thread.start()

    def acquire(self, i: int) -> str | None:
        """Wait for file `i`: its local copy, or None to read it directly."""
        with self._cond:
            while i not in self._fetched:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the prefetch thread ended before fetching {self._uris[i]}")
                self._cond.wait(timeout=1.0)
            fetched = self._fetched[i]
        if fetched.error is not None:
            raise self._describe(self._uris[i], fetched.error) from fetched.error
        return fetched.local_path

    def release(self, i: int) -> None:
        """File `i` is read: delete its copy and let the thread fetch further."""
        with self._cond:
            fetched = self._fetched.pop(i, None)
            if fetched is not None and fetched.local_path is not None:
                os.remove(fetched.local_path)
                self._reserved -= fetched.size
            self._reading = i + 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _describe(self, uri: str, error: BaseException) -> DataError:
        if isinstance(error, DataError):
            return error
        if isinstance(error, FileNotFoundError):
            return DataError("file not found (deleted or moved after the file list was made?)",
                             file=uri, reason="missing_file")
        if isinstance(error, RetryError):
            return DataError(f"prefetching it into the cache {self.dir} failed: {error.detail}",
                             file=uri, reason="unreadable_file")
        return DataError(f"prefetching it into the cache {self.dir} failed: "
                         f"{type(error).__name__}: {error}", file=uri, reason="unreadable_file")

    def _run(self, start: int) -> None:
        for i in range(start, len(self._uris)):
            try:
                fetched = self._fetch(i)
            except _Stopped:
                return
            except Exception as e:  # handed to the reader, who raises it with the file named
                fetched = _Fetched(None, error=e)
            with self._cond:
                self._fetched[i] = fetched
                self._cond.notify_all()
            if fetched.error is not None:
                return

    def _fetch(self, i: int) -> _Fetched:
        uri = self._uris[i]
        if is_local(uri):
            return _Fetched(None)
        fs, path = filesystem(uri, self._storage_options)
        size = self._retrying(uri, lambda: fs.size(path))
        if size > self._max_bytes:
            self.stats["streamed_direct"] += 1
            return _Fetched(None)
        self._reserve(i, size)
        try:
            local_path = self._retrying(uri, lambda: self._download(fs, path, i, size))
        except BaseException:
            with self._cond:
                self._reserved -= size
                self._cond.notify_all()
            raise
        self.stats["downloaded"] += 1
        return _Fetched(local_path, size)

    def _retrying(self, uri: str, fn):
        """`fn()`, repeated after transient errors; `close` ends the wait between attempts."""
        return retry_call(fn, self._retry, uri, log, sleep=self._wait_or_stop)

    def _wait_or_stop(self, seconds: float) -> None:
        with self._cond:
            if self._cond.wait_for(lambda: self._stopping, timeout=seconds):
                raise _Stopped

    def _reserve(self, i: int, size: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or (
                i - self._reading <= self._ahead and self._reserved + size <= self._max_bytes))
            if self._stopping:
                raise _Stopped
            self._reserved += size
            self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self._reserved)

    def _download(self, fs: fsspec.AbstractFileSystem, path: str, i: int, size: int) -> str:
        name = f"{i:06d}-{os.path.basename(path)}"
        partial = os.path.join(self.dir, name + ".part")
        try:
            self._copy(fs, path, partial, size)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial)
            raise
        final = os.path.join(self.dir, name)
        os.replace(partial, final)
        return final


    def _copy(self, fs: fsspec.AbstractFileSystem, path: str, target: str, size: int) -> None:
        written = 0
        with fs.open(path, "rb") as src, open(target, "wb") as dst:
            for chunk in iter(lambda: src.read(_COPY_CHUNK_BYTES), b""):
                if self._stopping:
                    raise _Stopped
                written += len(chunk)
                if written > size:
                    raise DataError(f"the file grew past its listed size of {size} bytes while "
                                    "being downloaded", file=fs.unstrip_protocol(path),
                                    reason="unreadable_file")
                dst.write(chunk)
