"""A WorkerGroup of 2 CPU Ray actors forms a gloo group, reports errors by rank, cleans up."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from posttrain.distributed import (WorkerError, WorkerGroup, build_mesh,  # noqa: E402
                                   get_device)
from posttrain.distributed.worker_group import _rank_env  # noqa: E402
from posttrain.errors import PosttrainError  # noqa: E402


class RankWorker:
    """A plain class: no Ray decorators; built after the process group is up."""

    def __init__(self, scale: int = 1):
        self.scale = scale
        self.backend = dist.get_backend()

    def all_reduce_rank(self) -> int:
        t = torch.tensor([self.scale * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return int(t.item())

    def describe(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "POSTTRAIN_TEST_FLAG")
        return {"rank": dist.get_rank(), "world": dist.get_world_size(),
                "backend": self.backend, "device": str(get_device()),
                "young_collection_every": gc.get_threshold()[0],
                "mesh": tuple(build_mesh().shape), **{k: os.environ.get(k) for k in keys}}

    def pid(self) -> int:
        return os.getpid()

    def late_all_reduce(self, late_rank: int, seconds: float) -> int:
        """A step in which `late_rank` arrives `seconds` late: the others wait in the
        collective for it."""
        if dist.get_rank() == late_rank:
            time.sleep(seconds)
        return self.all_reduce_rank()

    def heap_pages(self) -> dict:
        """The glibc tunables this process started with, and how much of its anonymous memory
        sits on transparent huge pages once it holds a 64 MiB tensor."""
        held = torch.ones(16 << 20)
        huge_kb = 0
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    huge_kb = int(line.split()[1])
        return {"tunables": os.environ.get("GLIBC_TUNABLES"), "huge_kb": huge_kb,
                "held": int(held.sum())}

    def close(self) -> None:
        pass

    def fail_then_peer_dies(self, delay: float) -> None:
        """Rank 0 fails at once; rank 1's process ends `delay` seconds later: the order in
        which a busy host can report a rank killed inside a collective and its peer's error."""
        if dist.get_rank() == 0:
            raise RuntimeError("Connection closed by peer")
        time.sleep(delay)
        os._exit(1)

    def fail_on(self, bad_rank: int) -> str:
        if dist.get_rank() == bad_rank:
            raise ValueError(f"boom from rank {bad_rank}")
        return "ok"


class FailingInit:
    def __init__(self):
        if dist.get_rank() == 1:
            raise RuntimeError("cannot build on rank 1")


@pytest.fixture(scope="module")
def local_ray():
    # classes defined in this test module are shipped by value: the workers cannot import it
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    tmp = tempfile.mkdtemp(prefix="ptwg")  # short: Ray's socket paths must stay < 108 chars
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    shutil.rmtree(tmp, ignore_errors=True)


def _live_actors(expect: int | None = None, wait_s: float = 20.0) -> int:
    """Actors not DEAD, from the GCS actor table (ray.util.state needs the dashboard, which
    these tests do not start); polls briefly since ray.kill is asynchronous."""
    from ray._private import state
    deadline = time.monotonic() + wait_s
    while True:
        alive = sum(a["State"] != "DEAD" for a in state.actors().values())
        if expect is None or alive == expect or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_needs_ray_running(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(PosttrainError, match=r"call ray.init\(\) first"):
        WorkerGroup(RankWorker, 2)


def test_group_forms_gloo_world_and_all_reduces(local_ray):
    with WorkerGroup(RankWorker, 2, init_kwargs={"scale": 10},
                     env={"POSTTRAIN_TEST_FLAG": "on"}) as group:
        assert group.call("all_reduce_rank") == [30, 30]  # 10*1 + 10*2 on both ranks
        info = group.call("describe")
        assert [i["rank"] for i in info] == [0, 1]
        assert [i["RANK"] for i in info] == ["0", "1"]
        assert [i["LOCAL_RANK"] for i in info] == ["0", "1"]  # one node
        assert all(i["world"] == 2 and i["WORLD_SIZE"] == "2" for i in info)
        assert all(i["backend"] == "gloo" and i["device"] == "cpu" for i in info)
        assert all(i["mesh"] == (1, 2, 1, 1) for i in info)   # (dp_replicate, dp_shard, cp, tp)
        assert len({(i["MASTER_ADDR"], i["MASTER_PORT"]) for i in info}) == 1
        assert all(i["POSTTRAIN_TEST_FLAG"] == "on" for i in info)
        assert all(i["young_collection_every"] == 20_000 for i in info)   # posttrain.process
        assert group.call_rank(1, "describe")["rank"] == 1
        refs = group.call_async("all_reduce_rank")
        assert ray.get(refs) == [30, 30]


def test_exception_surfaces_with_rank_and_remote_traceback(local_ray):
    group = WorkerGroup(RankWorker, 2)
    try:
        with pytest.raises(WorkerError) as info:
            group.call("fail_on", 1)
        err = info.value
        assert err.rank == 1 and err.method == "fail_on"
        assert isinstance(err.cause, ValueError)
        assert "rank 1 failed in fail_on(): ValueError: boom from rank 1" in str(err)
        assert "in fail_on" in err.remote_traceback  # the worker's own frame
        with pytest.raises(AttributeError, match="no method 'nope'"):
            group.call("nope")
        assert group.call("fail_on", -1) == ["ok", "ok"]  # the group is still usable
        # a peer's error that reaches the driver before a rank's death: the death is named
        # (the cause), then the error (without the grace for dead peers: "rank 0 failed")
        with pytest.raises(WorkerError) as info:
            group.call("fail_then_peer_dies", 0.5)
        assert info.value.rank == 1, str(info.value)
        assert str(info.value).startswith("rank 1 failed in fail_then_peer_dies(): the worker "
                                          "process died"), str(info.value)
        assert "; then rank 0 failed in fail_then_peer_dies(): RuntimeError: Connection " \
               "closed by peer" in str(info.value), str(info.value)
    finally:
        group.shutdown()


def test_failing_worker_init_raises_and_cleans_up(local_ray):
    with pytest.raises(WorkerError, match="rank 1 failed in FailingInit.__init__"):
        WorkerGroup(FailingInit, 2)
    assert _live_actors(expect=0) == 0


def test_shutdown_kills_actors_and_is_idempotent(local_ray):
    group = WorkerGroup(RankWorker, 2)
    actors = group.actors
    assert _live_actors(expect=2) == 2
    group.shutdown()
    group.shutdown()
    assert _live_actors(expect=0) == 0
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_info.remote(), timeout=30)
    with pytest.raises(PosttrainError, match="shut down"):
        group.call("describe")
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_a_worker_killed_mid_step_fails_the_call_at_once_naming_it(local_ray):
    """Rank 1's process is SIGKILLed in the middle of a step while rank 0 waits for it in a
    collective (where it would wait for the collective's timeout, 30 minutes by default): the
    driver's call fails as soon as Ray reports the death, naming the rank. The bound below
    only catches a hang; the failure comes within seconds."""
    import signal
    import threading
    group = WorkerGroup(RankWorker, 2)
    try:
        pid = group.call("pid")[1]
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        outcome: dict = {}

        def step():
            try:
                group.call("late_all_reduce", 1, 600.0)
            except Exception as e:          # noqa: BLE001 - the test inspects it
                outcome["error"] = e

        caller = threading.Thread(target=step, daemon=True)
        caller.start()
        caller.join(timeout=120)
        assert not caller.is_alive(), "the driver hung on a dead worker"
        error = outcome.get("error")
        assert isinstance(error, WorkerError), error
        assert "rank 1" in str(error) and "died" in str(error), str(error)
    finally:
        group.shutdown()
    assert _live_actors(expect=0) == 0


def _huge_pages_on_request() -> bool:
    """Whether this machine backs a heap that asks for them (glibc 2.35+, `madvise`) with
    transparent huge pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
        major, minor = os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2]
    except (OSError, ValueError, AttributeError, IndexError):
        return False
    return "[never]" not in mode and (int(major), int(minor)) >= (2, 35)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc, /proc")
def test_a_cpu_rank_of_a_run_starts_with_its_heap_on_huge_pages(local_ray):
    """`steps.common.launch_workers` starts a CPU rank with glibc's huge-page heap tunable
    (`posttrain.process.rank_environment`), and where this machine honours it, the rank's
    64 MiB tensor sits on transparent huge pages. Catches a launcher that drops the variable,
    after which the rank faults its re-used heap in 4 KiB pages again (~9 % of an SFT step on
    this CPU; `posttrain.process`)."""
    from types import SimpleNamespace

    from steps.common import launch_workers
    run_cfg = SimpleNamespace(launcher="ray", num_workers=1, resources_per_worker={"CPU": 1})
    with launch_workers(run_cfg, RankWorker, ()) as group:
        [pages] = group.call("heap_pages")
    assert "glibc.malloc.hugetlb=1" in (pages["tunables"] or "").split(":"), pages
    assert pages["held"] == 16 << 20
    if _huge_pages_on_request():
        assert pages["huge_kb"] >= 32 << 10, pages


def test_rank_env_gives_each_gpu_rank_its_device():
    infos = [{"node_id": "a", "ip": "10.0.0.1", "gpus": ["3"]},
             {"node_id": "a", "ip": "10.0.0.1", "gpus": ["1"]},
             {"node_id": "b", "ip": "10.0.0.2", "gpus": ["0"]}]
    envs = _rank_env(infos, "10.0.0.1", 1234)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "3,1", "0"]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"}
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2", "1"]
