"""The GRPO prompt stream: prepared prompt rows, shuffled per epoch, with a resumable position.

`prepare` (format ``prompt``) writes rows of ``prompt_ids`` (the chat template applied with the
generation prompt), ``prompt_messages`` (JSON) and ``extras`` (JSON: the dataset's other
columns, e.g. ``answer``, which the reward functions read). Prompt sets are small next to SFT
corpora (tokens of the prompts only), so the stream holds them in memory: that makes the order
a pure function of (seed, epoch), and the state two integers.

Order: epoch e visits the rows of every train source (manifest order) in the permutation drawn
by ``random.Random(seed * 1_000_003 + e)``. `next_batch(n)` returns the next n rows, crossing
into the next epoch when one ends, so every step gets a full batch. ``state_dict()`` is
``{"epoch", "index"}`` and a stream restored from it continues with the same rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.data.loader import sources_from_manifest
from posttrain.errors import DataError

__all__ = ["PromptRow", "PromptStream", "prompt_columns", "read_prompt_rows", "shard_tables"]


@dataclass(frozen=True)
class PromptRow:
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    extras: dict[str, Any]


def prompt_columns(rows: list[PromptRow]) -> dict[str, list[Any]]:
    """The extra dataset columns of the rows, one list per column (None where a row lacks it)."""
    names = sorted({k for r in rows for k in r.extras})
    return {k: [r.extras.get(k) for r in rows] for k in names}


def shard_tables(prepared_dir: str, split: str) -> Iterator[tuple[str, str, pa.Table]]:
    """(source name, shard URI, table) of every shard of `split`, sources in manifest order."""
    for name, uris in sources_from_manifest(prepared_dir, split).items():
        for uri in uris:
            fs, path = fsspec.core.url_to_fs(uri)
            with fs.open(path, "rb") as f:
                yield name, uri, pq.read_table(f)


def read_prompt_rows(prepared_dir: str, split: str = "train") -> list[PromptRow]:
    """All prompt rows of `split`, sources in manifest order, rows in shard order."""
    rows: list[PromptRow] = []
    for name, uri, table in shard_tables(prepared_dir, split):
        missing = {"prompt_ids", "prompt_messages", "extras"} - set(table.column_names)
        if missing:
            raise DataError(f"source {name!r}: shard has no columns {sorted(missing)}; "
                            "GRPO needs data prepared with format: prompt", file=uri)
        cols = table.to_pydict()
        for ids, messages, extras in zip(cols["prompt_ids"], cols["prompt_messages"],
                                         cols["extras"]):
            rows.append(PromptRow(list(ids), json.loads(messages),
                                  json.loads(extras) if extras else {}))
    if not rows:
        raise DataError(f"the '{split}' split of {prepared_dir} has no prompt rows")
    return rows


class PromptStream:
    """Endless, seeded, epoch-shuffled batches of prompt rows (module docstring)."""

    def __init__(self, rows: list[PromptRow], seed: int = 0, shuffle: bool = True):
        if not rows:
            raise ValueError("PromptStream needs at least one prompt row")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptRow]:
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.rows[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state.get("num_rows", len(self.rows))) != len(self.rows):
            raise DataError(f"the prompt stream state is for {state['num_rows']} rows but the "
                            f"prepared data has {len(self.rows)}; resume with the same data")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
