"""A process group of its own between processes of different torch.distributed worlds.

Trainer ranks already belong to their default group (the FSDP world); rollout engines run in
other processes (Ray actors) that are in no world, or in worlds of their own. A process has one
default group and `dist.new_group` only splits it, so the weight sync builds a second group
straight from a TCP store: its source (trainer rank 0) serves the store (`serve_group`), and
every member constructs the backend on it (`StoreGroup`): gloo on CPUs, NCCL on GPUs, through
the `ProcessGroupGloo` / `ProcessGroupNCCL` classes torch.distributed exports (the pattern of
vLLM's `StatelessProcessGroup`). The group is used only through its own methods; it never
touches the default group, and the default group's collectives never involve it.

    address, store = serve_group(world_size=1 + num_engines, backend="gloo", host=ip)  # source
    group = StoreGroup(address, rank=0, store=store)
    ...                                   # meanwhile, on engine i: StoreGroup(address, 1 + i)
    group.broadcast(tensor, src=0)        # every member, the same tensor shape and dtype

Constructing a member blocks until all have joined (gloo connects eagerly; NCCL at the first
collective), so the members are built concurrently (the GRPO controller starts them together).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from posttrain.errors import PosttrainError

__all__ = ["GroupAddress", "StoreGroup", "serve_group"]

Backend = Literal["gloo", "nccl"]
_PREFIX = "posttrain/sync_group"


@dataclass(frozen=True)
class GroupAddress:
    """Where a group's store listens, how many members it has and which backend they use."""

    host: str
    port: int
    world_size: int
    backend: Backend


def serve_group(world_size: int, backend: Backend, host: str, *, timeout_s: float = 600.0
                ) -> tuple[GroupAddress, dist.TCPStore]:
    """Start the store of a new group on this process (its rank 0) on a free port of `host`.

    Returns the address to give the other members and the store, which rank 0 passes to its
    own `StoreGroup` (and must keep alive as long as the group)."""
    if world_size < 2:
        raise ValueError(f"a sync group needs at least 2 members, got {world_size}")
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    return GroupAddress(host, store.port, world_size, backend), store


class StoreGroup:
    """Member `rank` of the group at `address` (rank 0 passes the store `serve_group` made).

    On NCCL, each member's tensors live on its current CUDA device; set it first.
    """

    def __init__(self, address: GroupAddress, rank: int, *, store: dist.Store | None = None,
                 timeout_s: float = 600.0):
        if not 0 <= rank < address.world_size:
            raise ValueError(f"rank {rank} is outside a group of {address.world_size}")
        if address.backend == "nccl" and not torch.cuda.is_available():
            raise PosttrainError(
                "the weight sync group uses NCCL (the trainers are on GPUs), but this process "
                "has no GPU; give every rollout engine a GPU (rollout.resources_per_engine: "
                "{num_gpus: 1}) or run the trainers on CPUs")
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(address.host, address.port, address.world_size,
                                  is_master=False, timeout=timeout)
        self.address, self.rank = address, rank
        self._store = store            # rank 0's serves the others: it must outlive the group
        prefixed = dist.PrefixStore(_PREFIX, store)
        if address.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)

    @property
    def device(self) -> torch.device:
        """Where this member's tensors must be for the group's backend."""
        if self.address.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """`tensor` of member `src` into `tensor` of every other member (in place; waits)."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self._pg.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Drop the backend and the store (the backend closes its connections when freed)."""
        self._pg = self._store = None
