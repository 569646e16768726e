"""Event sequences: token ids from a vocabulary laid out by the config, no text tokenizer.

For models trained from scratch on sequences of events or items (recommendation, logs,
transactions), the vocabulary is not learned from text: it is the config's

    vocab: {num_items: 500, special: [pad, bos, eos],
            semantic_ids: {levels: 2, codes_per_level: 16}}

and ids are laid out deterministically: the special tokens first (in the listed order), then
the items, then the semantic-ID codes level-major::

    id 0 .. S-1                 <pad>, <bos>, <eos>, ...       (special: S names)
    id S .. S+N-1               item 0 .. item N-1              (num_items: N)
    id S+N + l*C + c            <sid_{l}_{c}>, level l, code c  (semantic_ids: L levels x C)

A row (``data.format: sequence``) gives the events in order, each an item id (an integer in
[0, N)) or the name of a special or semantic-ID token (``"<eos>"``, ``"<sid_0_3>"``), and
optionally per-position labels for the model's extra heads, one value per token (``null``: no
label at that position)::

    {"tokens": [17, 4, 4, 230], "labels": {"event_type": [0, 2, 2, 1],
                                           "dwell": [1.5, null, 0.25, 3.0]}}

With ``add_bos`` each sequence starts with ``<bos>`` (no label there), with ``add_eos`` it ends
with ``<eos>``. Every token but the first is a next-token target. `EventEncoder` validates a
row against the vocabulary and the configured labels (an out-of-range id, an unknown token, a
label of the wrong type or length is a `DataError` naming file, row and field; ``data.on_bad_row:
skip`` counts and skips such rows instead) and writes the shard columns: ``input_ids``,
``loss_mask``, counts, and per label ``label_<name>`` (int32 with -100, or float32 with NaN, where
there is no label), which the loader packs with their tokens (`posttrain.data.loader`).

`EventVocab` stands where a tokenizer stands in the other recipes: the prepare step records its
`describe()` as the manifest's ``tokenizer`` (``vocab_size`` included) and saves it as
``event_vocab.json`` in the prepared ``tokenizer/`` directory, from where it is copied beside the
exported checkpoint; `load_event_vocab(dir)` reads it back (both in the pure-Python
`posttrain.data.event_vocab`, which a config reads without numpy or pyarrow).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa

from posttrain.config.data import LabelConfig, VocabConfig
from posttrain.data.event_vocab import VOCAB_FILE, EventVocab, load_event_vocab
from posttrain.data.encode import EncodedRow, LengthConfig, fitted_length, schema_for
from posttrain.errors import ConfigError, DataError

__all__ = ["EventEncoder", "EventVocab", "label_column", "LABEL_PREFIX", "LabelConfig",
           "load_event_vocab", "MISSING_CLASS", "VOCAB_FILE", "VocabConfig"]

LABEL_PREFIX = "label_"          # the shard column of label `name` is label_<name>
MISSING_CLASS = -100             # the ignore index: no class label at this position
_FLOAT32_MAX = float(np.finfo(np.float32).max)   # regression labels are stored as float32


def label_column(name: str) -> str:
    return f"{LABEL_PREFIX}{name}"


class EventEncoder:
    """Validate event rows and turn them into shard columns (module docstring)."""

    def __init__(self, vocab: EventVocab, labels: dict[str, LabelConfig], lengths: LengthConfig):
        self.vocab, self.labels, self.lengths = vocab, dict(labels), lengths
        for name in self.labels:
            if not name or not name.replace("_", "").isalnum():
                raise ConfigError(f"label name {name!r}: use letters, digits and '_'")

    @property
    def schema(self) -> pa.Schema:
        base = schema_for("sequence")
        for name, spec in self.labels.items():
            kind = pa.int32() if spec.kind == "classification" else pa.float32()
            base = base.append(pa.field(label_column(name), pa.list_(kind)))
        return base

    def encode_row(self, row: Any, *, file: str | None = None,
                   line: int | None = None) -> EncodedRow:
        """One raw row -> shard columns; a `DataError` names the file, row and field."""
        def error(field: str, message: str, reason: str) -> DataError:
            return DataError(message, file=file, line=line, field=field, reason=reason)

        if not isinstance(row, dict):
            raise error("<row>", f"expected a JSON object, got {type(row).__name__}",
                        "not_an_object")
        if "tokens" not in row:
            present = ", ".join(sorted(map(str, row))) or "none"
            raise error("tokens", f"missing required field (row has: {present})",
                        "missing_field")
        tokens = row["tokens"]
        if not isinstance(tokens, list):
            raise error("tokens", f"expected a list of tokens, got {type(tokens).__name__}",
                        "wrong_type")
        if not tokens:
            raise error("tokens", "empty sequence", "empty")
        ids = [self.vocab.token_id(t, file=file, line=line, field=f"tokens[{i}]")
               for i, t in enumerate(tokens)]
        columns = self._labels(row.get("labels"), len(tokens), error)
        cfg = self.vocab.cfg
        head = [self.vocab.special_id("bos")] if cfg.add_bos else []
        tail = [self.vocab.special_id("eos")] if cfg.add_eos else []
        ids = head + ids + tail
        mask = [0] * len(head) + [1] * (len(ids) - len(head))
        keep = fitted_length(len(ids), self.lengths, file, line, "tokens")
        out: dict[str, Any] = {"input_ids": np.asarray(ids[:keep], np.int32),
                               "loss_mask": np.asarray(mask[:keep], np.int8)}
        for name, values in columns.items():
            fill = np.nan if values.dtype.kind == "f" else MISSING_CLASS
            out[label_column(name)] = np.concatenate([
                np.full(len(head), fill, values.dtype), values,
                np.full(len(tail), fill, values.dtype)])[:keep]
        out["num_tokens"] = keep
        out["num_loss_tokens"] = int(out["loss_mask"].sum())
        if out["num_loss_tokens"] == 0:
            raise error("tokens", "no token to train on", "no_loss_tokens")
        return EncodedRow(out, keep < len(ids))

    def _labels(self, labels: Any, n: int, error) -> dict[str, np.ndarray]:
        """Each configured label as an array over the row's n tokens (missing: the fill)."""
        if labels is None:
            labels = {}
        if not isinstance(labels, dict):
            raise error("labels", f"expected a mapping of label name to a list of values, got "
                        f"{type(labels).__name__}", "wrong_type")
        out = {}
        for name, spec in self.labels.items():
            where = f"labels.{name}"
            values = labels.get(name)
            classes = spec.kind == "classification"
            if values is None:
                out[name] = (np.full(n, MISSING_CLASS, np.int32) if classes
                             else np.full(n, np.nan, np.float32))
                continue
            if not isinstance(values, list) or len(values) != n:
                got = (f"{len(values)} values" if isinstance(values, list)
                       else type(values).__name__)
                raise error(where, f"expected a list of {n} values (one per token, null where "
                            f"there is none), got {got}", "label_length")
            out[name] = (self._classes(values, spec.num_classes, where, error) if classes
                         else self._reals(values, where, error))
        return out

    @staticmethod
    def _classes(values: list, num_classes: int, where: str, error) -> np.ndarray:
        out = np.full(len(values), MISSING_CLASS, np.int32)
        for i, v in enumerate(values):
            if v is None:
                continue
            if type(v) is not int:
                raise error(f"{where}[{i}]", f"a class label is an integer or null, got "
                            f"{type(v).__name__} {v!r}", "wrong_type")
            if not 0 <= v < num_classes:
                raise error(f"{where}[{i}]", f"class {v} is out of range [0, {num_classes})",
                            "out_of_range")
            out[i] = v
        return out

    @staticmethod
    def _reals(values: list, where: str, error) -> np.ndarray:
        out = np.full(len(values), np.nan, np.float32)
        for i, v in enumerate(values):
            if v is None:
                continue
            if type(v) not in (int, float):
                raise error(f"{where}[{i}]", f"a regression label is a finite number or null, "
                            f"got {v!r}", "wrong_type")
            if not (math.isfinite(v) and abs(v) <= _FLOAT32_MAX):
                raise error(f"{where}[{i}]", f"a regression label is a finite number (as a "
                            f"float32) or null, got {v!r}", "non_finite")
            out[i] = v
        return out
