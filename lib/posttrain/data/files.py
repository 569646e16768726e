"""The files of a data source, and opening them: what `posttrain.data.sources.RowStream` reads.

* **Which files.** `expand_paths` turns files, directories, globs and ``s3://`` URIs into a
  sorted, deduplicated file list (a remote listing retried after transient errors), and
  `file_format` tells JSON Lines from Parquet (and gzip) by the file name.
* **Opening them.** `open_binary` opens a file, or its prefetched local copy, for binary
  reading. A remote file that fails with an error that may pass (`posttrain.retry.is_transient`),
  while being opened or read through a decompressor or pyarrow, surfaces as `TransientRead`,
  which the row stream answers by reopening it after a backoff; every other failure is a
  `DataError` naming the file.
* **Parquet.** `parquet_file`, `locate_row` and `parquet_batches` read a Parquet file one row
  group at a time, in batches, from any row.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import IO, Any

import fsspec.compression
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.config.data import Format
from posttrain.data.prefetch import filesystem, is_local
from posttrain.errors import DataError
from posttrain.retry import RetryConfig, RetryError, is_transient
from posttrain.retry import call as retry_call

log = logging.getLogger(__name__)

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_COMPRESSION_SUFFIXES = {".gz": "gzip"}
_GLOB_CHARS = "*?["


# ---------------------------------------------------------------------------------------------
# Paths


def expand_paths(path: str | list[str], storage_options: dict | None = None,
                 retry: RetryConfig = RetryConfig()) -> list[str]:
    """Turn files, directories, globs and URIs into a deterministic list of files.

    Each entry expands to a sorted list: a glob to the files it matches, a directory to the
    data files below it (by extension, recursively), a file to itself; globs and directories
    skip names that start with '.' or '_'. Entries keep their given
    order and a file named twice is kept once. A missing path, an empty glob or directory, or a
    listing failure raises `DataError` naming the entry; a remote listing is retried after
    transient errors as `retry` allows. Remote files come back as URIs (``s3://bucket/key``),
    local ones as absolute paths.
    """
    entries = [path] if isinstance(path, str) else list(path)
    if not entries:
        raise DataError("no data path given: name a file, directory, glob or s3:// URI",
                        reason="missing_file")
    files: list[str] = []
    seen: set[str] = set()
    for entry in entries:
        for uri in _expand_entry(entry, storage_options, retry):
            if uri not in seen:
                seen.add(uri)
                files.append(uri)
    return files


def _expand_entry(entry: str, storage_options: dict | None, retry: RetryConfig) -> list[str]:
    fs, root = filesystem(entry, storage_options)

    def listing() -> tuple[list[str], str]:
        fs.invalidate_cache()
        if any(c in root for c in _GLOB_CHARS):
            return ([p for p, info in fs.glob(root, detail=True).items()
                     if info["type"] == "file" and not _is_hidden(p)],
                    "the pattern matches no files")
        if fs.isdir(root):
            return ([p for p in fs.find(root) if _is_data_file(p)],
                    "the directory holds no data files (.jsonl, .json, .ndjson, .parquet, .pq, "
                    "optionally .gz for JSON Lines)")
        if fs.isfile(root):
            return [root], ""
        return [], "no such file or directory"

    try:
        found, missing = listing() if is_local(entry) else retry_call(listing, retry, entry, log)
    except RetryError as e:
        raise DataError(f"cannot list it: {e.detail}", file=entry,
                        reason="unreadable_file") from e
    except Exception as e:  # storage errors vary by backend; the cause stays chained
        raise DataError(f"cannot list it: {type(e).__name__}: {e}", file=entry,
                        reason="unreadable_file") from e
    if not found:
        raise DataError(missing, file=entry, reason="missing_file")
    return sorted(p if is_local(entry) else fs.unstrip_protocol(p) for p in found)


def _is_hidden(path: str) -> bool:
    """Names starting with '.' or '_' are bookkeeping (``_SUCCESS``, ``.crc``), as in Hadoop."""
    return os.path.basename(path).startswith((".", "_"))


def _is_data_file(path: str) -> bool:
    if _is_hidden(path):
        return False
    stem, _ = _split_compression(os.path.basename(path).lower())
    return stem.endswith(_JSONL_SUFFIXES + _PARQUET_SUFFIXES)


def _split_compression(name: str) -> tuple[str, str | None]:
    for suffix, compression in _COMPRESSION_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], compression
    return name, None


def file_format(uri: str, fmt: Format) -> tuple[str, str | None]:
    """(``"jsonl"`` or ``"parquet"``, compression) for one file."""
    stem, compression = _split_compression(uri.lower())
    if fmt != "auto":
        kind = fmt
    elif stem.endswith(_JSONL_SUFFIXES):
        kind = "jsonl"
    elif stem.endswith(_PARQUET_SUFFIXES):
        kind = "parquet"
    else:
        raise DataError("cannot tell the format from the file name (expected .jsonl, .json, "
                        ".ndjson, .jsonl.gz, .parquet or .pq); set `format: jsonl` or "
                        "`format: parquet` on the source", file=uri, reason="unknown_format")
    if kind == "parquet" and compression:
        raise DataError("a Parquet file cannot be gzipped as a whole; Parquet compresses its "
                        "columns itself", file=uri, reason="unknown_format")
    return kind, compression


# ---------------------------------------------------------------------------------------------
# Reading files


class TransientRead(Exception):
    """Opening or reading a remote file failed with a transient `error`: worth reopening."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class _RecordingFile:
    """A remote file that remembers the error of its last failed read or seek.

    A storage failure reaches the reader through a decompressor or pyarrow, changed or wrapped;
    what the file itself raised tells it apart from bad content.
    """

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.error: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def _do(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._f, method)(*args)
        except Exception as e:
            self.error = e
            raise

    def read(self, *args: Any) -> bytes:
        return self._do("read", *args)

    def readline(self, *args: Any) -> bytes:
        return self._do("readline", *args)

    def readinto(self, *args: Any) -> int:
        return self._do("readinto", *args)

    def seek(self, *args: Any) -> int:
        return self._do("seek", *args)


@contextlib.contextmanager
def open_binary(uri: str, local_copy: str | None, compression: str | None,
                 storage_options: dict | None) -> Iterator[IO[bytes]]:
    """Open `uri` (or its cached `local_copy`) for binary reading, failing with a DataError,
    or, for a remote file that failed transiently while being opened or read, `TransientRead`."""
    remote = local_copy is None and not is_local(uri)
    try:
        fs, path = filesystem(local_copy or uri, storage_options)
        raw = fs.open(path, "rb")
    except FileNotFoundError as e:
        raise DataError("file not found (deleted or moved after the file list was made?)",
                        file=uri, reason="missing_file") from e
    except Exception as e:  # storage errors vary by backend; the cause stays chained
        if remote and is_transient(e):
            raise TransientRead(e) from e
        raise DataError(f"cannot open it for reading: {type(e).__name__}: {e}", file=uri,
                        reason="unreadable_file") from e
    recorder = _RecordingFile(raw) if remote else None
    f = recorder or raw
    try:
        with (fsspec.compression.compr[compression](f, mode="rb") if compression
              else contextlib.nullcontext(f)) as stream:
            yield stream
    except Exception:
        if recorder is not None and recorder.error is not None and is_transient(recorder.error):
            raise TransientRead(recorder.error) from recorder.error
        raise
    finally:
        raw.close()


def read_line(f: IO[bytes], uri: str, line: int) -> bytes:
    try:
        return f.readline()
    except Exception as e:  # a network or decompression failure mid-file
        raise DataError(f"reading failed: {type(e).__name__}: {e}", file=uri, line=line,
                        reason="unreadable_file") from e


def parquet_file(f: IO[bytes], uri: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(f, page_checksum_verification=True)   # where a file has them
    except Exception as e:
        raise DataError(f"not a readable Parquet file: {type(e).__name__}: {e}", file=uri,
                        reason="invalid_parquet") from e


def locate_row(metadata: pq.FileMetaData, row: int) -> tuple[int, int]:
    """The row group holding 0-based `row`, and how many of its rows come before it."""
    start = 0
    for group in range(metadata.num_row_groups):
        size = metadata.row_group(group).num_rows
        if row < start + size:
            return group, row - start
        start += size
    return metadata.num_row_groups, 0


def parquet_batches(parquet: pq.ParquetFile, groups: range, batch_rows: int,
             uri: str) -> Iterator[pa.RecordBatch]:
    """Batches of at most `batch_rows` rows, one row group at a time: pyarrow fetches the
    groups of one call together, so this bounds what is in memory, and a read that fails
    costs only the group it was fetching."""
    for group in groups:
        batches = parquet.iter_batches(batch_size=batch_rows, row_groups=[group],
                                       use_threads=False)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except Exception as e:
                raise DataError(f"reading Parquet data failed: {type(e).__name__}: {e}",
                                file=uri, reason="invalid_parquet") from e
            yield batch
