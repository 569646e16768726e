"""On-the-fly packing of tokenized samples into fixed-length rows that keep document boundaries.

Why: chat data is skewed (most samples short, a long tail), so padding each sample to its
batch's longest wastes most of the compute. Packing concatenates whole samples ("documents")
into rows of exactly ``max_tokens_per_pack`` tokens; the attention kernel and the loss see the
boundaries through ``document_lengths`` / ``position_ids`` and ``labels``, so nothing leaks
across documents.

Row conventions (the same for packed rows and, via `pad_rows`, padded rows):

* ``input_ids[L]`` int32; the pad tail holds ``pad_token_id``.
* ``labels[L]`` int64, already shifted: ``labels[t] = input_ids[t+1]`` when ``t+1`` lies in the
  same document and ``loss_mask[t+1] == 1``, else ``-100`` (`IGNORE_INDEX`). Hence the last
  token of every document and every pad position is ``-100``; a loss never crosses documents.
* ``position_ids[L]`` int64, restarting at 0 at each document; the pad tail restarts at 0 too.
* ``document_lengths``: segment lengths in order, summing to ``L``; a pad tail is its own
  trailing segment (``num_pad`` > 0), not counted in ``num_documents``.

Multi-document samples: a `Sample` with ``segment_lengths`` (e.g. the chosen and the rejected
sequence of a preference pair) is one packing unit of several documents. The packer places the
unit whole in one row, never splits it, and never truncates it (an over-long unit is dropped:
a cut pair would compare a response with a fragment); inside the row each segment is its own
document for labels, position ids and ``document_lengths``. ``PackedRow.segment_index`` says
which segment of its sample each document is (0 for ordinary samples). `pad_rows` puts each
segment of a unit in its own row, in order, within the same batch.

Packing algorithm: best fit over a bounded look-ahead buffer. Up to ``buffer_samples`` pending
samples are kept sorted by (length, arrival); a row starts with the longest pending sample and
is filled by repeatedly taking the longest pending sample that still fits (a bisect), until none
fits. The row is emitted and the buffer refilled. Ties go to the earliest arrival, so the output
is a pure function of the input order and the config. Samples longer than the row are truncated
(keep the first ``max_tokens_per_pack`` tokens) or dropped; empty samples are dropped; all are
counted in ``stats``.

Per-token side columns: a `Sample` may carry ``extras``, named arrays aligned with its tokens
(e.g. the labels of extra output heads, one value per event). They travel with their tokens
through truncation and packing; a row holds each column over its documents (``PackedRow.extras``,
``[L]`` each, and a ``[B, L]`` tensor of that name in a collated batch), with a fill value where
there is none: on the pad tail and in a document without that column (NaN for float columns,
-100 for integer ones). They are not shifted: position t holds token t's value.

Resume: ``state_dict()`` holds the upstream position, the pending buffer (token ids, masks and
side columns) and the stats, so a fresh `Packer` over a fresh upstream continues bit for bit.
`AsyncPacker` packs in a background thread and reports the state that belongs to the last row
the *consumer* received, not what the thread has produced ahead.
"""

from __future__ import annotations

import copy
import queue
import threading
import warnings
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from posttrain.config.data import PackingConfig
from posttrain.data.stream import StatefulIterable
from posttrain.errors import ConfigError, DataError

IGNORE_INDEX = -100
STATS_KEYS = ("samples_in", "samples_packed", "samples_truncated", "samples_dropped",
              "tokens_in", "real_tokens_out", "pad_tokens_out", "rows_out")
_STATE_VERSION = 1
# Buffer sort key = (length << _SEQ_BITS) | (_SEQ_MAX - seq): longest first, then earliest arrival.
_SEQ_BITS = 40
_SEQ_MAX = (1 << _SEQ_BITS) - 1


@dataclass
class Sample:
    """One tokenized document: ``loss_mask[t] == 1`` where token t is to be predicted."""

    input_ids: np.ndarray   # [n] int32
    loss_mask: np.ndarray   # [n] uint8 or bool
    sample_id: int | None = None
    segment_lengths: tuple[int, ...] | None = None  # several documents, packed as one unit
    extras: dict[str, np.ndarray] | None = None      # per-token side columns, each [n]


@dataclass
class PackedRow:
    """One training row of length L; field conventions in the module docstring."""

    input_ids: np.ndarray      # [L] int32
    labels: np.ndarray         # [L] int64, shifted, -100 where ignored
    position_ids: np.ndarray   # [L] int64, restarting at 0 per segment
    document_lengths: list[int]
    num_pad: int
    num_documents: int
    sample_ids: list[int | None] = field(default_factory=list)  # per document, in order
    segment_index: list[int] = field(default_factory=list)      # per document: its segment
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # side columns, [L] each


class _Pending:
    """A sample admitted to the buffer: validated, converted, maybe truncated. Never mutated."""

    __slots__ = ("ids", "mask", "sample_id", "seq", "length", "segments", "extras")

    def __init__(self, ids: np.ndarray, mask: np.ndarray, sample_id: int | None, seq: int,
                 segments: tuple[int, ...] | None = None,
                 extras: dict[str, np.ndarray] | None = None):
        self.ids = ids
        self.mask = mask
        self.sample_id = sample_id
        self.seq = seq
        self.length = len(ids)
        self.segments = segments
        self.extras = extras or {}

    def documents(self) -> list[tuple[np.ndarray, np.ndarray, int, dict[str, np.ndarray]]]:
        """(ids, mask, segment index, side columns) of each document of this unit."""
        if self.segments is None:
            return [(self.ids, self.mask, 0, self.extras)]
        ends = list(accumulate(self.segments))
        return [(self.ids[e - n:e], self.mask[e - n:e], i,
                 {k: v[e - n:e] for k, v in self.extras.items()})
                for i, (n, e) in enumerate(zip(self.segments, ends))]

    @property
    def key(self) -> int:
        return (self.length << _SEQ_BITS) | (_SEQ_MAX - self.seq)


def _admit(sample: Sample, cfg: PackingConfig, stats: dict[str, int], seq: int) -> _Pending | None:
    """Validate and convert one sample; truncate, drop or keep it, and count what happened."""
    ids = np.asarray(sample.input_ids, dtype=np.int32)
    mask = np.asarray(sample.loss_mask)
    if mask.dtype != np.bool_:
        mask = mask.astype(np.bool_)
    if ids.ndim != 1 or ids.shape != mask.shape:
        raise DataError(f"sample {sample.sample_id}: input_ids {ids.shape} and loss_mask "
                        f"{mask.shape} must be 1-D and of equal length; check the tokenizer step",
                        field="loss_mask", reason="mask_length")
    n = ids.shape[0]
    segments = _check_segments(sample, n)
    extras = {k: np.asarray(v) for k, v in (sample.extras or {}).items()}
    for k, v in extras.items():
        if v.shape != ids.shape:
            raise DataError(f"sample {sample.sample_id}: side column {k!r} {v.shape} is not "
                            f"aligned with input_ids {ids.shape}", field=k,
                            reason="mask_length")
    stats["samples_in"] += 1
    stats["tokens_in"] += n
    limit = cfg.max_tokens_per_pack
    if n == 0 or (n > limit and (cfg.overlong == "drop" or segments is not None)):
        stats["samples_dropped"] += 1
        return None
    if n > limit:
        stats["samples_truncated"] += 1
        ids, mask = ids[:limit], mask[:limit]
        extras = {k: v[:limit] for k, v in extras.items()}
    return _Pending(ids, mask, sample.sample_id, seq, segments, extras)


def _check_segments(sample: Sample, n: int) -> tuple[int, ...] | None:
    if sample.segment_lengths is None:
        return None
    segments = tuple(int(x) for x in sample.segment_lengths)
    if not segments or min(segments) < 1 or sum(segments) != n:
        raise DataError(f"sample {sample.sample_id}: segment_lengths {list(segments)} must be "
                        f"positive and sum to the sample's {n} tokens",
                        field="segment_lengths", reason="mask_length")
    return segments


class _RowBuilder:
    """Turns a list of documents into one row's arrays with numpy; no per-token Python loops."""

    def __init__(self, cfg: PackingConfig):
        self._arange = np.arange(cfg.max_tokens_per_pack, dtype=np.int64)
        self._pad_ids = np.full(cfg.max_tokens_per_pack, cfg.pad_token_id, dtype=np.int32)
        self._no_loss = np.zeros(cfg.max_tokens_per_pack, dtype=np.bool_)

    def build(self, docs: list[_Pending], length: int) -> PackedRow:
        assert length <= self._arange.shape[0], "rows are at most max_tokens_per_pack long"
        parts = [part for d in docs for part in d.documents()]
        owners = [d.sample_id for d in docs for _ in range(len(d.segments or (0,)))]
        lengths = [len(ids) for ids, _, _, _ in parts]
        num_pad = length - sum(lengths)
        assert num_pad >= 0, "documents exceed the row length"
        id_parts = [ids for ids, _, _, _ in parts]
        mask_parts = [mask for _, mask, _, _ in parts]
        segments = lengths
        if num_pad:
            id_parts.append(self._pad_ids[:num_pad])
            mask_parts.append(self._no_loss[:num_pad])
            segments = lengths + [num_pad]
        input_ids = np.concatenate(id_parts)
        # next_ok[t]: token t+1 is a loss token of the same document as t.
        next_ok = np.concatenate(mask_parts)[1:]
        for start in accumulate(segments[:-1]):
            next_ok[start - 1] = False
        labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
        np.copyto(labels[:-1], input_ids[1:], where=next_ok)
        arange = self._arange
        position_ids = np.concatenate([arange[:n] for n in segments])
        return PackedRow(input_ids=input_ids, labels=labels, position_ids=position_ids,
                         document_lengths=segments, num_pad=num_pad, num_documents=len(parts),
                         sample_ids=owners, segment_index=[i for _, _, i, _ in parts],
                         extras=_concat_extras([x for _, _, _, x in parts], lengths, num_pad))


def _fill_value(dtype: np.dtype) -> float:
    """A side column's value where it has none: NaN (float) or the ignore index (integer)."""
    return np.nan if dtype.kind == "f" else IGNORE_INDEX


def _concat_extras(extras: list[dict[str, np.ndarray]], lengths: list[int],
                   num_pad: int) -> dict[str, np.ndarray]:
    """Each side column over consecutive documents (of `lengths`) and a pad tail, the fill value
    where a document lacks the column."""
    dtypes: dict[str, np.dtype] = {}
    for x in extras:
        for k, v in x.items():
            dtypes.setdefault(k, v.dtype)
    out = {}
    for k in sorted(dtypes):
        dt = dtypes[k]
        pieces = [x[k] if k in x else np.full(n, _fill_value(dt), dt)
                  for x, n in zip(extras, lengths)]
        if num_pad:
            pieces.append(np.full(num_pad, _fill_value(dt), dt))
        out[k] = np.concatenate(pieces)
    return out


@dataclass(frozen=True)
class _Snapshot:
    """A cheap, immutable capture of a Packer's state; turned into JSON only when asked."""

    upstream: dict[str, Any]
    pending: tuple[_Pending, ...]
    next_seq: int
    stats: dict[str, int]
    config: dict[str, Any]

    def to_state(self) -> dict[str, Any]:
        pending = self.pending
        if pending:
            ids = np.concatenate([p.ids for p in pending]).tolist()
            mask = np.concatenate([p.mask for p in pending]).astype(np.uint8).tolist()
        else:
            ids, mask = [], []
        extras = _concat_extras([p.extras for p in pending], [p.length for p in pending], 0)
        buffer = {"extras": {k: {"dtype": v.dtype.str, "values": v.tolist()}
                             for k, v in extras.items()}} if extras else {}
        return {
            "version": _STATE_VERSION,
            "config": dict(self.config),
            "upstream": copy.deepcopy(self.upstream),
            "next_seq": self.next_seq,
            "stats": dict(self.stats),
            "buffer": {
                "seq": [p.seq for p in pending],
                "sample_id": [p.sample_id for p in pending],
                "length": [p.length for p in pending],
                "segments": [list(p.segments) if p.segments else None for p in pending],
                "input_ids": ids,
                "loss_mask": mask,
                **buffer,
            },
        }


class Packer:
    """Packs a stateful stream of `Sample` into `PackedRow`s, synchronously (see module doc).

    ``stats`` counts samples and tokens: at any time ``samples_in == samples_packed +
    samples_dropped + (samples waiting in the buffer)``; truncated samples are packed and also
    counted in ``samples_truncated``.
    """

    def __init__(self, samples: StatefulIterable[Sample], cfg: PackingConfig):
        self.cfg = cfg
        self._upstream = samples
        self._upstream_iter: Iterator[Sample] | None = None
        self._upstream_done = False
        self._keys: list[int] = []           # sorted ascending; parallel to _pending
        self._pending: list[_Pending] = []
        self._next_seq = 0
        self._stats = dict.fromkeys(STATS_KEYS, 0)
        self._builder = _RowBuilder(cfg)

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def __iter__(self) -> Iterator[PackedRow]:
        if self._upstream_iter is None:
            self._upstream_iter = iter(self._upstream)
        while True:
            self._refill()
            if not self._keys:
                return
            yield self._next_row()

    def _refill(self) -> None:
        want = self.cfg.buffer_samples - len(self._keys)
        if want <= 0 or self._upstream_done:
            return
        cfg, stats, keys, pending = self.cfg, self._stats, self._keys, self._pending
        for sample in self._upstream_iter:
            p = _admit(sample, cfg, stats, self._next_seq)
            self._next_seq += 1
            if p is None:
                continue
            key = p.key
            i = bisect_left(keys, key)
            keys.insert(i, key)
            pending.insert(i, p)
            want -= 1
            if want == 0:
                return
        self._upstream_done = True

    def _next_row(self) -> PackedRow:
        keys, pending = self._keys, self._pending
        keys.pop()
        docs = [pending.pop()]
        room = self.cfg.max_tokens_per_pack - docs[0].length
        hi = len(keys)
        while room > 0 and hi > 0:
            # Keys below (room + 1) << _SEQ_BITS are exactly the samples of length <= room;
            # the one just below the bound is the longest, earliest. The room only shrinks, so
            # the next search can stop where this one ended.
            i = bisect_left(keys, (room + 1) << _SEQ_BITS, 0, hi) - 1
            if i < 0:
                break
            keys.pop(i)
            doc = pending.pop(i)
            docs.append(doc)
            room -= doc.length
            hi = i
        row = self._builder.build(docs, self.cfg.max_tokens_per_pack)
        stats = self._stats
        stats["samples_packed"] += len(docs)
        stats["real_tokens_out"] += self.cfg.max_tokens_per_pack - row.num_pad
        stats["pad_tokens_out"] += row.num_pad
        stats["rows_out"] += 1
        return row

    def _config_state(self) -> dict[str, Any]:
        c = self.cfg
        return {"max_tokens_per_pack": c.max_tokens_per_pack, "buffer_samples": c.buffer_samples,
                "overlong": c.overlong, "pad_token_id": c.pad_token_id}

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(upstream=self._upstream.state_dict(), pending=tuple(self._pending),
                         next_seq=self._next_seq, stats=dict(self._stats),
                         config=self._config_state())

    def state_dict(self) -> dict[str, Any]:
        """Upstream position, buffered samples and stats; JSON-serializable."""
        return self._snapshot().to_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()`; call on a fresh Packer before iterating."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"Packer state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}; it was written by another posttrain version")
        self._check_config(state["config"])
        self._upstream.load_state_dict(state["upstream"])
        self._upstream_iter = None
        self._upstream_done = False
        self._next_seq = int(state["next_seq"])
        self._stats = {k: int(state["stats"][k]) for k in STATS_KEYS}
        buf = state["buffer"]
        ids = np.asarray(buf["input_ids"], dtype=np.int32)
        mask = np.asarray(buf["loss_mask"], dtype=np.uint8).astype(np.bool_)
        ends = list(accumulate(buf["length"]))
        starts = [0] + ends[:-1]
        segments = buf.get("segments") or [None] * len(starts)
        extras = {k: np.asarray(x["values"], dtype=np.dtype(x["dtype"]))
                  for k, x in (buf.get("extras") or {}).items()}
        restored = sorted((_Pending(ids[s:e], mask[s:e], sid, seq, tuple(seg) if seg else None,
                                    {k: v[s:e] for k, v in extras.items()})
                           for s, e, sid, seq, seg in zip(starts, ends, buf["sample_id"],
                                                          buf["seq"], segments)),
                          key=lambda p: p.key)
        self._pending = restored
        self._keys = [p.key for p in restored]

    def _check_config(self, saved: dict[str, Any]) -> None:
        current = self._config_state()
        for name in ("max_tokens_per_pack", "overlong", "pad_token_id"):
            if saved[name] != current[name]:
                raise ConfigError(f"PackingConfig.{name}: the checkpoint was packed with "
                                  f"{saved[name]!r}, the config now says {current[name]!r}; "
                                  f"restore the old value to resume this run")
        if saved["buffer_samples"] != current["buffer_samples"]:
            warnings.warn(f"PackingConfig.buffer_samples changed from {saved['buffer_samples']} "
                          f"to {current['buffer_samples']}; the resumed rows will differ from an "
                          f"uninterrupted run", stacklevel=3)


_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class AsyncPacker:
    """A `Packer` running in a background thread, so packing overlaps the training step.

    Up to ``prefetch_rows`` rows wait in a bounded queue; each carries the packer state taken
    right after it was built, and ``state_dict()`` returns the state attached to the last row
    handed to the consumer. An exception in the thread is re-raised in the consumer. Call
    `close()` (or use it as a context manager) to stop the thread early.
    """

    def __init__(self, samples: StatefulIterable[Sample], cfg: PackingConfig):
        self.cfg = cfg
        self._packer = Packer(samples, cfg)
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.prefetch_rows)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumed: _Snapshot | None = None   # state after the last row the consumer got
        self._closed = False

    @property
    def stats(self) -> dict[str, int]:
        snap = self._consumed
        return dict(snap.stats) if snap is not None else self._packer.stats

    def __iter__(self) -> Iterator[PackedRow]:
        if self._closed:
            raise RuntimeError("AsyncPacker: iterated after close()")
        if self._thread is None:
            self._start()
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                self.close()
                raise item.exc
            row, self._consumed = item
            yield row

    def _start(self) -> None:
        self._consumed = self._packer._snapshot()
        self._thread = threading.Thread(target=self._produce, name="posttrain-packer",
                                        daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        packer = self._packer
        try:
            for row in packer:
                if not self._put((row, packer._snapshot())):
                    return
            self._put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, not swallowed
            self._put(_Failure(exc))

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def state_dict(self) -> dict[str, Any]:
        """The state after the last row the consumer received; JSON-serializable."""
        snap = self._consumed if self._thread is not None else self._packer._snapshot()
        return snap.to_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` (of a Packer or AsyncPacker) before iterating."""
        if self._thread is not None:
            raise RuntimeError("AsyncPacker.load_state_dict: call it before iterating")
        self._packer.load_state_dict(state)

    def close(self) -> None:
        """Stop the background thread; rows still queued are discarded."""
        self._closed = True
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        while thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)

    def __enter__(self) -> AsyncPacker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pad_rows(samples: Iterable[Sample], cfg: PackingConfig,
             rows_per_batch: int) -> Iterator[PackedRow]:
    """Padded-batch mode, for comparison: one sample per row, padded to its batch's longest.

    Batches are ``rows_per_batch`` consecutive kept samples (the last one may be smaller); a
    sample with ``segment_lengths`` gives one row per segment, in order, in the same batch.
    Over-long and empty samples are handled as in `Packer`. Rows follow the packed-row
    conventions, with one document and possibly a pad segment.
    """
    if rows_per_batch < 1:
        raise ConfigError(f"pad_rows: rows_per_batch must be positive, got {rows_per_batch}")
    builder = _RowBuilder(cfg)
    stats = dict.fromkeys(STATS_KEYS, 0)
    batch: list[_Pending] = []
    for seq, sample in enumerate(samples):
        p = _admit(sample, cfg, stats, seq)
        if p is not None:
            batch.append(p)
        if len(batch) == rows_per_batch:
            yield from _padded_batch(batch, builder)
            batch = []
    if batch:
        yield from _padded_batch(batch, builder)


def _padded_batch(batch: list[_Pending], builder: _RowBuilder) -> Iterator[PackedRow]:
    docs = [(p, ids, mask, i, x) for p in batch for ids, mask, i, x in p.documents()]
    width = max(len(ids) for _, ids, _, _, _ in docs)
    for p, ids, mask, i, x in docs:
        row = builder.build([_Pending(ids, mask, p.sample_id, p.seq, extras=x)], width)
        row.segment_index = [i]
        yield row


def collate(rows: list[PackedRow]) -> dict[str, Any]:
    """Stack rows of equal length into a batch.

    Returns ``input_ids``, ``labels``, ``position_ids`` as int64 tensors [B, L],
    ``document_lengths`` (list of per-row segment lengths, pad segment included),
    ``row_num_pad`` (per row, the length of its trailing pad segment, 0 if none), and the
    counts ``num_documents``, ``num_pad_tokens``, ``num_real_tokens`` and ``num_loss_tokens``
    (labels != -100; the normalizer of a token-mean loss) as ints; and each side column of the
    rows (module docstring) as a [B, L] tensor under its name.
    """
    if not rows:
        raise ValueError("collate: got no rows")
    widths = {r.input_ids.shape[0] for r in rows}
    if len(widths) != 1:
        raise ValueError(f"collate: rows have different lengths {sorted(widths)}; pack them or "
                         f"pad them to one length first")
    (width,) = widths
    labels = np.stack([r.labels for r in rows])
    num_pad = sum(r.num_pad for r in rows)
    batch = {
        "input_ids": torch.from_numpy(np.stack([r.input_ids for r in rows]).astype(np.int64)),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(np.stack([r.position_ids for r in rows])),
        "document_lengths": [list(r.document_lengths) for r in rows],
        "row_num_pad": [r.num_pad for r in rows],
        "num_documents": sum(r.num_documents for r in rows),
        "num_pad_tokens": num_pad,
        "num_real_tokens": len(rows) * width - num_pad,
        "num_loss_tokens": int(np.count_nonzero(labels != IGNORE_INDEX)),
    }
    extras = [r.extras for r in rows]
    names = sorted({k for x in extras for k in x})
    for k in names:
        assert k not in batch, f"side column {k!r} shadows a batch field"
        dt = next(x[k].dtype for x in extras if k in x)
        batch[k] = torch.from_numpy(np.stack(
            [x[k] if k in x else np.full(width, _fill_value(dt), dt) for x in extras]))
    return batch
