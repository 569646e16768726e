"""Where checkpoints live: a local directory or an object-store prefix, and safe DCP reading.

`Store` hides the two commit protocols (an atomic ``os.rename`` locally; the manifest written
last as the commit marker on s3) behind one small interface. The `Safe*` readers load DCP's own
pickled index with an unpickler restricted to DCP's metadata classes, and require every small
non-tensor value to load with ``torch.load(weights_only=True)`` (see `checkpoint.py`).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil

import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import strip_protocol, url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import StorageMeta

_MANIFEST = "manifest.json"
_HASH_CHUNK = 1 << 20


class Store:
    """The few file operations a checkpoint needs, on a local directory or through fsspec."""

    def __init__(self, root: str, storage_options: dict):
        self.remote = "://" in root and not root.startswith("file://")
        self.storage_options = storage_options
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

    def write(self, path: str, data: bytes) -> None:
        if self.remote:
            self.fs.pipe_file(path, data)
            return
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def read(self, path: str) -> bytes:
        if self.remote:
            return self.fs.cat_file(path)
        with open(path, "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        return self.fs.exists(path) if self.remote else os.path.exists(path)

    def size(self, path: str) -> int:
        return self.fs.size(path) if self.remote else os.path.getsize(path)

    def sha256(self, path: str) -> str:
        h = hashlib.sha256()
        with (self.fs.open(path, "rb") if self.remote else open(path, "rb")) as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def listdir(self) -> list[str]:
        """Names directly under the root ([] when it does not exist yet)."""
        if not self.remote:
            return sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []
        self.fs.invalidate_cache()
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)

    def files(self, path: str) -> list[str]:
        """Every file under `path`, relative to it, sorted."""
        if self.remote:
            self.fs.invalidate_cache()
            return sorted(p[len(path) + 1:] for p in self.fs.find(path))
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
        for victim in (f"{path}/{_MANIFEST}", path):
            try:
                self.fs.rm(victim, recursive=victim == path)
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
