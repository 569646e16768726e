"""This rank's place on the data-parallel dim of the device mesh (`DataParallel`: which share
of a step's data it takes, and sums over the data taken over that dim only), and small
collectives over plain numbers (`all_reduce_sum`, `all_reduce_max`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

from posttrain.distributed.env import dp_mesh

__all__ = ["DataParallel", "all_reduce_max", "all_reduce_sum"]

T = TypeVar("T")


@dataclass(frozen=True)
class DataParallel:
    """This rank's place on the data-parallel ("dp") dim of the device mesh: which share
    of a step's data it takes, and the group over which sums of that data are taken. The ranks
    of one tensor-parallel group have the same `rank` and see the same data."""

    rank: int
    size: int
    group: Any = None             # the process group of the "dp" dim (None: no group)

    @classmethod
    def of_mesh(cls, mesh: Any) -> "DataParallel":
        dim = dp_mesh(mesh)          # dp_replicate x dp_shard
        return cls(dim.get_local_rank(), dim.size(), dim.get_group() if dim.size() > 1 else None)

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's items: r, r + size, r + 2 size, ..."""
        return list(items[self.rank::self.size])

    def rounds(self, n: int) -> int:
        """Forwards every rank runs over n items dealt out by `share` (the most any rank gets):
        under FSDP the all-gathers are collective, so a rank with fewer repeats one."""
        return -(-n // self.size)

    def sum(self, value: float) -> float:
        """`value` summed over the data-parallel ranks (each data item counted once)."""
        return value if self.group is None else _all_reduce(value, dist.ReduceOp.SUM, self.group)

    def sum_all(self, values: dict[str, float]) -> dict[str, float]:
        """Each of `values` summed over the data-parallel ranks, in one collective."""
        if self.group is None:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return dict(zip(keys, t.tolist()))

    def all(self, flag: bool) -> bool:
        """Whether `flag` holds on every data-parallel rank (a collective)."""
        if self.group is None:
            return flag
        return bool(_all_reduce(float(flag), dist.ReduceOp.MIN, self.group))

    def gather(self, obj: Any) -> list[Any]:
        """The `obj` of every data-parallel rank, in rank order (a collective)."""
        if self.group is None:
            return [obj]
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def all_reduce_sum(value: float) -> float:
    return _all_reduce(value, dist.ReduceOp.SUM)


def all_reduce_max(value: float) -> float:
    return _all_reduce(value, dist.ReduceOp.MAX)


def _all_reduce(value: float, op, group: Any = None) -> float:
    """`value` reduced over `group` (default: every rank)."""
    if group is None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())
