"""The process's place in a torch.distributed job: rank, device, process group, device mesh.

Everything reads the torchrun-style environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`), which torchrun sets and so does `WorkerGroup` for Ray actors.
The helpers also work in a plain single process, where rank is 0 and the world is 1.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from posttrain.config.parallel import resolve_mesh_shape
from posttrain.errors import PosttrainError

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
DP_DIM = "dp"        # dp_replicate x dp_shard flattened: the data-parallel ranks
SHARD_CP_DIM = "dp_shard_cp"   # dp_shard x cp flattened: what FSDP shards over with cp > 1
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank() -> int:
    """Global rank: from the process group if there is one, else `RANK`, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of processes: from the process group if there is one, else `WORLD_SIZE`, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_device() -> torch.device:
    """`cuda:LOCAL_RANK` where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


_LISTEN_PORTS_FROM = 20_000     # above Ray's worker ports (10002-19999 by default)


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range [low, high] of local ports for outgoing connections: Linux's
    `ip_local_port_range`, else Linux's default."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32_768, 60_999


def free_port(host: str = "") -> int:
    """A TCP port that nothing on this host listens on right now, for a rendezvous to listen on.

    Chosen at random below the ephemeral range, never by the kernel: a port the kernel hands
    out (bind to port 0) lies in that range, so in the seconds before rank 0 listens on it
    any outgoing connection on the host may take it as its local port and rank 0 fails with
    EADDRINUSE (seen in the test suite). Below the range only another listener can take it.
    Where the range starts too low to leave room, the kernel picks."""
    low = _LISTEN_PORTS_FROM
    high = ephemeral_ports()[0]
    rng = random.SystemRandom()
    for _ in range(100 if high - low >= 1_000 else 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as TCPStore binds
            try:
                s.bind((host, rng.randrange(low, high)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def init_process_group(backend: str | None = None, timeout_s: int = 600) -> None:
    """Join the default process group described by the environment; a no-op if already joined.

    Without any launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) this process
    forms a group of one. `backend` defaults to NCCL where CUDA is available (with gloo for
    CPU tensors: the shards `parallel.offload` keeps in host memory take part in collectives,
    the gradient norm and weight sync), else gloo.
    """
    if dist.is_initialized():
        if backend is not None and dist.get_backend() != backend:
            raise PosttrainError(
                f"a process group with backend '{dist.get_backend()}' already exists; "
                f"cannot re-initialise it with '{backend}'. Call "
                "torch.distributed.destroy_process_group() first.")
        return
    cuda = torch.cuda.is_available()
    backend = backend or ("cpu:gloo,cuda:nccl" if cuda else "gloo")
    kwargs = {}
    if cuda and "nccl" in backend:
        torch.cuda.set_device(local_rank())
        kwargs["device_id"] = get_device()
    launched = [k for k in _LAUNCH_VARS if k in os.environ]
    if not launched:
        # a plain `python script.py`: a one-process group, so that the same code (meshes,
        # FSDP, DCP) runs unchanged; the in-memory store needs no address or port
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
        return
    missing = [k for k in _LAUNCH_VARS if k not in os.environ]
    if missing:
        raise PosttrainError(
            f"cannot join a process group: environment variable(s) {', '.join(missing)} not set "
            f"(found {', '.join(launched)}). Launch with torchrun or through "
            "posttrain.distributed.WorkerGroup, or set all of them.")
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **kwargs)


def close_process_group() -> None:
    """Leave the default process group at the end of a job; a no-op without one.

    Every rank waits at a barrier first, so that none tears down its transport while a peer
    is still in a collective with it; then the group is destroyed. Call it on the success
    path only: after a rank-local failure the barrier would wait for a rank that never comes.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def build_mesh(dp_shard: int = -1, tp: int = 1, dp_replicate: int = 1,
               cp: int = 1) -> DeviceMesh:
    """A 4-D device mesh ("dp_replicate", "dp_shard", "cp", "tp"), tp innermost (neighbouring
    ranks), with the data-parallel dims also flattened into one "dp" dim.

    FSDP2 shards over "dp_shard" (x "cp") and, with dp_replicate > 1, replicates over
    "dp_replicate" (HSDP: shards within a node, replicas across nodes); tensor parallelism
    splits over "tp"; context parallelism splits each row's tokens over "cp"
    (`posttrain.ops.context_parallel`); data (micro-batches, sums of losses) is dealt out over
    "dp", whose ranks see different rows (the "cp" ranks of one group see the same rows).
    `dp_shard=-1` takes the rest of the world. Joins the process group first if needed
    (`init_process_group()`: a group of one in a plain single process).
    """
    dp_shard, tp = resolve_mesh_shape(world_size(), dp_shard, tp, dp_replicate, cp)
    init_process_group()
    mesh = init_device_mesh(get_device().type, (dp_replicate, dp_shard, cp, tp),
                            mesh_dim_names=MESH_DIM_NAMES)
    dp_mesh(mesh)
    if cp > 1:
        mesh["dp_shard", "cp"]._flatten(SHARD_CP_DIM)
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel ranks of `mesh` (from `build_mesh`) as one 1-D mesh: "dp_replicate" x
    "dp_shard" flattened (created once, then returned again)."""
    return mesh["dp_replicate", "dp_shard"]._flatten(DP_DIM)
