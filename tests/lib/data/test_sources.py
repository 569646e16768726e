"""Tests for posttrain.data.sources: reading, bad input, sharding, resumption, prefetch cache,
s3 outages."""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.config.loader import build
from posttrain.errors import ConfigError, DataError
from posttrain.data.sources import (MAX_JSON_DEPTH, CacheConfig, RawRow, RowStream, SourceConfig,
                                    expand_paths, shard_for)
from posttrain.retry import RetryConfig

# ---------------------------------------------------------------------------------------------
# helpers


def jsonl_bytes(rows: list[dict], blank_every: int = 0) -> bytes:
    lines = []
    for i, row in enumerate(rows):
        if blank_every and i % blank_every == 0:
            lines.append("")
        lines.append(json.dumps(row))
    return ("\n".join(lines) + "\n").encode()


def parquet_bytes(rows: list[dict], row_group_rows: int = 4) -> bytes:
    sink = pa.BufferOutputStream()
    table = pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.string()),
                                                         ("tags", pa.list_(pa.int64()))]))
    pq.write_table(table, sink, row_group_size=row_group_rows)
    return sink.getvalue().to_pybytes()


def make_rows(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "tags": [i, i + 1]} for i in range(n)]


def write_files(root: Path, counts: list[int], kinds: list[str]) -> list[str]:
    """Files f000.jsonl / f001.parquet ... with the given row counts; returns sorted paths."""
    paths = []
    for i, (n, kind) in enumerate(zip(counts, kinds)):
        path = root / f"f{i:03d}.{kind}"
        rows = make_rows(path.name, n)
        path.write_bytes(jsonl_bytes(rows, blank_every=3) if kind == "jsonl" else
                         parquet_bytes(rows, row_group_rows=3))
        paths.append(str(path))
    return paths


def key(row: RawRow) -> tuple:
    return (json.dumps(row.data, sort_keys=True), row.file, row.line,
            row.error.reason if row.error else None)


def assert_resume_matches(files: list[str], k: int, **kwargs) -> None:
    """Consume k rows, save, restore into a fresh stream: head + tail == uninterrupted run."""
    with RowStream(files, **kwargs) as full_stream:
        full = [key(r) for r in full_stream]
        full_stats = full_stream.stats
    with RowStream(files, **kwargs) as first:
        head = [key(r) for r in itertools.islice(iter(first), k)]
        state = json.loads(json.dumps(first.state_dict()))
    with RowStream(files, **kwargs) as second:
        second.load_state_dict(state)
        tail = [key(r) for r in second]
        assert head + tail == full
        assert second.stats == full_stats


def disk_bytes(root: Path) -> int:
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except FileNotFoundError:
                pass
    return total


# ---------------------------------------------------------------------------------------------
# reading


def test_jsonl_rows_keep_physical_line_numbers_and_skip_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n\n   \n{"a": 2}\r\n{"a": 3}')
    with RowStream([str(path)]) as stream:
        rows = list(stream)
    assert [(r.data, r.line) for r in rows] == [({"a": 1}, 1), ({"a": 2}, 4), ({"a": 3}, 5)]
    assert stream.stats == {str(path): {"rows": 3, "errors": 0, "blank_lines": 2}}


def test_parquet_rows_become_dicts_with_lists(tmp_path):
    path = tmp_path / "a.parquet"
    path.write_bytes(parquet_bytes(make_rows("p", 10), row_group_rows=4))
    with RowStream([str(path)], parquet_batch_rows=3) as stream:
        rows = list(stream)
    assert [r.data for r in rows] == make_rows("p", 10)
    assert [r.line for r in rows] == list(range(1, 11))
    assert all(r.error is None and r.file == str(path) for r in rows)


def test_gzipped_jsonl_and_explicit_format(tmp_path):
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl_bytes(make_rows("g", 5))))
    odd = tmp_path / "b.data"
    odd.write_bytes(jsonl_bytes(make_rows("o", 2)))
    assert [r.data["id"] for r in RowStream([str(gz)])] == [f"g-{i}" for i in range(5)]
    assert len(list(RowStream([str(odd)], fmt="jsonl"))) == 2
    assert_resume_matches([str(gz)], 2)
    with pytest.raises(DataError, match="cannot tell the format") as e:
        RowStream([str(odd)])
    assert e.value.file == str(odd)


def test_bad_rows_are_reported_not_raised(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"ok": 1}\n{"broken": \n\xff\xfe{"x": 1}\n[1, 2]\n"text"\n{"ok": 2}\n')
    with RowStream([str(path)]) as stream:
        rows = list(stream)
    assert [r.line for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r.error.reason if r.error else None for r in rows] == [
        None, "invalid_json", "invalid_utf8", "not_an_object", "not_an_object", None]
    assert rows[5].data == {"ok": 2}
    bad = rows[1]
    assert bad.data is None and bad.error.file == str(path) and bad.error.line == 2
    assert f"{path}:2" in str(bad.error) and "not valid JSON" in str(bad.error)
    assert "array" in str(rows[3].error) and "string" in str(rows[4].error)
    assert rows[2].error.to_record()["reason"] == "invalid_utf8"
    assert stream.stats[str(path)] == {"rows": 6, "errors": 4, "blank_lines": 0}


def nested(depth: int) -> bytes:
    """A JSON array `depth` levels deep."""
    return b"[" * depth + b"]" * depth


def test_deeply_nested_rows_are_bad_rows_not_crashes(tmp_path):
    path = tmp_path / "deep.jsonl"
    lines = [b'{"ok": 1}',
             b'{"a": ' + nested(5000) + b"}",                      # past the JSON decoder
             b'{"ok": 2, "meta": {"x": ' + nested(MAX_JSON_DEPTH - 1) + b"}}",  # past the cap
             b'{"ok": 3, "meta": ' + nested(MAX_JSON_DEPTH - 1) + b"}",          # at the cap
             nested(5000),
             # brackets in a string are text: more of them than the cap, nesting of 1
             b'{"ok": 5, "text": "' + nested(MAX_JSON_DEPTH) + b'"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    with RowStream([str(path)]) as stream:
        rows = list(stream)
    assert [r.error.reason if r.error else None for r in rows] == [
        None, "too_deep", "too_deep", None, "too_deep", None]
    assert [r.error.field if r.error else None for r in rows] == [
        None, None, "meta", None, None, None]
    assert all(r.data is None and r.error.line == r.line for r in rows if r.error)
    assert f"{path}:2" in str(rows[1].error) and f"{MAX_JSON_DEPTH} levels" in str(rows[1].error)
    assert f"{path}:3, field 'meta'" in str(rows[2].error)
    assert rows[3].data["ok"] == 3 and rows[5].data["ok"] == 5
    assert stream.stats[str(path)] == {"rows": 6, "errors": 3, "blank_lines": 0}


def test_utf8_bom_at_file_start_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n')
    assert [r.data for r in RowStream([str(path)])] == [{"a": 1}]


def test_missing_file_at_read_time_raises_naming_it(tmp_path):
    path = tmp_path / "gone.jsonl"
    with pytest.raises(DataError, match="file not found") as e:
        list(RowStream([str(path)]))
    assert e.value.file == str(path) and e.value.reason == "missing_file"


def test_corrupt_parquet_raises_naming_the_file(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"definitely not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file") as e:
        list(RowStream([str(path)]))
    assert e.value.file == str(path)


# ---------------------------------------------------------------------------------------------
# paths


def test_expand_paths_directories_globs_and_lists(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ["b.jsonl", "a.parquet", "sub/c.jsonl.gz", "_SUCCESS", ".a.jsonl.crc", "notes.txt"]:
        (tmp_path / name).write_bytes(b"")
    assert expand_paths(str(tmp_path)) == [str(tmp_path / n) for n in
                                           ["a.parquet", "b.jsonl", "sub/c.jsonl.gz"]]
    assert expand_paths(str(tmp_path / "*.jsonl")) == [str(tmp_path / "b.jsonl")]
    both = expand_paths([str(tmp_path / "b.jsonl"), str(tmp_path / "*.*")])
    assert both == [str(tmp_path / n) for n in ["b.jsonl", "a.parquet", "notes.txt"]]


@pytest.mark.parametrize("entry, message", [
    ("missing.jsonl", "no such file or directory"),
    ("*.nothing", "matches no files"),
    ("empty_dir", "holds no data files"),
])
def test_expand_paths_failures_name_the_entry(tmp_path, entry, message):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=message) as e:
        expand_paths(str(tmp_path / entry))
    assert e.value.file == str(tmp_path / entry)


def test_source_config_is_built_strictly():
    source = build(SourceConfig, {"path": ["a.jsonl"], "weight": 2, "name": "x"}, "data.sources[0]")
    assert source.weight == 2.0 and source.format == "auto"
    with pytest.raises(ConfigError, match="weight"):
        build(SourceConfig, {"path": "a.jsonl", "weight": 0}, "data.sources[0]")
    with pytest.raises(ConfigError, match="pathh"):
        build(SourceConfig, {"pathh": "a.jsonl"}, "data.sources[0]")
    with pytest.raises(ConfigError, match="max_bytes"):
        CacheConfig(max_bytes=0)


def test_from_source(tmp_path):
    write_files(tmp_path, [2, 3], ["jsonl", "parquet"])
    source = SourceConfig(path=str(tmp_path))
    with RowStream.from_source(source, shard_index=1, num_shards=2) as stream:
        assert [r.data["id"] for r in stream] == [f"f001.parquet-{i}" for i in range(3)]


# ---------------------------------------------------------------------------------------------
# sharding


def test_shard_for_is_rank_major():
    assert shard_for(0, 2, 0, 3) == (0, 6)
    assert shard_for(1, 2, 2, 3) == (5, 6)
    assert sorted(shard_for(r, 2, w, 3)[0] for r in range(2) for w in range(3)) == list(range(6))
    with pytest.raises(ValueError):
        shard_for(2, 2)


def test_auto_shard_mode_follows_file_count(tmp_path):
    files = write_files(tmp_path, [2, 2, 2], ["jsonl"] * 3)
    assert RowStream(files, shard_index=0, num_shards=3).shard_by == "file"
    assert RowStream(files, shard_index=0, num_shards=4).shard_by == "row"
    assert RowStream(files, shard_index=1, num_shards=2, shard_by="file").files == [files[1]]


file_specs = st.lists(st.tuples(st.integers(0, 9), st.sampled_from(["jsonl", "parquet"])),
                      min_size=1, max_size=5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=file_specs, num_shards=st.integers(1, 6),
       shard_by=st.sampled_from(["auto", "file", "row"]))
def test_shards_cover_every_row_exactly_once(specs, num_shards, shard_by):
    with tempfile.TemporaryDirectory() as tmp:
        counts, kinds = [n for n, _ in specs], [k for _, k in specs]
        files = write_files(Path(tmp), counts, kinds)
        seen = []
        for shard in range(num_shards):
            with RowStream(files, shard_index=shard, num_shards=num_shards, shard_by=shard_by,
                           parquet_batch_rows=2) as stream:
                seen += [r.data["id"] for r in stream]
        expected = [row["id"] for f, n in zip(files, counts) for row in make_rows(
            os.path.basename(f), n)]
        assert sorted(seen) == sorted(expected)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=file_specs, num_shards=st.integers(1, 3), shard_by=st.sampled_from(["file", "row"]),
       data=st.data())
def test_resume_gives_identical_continuation(specs, num_shards, shard_by, data):
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), [n for n, _ in specs], [k for _, k in specs])
        shard = data.draw(st.integers(0, num_shards - 1))
        kwargs = dict(shard_index=shard, num_shards=num_shards, shard_by=shard_by,
                      parquet_batch_rows=2)
        total = len(list(RowStream(files, **kwargs)))
        assert_resume_matches(files, data.draw(st.integers(0, total)), **kwargs)


def test_resume_at_file_boundary_and_mid_file(tmp_path):
    files = write_files(tmp_path, [4, 5, 3], ["jsonl", "parquet", "jsonl"])
    for k in [0, 2, 4, 9, 11, 12]:
        assert_resume_matches(files, k)
    with RowStream(files) as stream:
        list(itertools.islice(iter(stream), 4))
        state = stream.state_dict()
    assert (state["file_index"], state["line"]) == (0, 6) and state["offset"] > 0


def test_jsonl_resume_seeks_by_byte_offset(tmp_path):
    files = write_files(tmp_path, [6], ["jsonl"])
    with RowStream(files) as stream:
        list(itertools.islice(iter(stream), 3))
        state = stream.state_dict()
    state["line"] += 1000  # the offset alone positions the reader; line only numbers rows
    with RowStream(files) as resumed:
        resumed.load_state_dict(state)
        assert [r.data["id"] for r in resumed] == [f"f000.jsonl-{i}" for i in range(3, 6)]


def test_load_state_refuses_a_different_setup(tmp_path):
    files = write_files(tmp_path, [3, 3], ["jsonl", "jsonl"])
    state = RowStream(files, shard_index=0, num_shards=2).state_dict()
    with pytest.raises(ConfigError, match="num_shards"):
        RowStream(files).load_state_dict(state)
    with pytest.raises(ConfigError, match="file list changed"):
        RowStream(list(reversed(files)), shard_index=0, num_shards=2).load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# s3 (a real moto server)


def test_s3_expand_and_read_both_formats(s3):
    s3.put("read/a.jsonl", jsonl_bytes(make_rows("a", 3)))
    s3.put("read/sub/b.parquet", parquet_bytes(make_rows("b", 4)))
    s3.put("read/_SUCCESS", b"")
    files = expand_paths(s3.uri("read/"))  # credentials and endpoint from the environment
    assert files == [s3.uri("read/a.jsonl"), s3.uri("read/sub/b.parquet")]
    assert expand_paths(s3.uri("read/*.jsonl"), s3.storage_options) == files[:1]
    with RowStream(files, storage_options=s3.storage_options) as stream:
        assert [r.data["id"] for r in stream] == [f"a-{i}" for i in range(3)] + [
            f"b-{i}" for i in range(4)]
    with pytest.raises(DataError, match="matches no files"):
        expand_paths(s3.uri("read/*.nothing"))
    with pytest.raises(DataError, match="no such file"):
        expand_paths(s3.uri("read/missing.jsonl"))


@pytest.mark.parametrize("cache", [None, "cache"])
@pytest.mark.parametrize("shard_by", ["file", "row"])
def test_s3_resume_gives_identical_continuation(s3, tmp_path, cache, shard_by):
    prefix = f"resume-{cache}-{shard_by}"
    files = [s3.put(f"{prefix}/f0.jsonl", jsonl_bytes(make_rows("a", 5), blank_every=2)),
             s3.put(f"{prefix}/f1.parquet", parquet_bytes(make_rows("b", 7))),
             s3.put(f"{prefix}/f2.jsonl", jsonl_bytes(make_rows("c", 4)))]
    config = CacheConfig(dir=str(tmp_path / "cache"), max_bytes=1 << 20) if cache else None
    for k in [1, 3]:
        assert_resume_matches(files, k, shard_index=1, num_shards=2, shard_by=shard_by,
                              cache=config, parquet_batch_rows=2)
    assert disk_bytes(tmp_path) == 0


def test_prefetch_cache_stays_under_its_cap(s3, tmp_path):
    cap = 100_000
    padded = [{"id": f"r{i}", "text": "x" * 380} for i in range(100)]  # ~40 kB per file
    files = [s3.put(f"cap/f{i}.jsonl", jsonl_bytes(padded)) for i in range(6)]
    files.insert(3, s3.put("cap/big.jsonl", jsonl_bytes(padded * 4)))  # ~160 kB > cap
    cache_dir = tmp_path / "cache"
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], disk_bytes(cache_dir))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rows = 0
    try:
        with RowStream(files, cache=CacheConfig(dir=str(cache_dir), max_bytes=cap,
                                                prefetch_files=3)) as stream:
            for row in stream:
                rows += 1
                peak[0] = max(peak[0], disk_bytes(cache_dir))
                current = stream.state_dict()["file_index"]
                cached = [int(n.split("-")[0]) for _, _, names in os.walk(cache_dir)
                          for n in names]
                assert all(i >= current for i in cached), "a consumed file was not deleted"
            stats = stream.cache_stats
    finally:
        stop.set()
        sampler.join()
    assert rows == 100 * 6 + 400
    assert 0 < peak[0] <= cap
    assert stats["downloaded"] == 6 and stats["streamed_direct"] == 1
    assert stats["peak_bytes"] <= cap
    assert disk_bytes(cache_dir) == 0


def test_prefetch_failure_surfaces_in_the_reader(s3, tmp_path):
    files = [s3.put("fail/a.jsonl", jsonl_bytes(make_rows("a", 2))),
             s3.put("fail/b.jsonl", jsonl_bytes(make_rows("b", 2)))]
    s3.client.delete_object(Bucket=s3.bucket, Key="fail/b.jsonl")
    stream = RowStream(files, cache=CacheConfig(dir=str(tmp_path)))
    rows = []
    with pytest.raises(DataError, match="file not found") as e:
        for row in stream:
            rows.append(row)
    assert len(rows) == 2 and e.value.file == files[1]
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "posttrain-prefetch"]


def test_close_stops_the_prefetch_thread_midway(s3, tmp_path):
    files = [s3.put(f"close/f{i}.jsonl", jsonl_bytes(make_rows(str(i), 50))) for i in range(4)]
    with RowStream(files, cache=CacheConfig(dir=str(tmp_path))) as stream:
        next(iter(stream))
        assert any(t.name == "posttrain-prefetch" for t in threading.enumerate())
    assert not [t for t in threading.enumerate() if t.name == "posttrain-prefetch"]
    assert disk_bytes(tmp_path) == 0


# ---------------------------------------------------------------------------------------------
# s3 outages (`s3_outage`: a proxy in front of moto that goes down and comes back)

FAST_RETRY = RetryConfig(initial_backoff_s=0.25, max_backoff_s=1.0)
SMALL_READS = {"default_block_size": 4096}  # s3fs fetches 4 kB at a time: many requests per file


def random_rows(prefix: str, n: int) -> list[dict]:
    """Rows that do not compress away, so that a file takes many requests to read."""
    rnd = random.Random(prefix)
    return [{"id": f"{prefix}-{i}", "tags": [rnd.getrandbits(62) for _ in range(4)]}
            for i in range(n)]


def outage_data(kind: str, rows: list[dict]) -> bytes:
    if kind == "parquet":
        return parquet_bytes(rows, row_group_rows=500)
    data = jsonl_bytes(rows, blank_every=7)
    return gzip.compress(data) if kind == "jsonl.gz" else data


def read_across_outage(stream: RowStream, proxy, after_rows: int, seconds: float) -> list[tuple]:
    """Every row of `stream`, while another thread takes the proxy down for `seconds` as soon
    as `after_rows` rows were read (possibly with a request in flight)."""
    reached, finished = threading.Event(), threading.Event()

    def outage():
        if reached.wait(timeout=60) and not finished.is_set():
            proxy.go_down(seconds)

    thread = threading.Thread(target=outage)
    thread.start()
    rows = []
    try:
        for row in stream:
            rows.append(key(row))
            if len(rows) == after_rows:
                reached.set()
    finally:
        finished.set()
        reached.set()
        thread.join()
    return rows


def retry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "transient storage error" in r.getMessage()]


# Parquet: more rows, since pyarrow reads the last 64 kB of a file (its footer) in one go
@pytest.mark.parametrize("kind, num_rows", [("jsonl", 1000), ("jsonl.gz", 1000),
                                            ("parquet", 4000)])
def test_s3_outage_mid_file_loses_and_repeats_no_row(s3, s3_outage, caplog, kind, num_rows):
    uri = s3.put(f"outage/{kind}/data.{kind}", outage_data(kind, random_rows(kind, num_rows)))
    options = {**s3_outage.storage_options, **SMALL_READS}

    def stream() -> RowStream:
        return RowStream([uri], storage_options=options, retry=FAST_RETRY, parquet_batch_rows=64)

    with stream() as plain:
        expected = [key(r) for r in plain]
        expected_stats = plain.stats
    assert not retry_warnings(caplog)
    with caplog.at_level(logging.WARNING, logger="posttrain.data.sources"), stream() as flaky:
        rows = read_across_outage(flaky, s3_outage, after_rows=300, seconds=2.0)
        assert flaky.stats == expected_stats
    assert len(rows) == len(expected) == num_rows
    assert rows == expected     # same rows, same order, same file:line: none lost or repeated
    warnings = retry_warnings(caplog)
    assert s3_outage.outages == 1 and warnings
    assert all(m.startswith(f"{uri}: transient storage error") for m in warnings)


def test_s3_outage_while_prefetching_into_the_cache(s3, s3_outage, caplog, tmp_path):
    files = [s3.put(f"outage/cached/f{i}.jsonl", jsonl_bytes(random_rows(f"f{i}", 300)))
             for i in range(4)]
    cache = CacheConfig(dir=str(tmp_path / "cache"), prefetch_files=1)

    def stream() -> RowStream:
        return RowStream(files, storage_options=s3_outage.storage_options, cache=cache,
                         retry=FAST_RETRY)

    with stream() as plain:
        expected = [key(r) for r in plain]
    # down while file 0 is read: file 2 is fetched (file 1 read from the cache) during it
    with caplog.at_level(logging.WARNING, logger="posttrain.data.prefetch"), stream() as flaky:
        rows = read_across_outage(flaky, s3_outage, after_rows=100, seconds=2.0)
        assert flaky.cache_stats["downloaded"] == 4
    assert len(rows) == len(expected) == 1200 and rows == expected
    warnings = retry_warnings(caplog)
    assert warnings and all(m.split(": transient")[0] in files for m in warnings)
    assert disk_bytes(tmp_path) == 0


@pytest.mark.parametrize("cache", [None, "cache"])
def test_s3_outage_longer_than_the_retries_fails_naming_the_file(s3, s3_outage, caplog,
                                                                 tmp_path, cache):
    files = [s3.put(f"outage/long-{cache}/f{i}.jsonl", jsonl_bytes(random_rows(str(i), 500)))
             for i in range(2)]
    retry = RetryConfig(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.1)
    cache_cfg = CacheConfig(dir=str(tmp_path), prefetch_files=1) if cache else None
    with RowStream(files, storage_options={**s3_outage.storage_options, **SMALL_READS},
                   retry=retry, cache=cache_cfg) as stream:
        rows = iter(stream)
        next(rows)
        s3_outage.stop()    # and it stays down
        started = time.monotonic()
        with pytest.raises(DataError, match="gave up after 3 attempts") as e:
            for _ in rows:
                pass
    assert time.monotonic() - started < 10
    assert e.value.reason == "unreadable_file" and e.value.file in files
    assert str(e.value).startswith(e.value.file)
    assert "EndpointConnectionError" in str(e.value)
    assert len(retry_warnings(caplog)) == 2


def test_s3_bad_content_is_not_retried(s3, s3_outage, caplog):
    not_parquet = s3.put("outage/bad/not.parquet", b"no magic bytes here " * 500)
    bad_gzip = s3.put("outage/bad/broken.jsonl.gz",
                      gzip.compress(jsonl_bytes(make_rows("g", 200)))[:-100] + b"garbage" * 20)
    options = {**s3_outage.storage_options, **SMALL_READS}
    with pytest.raises(DataError, match="not a readable Parquet file") as e:
        list(RowStream([not_parquet], storage_options=options))
    assert e.value.reason == "invalid_parquet"
    with pytest.raises(DataError, match="reading failed") as e:
        list(RowStream([bad_gzip], storage_options=options))
    assert e.value.reason == "unreadable_file" and "gave up" not in str(e.value)
    assert not retry_warnings(caplog)
