"""The Ray side of a flow's training step: how many nodes it spans, and their cluster.

- `@ray_nodes()`: a `StepMutator` that turns the step called with `num_parallel` into a
  `@metaflow_ray` step when the config asks for several nodes, and a plain one-node `@parallel`
  step otherwise (that one starts its own local Ray, so it also runs on the local datastore).
- `gpus_per_node`: the GPUs each node of that step asks `@kubernetes` for.
- `ray_cluster`: joins the Ray cluster `@metaflow_ray` formed and stops, by PID, the Ray
  processes of that cluster on this machine when the step ends (metaflow-ray leaves them
  running, and the next run on the machine then cannot start Ray); with one node, starts and
  stops the step's local Ray.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

from metaflow import StepMutator


class ray_nodes(StepMutator):
    """`@metaflow_ray` over `config.run.num_nodes` nodes, or a one-node `@parallel` step."""

    def init(self, config_name: str = "config", all_nodes_started_timeout: int = 300):
        self.config_name = config_name
        self.timeout = all_nodes_started_timeout

    def pre_mutate(self, mutable_step) -> None:
        # pre_mutate, not mutate: the graph linter (which checks that a num_parallel call
        # leads to a @parallel step) runs between the two.
        cfg = getattr(mutable_step.flow, self.config_name)
        gpus = gpus_per_node(cfg)
        if gpus:
            # read by @kubernetes (run --with kubernetes, Argo Workflows) for every node of the
            # step, control and workers alike; ignored by local runs
            mutable_step.add_decorator("resources", deco_kwargs={"gpu": gpus})
        if int(cfg.run.num_nodes) > 1:
            mutable_step.add_decorator(
                "metaflow_ray", deco_kwargs={"all_nodes_started_timeout": self.timeout})
            # Ray >= 2.5x turns token auth on for `ray start --head` when ~/.ray/auth_token
            # exists (any earlier local `ray.init()` writes one), but `ray start --address`
            # on the other nodes does not load it, so they cannot join. The cluster is private
            # to this step's tasks; set RAY_AUTH_MODE at launch to choose otherwise.
            mutable_step.add_decorator("environment", deco_kwargs={"vars": {
                "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}})
        else:
            mutable_step.add_decorator("parallel")


def gpus_per_node(cfg: Any) -> int:
    """GPUs one node of a training step needs: its share of the GPUs of the Ray trainer
    workers, plus those of separately placed rollout engines (GRPO)."""
    import math
    run = cfg.run
    total = int(run.num_workers) * float(dict(run.resources_per_worker or {}).get("GPU", 0))
    rollout = cfg.get("rollout") if hasattr(cfg, "get") else getattr(cfg, "rollout", None)
    if rollout and rollout.get("placement") == "separate":
        per_engine = dict(rollout.get("resources_per_engine") or {})
        total += int(rollout.get("num_engines", 1)) * float(per_engine.get("num_gpus", 0))
    return math.ceil(total / int(run.num_nodes))


@contextlib.contextmanager
def ray_cluster(num_nodes: int, run: Any = None) -> Iterator[None]:
    """Join `@metaflow_ray`'s cluster (several nodes) and stop its processes here at the end.

    With one node nothing is joined: the training step starts its own local Ray, and with the
    run's `run` config section it starts now, in the background (`steps.common.start_local_ray`),
    while the block imports the driver and prepares; it is stopped when the block ends.
    """
    if num_nodes <= 1:
        from steps.common import start_local_ray, stop_local_ray
        if run is not None:
            start_local_ray(run)
        try:
            yield
        finally:
            stop_local_ray()
        return
    import ray
    ray.init(log_to_driver=True)            # no address: the cluster metaflow_ray started
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()
    try:
        yield
    finally:
        ray.shutdown()
        stopped = stop_ray_processes(session_dir)
        print(f"stopped {len(stopped)} Ray processes of {session_dir} on this machine")


def stop_ray_processes(session_dir: str, grace_s: float = 2.0,
                       timeout_s: float = 15.0) -> list[int]:
    """Terminate (then kill) the processes whose command line names `session_dir`.

    Every Ray daemon and worker process of a session (gcs_server, raylet, dashboard, agents,
    actors) carries its session directory on the command line, and a session directory
    belongs to one cluster, so this stops exactly what that cluster started on this machine.
    The workers exit on SIGTERM; gcs_server, the raylet and the autoscaler's monitor did not
    within 20 s here, so what is left after `grace_s` is killed (a 15 s wait cost every
    multi-node train step 15 s). An exited process that nobody reaps (a container's init may
    not) stays a zombie: it counts as stopped.
    """
    import psutil
    me = os.getpid()
    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != me and session_dir in " ".join(p.info["cmdline"] or ()):
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    alive = _wait_stopped(procs, grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _wait_stopped(alive, timeout_s)
    return [p.pid for p in procs]


def _wait_stopped(procs: list, timeout_s: float) -> list:
    """Wait up to `timeout_s` for `procs` to exit (a zombie has); those still running."""
    import psutil

    def running(p) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if running(p)]
    return alive
