"""Offline teacher signal: top-k teacher log-probs stored beside the prepared shards, and the
loader that packs them with their rows.

Layout (written once by `steps/teacher_topk.py`)::

    <prepared>/teacher_topk/manifest.json          k, teacher, prepared content hash, files
    <prepared>/teacher_topk/<source>/part-00000.parquet   one per prepared train shard

Each row is a prepared row (`input_ids`, `loss_mask`) plus `topk_ids` (int32) and `topk_logps`
(float32), flat lists of ``m * k`` values: for each of the row's m label positions t (those
with ``loss_mask[t + 1] == 1``, in order) the teacher's k most likely next tokens and their
log-probs at temperature 1.

`TopkLoader` is the distillation worker's own loader over these rows (the SFT loader's samples
carry ids and masks only): rows -> seeded shuffle buffer -> `Packer` (best fit, the SFT row
conventions) -> batches with ``teacher_topk_ids`` / ``teacher_topk_logps`` [B, L, k] aligned
with ``labels`` (zeros where a label is -100). The packer sees each sample with a running
`sample_id`; the top-k of samples read but not yet packed into a handed-out row wait in a table
keyed by it; the loader state names those rows by (file, row number) and a restored loader
reads them again, so it continues bit for bit. It reads all train sources as one stream (no
mixer weights) and packs in the calling thread.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pyarrow.parquet as pq
import torch

from posttrain.data.loader import LoaderConfig
from posttrain.data.packing import IGNORE_INDEX, Packer, PackedRow, Sample, collate
from posttrain.data.sources import RowStream
from posttrain.data.stream import StatefulIterable
from posttrain.errors import DataError

TOPK_DIR = "teacher_topk"


def read_topk_manifest(prepared_dir: str) -> dict | None:
    """The top-k manifest under `prepared_dir`, or None when there is none."""
    fs, root = fsspec.core.url_to_fs(prepared_dir)
    path = f"{root.rstrip('/')}/{TOPK_DIR}/manifest.json"
    if not fs.exists(path):
        return None
    with fs.open(path) as f:
        return json.load(f)


def topk_files(prepared_dir: str) -> list[str]:
    """The top-k Parquet files of the train split, in the prepared manifest's order."""
    manifest = read_topk_manifest(prepared_dir)
    if manifest is None:
        raise DataError(f"no {TOPK_DIR}/manifest.json in {prepared_dir}: run "
                        f"`python -m steps.teacher_topk` first (teacher.signal: offline)",
                        file=f"{prepared_dir}/{TOPK_DIR}/manifest.json")
    return [f for s in manifest["sources"] for f in s["files"]]


def label_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions t whose next token is a loss token: where a row's label is not -100."""
    return np.flatnonzero(np.asarray(loss_mask[1:], dtype=bool))


class _TopkSamples(StatefulIterable[Sample]):
    """Top-k rows over `epochs` passes, shuffled in a seeded buffer, as packer samples.

    The state refers to the rows waiting in the shuffle buffer and the top-k table by (file,
    row number) and reads them again on restore, so it stays small whatever k and the buffers.
    """

    def __init__(self, files: list[str], *, epochs: int, shuffle: int, seed: int):
        self.files, self.epochs, self.shuffle = files, epochs, shuffle
        self._index = {f: i for i, f in enumerate(files)}
        self._epoch = 0
        self._rows = RowStream(files, fmt="parquet")
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._buffer: list[_Row] = []
        self._next_id = 0
        self.table: dict[int, _Row] = {}        # sample id -> row, until packed into a batch

    def _read(self) -> Iterator[_Row]:
        while self._epoch < self.epochs:
            for raw in self._rows:
                if raw.error is not None:
                    raise raw.error
                row = _Row.parse(raw.data, (self._index[raw.file], raw.line), self._next_id,
                                 raw.file)
                self._next_id += 1
                self.table[row.sid] = row
                yield row
            self._epoch += 1
            self._rows = RowStream(self.files, fmt="parquet")

    def __iter__(self) -> Iterator[Sample]:
        for row in self._read():
            if len(self._buffer) < self.shuffle:
                self._buffer.append(row)
                continue
            if self.shuffle:
                i = int(self._rng.integers(len(self._buffer)))
                row, self._buffer[i] = self._buffer[i], row
            yield row.sample()
        while self._buffer:
            i = int(self._rng.integers(len(self._buffer)))
            self._buffer[i], self._buffer[-1] = self._buffer[-1], self._buffer[i]
            yield self._buffer.pop().sample()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "rows": self._rows.state_dict(),
                "rng": self._rng.bit_generator.state, "next_id": self._next_id,
                "buffer": [r.sid for r in self._buffer],
                "table": [[r.sid, *r.where] for r in self.table.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state["epoch"])
        self._rows = RowStream(self.files, fmt="parquet")
        self._rows.load_state_dict(state["rows"])
        self._rng.bit_generator.state = state["rng"]
        self._next_id = int(state["next_id"])
        by_file: dict[int, list[tuple[int, int]]] = {}
        for sid, file_index, line in state["table"]:
            by_file.setdefault(int(file_index), []).append((int(sid), int(line)))
        self.table = {}
        for file_index, wanted in sorted(by_file.items()):
            with fsspec.open(self.files[file_index], "rb") as f:
                data = pq.read_table(f).to_pylist()
            for sid, line in wanted:
                self.table[sid] = _Row.parse(data[line - 1], (file_index, line), sid,
                                             self.files[file_index])
        self._buffer = [self.table[int(sid)] for sid in state["buffer"]]


class _Row:
    """One top-k row: the packer's sample and the teacher's [m, k] ids and log-probs."""

    __slots__ = ("ids", "mask", "top_ids", "top_logps", "sid", "where")

    def __init__(self, ids: np.ndarray, mask: np.ndarray, top_ids: np.ndarray,
                 top_logps: np.ndarray, sid: int, where: tuple[int, int]):
        self.ids, self.mask, self.top_ids, self.top_logps = ids, mask, top_ids, top_logps
        self.sid, self.where = sid, where

    @classmethod
    def parse(cls, data: dict, where: tuple[int, int], sid: int, file: str) -> "_Row":
        ids = np.asarray(data["input_ids"], np.int32)
        mask = np.asarray(data["loss_mask"], np.uint8)
        m = len(label_positions(mask))
        top_ids = np.asarray(data["topk_ids"], np.int32)
        top_logps = np.asarray(data["topk_logps"], np.float32)
        if top_ids.shape != top_logps.shape or (top_ids.size % m if m else top_ids.size):
            raise DataError(f"top-k row has {top_ids.size} ids / {top_logps.size} log-probs "
                            f"for {m} label positions; rerun steps/teacher_topk.py",
                            file=file, line=where[1])
        k = top_ids.size // m if m else 1
        return cls(ids, mask, top_ids.reshape(m, k), top_logps.reshape(m, k), sid, where)

    def sample(self) -> Sample:
        return Sample(self.ids, self.mask, sample_id=self.sid)


class TopkLoader(StatefulIterable[dict]):
    """Packed batches of top-k rows with their teacher tensors (see the module docstring)."""

    def __init__(self, files: list[str], cfg: LoaderConfig):
        if not files:
            raise DataError("no teacher top-k files to read")
        self.cfg = cfg
        self._samples = _TopkSamples(files, epochs=cfg.epochs, shuffle=cfg.shuffle_buffer_samples,
                                     seed=cfg.seed)
        self._packer = Packer(self._samples, cfg.packing)
        self.batches_out = 0

    def __iter__(self) -> Iterator[dict]:
        rows = iter(self._packer)
        while True:
            batch = [r for _, r in zip(range(self.cfg.rows_per_batch), rows)]
            if not batch:
                return
            out = collate(batch)
            out["teacher_topk_ids"], out["teacher_topk_logps"] = self._topk(batch)
            self.batches_out += 1
            yield out

    def _topk(self, rows: list[PackedRow]) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._samples.table
        k = next((table[s].top_ids.shape[1] for r in rows for s in r.sample_ids
                  if table[s].top_ids.shape[0]), 1)
        width = rows[0].input_ids.shape[0]
        ids = np.zeros((len(rows), width, k), np.int64)
        logps = np.zeros((len(rows), width, k), np.float32)
        for b, row in enumerate(rows):
            start = 0
            for length, sid in zip(row.document_lengths, row.sample_ids + [None]):
                if sid is not None:
                    entry = table.pop(sid)
                    top_ids, top_logps = entry.top_ids, entry.top_logps
                    pos = start + np.flatnonzero(row.labels[start:start + length] != IGNORE_INDEX)
                    # truncation by the packer can only drop trailing label positions
                    assert len(pos) <= top_ids.shape[0], "top-k rows are missing positions"
                    ids[b, pos] = top_ids[:len(pos)]
                    logps[b, pos] = top_logps[:len(pos)]
                start += length
        return torch.from_numpy(ids), torch.from_numpy(logps)

    def state_dict(self) -> dict[str, Any]:
        return {"batches_out": self.batches_out, "rows": self._packer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches_out = int(state["batches_out"])
        self._packer.load_state_dict(state["rows"])

    def close(self) -> None:
        self._samples._rows.close()
