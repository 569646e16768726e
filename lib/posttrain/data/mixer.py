"""Weighted mixing of several named data streams, deterministic and resumable.

Each item is drawn from a source chosen at random with probability proportional to its weight
(a numpy PCG64 generator seeded by ``MixerConfig.seed``; one uniform draw per choice, mapped
onto the cumulative weights of the sources still active, in the order the streams were given).
When a source runs out:

* ``on_exhausted="drop"``: the source is removed, the remaining weights are renormalized, and a
  new choice is drawn; the mix ends when every source is exhausted.
* ``on_exhausted="stop"``: the mix ends at once (every epoch sees the weights exactly).

``state_dict()`` holds the generator state, every stream's state, the exhausted sources and the
per-source counts, so a fresh Mixer over fresh streams continues identically.
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, TypeVar

import numpy as np

from posttrain.config.data import MixerConfig
from posttrain.data.stream import StatefulIterable, as_state, capture
from posttrain.errors import ConfigError

T = TypeVar("T")


def _check_weights(names: list[str], weights: Mapping[str, float]) -> dict[str, float]:
    if not names:
        raise ConfigError("mixer: no sources given; name at least one stream with a weight")
    missing = [n for n in names if n not in weights]
    unknown = [n for n in weights if n not in names]
    if missing or unknown:
        raise ConfigError(f"mixer weights: sources without a weight {missing}, weights without a "
                          f"source {unknown}; the weight names must match the source names")
    checked = {}
    for name in names:
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"mixer weights.{name}: must be a positive finite number, got {w!r}")
        checked[name] = float(w)
    return checked


class Mixer(StatefulIterable[T]):
    """Draws items from named streams in proportion to their weights.

    ``counts`` gives the number of items yielded per source so far.
    """

    def __init__(self, streams: Mapping[str, StatefulIterable[T]], weights: Mapping[str, float],
                 cfg: MixerConfig):
        self.cfg = cfg
        self._names = list(streams)
        self._weights = _check_weights(self._names, weights)
        self._streams = dict(streams)
        self._rng = np.random.Generator(np.random.PCG64(cfg.seed))
        self._exhausted: set[str] = set()
        self._counts = dict.fromkeys(self._names, 0)
        self._iters: dict[str, Iterator[T]] | None = None

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    @property
    def active(self) -> list[str]:
        """Sources not yet exhausted, in the given order."""
        return [n for n in self._names if n not in self._exhausted]

    def __iter__(self) -> Iterator[T]:
        if self._iters is None:
            self._iters = {n: iter(self._streams[n]) for n in self._names}
        iters, counts, rng = self._iters, self._counts, self._rng
        while not (self._exhausted and self.cfg.on_exhausted == "stop"):
            active = self.active
            if not active:
                return
            cumulative = list(accumulate(self._weights[n] for n in active))
            # min() guards the float edge u * total == total.
            pick = min(bisect_right(cumulative, rng.random() * cumulative[-1]), len(active) - 1)
            name = active[pick]
            try:
                item = next(iters[name])
            except StopIteration:
                self._exhausted.add(name)
                continue
            counts[name] += 1
            yield item

    def capture(self) -> _MixerCapture:
        """The state with each stream's own capture (`posttrain.data.stream.capture`)."""
        return _MixerCapture(self._rng.bit_generator.state,
                             {n: capture(self._streams[n]) for n in self._names},
                             [n for n in self._names if n in self._exhausted],
                             dict(self._counts))

    def state_dict(self) -> dict[str, Any]:
        """Generator state, each stream's state, exhausted sources, counts; JSON-serializable."""
        return self.capture().to_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()`; call on a fresh Mixer over fresh streams."""
        saved = set(state["streams"])
        if saved != set(self._names):
            raise ConfigError(f"mixer: the checkpoint has sources {sorted(saved)}, the config "
                              f"has {sorted(self._names)}; a resumed run needs the same sources")
        self._rng.bit_generator.state = copy.deepcopy(state["rng"])
        for name in self._names:
            self._streams[name].load_state_dict(state["streams"][name])
        self._exhausted = set(state["exhausted"])
        self._counts = {n: int(state["counts"][n]) for n in self._names}
        self._iters = None


@dataclass(frozen=True)
class _MixerCapture:
    rng: dict[str, Any]
    streams: dict[str, Any]
    exhausted: list[str]
    counts: dict[str, int]

    def to_state(self) -> dict[str, Any]:
        return {"rng": copy.deepcopy(self.rng),
                "streams": {n: as_state(c) for n, c in self.streams.items()},
                "exhausted": list(self.exhausted), "counts": dict(self.counts)}
