"""Where checkpoints live: a local directory or an object-store prefix, and safe DCP reading.

`Store` hides the two commit protocols (an atomic ``os.rename`` locally; the manifest written
last as the commit marker on s3) behind one small interface. On an object store each of its
operations is retried after a transient error (`posttrain.retry`: connection refused or reset, a
timeout, a 5xx) as its `RetryConfig` allows, with a warning naming the file each time; that is
safe because every write overwrites a whole object with the same bytes. When the budget is
spent it raises `CheckpointStorageError`. The `Safe*` readers load DCP's own pickled index with
an unpickler restricted to DCP's metadata classes, and require every small non-tensor value to
load with ``torch.load(weights_only=True)`` (see `checkpoint.py`).
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import strip_protocol, url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from posttrain.errors import PosttrainError
from posttrain.retry import RetryConfig, RetryError, is_transient
from posttrain.retry import call as retry_call

log = logging.getLogger(__name__)
T = TypeVar("T")

_MANIFEST = "manifest.json"
_HASH_CHUNK = 1 << 20


class CheckpointError(PosttrainError):
    """A checkpoint is missing, incomplete or damaged, or cannot hold what was asked of it."""


class CheckpointStorageError(CheckpointError):
    """The checkpoint storage kept failing with transient errors until the retries ran out: the
    checkpoint may be fine, the storage is unreachable."""


def transient_dcp_error(error: BaseException) -> bool:
    """Whether a failed DCP save or load is worth running again: every rank's failure in DCP's
    `CheckpointException` (or `error` itself) is transient."""
    if isinstance(error, CheckpointException):
        failures = [exc for exc, _ in error.failures.values()]
        return bool(failures) and all(is_transient(e) for e in failures)
    return is_transient(error)


def dcp_failure(error: BaseException) -> BaseException:
    """The lowest rank's own exception in DCP's `CheckpointException` (whose message is every
    rank's whole traceback), or `error` itself: what a one-line message should name."""
    if isinstance(error, CheckpointException) and error.failures:
        return error.failures[min(error.failures)][0]
    return error


def no_space(error: BaseException) -> OSError | None:
    """The out-of-space OSError (ENOSPC, EDQUOT: a quota) behind a failed write, or None:
    `error` itself, one it was raised from, or DCP's wrapped failure of the lowest rank."""
    seen: set[int] = set()
    e: BaseException | None = dcp_failure(error)
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        e = e.__cause__ or e.__context__
    return None


class Store:
    """The few file operations a checkpoint needs, on a local directory or through fsspec."""

    def __init__(self, root: str, storage_options: dict, retry: RetryConfig = RetryConfig()):
        self.remote = "://" in root and not root.startswith("file://")
        self.storage_options = storage_options
        self.retry = retry
        if self.remote:
            self.protocol = root.split("://", 1)[0]
            self.fs, self.root = url_to_fs(root, **storage_options)
            self.root = self.root.rstrip("/")
        else:
            self.fs = None
            self.root = os.path.abspath(root.removeprefix("file://"))

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def uri(self, path: str) -> str:
        return f"{self.protocol}://{path}" if self.remote else path

    def strip(self, uri: str) -> str:
        return strip_protocol(uri).rstrip("/") if self.remote else os.path.abspath(uri)

    def retrying(self, path: str, fn: Callable[[], T]) -> T:
        """`fn()`, an idempotent operation on `path` in the object store, repeated after
        transient errors; `CheckpointStorageError` when the retries are spent."""
        try:
            return retry_call(fn, self.retry, self.uri(path), log)
        except RetryError as e:
            raise CheckpointStorageError(str(e)) from e

    def write(self, path: str, data: bytes) -> None:
        if self.remote:
            self.retrying(path, lambda: self.fs.pipe_file(path, data))
            return
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def read(self, path: str) -> bytes:
        if self.remote:
            return self.retrying(path, lambda: self.fs.cat_file(path))
        with open(path, "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        if self.remote:
            return self.retrying(path, lambda: self.fs.exists(path))
        return os.path.exists(path)

    def size(self, path: str) -> int:
        if self.remote:
            return self.retrying(path, lambda: self.fs.size(path))
        return os.path.getsize(path)

    def sha256(self, path: str) -> str:
        if self.remote:  # a failed read hashes the whole file again
            return self.retrying(path, lambda: self._sha256(lambda: self.fs.open(path, "rb")))
        return self._sha256(lambda: open(path, "rb"))

    @staticmethod
    def _sha256(opener: Callable) -> str:
        h = hashlib.sha256()
        with opener() as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def listdir(self) -> list[str]:
        """Names directly under the root ([] when it does not exist yet)."""
        if not self.remote:
            return sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []

        def ls() -> list[str]:
            self.fs.invalidate_cache()
            try:
                return self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.retrying(self.root, ls))

    def files(self, path: str) -> list[str]:
        """Every file under `path`, relative to it, sorted."""
        if self.remote:
            def find() -> list[str]:
                self.fs.invalidate_cache()
                return self.fs.find(path)
            return sorted(p[len(path) + 1:] for p in self.retrying(path, find))
        out = []
        for d, _, names in os.walk(path):
            out += [os.path.relpath(os.path.join(d, n), path).replace(os.sep, "/") for n in names]
        return sorted(out)

    def makedirs(self, path: str) -> None:
        if not self.remote:
            os.makedirs(path, exist_ok=True)

    def remove_tree(self, path: str) -> None:
        """Delete a checkpoint so that no crash leaves it looking complete: manifest first."""
        if not self.remote:
            shutil.rmtree(path, ignore_errors=True)
            return
        for victim, recursive in ((f"{path}/{_MANIFEST}", False), (path, True)):
            self.retrying(victim, lambda: self._rm(victim, recursive))

    def _rm(self, victim: str, recursive: bool) -> None:
        try:
            self.fs.rm(victim, recursive=recursive)
        except FileNotFoundError:
            pass

    def commit(self, work: str, final: str, nonce: str) -> None:
        """Local: move the finished directory into place atomically. Remote: nothing to do."""
        if self.remote:
            return
        if os.path.exists(final):  # a step saved again, e.g. after falling back past a bad one
            os.rename(final, f"{final}.tmp-{nonce}-replaced")
        os.rename(work, final)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def dcp_writer(self, path: str):
        if self.remote:
            return FsspecWriter(self.uri(path), sync_files=False, **self.storage_options)
        return dcp.FileSystemWriter(path, sync_files=True)

    def dcp_reader(self, path: str):
        if self.remote:
            return _SafeFsspecReader(self.uri(path), **self.storage_options)
        return _SafeFileSystemReader(path)


# --- restricted reading of DCP's own pickles -----------------------------------------------------

# Everything a DCP index pickle names (torch 2.13): its metadata dataclasses and enums, the
# filesystem's storage record, sizes, dtypes, layouts and paths. No function that does I/O.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"), ("torch", "Size"), ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}


_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = super().find_class(module, name) if module.startswith(("torch", "pathlib",
                                                                        "collections")) else None
        if (module, name) in _METADATA_GLOBALS:
            return found
        if module == "torch.distributed.checkpoint.metadata" and isinstance(found, type):
            return found
        if module == "torch" and isinstance(found, _TORCH_ENUMS):
            return found
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which a checkpoint "
                                     "index never needs; refusing to load it")


def _safe_read_metadata(reader, *args, **kwargs):
    path = reader.fs.concat_path(reader.path, ".metadata")
    with reader.fs.create_stream(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class _SafeFileSystemReader(dcp.FileSystemReader):
    read_metadata = _safe_read_metadata


class _SafeFsspecReader(FsspecReader):
    read_metadata = _safe_read_metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's planner, but a non-tensor value must load with weights_only=True first."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # raises on anything but plain data
        value.seek(0)
        super().load_bytes(read_item, value)


# --- the manager ---------------------------------------------------------------------------------
