"""Stream raw rows from JSONL and Parquet files, local or remote, with bounded memory.

A *source* is one or more paths (files, directories, globs, ``s3://`` URIs). `expand_paths`
turns them into a sorted file list, and `RowStream` reads that list row by row (listing and
opening the files, and telling a transient storage error from bad content, is
`posttrain.data.files`):

* **Formats.** JSONL is read line by line from a binary stream and each line is decoded
  strictly as UTF-8, so one bad line never costs more than one row. A JSON file that holds one
  array of rows (its first character, after a BOM and blanks, is ``[``) is read element by
  element (`posttrain.data.jsonarray`): memory holds a chunk of the file and the row being
  decoded, never the whole file; its rows are numbered 1, 2, ... in the array, and since
  nothing marks where the next row starts, malformed JSON inside the array stops the read with
  a `DataError` naming the row. Parquet is read one row group at a time, in batches, with
  ``ParquetFile.iter_batches``. Nothing holds a whole file in memory.
* **Bad rows are data, not exceptions.** A malformed JSONL line becomes a `RawRow` with
  ``data=None`` and a `DataError` that names file, line and reason (``invalid_json``,
  ``invalid_utf8``, ``not_an_object``, ``too_deep``), so that the caller can write a
  rejected-rows report and carry on. A missing or unreadable *file* does raise: nothing
  sensible can follow it.
* **Bounded nesting.** A JSONL row nested deeper than `MAX_JSON_DEPTH` levels is such a bad
  row (``too_deep``), so that no later stage (serializing columns, rendering a template) can
  run out of Python's recursion limit on it.
* **Sharding.** Ranks and loader workers split the data deterministically (see `RowStream`),
  and all shards together yield every row exactly once.
* **Resumption.** `RowStream.state_dict` records the position (file, row, JSON byte offset),
  and a fresh stream given that state yields exactly what the original would have yielded next.
* **Remote files.** Remote files are streamed directly, or, with a `CacheConfig`, downloaded a
  few files ahead by a background thread into a size-capped local cache, so that training
  never waits on the network and never fills the local disk.
* **Transient storage errors.** Where reading a remote file fails with an error that may pass
  (`posttrain.retry.is_transient`: connection refused or reset, a timeout, a 5xx), the file is
  reopened after a backoff (`RetryConfig`, a warning naming the file each time) and read on from
  the current position, so no row is lost or read twice; after the last attempt a `DataError`
  says it gave up. Listing and prefetching retry the same way. Bad content (a malformed line, a
  file that is not Parquet) fails at once, and so does any error of a local file.

Credentials and endpoints for ``s3://`` come from the environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...) or from ``storage_options``, which is passed to fsspec unchanged for
remote paths only.
"""

from __future__ import annotations

import codecs
import copy
import dataclasses
import json
import logging
import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

import pyarrow as pa

from posttrain.config.data import CacheConfig, Format, SourceConfig
from posttrain.data.files import (TransientRead, expand_paths, file_format, locate_row,
                                  open_binary, parquet_batches, parquet_file, read_line)
from posttrain.data.jsonarray import JsonArray, is_json_array
from posttrain.data.prefetch import Prefetcher, is_local
from posttrain.errors import ConfigError, DataError
from posttrain.retry import Backoff, RetryConfig, RetryError

__all__ = ["MAX_JSON_DEPTH", "CacheConfig", "RawRow", "RowStream", "ShardBy", "SourceConfig",
           "expand_paths", "shard_for"]

log = logging.getLogger(__name__)

ShardBy = Literal["auto", "file", "row"]

_STATE_VERSION = 1
MAX_JSON_DEPTH = 100  # levels of objects and arrays in a JSONL row, the row itself 1


# ---------------------------------------------------------------------------------------------
# Rows and sharding


@dataclass(frozen=True)
class RawRow:
    """One row as read: `data` is None exactly when `error` says why the row is unusable.

    `line` is the 1-based line number for JSON Lines (blank lines included) and the 1-based row
    number for Parquet and for a JSON array (its element index + 1).
    """

    data: dict | None
    file: str
    line: int
    error: DataError | None = None


def shard_for(rank: int, world_size: int, worker_id: int = 0,
              num_workers: int = 1) -> tuple[int, int]:
    """``(shard_index, num_shards)`` of one loader worker on one rank.

    Every (rank, worker) pair gets a distinct shard, ``rank * num_workers + worker_id`` of
    ``world_size * num_workers``, so the same data split follows from the same launch shape.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id {worker_id} is outside 0..{num_workers - 1}")
    return rank * num_workers + worker_id, world_size * num_workers


def _bad_row(file: str, line: int, reason: str, message: str,
             field: str | None = None) -> RawRow:
    return RawRow(None, file, line, DataError(message, file=file, line=line, field=field,
                                              reason=reason))


def _parse_jsonl_line(raw: bytes, file: str, line: int) -> RawRow:
    if line == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _bad_row(file, line, "invalid_utf8",
                        f"not valid UTF-8 (byte {raw[e.start:e.start + 1]!r} at offset {e.start} "
                        "in the line); re-encode the file as UTF-8")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return _bad_row(file, line, "invalid_json",
                        f"not valid JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return _bad_row(file, line, "too_deep", f"nested more than {MAX_JSON_DEPTH} levels deep "
                        "(too deep for the JSON decoder); flatten the row")
    # each level of nesting opens with one of these characters, so a line with no more of them
    # than the cap cannot nest deeper (strings holding brackets only make the count larger)
    shallow = raw.count(b"{") + raw.count(b"[") <= MAX_JSON_DEPTH
    return _object_row(value, file, line, "one JSON object per line", shallow=shallow)


def _object_row(value: Any, file: str, line: int, expected: str, *,
                shallow: bool = False) -> RawRow:
    """A decoded row: a bad row unless it is an object no deeper than `MAX_JSON_DEPTH`
    (walked unless its text already showed it `shallow`)."""
    if not isinstance(value, dict):
        return _bad_row(file, line, "not_an_object",
                        f"expected {expected}, got a JSON {_json_kind(value)}")
    deep = None if shallow else _too_deep_key(value)
    if deep is not None:
        return _bad_row(file, line, "too_deep",
                        f"nested more than {MAX_JSON_DEPTH} levels deep; flatten the row", deep)
    return RawRow(value, file, line)


def _too_deep_key(row: dict) -> str | None:
    """The top-level key under which `row` nests more than `MAX_JSON_DEPTH` levels, or None.
    Iterative: the point is to refuse rows that recursion would choke on."""
    for key, value in row.items():
        stack = [(value, 2)] if isinstance(value, (dict, list)) else []
        while stack:
            node, depth = stack.pop()
            if depth > MAX_JSON_DEPTH:
                return str(key)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return None


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


@dataclass
class _Position:
    """Where a stream is; all counts are of what has been consumed so far."""

    file_index: int = 0  # into the stream's own file list
    line: int = 0  # JSONL: physical lines of the current file; Parquet, JSON array: its rows
    offset: int = 0  # JSONL, JSON array: bytes of the current file
    global_row: int = 0  # rows (not blank lines) before this point in the files read


class RowStream:
    """A resumable, sharded stream of `RawRow`s over a list of files.

    Sharding rule, for ``num_shards`` shards of which this is ``shard_index``:

    * ``shard_by="file"``: file ``i`` of `files` belongs to shard ``i % num_shards``, read whole.
    * ``shard_by="row"``: every shard reads every file, and the ``g``-th row of the whole list
      (0-based, in file order, blank lines not counted, malformed rows counted) belongs to shard
      ``g % num_shards``. Every shard reads every byte, so prefer many files.
    * ``shard_by="auto"``: ``"file"`` when there are at least as many files as shards, else
      ``"row"`` (so no shard is left without data).

    The stream is stateful: iterating continues from the current position, and `state_dict` /
    `load_state_dict` save and restore it. `stats` counts, per file, the rows this shard
    yielded, how many of them were errors, and the blank lines it skipped. Use it as a context
    manager (or call `close`) so that a prefetch thread stops and its cache is removed.

    `retry` governs transient errors of remote files (see the module docstring): each outage
    gets the whole budget anew once reading has moved on since the previous one.
    """

    def __init__(self, files: list[str], *, fmt: Format = "auto", shard_index: int = 0,
                 num_shards: int = 1, shard_by: ShardBy = "auto",
                 cache: CacheConfig | None = None, storage_options: dict | None = None,
                 parquet_batch_rows: int = 1024, retry: RetryConfig = RetryConfig()):
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} is outside 0..{num_shards - 1}")
        if shard_by not in ("auto", "file", "row"):
            raise ValueError(f"shard_by must be 'auto', 'file' or 'row', got {shard_by!r}")
        if parquet_batch_rows < 1:
            raise ValueError(f"parquet_batch_rows must be positive, got {parquet_batch_rows}")
        self._all_files = list(files)
        self._formats = [file_format(f, fmt) for f in self._all_files]
        self.shard_index = shard_index
        self.num_shards = num_shards
        if shard_by == "auto":
            shard_by = "file" if len(self._all_files) >= num_shards else "row"
        self.shard_by: Literal["file", "row"] = shard_by
        own = range(len(self._all_files))
        self._own = list(own[shard_index::num_shards] if shard_by == "file" else own)
        self._cache = cache
        self._storage_options = storage_options
        self._parquet_batch_rows = parquet_batch_rows
        self._retry = retry
        self._pos = _Position()
        self._stats: dict[str, dict[str, int]] = {}
        self._active: Generator[RawRow, None, None] | None = None
        self._prefetcher: Prefetcher | None = None

    @classmethod
    def from_source(cls, source: SourceConfig, **kwargs: Any) -> RowStream:
        """A stream over `source`'s files; `kwargs` are `RowStream`'s keyword arguments."""
        files = expand_paths(source.path, kwargs.get("storage_options"),
                             kwargs.get("retry", RetryConfig()))
        return cls(files, fmt=source.format, **kwargs)

    @property
    def files(self) -> list[str]:
        """The files this shard reads, in reading order."""
        return [self._all_files[i] for i in self._own]

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Per file: ``rows`` yielded by this shard, ``errors`` among them, ``blank_lines``."""
        return copy.deepcopy(self._stats)

    @property
    def cache_stats(self) -> dict[str, int]:
        """From the latest prefetcher: files ``downloaded``, ``streamed_direct``, ``peak_bytes``."""
        return dict(self._prefetcher.stats) if self._prefetcher else {}

    def __iter__(self) -> Iterator[RawRow]:
        self._close_active()
        self._active = self._iterate()
        return self._active

    def __enter__(self) -> RowStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop iterating: close open files, stop the prefetch thread, delete its cache."""
        self._close_active()

    def state_dict(self) -> dict:
        """The position after the rows yielded so far, as plain JSON data."""
        k = self._pos.file_index
        return {
            "version": _STATE_VERSION,
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "shard_by": self.shard_by,
            "num_files": len(self._all_files),
            "file_index": k,
            "file": self._all_files[self._own[k]] if k < len(self._own) else None,
            "line": self._pos.line,
            "offset": self._pos.offset,
            "global_row": self._pos.global_row,
            "stats": self.stats,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; the stream must have the same files and shard settings."""
        self._check_state(state)
        self._close_active()
        self._pos = _Position(file_index=state["file_index"], line=state["line"],
                              offset=state["offset"], global_row=state["global_row"])
        self._stats = copy.deepcopy(state["stats"])

    def _check_state(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(f"data position has version {state.get('version')!r}; this "
                              f"version of posttrain reads version {_STATE_VERSION}")
        ours = {"shard_index": self.shard_index, "num_shards": self.num_shards,
                "shard_by": self.shard_by, "num_files": len(self._all_files)}
        for key, value in ours.items():
            if state.get(key) != value:
                raise ConfigError(f"data position was saved with {key}={state.get(key)!r} but "
                                  f"this stream has {key}={value!r}; resume with the same data "
                                  "and the same number of ranks and workers, or start fresh")
        k = state["file_index"]
        expected = self._all_files[self._own[k]] if k < len(self._own) else None
        saved = state.get("file")
        if (saved is None) != (expected is None) or (
                saved and os.path.basename(saved) != os.path.basename(expected)):
            raise ConfigError(f"data position points at file {saved!r} but this stream has "
                              f"{expected!r} there; the file list changed since it was saved")

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def _iterate(self) -> Generator[RawRow, None, None]:
        prefetcher = self._start_prefetcher()
        try:
            while self._pos.file_index < len(self._own):
                k = self._pos.file_index
                yield from self._read_file(k, prefetcher)
                if prefetcher is not None:
                    prefetcher.release(k)
                self._pos = _Position(file_index=k + 1, global_row=self._pos.global_row)
        finally:
            if prefetcher is not None:
                prefetcher.close()

    def _start_prefetcher(self) -> Prefetcher | None:
        files = self.files
        start = self._pos.file_index
        if self._cache is None or all(is_local(f) for f in files[start:]):
            return None
        self._prefetcher = Prefetcher(files, start, self._cache, self._storage_options,
                                      self._retry)
        return self._prefetcher

    def _read_file(self, k: int, prefetcher: Prefetcher | None) -> Iterator[RawRow]:
        """The rows of file `k` from the current position. A transient failure of a remote
        file reopens it after a backoff and goes on from the position of the last row read."""
        uri = self._all_files[self._own[k]]
        kind, compression = self._formats[self._own[k]]
        local_copy = prefetcher.acquire(k) if prefetcher is not None else None
        rows = self._jsonl_rows if kind == "jsonl" else self._parquet_rows
        backoff, failed_at = None, None
        while True:
            try:
                with open_binary(uri, local_copy, compression, self._storage_options) as f:
                    yield from rows(f, uri)
                return
            except TransientRead as e:
                if backoff is None or self._pos != failed_at:  # rows read since: a new outage
                    backoff = Backoff(self._retry, uri, log)
                failed_at = dataclasses.replace(self._pos)
                try:
                    backoff.failed(e.error)
                except RetryError as gave_up:
                    line = self._pos.line + 1 if kind == "jsonl" else None
                    raise DataError(f"reading failed: {gave_up.detail}", file=uri, line=line,
                                    reason="unreadable_file") from e.error

    def _mine(self, global_row: int) -> bool:
        return self.shard_by == "file" or global_row % self.num_shards == self.shard_index

    def _file_stats(self, uri: str) -> dict[str, int]:
        return self._stats.setdefault(uri, {"rows": 0, "errors": 0, "blank_lines": 0})

    def _emit(self, row: RawRow) -> RawRow:
        stats = self._file_stats(row.file)
        stats["rows"] += 1
        stats["errors"] += row.error is not None
        return row

    def _jsonl_rows(self, f: IO[bytes], uri: str) -> Iterator[RawRow]:
        if is_json_array(f, uri):
            yield from self._json_array_rows(f, uri)
            return
        pos = self._pos
        if pos.offset:
            f.seek(pos.offset)
        while raw := read_line(f, uri, pos.line + 1):
            pos.offset += len(raw)
            pos.line += 1
            if not raw.strip():
                self._file_stats(uri)["blank_lines"] += 1
                continue
            pos.global_row += 1
            if self._mine(pos.global_row - 1):
                yield self._emit(_parse_jsonl_line(raw, uri, pos.line))

    def _json_array_rows(self, f: IO[bytes], uri: str) -> Iterator[RawRow]:
        pos = self._pos
        for value, end in JsonArray(f, uri, pos.offset, pos.line):
            pos.offset = end
            pos.line += 1
            pos.global_row += 1
            if self._mine(pos.global_row - 1):
                yield self._emit(_object_row(value, uri, pos.line,
                                             "each element of the array to be a JSON object"))

    def _parquet_rows(self, f: IO[bytes], uri: str) -> Iterator[RawRow]:
        parquet = parquet_file(f, uri)
        first_group, skip = locate_row(parquet.metadata, self._pos.line)
        groups = range(first_group, parquet.metadata.num_row_groups)
        for batch in parquet_batches(parquet, groups, self._parquet_batch_rows, uri):
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            yield from self._batch_rows(batch.slice(skip), uri)
            skip = 0

    def _batch_rows(self, batch: pa.RecordBatch, uri: str) -> Iterator[RawRow]:
        pos = self._pos
        first_line, first_global, n = pos.line, pos.global_row, batch.num_rows
        if self.shard_by == "file":
            offsets = range(n)
            rows = batch.to_pylist()
        else:
            offsets = range((self.shard_index - first_global) % self.num_shards, n,
                            self.num_shards)
            rows = batch.take(pa.array(offsets, type=pa.int64())).to_pylist()
        for i, data in zip(offsets, rows):
            pos.line, pos.global_row = first_line + i + 1, first_global + i + 1
            yield self._emit(RawRow(data, uri, first_line + i + 1))
        pos.line, pos.global_row = first_line + n, first_global + n
