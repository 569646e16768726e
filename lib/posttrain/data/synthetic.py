"""A tiny synthetic event dataset with learnable structure, deterministic from a seed.

The world: `num_items` items on a sparse random graph. Each item has `out_degree` successors
(distinct, not itself) reached with the probabilities `transition` (most likely first); with
probability `jump` a user jumps to a uniformly random item instead. Each item has a usual event
type (one of `num_event_types`) and a mean dwell time.

A user's sequence starts at a random item and walks the graph for `min_len`..`max_len` events.
Each event carries the item id, an event type (the item's usual type, or with probability
`type_noise` a random one) and a dwell time (the item's mean + uniform noise in [-0.5, 0.5],
rounded to 0.1; missing, ``null``, with probability `dwell_missing`). Rows are the `sequence`
format of `posttrain.data.events`::

    {"tokens": [17, 4, 61], "labels": {"event_type": [2, 0, 2], "dwell": [1.3, null, 0.8]}}

What a model can learn: the next item (at best about ``(1 - jump) * transition[0]``, against
``1 / num_items`` by chance), the next event's type (from its predicted item) and dwell.

Everything is drawn from one `random.Random(seed)` with `random()` only, whose sequence Python
keeps stable across versions and platforms, so the bundled files (``assets/data/events``,
`write_event_dataset`) are reproduced exactly by the generator (a test checks it).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EventWorld:
    """The hidden structure the sequences follow (module docstring)."""

    successors: tuple[tuple[int, ...], ...]   # per item, most likely successor first
    event_type: tuple[int, ...]               # per item, its usual event type
    dwell: tuple[float, ...]                  # per item, its mean dwell time


@dataclass(frozen=True)
class EventDatasetConfig:
    num_items: int = 100
    out_degree: int = 3
    transition: tuple[float, ...] = (0.6, 0.25, 0.15)
    jump: float = 0.05
    num_event_types: int = 4
    type_noise: float = 0.2
    dwell_missing: float = 0.1
    min_len: int = 8
    max_len: int = 40
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.transition) != self.out_degree or abs(sum(self.transition) - 1) > 1e-9:
            raise ValueError(f"transition {self.transition} must hold out_degree="
                             f"{self.out_degree} probabilities summing to 1")
        if not 0 < self.out_degree < self.num_items:
            raise ValueError("out_degree must be in [1, num_items)")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError("need 1 <= min_len <= max_len")


def _below(rng: random.Random, n: int) -> int:
    """A uniform integer in [0, n) from `random()` alone (version-stable, unlike randrange)."""
    return min(int(rng.random() * n), n - 1)


def _pick(rng: random.Random, probs: tuple[float, ...]) -> int:
    u, acc = rng.random(), 0.0
    for i, p in enumerate(probs):
        acc += p
        if u < acc:
            return i
    return len(probs) - 1


def event_world(cfg: EventDatasetConfig, rng: random.Random) -> EventWorld:
    successors, types, dwell = [], [], []
    for item in range(cfg.num_items):
        nxt: list[int] = []
        while len(nxt) < cfg.out_degree:
            j = _below(rng, cfg.num_items)
            if j != item and j not in nxt:
                nxt.append(j)
        successors.append(tuple(nxt))
        types.append(_below(rng, cfg.num_event_types))
        dwell.append(round(0.5 + 2.5 * rng.random(), 1))
    return EventWorld(tuple(successors), tuple(types), tuple(dwell))


def event_sequences(num_sequences: int, cfg: EventDatasetConfig = EventDatasetConfig()
                    ) -> tuple[EventWorld, list[dict[str, Any]]]:
    """The world of `cfg.seed` and `num_sequences` users' rows (module docstring)."""
    rng = random.Random(cfg.seed)
    world = event_world(cfg, rng)
    rows = []
    for _ in range(num_sequences):
        n = cfg.min_len + _below(rng, cfg.max_len - cfg.min_len + 1)
        item = _below(rng, cfg.num_items)
        tokens, types, dwell = [], [], []
        for t in range(n):
            if t:
                item = (_below(rng, cfg.num_items) if rng.random() < cfg.jump
                        else world.successors[item][_pick(rng, cfg.transition)])
            tokens.append(item)
            types.append(_below(rng, cfg.num_event_types) if rng.random() < cfg.type_noise
                         else world.event_type[item])
            d = round(max(0.0, world.dwell[item] + rng.random() - 0.5), 1)
            dwell.append(None if rng.random() < cfg.dwell_missing else d)
        rows.append({"tokens": tokens, "labels": {"event_type": types, "dwell": dwell}})
    return world, rows


def dataset_files(train_sequences: int = 600, eval_sequences: int = 100,
                  cfg: EventDatasetConfig = EventDatasetConfig()) -> dict[str, str]:
    """The text of ``train.jsonl`` and ``eval.jsonl``: the first `train_sequences` users for
    training, the next `eval_sequences` held out (same world, other users)."""
    _, rows = event_sequences(train_sequences + eval_sequences, cfg)
    text = [json.dumps(r, separators=(",", ":")) + "\n" for r in rows]
    return {"train.jsonl": "".join(text[:train_sequences]),
            "eval.jsonl": "".join(text[train_sequences:])}


def write_event_dataset(out_dir: str | Path, **kwargs: Any) -> dict[str, Path]:
    """Write `dataset_files(**kwargs)` into `out_dir`; returns the paths by file name.

    The bundled copy: ``python tools/make_assets.py`` (with the other assets) or
    ``python -m posttrain.data.synthetic assets/data/events``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in dataset_files(**kwargs).items():
        paths[name] = out / name
        paths[name].write_text(text)
    return paths


if __name__ == "__main__":
    import sys
    for path in write_event_dataset(sys.argv[1] if len(sys.argv) > 1 else "assets/data/events"
                                    ).values():
        print(path, path.stat().st_size, "bytes")
