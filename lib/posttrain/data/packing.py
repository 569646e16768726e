"""On-the-fly packing of tokenized samples into fixed-length rows that keep document boundaries.

Why: chat data is skewed (most samples short, a long tail), so padding each sample to its
batch's longest wastes most of the compute. Packing concatenates whole samples ("documents")
into rows of exactly ``max_tokens_per_pack`` tokens; the attention kernel and the loss see the
boundaries through ``document_lengths`` / ``position_ids`` and ``labels``, so nothing leaks
across documents.

Rows follow the conventions of `posttrain.data.rows` (labels shifted and cut at document
boundaries, position ids restarting per document, the pad tail its own segment), which also
builds them, pads samples one per row (`pad_rows`) and collates rows into a batch (`collate`).
A multi-document `Sample` (``segment_lengths``: a preference pair) is placed whole in one row,
never split nor truncated, and its per-token side columns (``extras``) travel with its tokens.

Packing algorithm: best fit over a bounded look-ahead buffer. Up to ``buffer_samples`` pending
samples are kept sorted by (length, arrival); a row starts with the longest pending sample and
is filled by repeatedly taking the longest pending sample that still fits (a bisect), until none
fits. The row is emitted and the buffer refilled. Ties go to the earliest arrival, so the output
is a pure function of the input order and the config. Samples longer than the row are truncated
(keep the first ``max_tokens_per_pack`` tokens) or dropped; empty samples are dropped; all are
counted in ``stats``.

Resume: ``state_dict()`` holds the upstream position, the pending buffer (token ids, masks and
side columns) and the stats, so a fresh `Packer` over a fresh upstream continues bit for bit.
`AsyncPacker` packs in a background thread and reports the state that belongs to the last row
the *consumer* received, not what the thread has produced ahead.
"""

from __future__ import annotations

import queue
import threading
import warnings
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from posttrain.config.data import PackingConfig
from posttrain.data.rows import (IGNORE_INDEX, STATS_KEYS, PackedRow, Pending, RowBuilder, Sample,
                                 admit, collate, concat_extras, pad_rows)
from posttrain.data.stream import StatefulIterable, as_state, capture
from posttrain.errors import ConfigError

__all__ = ["IGNORE_INDEX", "STATS_KEYS", "AsyncPacker", "PackedRow", "Packer", "PackingConfig",
           "Sample", "collate", "pad_rows"]

_STATE_VERSION = 1
# Buffer sort key = (length << _SEQ_BITS) | (_SEQ_MAX - seq): longest first, then earliest arrival.
_SEQ_BITS = 40
_SEQ_MAX = (1 << _SEQ_BITS) - 1


def _key(p: Pending) -> int:
    return (p.length << _SEQ_BITS) | (_SEQ_MAX - p.seq)


@dataclass(frozen=True)
class _Snapshot:
    """A cheap, immutable capture of a Packer's state; turned into JSON only when asked."""

    upstream: Any                   # the upstream's capture (`posttrain.data.stream.capture`)
    pending: tuple[Pending, ...]
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
        extras = concat_extras([p.extras for p in pending], [p.length for p in pending], 0)
        buffer = {"extras": {k: {"dtype": v.dtype.str, "values": v.tolist()}
                             for k, v in extras.items()}} if extras else {}
        return {
            "version": _STATE_VERSION,
            "config": dict(self.config),
            "upstream": as_state(self.upstream),
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
        self._pending: list[Pending] = []
        self._next_seq = 0
        self._stats = dict.fromkeys(STATS_KEYS, 0)
        self._builder = RowBuilder(cfg)

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
            p = admit(sample, cfg, stats, self._next_seq)
            self._next_seq += 1
            if p is None:
                continue
            key = _key(p)
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
        return _Snapshot(upstream=capture(self._upstream), pending=tuple(self._pending),
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
        restored = sorted((Pending(ids[s:e], mask[s:e], sid, seq, tuple(seg) if seg else None,
                                    {k: v[s:e] for k, v in extras.items()})
                           for s, e, sid, seq, seg in zip(starts, ends, buf["sample_id"],
                                                          buf["seq"], segments)),
                          key=_key)
        self._pending = restored
        self._keys = [_key(p) for p in restored]

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
