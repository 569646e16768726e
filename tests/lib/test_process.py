"""posttrain's process settings (`posttrain.process`): how a tuned process ends.

Each case is a bare Python process that imports only `posttrain.process` (about 0.05 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A garbage cycle (unreachable before the exit) and a live one (reachable from the module until
# the teardown clears it), each announcing its finalizer. With the threshold raised neither is
# collected before the exit handlers run.
_PROBE = """
import gc, sys
from posttrain.process import tune_cycle_collector
if sys.argv[1] == "tuned":
    tune_cycle_collector()
    tune_cycle_collector()              # registers the exit collection once
class Loud:
    def __init__(self, name):
        self.name, self.me = name, self
    def __del__(self):
        print("finalized", self.name, flush=True)
gc.disable()                            # nothing is collected before the exit handlers
Loud("garbage")
live = Loud("live")
"""


def _finalized(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT / "lib"), "PATH": "/usr/bin:/bin"})
    return out.stdout.split()


def test_exit_collects_garbage_then_freezes_the_rest():
    """The exit handler `tune_cycle_collector` registers (once) runs one collection, so the
    finalizers of what is already garbage run, then freezes the live objects, so the teardown's
    collections skip them (0.8-0.9 s to 0.3 s for a process with torch and transformers). A
    process without it finalizes both cycles at teardown: the probe tells the two apart, and
    the tuned process must have printed the garbage cycle's finalizer exactly once."""
    plain = _finalized("plain")
    assert plain.count("garbage") == 1 and plain.count("live") == 1
    tuned = _finalized("tuned")
    assert tuned.count("garbage") == 1, tuned
    assert "live" not in tuned, "the teardown still walked the live objects: no freeze at exit"


def test_a_rank_environment_adds_the_huge_page_heap_to_the_parents_tunables():
    """`rank_environment`: the tunable alone, appended to tunables the parent sets, and a
    parent's own `glibc.malloc.hugetlb` choice kept. Catches a merge that drops the parent's
    other tunables or overrides a user who turned huge pages off."""
    from posttrain.process import rank_environment
    assert rank_environment({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert rank_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    off = "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"
    assert rank_environment({"GLIBC_TUNABLES": off}) == {"GLIBC_TUNABLES": off}
