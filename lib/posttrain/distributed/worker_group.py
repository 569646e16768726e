"""A group of Ray actors that together form one torch.distributed job (the single controller).

The driver (a Metaflow step, a script, the GRPO controller) holds a `WorkerGroup` and calls
methods on every rank at once; each actor wraps a plain Python object (the trainer), built
after its process group is up, so the object's `__init__` may already use collectives.

    ray.init()                                    # or join the cluster @metaflow_ray formed
    with WorkerGroup(Trainer, num_workers=4, init_kwargs={"cfg": cfg}) as group:
        for step in range(steps):
            metrics = group.call("train_step", step)   # one result per rank, in rank order

One actor per GPU (or per CPU process): ranks follow the placement group's bundle order, so
`PACK` keeps neighbouring ranks on one node. A failure on any rank raises `WorkerError` in the
driver at once, naming the rank, with the remote traceback. The other ranks may then be stuck
in a collective waiting for it: shut the group down (the context manager does) and start again.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.distributed import env as dist_env
from posttrain.errors import PosttrainError
from posttrain.process import tune_cycle_collector

_READY_TIMEOUT_S = 300.0
_TEARDOWN_TIMEOUT_S = 10.0
_PEER_GRACE_S = 3.0          # for a dead peer to show, after another rank failed


class WorkerError(PosttrainError, RuntimeError):
    """A method raised (or the process died) on one rank of a WorkerGroup."""

    def __init__(self, rank: int, method: str, summary: str, remote_traceback: str | None,
                 cause: BaseException | None = None):
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        self.cause = cause
        message = f"rank {rank} failed in {method}(): {summary}"
        if remote_traceback:
            message += f"\n\n--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        super().__init__(message)


class _WorkerActor:
    """The Ray actor around one rank's worker object (turned into an actor by `ray.remote`)."""

    def __init__(self) -> None:
        tune_cycle_collector()          # this actor's process is one rank of a run
        self.worker: Any = None

    def node_info(self) -> dict:
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in gpus]}

    def free_port(self) -> int:
        return dist_env.free_port()

    def setup(self, dist_vars: dict[str, str], backend: str | None, timeout_s: int,
              worker_cls: type, init_args: tuple, init_kwargs: dict) -> None:
        # before anything touches CUDA: the device list and LOCAL_RANK decide cuda:LOCAL_RANK
        os.environ.update(dist_vars)
        dist_env.init_process_group(backend, timeout_s)
        self.worker = worker_cls(*init_args, **init_kwargs)

    def execute(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def teardown(self) -> None:
        import torch.distributed as dist
        self.worker = None
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerGroup:
    """One Ray actor per device (GPU) or per CPU process; the actors form a torch.distributed
    group, and each holds one `worker_cls(*init_args, **init_kwargs)`.

    resources_per_worker: one placement-group bundle per rank, e.g. {"GPU": 1, "CPU": 8};
        default {"GPU": 1} when the cluster has GPUs, else {"CPU": 1}.
    env: extra environment variables for every worker process (set before it starts).
    placement_strategy: Ray placement-group strategy ("PACK", "SPREAD", "STRICT_PACK", ...).
    backend: torch.distributed backend; default NCCL on GPU workers, gloo otherwise.
    """

    def __init__(self, worker_cls: type, num_workers: int, *,
                 resources_per_worker: dict[str, float] | None = None,
                 env: dict[str, str] | None = None, init_args: tuple = (),
                 init_kwargs: dict | None = None, placement_strategy: str = "PACK",
                 backend: str | None = None, timeout_s: int = 600) -> None:
        if not ray.is_initialized():
            raise PosttrainError(
                "Ray is not running in this process: call ray.init() first (it joins the "
                "cluster that @metaflow_ray or `ray start` formed, or starts a local one), then "
                "create the WorkerGroup")
        if num_workers < 1:
            raise PosttrainError(f"num_workers must be >= 1, got {num_workers}")
        self.worker_cls = worker_cls
        self.num_workers = num_workers
        self._actors: list[Any] = []
        self._pg: PlacementGroup | None = None
        self._closed = False
        try:
            self._start(resources_per_worker, env, placement_strategy)
            self._init_workers(backend, timeout_s, init_args, init_kwargs or {})
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------ start

    def _start(self, resources: dict[str, float] | None, env: dict[str, str] | None,
               strategy: str) -> None:
        if resources is None:
            resources = {"GPU": 1} if ray.cluster_resources().get("GPU", 0) > 0 else {"CPU": 1}
        self.resources_per_worker = dict(resources)
        self._pg = placement_group([dict(resources)] * self.num_workers, strategy=strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=_READY_TIMEOUT_S)
        if not ready:
            raise PosttrainError(
                f"the Ray cluster cannot place {self.num_workers} workers x {resources} "
                f"(strategy {strategy}) within {_READY_TIMEOUT_S:.0f} s; it has "
                f"{ray.available_resources()} available. Ask for fewer workers or resources.")
        options: dict[str, Any] = {
            "num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0),
            "resources": {k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
        }
        if env:
            options["runtime_env"] = {"env_vars": {k: str(v) for k, v in env.items()}}
        actor_cls = ray.remote(_WorkerActor)
        self._actors = [
            actor_cls.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=rank)).remote()
            for rank in range(self.num_workers)]

    def _init_workers(self, backend: str | None, timeout_s: int, init_args: tuple,
                      init_kwargs: dict) -> None:
        infos = self._gather([a.node_info.remote() for a in self._actors], "node_info")
        master_addr = infos[0]["ip"]
        master_port = ray.get(self._actors[0].free_port.remote())
        dist_vars = _rank_env(infos, master_addr, master_port)
        refs = [actor.setup.remote(dist_vars[rank], backend, timeout_s, self.worker_cls,
                                   tuple(init_args), init_kwargs)
                for rank, actor in enumerate(self._actors)]
        self._gather(refs, f"{self.worker_cls.__name__}.__init__")

    # ------------------------------------------------------------------------------ calls

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method(*args, **kwargs)` on every rank; the results in rank order."""
        return self._gather(self.call_async(method, *args, **kwargs), method)

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on one rank only (it must not enter a collective)."""
        self._check_call(method)
        if not 0 <= rank < self.num_workers:
            raise IndexError(f"rank {rank} out of range for a group of {self.num_workers}")
        ref = self._actors[rank].execute.remote(method, args, kwargs)
        return self._gather([ref], method, ranks=[rank])[0]

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Start `method` on every rank; one ObjectRef per rank, in rank order (for `ray.get`)."""
        self._check_call(method)
        return [a.execute.remote(method, args, kwargs) for a in self._actors]

    def _check_call(self, method: str) -> None:
        if self._closed:
            raise PosttrainError("this WorkerGroup has been shut down; create a new one")
        if not callable(getattr(self.worker_cls, method, None)):
            raise AttributeError(f"{self.worker_cls.__name__} has no method {method!r}")

    def _gather(self, refs: list[ray.ObjectRef], method: str,
                ranks: list[int] | None = None) -> list[Any]:
        """ray.get in rank order, but raise as soon as any rank fails (the others may hang)."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    # ray.get raises a subclass of both RayTaskError and the cause's type, whose
                    # str() is the formatted remote traceback
                    cause = e.cause
                    summary = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
                    error = WorkerError(rank, method, summary, str(e), cause)
                    raise self._dead_peer(pending, method, error) or error from None
                except ray.exceptions.RayActorError as e:
                    raise WorkerError(rank, method, f"the worker process died ({e})", None,
                                      e) from None
        return [results[r] for r in ranks]

    @staticmethod
    def _dead_peer(pending: dict[ray.ObjectRef, int], method: str,
                   error: WorkerError) -> WorkerError | None:
        """The rank that died, if one did, when another rank's call failed: a rank killed inside
        a collective makes its peers fail there too ("Connection closed by peer"), and on a busy
        host that error can reach the driver before Ray reports the death. The death is the
        cause, so the ranks still pending get `_PEER_GRACE_S` to show it."""
        if not pending:
            return None
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_PEER_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return WorkerError(pending[ref], method,
                                   f"the worker process died ({e}); then "
                                   f"{str(error).splitlines()[0]}", None, e)
            except Exception:           # noqa: BLE001 - a second failure: the first is raised
                continue
        return None

    # --------------------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Destroy the process groups and kill the actors; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._actors:
            # best effort: a rank stuck in a collective will not answer; it is killed anyway
            ray.wait([a.teardown.remote() for a in self._actors], num_returns=len(self._actors),
                     timeout=_TEARDOWN_TIMEOUT_S)
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
        if self._pg is not None:
            remove_placement_group(self._pg)
        self._actors, self._pg = [], None

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __len__(self) -> int:
        return self.num_workers

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, in rank order (for low-level use, e.g. weight sync)."""
        return list(self._actors)


def _rank_env(infos: list[dict], master_addr: str, master_port: int) -> list[dict[str, str]]:
    """torchrun-style variables per rank; LOCAL_RANK counts ranks on the same node.

    Ray gives each GPU actor only its own GPU in CUDA_VISIBLE_DEVICES. The ranks of one node
    instead all see the node's group GPUs, listed in local-rank order, so that cuda:LOCAL_RANK
    is the actor's own GPU and NCCL can use peer-to-peer paths between them.
    """
    node_ranks: dict[str, list[int]] = defaultdict(list)
    for rank, info in enumerate(infos):
        node_ranks[info["node_id"]].append(rank)
    out = []
    for rank, info in enumerate(infos):
        peers = node_ranks[info["node_id"]]
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(infos)),
               "LOCAL_RANK": str(peers.index(rank)), "LOCAL_WORLD_SIZE": str(len(peers)),
               "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
        if info["gpus"]:
            if any(len(infos[p]["gpus"]) != 1 for p in peers):
                raise PosttrainError(
                    "each GPU worker must hold exactly one GPU (resources_per_worker "
                    "{'GPU': 1}); found workers with "
                    f"{sorted({len(infos[p]['gpus']) for p in peers})} GPUs")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(infos[p]["gpus"][0] for p in peers)
        out.append(env)
    return out
