"""Properties of packing: no document mixing, no token lost, loss-mask semantics, exact resume."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.config.loader import build
from posttrain.data.packing import (
    IGNORE_INDEX,
    AsyncPacker,
    Packer,
    PackedRow,
    PackingConfig,
    Sample,
    collate,
    pad_rows,
)
from posttrain.data.stream import ListStream, StatefulIterable
from posttrain.errors import ConfigError, DataError

PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def make_samples(lengths: list[int], seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(input_ids=rng.integers(1, 1000, n, dtype=np.int32),
                   loss_mask=rng.integers(0, 2, n).astype(np.uint8), sample_id=i)
            for i, n in enumerate(lengths)]


configs = st.builds(PackingConfig,
                    max_tokens_per_pack=st.integers(1, 24),
                    buffer_samples=st.integers(1, 6),
                    overlong=st.sampled_from(["truncate", "drop"]),
                    pad_token_id=st.integers(0, 3),
                    prefetch_rows=st.integers(1, 3))
length_lists = st.lists(st.integers(0, 30), max_size=30)
seeds = st.integers(0, 2**32 - 1)


def kept_view(sample: Sample, cfg: PackingConfig) -> tuple[np.ndarray, np.ndarray] | None:
    """What packing should keep of a sample: None if dropped, else (ids, mask) maybe truncated."""
    n = len(sample.input_ids)
    if n == 0 or (n > cfg.max_tokens_per_pack and cfg.overlong == "drop"):
        return None
    n = min(n, cfg.max_tokens_per_pack)
    return sample.input_ids[:n], sample.loss_mask[:n]


def reference_labels(ids: list[int], mask: list[int]) -> list[int]:
    """Labels of one document, written token by token as the convention states it."""
    return [ids[t + 1] if t + 1 < len(ids) and mask[t + 1] else IGNORE_INDEX
            for t in range(len(ids))]


def segments(row: PackedRow) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(row.document_lengths))
    return list(zip([0] + ends[:-1], ends))


def check_row(row: PackedRow, by_id: dict[int, Sample], cfg: PackingConfig, width: int) -> None:
    """Every field of one row against the conventions, document by document."""
    assert row.input_ids.shape == row.labels.shape == row.position_ids.shape == (width,)
    assert row.input_ids.dtype == np.int32 and row.labels.dtype == np.int64
    assert sum(row.document_lengths) == width and all(n > 0 for n in row.document_lengths)
    assert row.num_documents == len(row.sample_ids) >= 1
    assert len(row.document_lengths) == row.num_documents + (row.num_pad > 0)
    for (s, e), sid in itertools.zip_longest(segments(row), row.sample_ids):
        assert row.position_ids[s:e].tolist() == list(range(e - s))
        if sid is None:  # the pad segment
            assert (row.input_ids[s:e] == cfg.pad_token_id).all()
            assert (row.labels[s:e] == IGNORE_INDEX).all()
            continue
        ids, mask = kept_view(by_id[sid], cfg)
        assert row.input_ids[s:e].tolist() == ids.tolist()
        assert row.labels[s:e].tolist() == reference_labels(ids.tolist(), mask.tolist())
    # Labels never point across a boundary: a label at t means t+1 is in t's segment.
    seg_of = np.repeat(np.arange(len(row.document_lengths)), row.document_lengths)
    t = np.flatnonzero(row.labels != IGNORE_INDEX)
    assert (t + 1 < width).all() and (seg_of[t] == seg_of[t + 1]).all()
    assert (row.labels[t] == row.input_ids[t + 1]).all()


@PROPERTY
@given(cfg=configs, lengths=length_lists, seed=seeds)
def test_packing_keeps_documents_apart_and_loses_no_token(cfg, lengths, seed):
    samples = make_samples(lengths, seed)
    by_id = {s.sample_id: s for s in samples}
    packer = Packer(ListStream(samples), cfg)
    rows = list(packer)
    for row in rows:
        check_row(row, by_id, cfg, cfg.max_tokens_per_pack)

    kept = {s.sample_id: kept_view(s, cfg) for s in samples}
    kept = {k: v for k, v in kept.items() if v is not None}
    packed_ids = [sid for row in rows for sid in row.sample_ids]
    assert sorted(packed_ids) == sorted(kept)            # each kept sample exactly once

    stats = packer.stats
    assert stats["samples_in"] == len(samples)
    assert stats["samples_in"] == stats["samples_packed"] + stats["samples_dropped"]
    assert stats["samples_packed"] == len(kept)
    assert stats["samples_truncated"] == sum(
        n > cfg.max_tokens_per_pack for n in lengths) * (cfg.overlong == "truncate")
    assert stats["tokens_in"] == sum(lengths)
    assert stats["real_tokens_out"] == sum(len(ids) for ids, _ in kept.values())
    assert stats["pad_tokens_out"] == sum(r.num_pad for r in rows)
    assert stats["rows_out"] == len(rows)
    assert stats["real_tokens_out"] + stats["pad_tokens_out"] == len(rows) * cfg.max_tokens_per_pack
    # Loss-mask semantics: each kept token t >= 1 with mask 1 is predicted exactly once.
    assert sum(int((r.labels != IGNORE_INDEX).sum()) for r in rows) == \
        sum(int(mask[1:].sum()) for _, mask in kept.values())


@PROPERTY
@given(lengths=st.lists(st.integers(1, 16), max_size=30), buffer=st.integers(1, 8))
def test_rows_are_best_fit_over_the_buffer(lengths, buffer):
    """Replays the rule on lengths alone: longest first, then the longest that fits (earliest)."""
    cfg = PackingConfig(max_tokens_per_pack=16, buffer_samples=buffer)
    rows = list(Packer(ListStream(make_samples(lengths, 0)), cfg))
    pending: list[tuple[int, int]] = []      # (length, sample_id)
    upcoming = iter(enumerate(lengths))
    for row in rows:
        pending += [(n, i) for i, n in itertools.islice(upcoming, buffer - len(pending))]
        expected, room = [], 16
        while pending:
            fits = [p for p in pending if p[0] <= room]
            if not fits:
                break
            best = max(fits, key=lambda p: (p[0], -p[1]))
            pending.remove(best)
            expected.append(best[1])
            room -= best[0]
        assert row.sample_ids == expected


def test_small_example_and_ties_go_to_the_earliest():
    cfg = PackingConfig(max_tokens_per_pack=8, buffer_samples=8)
    rows = list(Packer(ListStream(make_samples([5, 3, 4, 2, 4], 1)), cfg))
    # 5 first, then the longest that fits in 3; then the first of the two 4s, then the other.
    assert [r.sample_ids for r in rows] == [[0, 1], [2, 4], [3]]
    assert [r.document_lengths for r in rows] == [[5, 3], [4, 4], [2, 6]]
    rows = list(Packer(ListStream(make_samples([2, 2, 2], 1)),
                       PackingConfig(max_tokens_per_pack=4, buffer_samples=3)))
    assert [r.sample_ids for r in rows] == [[0, 1], [2]]


def _row_tuple(row: PackedRow) -> tuple:
    return (row.input_ids.tobytes(), row.labels.tobytes(), row.position_ids.tobytes(),
            tuple(row.document_lengths), row.num_pad, row.num_documents, tuple(row.sample_ids))


def _resume_run(make, samples, cfg, cut, wait_for_thread=False):
    """Consume `cut` rows, save, build fresh, restore, return (rows after the cut, final stats)."""
    first = make(ListStream(samples), cfg)
    head = list(itertools.islice(iter(first), cut))
    if wait_for_thread:
        time.sleep(0.02)   # let the background thread run ahead of the consumer
    state = json.loads(json.dumps(first.state_dict()))
    if isinstance(first, AsyncPacker):
        first.close()
    second = make(ListStream(samples), cfg)
    second.load_state_dict(state)
    tail = list(second)
    if isinstance(second, AsyncPacker):
        second.close()
    return head, tail, second.stats


@PROPERTY
@given(cfg=configs, lengths=length_lists, seed=seeds, cuts=st.lists(st.integers(0, 12), max_size=3))
def test_packer_resume_is_exact(cfg, lengths, seed, cuts):
    samples = make_samples(lengths, seed)
    full = Packer(ListStream(samples), cfg)
    rows = [_row_tuple(r) for r in full]
    for cut in cuts:
        head, tail, stats = _resume_run(Packer, samples, cfg, cut)
        cut = len(head)
        assert [_row_tuple(r) for r in tail] == rows[cut:]
        assert stats == full.stats


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, lengths=length_lists, seed=seeds, cut=st.integers(0, 10))
def test_async_packer_matches_sync_and_resumes_exactly(cfg, lengths, seed, cut):
    samples = make_samples(lengths, seed)
    sync = [_row_tuple(r) for r in Packer(ListStream(samples), cfg)]
    with AsyncPacker(ListStream(samples), cfg) as packer:
        assert [_row_tuple(r) for r in packer] == sync
    head, tail, _ = _resume_run(AsyncPacker, samples, cfg, cut, wait_for_thread=True)
    assert [_row_tuple(r) for r in head + tail] == sync


def test_async_state_describes_consumed_rows_not_prefetched_ones():
    samples = make_samples([7] * 200, 3)
    cfg = PackingConfig(max_tokens_per_pack=16, buffer_samples=4, prefetch_rows=8)
    with AsyncPacker(ListStream(samples), cfg) as packer:
        it = iter(packer)
        next(it), next(it), next(it)
        time.sleep(0.05)
        assert packer._queue.qsize() > 0           # the thread is ahead of the consumer
        state = packer.state_dict()
        assert packer.stats["rows_out"] == 3
    sync = Packer(ListStream(samples), cfg)
    list(itertools.islice(iter(sync), 3))
    assert state == sync.state_dict()
    # The two kinds of state are interchangeable.
    resumed = Packer(ListStream(samples), cfg)
    resumed.load_state_dict(state)
    assert [_row_tuple(r) for r in resumed] == [_row_tuple(r) for r in sync]


def test_async_packer_states_hold_the_shuffle_buffer_by_reference_until_read():
    """The background packer takes a state after every row it builds; a shuffle buffer's
    state is its samples, so taking it must not copy them (it held 389 MB of Python lists on
    the SFT bench shape): the capture refers to the buffered samples themselves, and only
    reading the state (a checkpoint) turns them into lists, the same ones as before."""
    from posttrain.data.loader import ShuffleBuffer
    samples = make_samples([5 + i % 9 for i in range(300)], 4)
    cfg = PackingConfig(max_tokens_per_pack=16, buffer_samples=4, prefetch_rows=8)

    def stream():
        return ShuffleBuffer(ListStream(samples), size=32, seed=7)

    with AsyncPacker(stream(), cfg) as packer:
        it = iter(packer)
        for _ in range(5):
            next(it)
        held = packer._consumed.upstream.buffer
        assert len(held) == 32 and all(any(h is s for s in samples) for h in held)
        state = packer.state_dict()
        assert json.loads(json.dumps(state)) == state
        later = [_row_tuple(r) for r in itertools.islice(it, 20)]
    sync = Packer(stream(), cfg)
    list(itertools.islice(iter(sync), 5))
    assert state == sync.state_dict()        # what the eager state held, taken at row 5
    resumed = Packer(stream(), cfg)
    resumed.load_state_dict(state)
    assert [_row_tuple(r) for r in itertools.islice(iter(resumed), 20)] == later


class _Failing(ListStream):
    def __iter__(self):
        for i, item in enumerate(super().__iter__()):
            if i == 5:
                raise OSError("shard vanished")
            yield item


def test_async_packer_reraises_thread_errors_and_closes():
    cfg = PackingConfig(max_tokens_per_pack=8, buffer_samples=2)
    packer = AsyncPacker(_Failing(make_samples([3] * 20, 0)), cfg)
    with pytest.raises(OSError, match="shard vanished"):
        list(packer)
    assert not packer._thread.is_alive()
    with pytest.raises(RuntimeError):
        list(packer)


def test_async_packer_close_stops_a_blocked_thread():
    cfg = PackingConfig(max_tokens_per_pack=8, buffer_samples=2, prefetch_rows=1)
    packer = AsyncPacker(ListStream(make_samples([3] * 1000, 0)), cfg)
    next(iter(packer))
    packer.close()
    assert not packer._thread.is_alive()


def test_bad_sample_is_a_data_error():
    cfg = PackingConfig(max_tokens_per_pack=8)
    bad = [Sample(np.arange(4, dtype=np.int32), np.ones(3, np.uint8), sample_id=7)]
    with pytest.raises(DataError, match="sample 7"):
        list(Packer(ListStream(bad), cfg))
    with pytest.raises(DataError):
        list(AsyncPacker(ListStream(bad), cfg))


def test_resume_with_other_pack_length_is_refused():
    samples = make_samples([3] * 10, 0)
    packer = Packer(ListStream(samples), PackingConfig(max_tokens_per_pack=8))
    next(iter(packer))
    state = packer.state_dict()
    with pytest.raises(ConfigError, match="max_tokens_per_pack"):
        Packer(ListStream(samples), PackingConfig(max_tokens_per_pack=16)).load_state_dict(state)
    with pytest.warns(UserWarning, match="buffer_samples"):
        Packer(ListStream(samples),
               PackingConfig(max_tokens_per_pack=8, buffer_samples=3)).load_state_dict(state)


@PROPERTY
@given(cfg=configs, lengths=length_lists, seed=seeds, rows_per_batch=st.integers(1, 5))
def test_padded_rows_follow_the_same_conventions(cfg, lengths, seed, rows_per_batch):
    samples = make_samples(lengths, seed)
    by_id = {s.sample_id: s for s in samples}
    kept = [s for s in samples if kept_view(s, cfg) is not None]
    rows = list(pad_rows(ListStream(samples), cfg, rows_per_batch))
    assert [r.sample_ids for r in rows] == [[s.sample_id] for s in kept]
    for start in range(0, len(rows), rows_per_batch):
        batch = rows[start:start + rows_per_batch]
        width = max(r.document_lengths[0] for r in batch)
        for row in batch:
            check_row(row, by_id, cfg, width)
        collate(batch)


def test_collate_stacks_rows_and_counts():
    cfg = PackingConfig(max_tokens_per_pack=8, buffer_samples=4)
    rows = list(Packer(ListStream(make_samples([5, 3, 4, 2, 6], 2)), cfg))
    batch = collate(rows)
    assert batch["input_ids"].shape == batch["labels"].shape == (len(rows), 8)
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype \
        == torch.int64
    assert batch["document_lengths"] == [r.document_lengths for r in rows]
    assert batch["num_documents"] == 5
    assert batch["num_real_tokens"] == 20 and batch["num_pad_tokens"] == 8 * len(rows) - 20
    assert batch["num_loss_tokens"] == int((batch["labels"] != IGNORE_INDEX).sum())
    padded = list(pad_rows(make_samples([2, 5], 0), cfg, 1))
    with pytest.raises(ValueError, match="different lengths"):
        collate(padded)


def test_config_is_checked():
    assert build(PackingConfig, {"max_tokens_per_pack": 64}).max_tokens_per_pack == 64
    with pytest.raises(ConfigError, match="max_tokens_per_pak"):
        build(PackingConfig, {"max_tokens_per_pak": 64})
    for bad in ({"max_tokens_per_pack": 0}, {"buffer_samples": -1}, {"overlong": "split"},
                {"pad_token_id": -1}, {"prefetch_rows": 0}):
        with pytest.raises(ConfigError):
            build(PackingConfig, bad)


def test_streams_follow_the_protocol():
    cfg = PackingConfig()
    assert isinstance(ListStream([]), StatefulIterable)
    assert isinstance(Packer(ListStream([]), cfg), StatefulIterable)
    assert isinstance(AsyncPacker(ListStream([]), cfg), StatefulIterable)


# --------------------------------------------------------------------------- multi-document units

def make_units(lengths: list[tuple[int, ...]], seed: int) -> list[Sample]:
    """Samples of several segments (e.g. chosen + rejected), sample_id = index."""
    rng = np.random.default_rng(seed)
    out = []
    for i, segs in enumerate(lengths):
        n = sum(segs)
        out.append(Sample(input_ids=rng.integers(1, 1000, n, dtype=np.int32),
                          loss_mask=rng.integers(0, 2, n).astype(np.uint8), sample_id=i,
                          segment_lengths=segs))
    return out


def _split(sample: Sample) -> list[Sample]:
    ends = list(itertools.accumulate(sample.segment_lengths))
    return [Sample(sample.input_ids[e - n:e], sample.loss_mask[e - n:e], sample.sample_id)
            for n, e in zip(sample.segment_lengths, ends)]


def _docs(rows: list[PackedRow]) -> list[tuple[int, int, bytes, bytes, bytes]]:
    """Per document: (owner, segment, ids, labels, positions), in row order."""
    out = []
    for r in rows:
        start = 0
        for owner, seg, n in zip(r.sample_ids, r.segment_index, r.document_lengths):
            sl = slice(start, start + n)
            out.append((owner, seg, r.input_ids[sl].tobytes(), r.labels[sl].tobytes(),
                        r.position_ids[sl].tobytes()))
            start += n
    return out


@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=40),
       st.integers(0, 2**16), st.integers(1, 12))
@PROPERTY
def test_units_stay_whole_and_each_segment_is_its_own_document(lengths, seed, buffer):
    cfg = PackingConfig(max_tokens_per_pack=64, buffer_samples=buffer)
    units = make_units(lengths, seed)
    rows = list(Packer(ListStream(units), cfg))
    # every unit lands in one row, its segments adjacent and in order
    for r in rows:
        assert r.num_documents == len(r.sample_ids) == len(r.segment_index)
        for k in range(0, r.num_documents, 2):
            assert r.sample_ids[k] == r.sample_ids[k + 1]
            assert (r.segment_index[k], r.segment_index[k + 1]) == (0, 1)
    assert sorted(sid for r in rows for sid in r.sample_ids[::2]) == list(range(len(units)))
    # each segment reads exactly like the same tokens packed as a sample of its own
    alone = {}
    for u in units:
        for seg, s in enumerate(_split(u)):
            row = pad_rows([s], cfg, 1).__next__()
            alone[(u.sample_id, seg)] = _docs([row])[0][2:]
    for owner, seg, *fields in _docs(rows):
        assert tuple(fields) == alone[(owner, seg)]


def test_overlong_unit_is_dropped_never_cut():
    cfg = PackingConfig(max_tokens_per_pack=16, overlong="truncate")
    units = make_units([(10, 10), (4, 5)], seed=0)
    packer = Packer(ListStream(units), cfg)
    rows = list(packer)
    assert [r.sample_ids for r in rows] == [[1, 1]]
    assert packer.stats["samples_dropped"] == 1 and packer.stats["samples_truncated"] == 0


def test_bad_segment_lengths_are_refused():
    s = make_units([(3, 4)], seed=0)[0]
    s.segment_lengths = (3, 5)
    with pytest.raises(DataError, match="segment_lengths"):
        list(Packer(ListStream([s]), PackingConfig(max_tokens_per_pack=32)))


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_resume_with_units_in_the_buffer(cut):
    cfg = PackingConfig(max_tokens_per_pack=48, buffer_samples=6)
    units = make_units([(int(a), int(b)) for a, b in
                        np.random.default_rng(1).integers(1, 20, (40, 2))], seed=2)
    full = _docs(list(Packer(ListStream(units), cfg)))
    first = Packer(ListStream(units), cfg)
    it = iter(first)
    got = [next(it) for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Packer(ListStream(units), cfg)
    resumed.load_state_dict(state)
    assert _docs(got + list(resumed)) == full


def test_padded_rows_put_each_segment_in_its_own_row_of_the_same_batch():
    cfg = PackingConfig(max_tokens_per_pack=64)
    units = make_units([(3, 5), (7, 2), (4, 4)], seed=3)
    rows = list(pad_rows(units, cfg, rows_per_batch=2))
    assert [(r.sample_ids, r.segment_index) for r in rows] == [
        ([0], [0]), ([0], [1]), ([1], [0]), ([1], [1]), ([2], [0]), ([2], [1])]
    assert {r.input_ids.shape[0] for r in rows[:4]} == {7} and rows[4].input_ids.shape[0] == 4
    for r, s in zip(rows, [p for u in units for p in _split(u)]):
        n = len(s.input_ids)
        assert np.array_equal(r.input_ids[:n], s.input_ids)


# ---------------------------------------------------------------------------- side columns
def make_labelled(lengths: list[int], seed: int) -> list[Sample]:
    """Samples with an integer and a float side column whose values name their token."""
    samples = make_samples(lengths, seed)
    for s in samples:
        s.extras = {"label_cls": s.input_ids.astype(np.int64) % 7,
                    "label_val": (s.input_ids.astype(np.float32) / 4)}
        s.extras["label_val"][::3] = np.nan              # positions without a label
    return samples


def _extras_of(row: PackedRow) -> tuple:
    return tuple((k, v.tobytes()) for k, v in sorted(row.extras.items()))


@PROPERTY
@given(cfg=configs, lengths=length_lists, seed=seeds)
def test_side_columns_travel_with_their_tokens(cfg, lengths, seed):
    samples = make_labelled(lengths, seed)
    by_id = {s.sample_id: s for s in samples}
    rows = list(Packer(ListStream(samples), cfg))
    for row in rows:
        assert set(row.extras) == {"label_cls", "label_val"}
        for (s, e), sid in itertools.zip_longest(segments(row), row.sample_ids):
            cls, val = row.extras["label_cls"][s:e], row.extras["label_val"][s:e]
            if sid is None:                               # the pad tail holds the fill
                assert (cls == IGNORE_INDEX).all() and np.isnan(val).all()
                continue
            src = by_id[sid].extras
            assert np.array_equal(cls, src["label_cls"][:e - s])
            assert np.array_equal(val, src["label_val"][:e - s], equal_nan=True)
    if rows:                                              # packed rows are all full width
        batch = collate(rows)
        assert batch["label_cls"].dtype == torch.int64
        assert batch["label_val"].dtype == torch.float32
        assert batch["label_cls"].shape == batch["input_ids"].shape


@PROPERTY
@given(cfg=configs, lengths=length_lists, seed=seeds, cut=st.integers(0, 12))
def test_resume_with_side_columns_in_the_buffer_is_exact(cfg, lengths, seed, cut):
    samples = make_labelled(lengths, seed)
    full = [(_row_tuple(r), _extras_of(r)) for r in Packer(ListStream(samples), cfg)]
    head, tail, _ = _resume_run(Packer, samples, cfg, cut)
    assert [(_row_tuple(r), _extras_of(r)) for r in head + tail] == full


def test_a_document_without_a_column_gets_the_fill_and_padded_rows_keep_columns():
    cfg = PackingConfig(max_tokens_per_pack=16)
    a, b = make_labelled([5, 4], seed=0)
    b.extras = None
    (row,) = list(Packer(ListStream([a, b]), cfg))
    assert row.sample_ids == [0, 1] and row.num_pad == 7
    assert row.extras["label_cls"].tolist() == a.extras["label_cls"].tolist() + [-100] * 11
    rows = list(pad_rows([a, b], cfg, rows_per_batch=2))
    assert rows[0].extras["label_cls"].tolist() == a.extras["label_cls"].tolist()
    assert rows[1].extras == {}
    batch = collate(rows)
    assert batch["label_cls"][1].tolist() == [-100] * 5
    assert torch.isnan(batch["label_val"][1]).all()
    bad = Sample(np.arange(4, dtype=np.int32), np.ones(4, np.uint8), sample_id=3,
                 extras={"label_cls": np.zeros(3, np.int64)})
    with pytest.raises(DataError, match="side column 'label_cls'"):
        list(Packer(ListStream([bad]), cfg))
