"""Rows of tokens with document boundaries: what `posttrain.data.packing.Packer` emits and a
loss reads, built from admitted samples (`RowBuilder`), padded one sample per row for
comparison (`pad_rows`), and stacked into a batch (`collate`).

Row conventions (the same for packed rows and, via `pad_rows`, padded rows):

* ``input_ids[L]`` int32; the pad tail holds ``pad_token_id``.
* ``labels[L]`` int64, already shifted: ``labels[t] = input_ids[t+1]`` when ``t+1`` lies in the
  same document and ``loss_mask[t+1] == 1``, else ``-100`` (`IGNORE_INDEX`). Hence the last
  token of every document and every pad position is ``-100``; a loss never crosses documents.
* ``position_ids[L]`` int64, restarting at 0 at each document; the pad tail restarts at 0 too.
* ``document_lengths``: segment lengths in order, summing to ``L``; a pad tail is its own
  trailing segment (``num_pad`` > 0), not counted in ``num_documents``.

Multi-document samples: a `Sample` with ``segment_lengths`` (e.g. the chosen and the rejected
sequence of a preference pair) is one unit of several documents, never split and never
truncated (an over-long unit is dropped: a cut pair would compare a response with a fragment);
inside a row each segment is its own document for labels, position ids and
``document_lengths``. ``PackedRow.segment_index`` says which segment of its sample each
document is (0 for ordinary samples). `pad_rows` puts each segment of a unit in its own row, in
order, within the same batch.

Per-token side columns: a `Sample` may carry ``extras``, named arrays aligned with its tokens
(e.g. the labels of extra output heads, one value per event). They travel with their tokens
through truncation and packing; a row holds each column over its documents (``PackedRow.extras``,
``[L]`` each, and a ``[B, L]`` tensor of that name in a collated batch), with a fill value where
there is none: on the pad tail and in a document without that column (NaN for float columns,
-100 for integer ones). They are not shifted: position t holds token t's value.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from posttrain.config.data import PackingConfig
from posttrain.errors import ConfigError, DataError

__all__ = ["IGNORE_INDEX", "STATS_KEYS", "PackedRow", "Pending", "RowBuilder", "Sample", "admit",
           "collate", "concat_extras", "pad_rows"]

IGNORE_INDEX = -100
STATS_KEYS = ("samples_in", "samples_packed", "samples_truncated", "samples_dropped",
              "tokens_in", "real_tokens_out", "pad_tokens_out", "rows_out")


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


class Pending:
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


def admit(sample: Sample, cfg: PackingConfig, stats: dict[str, int], seq: int) -> Pending | None:
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
    return Pending(ids, mask, sample.sample_id, seq, segments, extras)


def _check_segments(sample: Sample, n: int) -> tuple[int, ...] | None:
    if sample.segment_lengths is None:
        return None
    segments = tuple(int(x) for x in sample.segment_lengths)
    if not segments or min(segments) < 1 or sum(segments) != n:
        raise DataError(f"sample {sample.sample_id}: segment_lengths {list(segments)} must be "
                        f"positive and sum to the sample's {n} tokens",
                        field="segment_lengths", reason="mask_length")
    return segments


class RowBuilder:
    """Turns a list of documents into one row's arrays with numpy; no per-token Python loops."""

    def __init__(self, cfg: PackingConfig):
        self._arange = np.arange(cfg.max_tokens_per_pack, dtype=np.int64)
        self._pad_ids = np.full(cfg.max_tokens_per_pack, cfg.pad_token_id, dtype=np.int32)
        self._no_loss = np.zeros(cfg.max_tokens_per_pack, dtype=np.bool_)

    def build(self, docs: list[Pending], length: int) -> PackedRow:
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
                         extras=concat_extras([x for _, _, _, x in parts], lengths, num_pad))


def _fill_value(dtype: np.dtype) -> float:
    """A side column's value where it has none: NaN (float) or the ignore index (integer)."""
    return np.nan if dtype.kind == "f" else IGNORE_INDEX


def concat_extras(extras: list[dict[str, np.ndarray]], lengths: list[int],
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
    builder = RowBuilder(cfg)
    stats = dict.fromkeys(STATS_KEYS, 0)
    batch: list[Pending] = []
    for seq, sample in enumerate(samples):
        p = admit(sample, cfg, stats, seq)
        if p is not None:
            batch.append(p)
        if len(batch) == rows_per_batch:
            yield from _padded_batch(batch, builder)
            batch = []
    if batch:
        yield from _padded_batch(batch, builder)


def _padded_batch(batch: list[Pending], builder: RowBuilder) -> Iterator[PackedRow]:
    docs = [(p, ids, mask, i, x) for p in batch for ids, mask, i, x in p.documents()]
    width = max(len(ids) for _, ids, _, _, _ in docs)
    for p, ids, mask, i, x in docs:
        row = builder.build([Pending(ids, mask, p.sample_id, p.seq, extras=x)], width)
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
