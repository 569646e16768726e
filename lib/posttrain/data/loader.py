"""The training-side data pipeline: tokenized shards -> (shuffle) -> mixer -> packer -> batches.

    per source: ShardSamples (this rank's share of the Parquet shards, `epochs` passes)
                  -> ShuffleBuffer (seeded, bounded)
    sources   -> Mixer (weighted, seeded)
              -> AsyncPacker (best fit, background thread)   or  padded batches
              -> collate(rows_per_batch rows) -> batch dict of tensors

Every stage follows `posttrain.data.stream.StatefulIterable`; `TrainLoader.state_dict()` is the
position after the last batch handed out, and a loader built the same way and restored with
`load_state_dict` yields exactly the batches an uninterrupted one would.

Preference mode (``format: preference``, shards with chosen_/rejected_ columns): each pair is
one `Sample` of two documents (chosen, then rejected; `Sample.segment_lengths`) that the packer
keeps together, and every batch also holds

* ``sequence_ids`` [B, T] and ``pair_index`` [P, 2], as `posttrain.losses.dpo` defines them;
* ``pair_keys``: per pair, a stable id of its shard row (`pair_key`), to look up values
  computed for the pair beforehand (reference log-probs); ``num_pairs``.

In padded mode a batch holds ``rows_per_batch`` pairs, each side in its own row (2 x rows).

Unpaired mode (``format: unpaired``, shards of single completions with a ``desirable`` column,
for KTO): each completion is one `Sample` whose label rides along as a per-token side column
(so the shuffle buffer and the packer keep it with its tokens and in their states), and every
batch holds ``sequence_ids`` [B, T], ``desirable`` [S] bool (the label of each sequence, in
`sequence_ids` order), ``completion_keys`` (per sequence, its shard row's `pair_key`) and
``num_completions``.

Label columns: sequence shards may hold per-token columns named ``label_<name>`` (the labels of
extra output heads, written by `posttrain.data.events`); each travels with its tokens as a side
column of the packer (`posttrain.data.packing`) and reaches the batch as a [B, T] tensor of that
name (int64 with -100, or float32 with NaN, where there is no label).

Ranks and loader workers: shard k of ``num_ranks * num_workers`` (k = rank * num_workers +
worker) reads the files (or rows) that `posttrain.data.sources.RowStream` assigns to it. A saved
state belongs to one (rank, world size) pair; it is restored on the same layout.

Streams (`StreamLoader`, ``streams: S > 1``): the training data is S independent streams,
stream s reading shard s of S of every source and packing it on its own, and global micro-batch
i of the run comes from stream i mod S. A data-parallel rank r of D (D dividing S) opens only
streams r, r + D, ..., so it reads and packs 1/D of the data; the global order does not depend
on D, and the per-stream states restore on any D that divides S.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch

from posttrain.config.data import LoaderConfig
from posttrain.data.events import LABEL_PREFIX
from posttrain.data.mixer import Mixer
from posttrain.data.packing import AsyncPacker, Packer, Sample, collate, pad_rows
from posttrain.data.sources import RowStream, shard_for
from posttrain.data.stream import StatefulIterable, as_state, capture
from posttrain.errors import ConfigError, DataError
from posttrain.losses.dpo import sequence_ids

DESIRABLE = "desirable"       # the label of an unpaired completion: a side column, then [S]


class ShardSamples(StatefulIterable[Sample]):
    """Samples from tokenized shards written by `steps/prepare.py`, over `epochs` passes."""

    def __init__(self, files: list[str], *, shard_index: int = 0, num_shards: int = 1,
                 epochs: int = 1, storage_options: dict | None = None,
                 preference: bool = False, source_index: int = 0, unpaired: bool = False):
        if not files:
            raise DataError("no tokenized shards to read")
        self.files = files
        self.preference, self.source_index = preference, source_index
        self.unpaired = unpaired
        self._file_index = {f: i for i, f in enumerate(files)}
        self.shard_index, self.num_shards = shard_index, num_shards
        self.epochs = epochs
        self.storage_options = storage_options
        self._epoch = 0
        self._rows = self._stream()

    def _stream(self) -> RowStream:
        return RowStream(self.files, fmt="parquet", shard_index=self.shard_index,
                         num_shards=self.num_shards, storage_options=self.storage_options)

    def __iter__(self) -> Iterator[Sample]:
        while self._epoch < self.epochs:
            for raw in self._rows:
                if raw.error is not None:
                    raise raw.error
                data = raw.data
                if self.preference:
                    yield self._pair(data, raw.file, raw.line)
                    continue
                if self.unpaired:
                    yield self._completion(data, raw.file, raw.line)
                    continue
                yield Sample(np.asarray(data["input_ids"], np.int32),
                             np.asarray(data["loss_mask"], np.uint8),
                             extras=label_columns(data))
            self._epoch += 1
            self._rows = self._stream()

    def _pair(self, data: dict, file: str, row: int) -> Sample:
        if "chosen_input_ids" not in data:
            raise DataError("loader format 'preference' needs shards with chosen_input_ids / "
                            "rejected_input_ids; prepare the data with data.format: "
                            "preference", file=file, line=row, field="chosen_input_ids")
        chosen = np.asarray(data["chosen_input_ids"], np.int32)
        rejected = np.asarray(data["rejected_input_ids"], np.int32)
        mask = np.concatenate([np.asarray(data["chosen_loss_mask"], np.uint8),
                               np.asarray(data["rejected_loss_mask"], np.uint8)])
        return Sample(np.concatenate([chosen, rejected]), mask,
                      sample_id=pair_key(self.source_index, self._file_index[file], row),
                      segment_lengths=(len(chosen), len(rejected)))

    def _completion(self, data: dict, file: str, row: int) -> Sample:
        if "desirable" not in data:
            raise DataError("loader format 'unpaired' needs shards with a desirable column; "
                            "prepare the data with data.format: unpaired", file=file,
                            line=row, field="desirable")
        ids = np.asarray(data["input_ids"], np.int32)
        return Sample(ids, np.asarray(data["loss_mask"], np.uint8),
                      sample_id=pair_key(self.source_index, self._file_index[file], row),
                      extras={DESIRABLE: np.full(len(ids), int(data["desirable"]), np.int64)})

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "rows": self._rows.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state["epoch"])
        self._rows = self._stream()
        self._rows.load_state_dict(state["rows"])


def label_columns(row: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The ``label_<name>`` columns of a shard row as side columns (module docstring)."""
    out = {}
    for k, v in row.items():
        if k.startswith(LABEL_PREFIX):
            a = np.asarray(v)
            out[k] = a.astype(np.float32 if a.dtype.kind == "f" else np.int64)
    return out or None


class ShuffleBuffer(StatefulIterable[Sample]):
    """Seeded shuffle over a bounded buffer: fill to `size`, then emit a random slot per input.

    The state holds the buffer's samples, the generator state and the upstream position, so a
    restored buffer continues bit for bit.
    """

    def __init__(self, upstream: StatefulIterable[Sample], size: int, seed: int):
        self.upstream, self.size = upstream, size
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._buffer: list[Sample] = []

    def __iter__(self) -> Iterator[Sample]:
        for sample in self.upstream:
            if len(self._buffer) < self.size:
                self._buffer.append(sample)
                continue
            i = int(self._rng.integers(len(self._buffer)))
            out, self._buffer[i] = self._buffer[i], sample
            yield out
        while self._buffer:
            i = int(self._rng.integers(len(self._buffer)))
            self._buffer[i], self._buffer[-1] = self._buffer[-1], self._buffer[i]
            yield self._buffer.pop()

    def capture(self) -> _BufferCapture:
        """The state by reference: the buffered samples, whose arrays nothing writes to, are
        turned into lists only by `to_state` (`posttrain.data.stream.capture`)."""
        return _BufferCapture(capture(self.upstream), self._rng.bit_generator.state,
                              tuple(self._buffer))

    def state_dict(self) -> dict[str, Any]:
        return self.capture().to_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.upstream.load_state_dict(state["upstream"])
        self._rng.bit_generator.state = state["rng"]
        self._buffer = [_sample_from_state(entry) for entry in state["buffer"]]


@dataclass(frozen=True)
class _BufferCapture:
    upstream: Any
    rng: dict[str, Any]
    buffer: tuple[Sample, ...]

    def to_state(self) -> dict[str, Any]:
        return {"upstream": as_state(self.upstream), "rng": copy.deepcopy(self.rng),
                "buffer": [[s.input_ids.tolist(), s.loss_mask.tolist(), s.sample_id,
                            list(s.segment_lengths) if s.segment_lengths else None,
                            *([{k: [v.dtype.str, v.tolist()] for k, v in s.extras.items()}]
                              if s.extras else [])]
                           for s in self.buffer]}


def _sample_from_state(entry: list) -> Sample:
    """[ids, mask, sample_id, segment_lengths(, side columns)]; states written before pairs hold
    [ids, mask]."""
    ids, mask, *rest = entry
    sample_id, segments, extras = (rest + [None, None, None])[:3]
    return Sample(np.asarray(ids, np.int32), np.asarray(mask, np.uint8), sample_id,
                  tuple(segments) if segments else None,
                  {k: np.asarray(v, dtype=np.dtype(dt)) for k, (dt, v) in extras.items()}
                  if extras else None)


class _PaddedBatches:
    """Padded-batch mode (for comparison): `rows_per_batch` consecutive samples per batch."""

    def __init__(self, samples: StatefulIterable[Sample], cfg: LoaderConfig):
        self.samples, self.cfg = samples, cfg

    def batches(self) -> Iterator[list]:
        it = iter(self.samples)
        while True:
            chunk = [s for _, s in zip(range(self.cfg.rows_per_batch), it)]
            if not chunk:
                return
            rows = list(pad_rows(chunk, self.cfg.packing, self.cfg.rows_per_batch))
            if rows:
                yield rows

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples.load_state_dict(state["samples"])

    def close(self) -> None:
        pass


class TrainLoader(StatefulIterable[dict]):
    """Batches for one rank (and loader worker) from named sources of tokenized shards."""

    def __init__(self, sources: dict[str, list[str]], cfg: LoaderConfig, *, rank: int = 0,
                 world_size: int = 1, worker_id: int = 0, num_workers: int = 1,
                 storage_options: dict | None = None):
        unknown = set(cfg.weights) - set(sources)
        if unknown:
            raise ConfigError(f"loader.weights names unknown source(s) {sorted(unknown)}; "
                              f"sources are {sorted(sources)}")
        self.cfg = cfg
        shard_index, num_shards = shard_for(rank, world_size, worker_id, num_workers)
        streams: dict[str, StatefulIterable[Sample]] = {}
        self._shards: list[ShardSamples] = []
        for i, (name, files) in enumerate(sorted(sources.items())):
            shard = ShardSamples(
                files, shard_index=shard_index, num_shards=num_shards, epochs=cfg.epochs,
                storage_options=storage_options, preference=cfg.format == "preference",
                source_index=i, unpaired=cfg.format == "unpaired")
            self._shards.append(shard)
            s: StatefulIterable[Sample] = shard
            if cfg.shuffle_buffer_samples:
                s = ShuffleBuffer(s, cfg.shuffle_buffer_samples,
                                  seed=_mix_seed(cfg.seed, shard_index, i))
            streams[name] = s
        if len(streams) == 1:
            (samples,) = streams.values()
        else:
            weights = {name: cfg.weights.get(name, 1.0) for name in streams}
            samples = Mixer(streams, weights, cfg.mixer)
        if cfg.mode == "padded":
            self._rows = _PaddedBatches(samples, cfg)
        else:
            packer_cls = AsyncPacker if cfg.background else Packer
            self._rows = packer_cls(samples, cfg.packing)
        self.batches_out = 0

    def __iter__(self) -> Iterator[dict]:
        if isinstance(self._rows, _PaddedBatches):
            for rows in self._rows.batches():
                self.batches_out += 1
                yield self._collate(rows)
            return
        it = iter(self._rows)
        while True:
            rows = [r for _, r in zip(range(self.cfg.rows_per_batch), it)]
            if not rows:
                return
            self.batches_out += 1
            yield self._collate(rows)

    def _collate(self, rows: list) -> dict:
        batch = collate(rows)
        if self.cfg.format == "preference":
            batch.update(pair_fields(rows, batch))
        elif self.cfg.format == "unpaired":
            batch.update(completion_fields(rows, batch))
        return batch

    @property
    def stats(self) -> dict[str, int]:
        return dict(getattr(self._rows, "stats", {}))

    @property
    def files(self) -> list[str]:
        """The shard files this loader reads (all of a source's when it reads by rows)."""
        return [f for shard in self._shards for f in shard._rows.files]

    def state_dict(self) -> dict[str, Any]:
        return {"batches_out": self.batches_out, "rows": self._rows.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "streams" in state:
            raise ConfigError(f"the saved loader state holds streams {sorted(state['streams'])}:"
                              f" it was written with train.loader.streams > 1; resume with the "
                              f"same streams")
        self.batches_out = int(state["batches_out"])
        self._rows.load_state_dict(state["rows"])

    def close(self) -> None:
        close = getattr(self._rows, "close", None)
        if close:
            close()

    def __enter__(self) -> "TrainLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamLoader(StatefulIterable[dict]):
    """The micro-batches of the streams `own` of `cfg.streams` (module docstring): a
    `TrainLoader` per stream, reading shard s of S of every source, yielded round-robin in
    stream order, which is the order of their global indices (batch i from stream i mod S).

    `state_dict` holds each own stream's position (``{"streams": {s: state}}``); a state
    merged from every rank's holds all S, so a loader owning any subset restores from it.
    """

    def __init__(self, sources: dict[str, list[str]], cfg: LoaderConfig, own: list[int], *,
                 storage_options: dict | None = None):
        bad = [s for s in own if not 0 <= s < cfg.streams]
        if not own or bad:
            raise ValueError(f"own streams {own} must be a non-empty subset of 0..{cfg.streams - 1}")
        self.cfg, self.own = cfg, sorted(own)
        self.loaders = {s: TrainLoader(sources, cfg, rank=s, world_size=cfg.streams,
                                       storage_options=storage_options) for s in self.own}
        self._iters: dict[int, Iterator[dict]] | None = None

    def __iter__(self) -> Iterator[dict]:
        if self._iters is None:
            self._iters = {s: iter(loader) for s, loader in self.loaders.items()}
        while True:
            for s in self.own:
                batch = next(self._iters[s], None)
                if batch is None:
                    return
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"streams": {str(s): loader.state_dict() for s, loader in self.loaders.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("streams")
        if saved is None or any(str(s) not in saved for s in self.own):
            raise ConfigError(f"the saved loader state holds streams "
                              f"{sorted(int(s) for s in (saved or {}))}, not {self.own}: it was "
                              f"written with another train.loader.streams")
        for s in self.own:
            self.loaders[s].load_state_dict(saved[str(s)])
        self._iters = None

    @property
    def files(self) -> list[str]:
        """The shard files this loader's streams read."""
        return [f for loader in self.loaders.values() for f in loader.files]

    @property
    def stats(self) -> dict[str, int]:
        """The packers' counts (samples and tokens in, packed, dropped), summed over streams."""
        out: dict[str, int] = {}
        for loader in self.loaders.values():
            for k, v in loader.stats.items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()

    def __enter__(self) -> "StreamLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pair_key(source_index: int, file_index: int, row: int) -> int:
    """A stable id of one shard row: (source, file in the source's list, 1-based row)."""
    assert source_index < 1 << 15 and file_index < 1 << 16 and row < 1 << 32
    return (source_index << 48) | (file_index << 32) | row


def pair_fields(rows: list, batch: dict) -> dict[str, Any]:
    """``sequence_ids``, ``pair_index``, ``pair_keys``, ``num_pairs`` of collated pair rows.

    Documents are numbered as `posttrain.losses.dpo.sequence_ids` does (row by row); a pair is
    a document of segment 0 followed by the segment 1 of the same sample.
    """
    owners = [(sid, seg) for r in rows for sid, seg in zip(r.sample_ids, r.segment_index)]
    pairs, keys = [], []
    for s, ((sid, seg), nxt) in enumerate(zip(owners, owners[1:])):
        if seg == 0 and nxt == (sid, 1):
            pairs.append((s, s + 1))
            keys.append(sid)
    assert 2 * len(pairs) == len(owners), "every document of a preference batch is in a pair"
    return {"sequence_ids": sequence_ids(batch["document_lengths"], batch["row_num_pad"]),
            "pair_index": torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2),
            "pair_keys": keys, "num_pairs": len(pairs)}


def completion_fields(rows: list, batch: dict) -> dict[str, Any]:
    """``sequence_ids``, ``desirable`` [S], ``completion_keys``, ``num_completions`` of
    collated completion rows (sequences numbered as `pair_fields` numbers them); replaces the
    per-token label column with the per-sequence one."""
    keys, labels = [], []
    for r in rows:
        start = 0
        for sid, length in zip(r.sample_ids, r.document_lengths):
            keys.append(sid)
            labels.append(bool(r.extras[DESIRABLE][start]))
            start += length
    return {"sequence_ids": sequence_ids(batch["document_lengths"], batch["row_num_pad"]),
            DESIRABLE: torch.tensor(labels, dtype=torch.bool), "completion_keys": keys,
            "num_completions": len(keys)}


def _mix_seed(seed: int, shard_index: int, source_index: int) -> int:
    return int(np.random.SeedSequence([seed, shard_index, source_index]).generate_state(1)[0])


def sources_from_manifest(prepared_dir: str, split: str = "train") -> dict[str, list[str]]:
    """Shard URIs per source name from a prepare manifest (`<dir>/manifest.json`)."""
    fs, root = fsspec.core.url_to_fs(prepared_dir)
    path = f"{root.rstrip('/')}/manifest.json"
    if not fs.exists(path):
        raise DataError(f"no manifest.json in {prepared_dir}: run `posttrain prepare` first",
                        file=path)
    with fs.open(path) as f:
        manifest = json.load(f)
    out = {s["name"]: [sh["uri"] for sh in s["shards"]]
           for s in manifest["sources"] if s["split"] == split and s["shards"]}
    if not out:
        raise DataError(f"the manifest has no non-empty '{split}' source", file=path)
    for source in manifest["sources"]:
        if source["split"] == split:
            for shard in source["shards"]:
                _check_shard(shard)
    return out


def _check_shard(shard: dict) -> None:
    """A shard is on disk with the size prepare wrote: a truncated or replaced one is an error
    naming it, not a short epoch (damage within a file fails its page checksums on reading)."""
    uri, want = shard["uri"], shard.get("bytes")
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise DataError("a prepared shard is missing (deleted or moved after prepare?); run "
                        "prepare again", file=uri, reason="missing_file")
    size = int(fs.size(path))
    if want is not None and size != int(want):
        raise DataError(f"the prepared shard has {size} bytes, but prepare wrote {want} "
                        f"({shard.get('rows')} rows): it was truncated or replaced after "
                        "prepare; run prepare again", file=uri, reason="shard_changed")
