"""The contract every stateful data stage follows, so a run can stop and resume exactly.

A stage (source reader, mixer, packer) is an iterable with a position it can save and restore:

* ``__iter__`` continues from the current position; it does not rewind. Iterating, saving
  ``state_dict()`` between two items, and later calling ``load_state_dict`` on a fresh stage
  built over fresh upstreams yields exactly the items an uninterrupted run would have yielded
  next.
* ``state_dict()`` describes the items the *consumer* has received so far, never items that
  were read ahead. It is JSON-serializable: plain dicts, lists, strings, ints, floats and bools.
  Numpy generator states are stored as ``bit_generator.state`` (a dict of Python ints; PCG64's
  128-bit ints survive Python's ``json`` round trip).
* ``load_state_dict(state)`` is called on a freshly built stage, before iteration starts.

The state returned must not alias anything the stage mutates later, so a caller can hold it
while iteration continues.

A stage whose state holds data (the shuffle buffer's samples) may also offer ``capture()``:
the same state taken cheaply, by reference to what it will not mutate, and turned into the
JSON state only by ``to_state()``. The background packer takes a state after every row it
builds, while only a checkpoint reads one; `capture(stage)` and `as_state(captured)` take and
read either kind.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class StatefulIterable(Protocol[T_co]):
    """An iterable whose position can be saved and restored (see the module docstring)."""

    def __iter__(self) -> Iterator[T_co]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def capture(stage: StatefulIterable[Any]) -> Any:
    """`stage`'s state now: its `capture()` where it has one, else its `state_dict()`."""
    take = getattr(stage, "capture", None)
    return take() if take is not None else stage.state_dict()


def as_state(captured: Any) -> dict[str, Any]:
    """The JSON state of what `capture` took (a copy: the caller may change it)."""
    to_state = getattr(captured, "to_state", None)
    return to_state() if to_state is not None else copy.deepcopy(captured)


class ListStream(StatefulIterable[T]):
    """A stateful stream over an in-memory sequence, for tests and benchmarks.

    The state is the number of items handed out. Iterators share that position, so an iterator
    created before ``load_state_dict`` also continues from the restored position.
    """

    def __init__(self, items: Sequence[T]):
        self._items = items
        self._position = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        while self._position < len(self._items):
            item = self._items[self._position]
            self._position += 1
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = int(state["position"])
        if not 0 <= position <= len(self._items):
            raise ValueError(f"ListStream: position {position} is outside [0, {len(self._items)}]")
        self._position = position
