"""Settings of the processes posttrain starts (a CLI command, a flow's task, a Ray worker of a
run), applied where such a process starts, never when a module is imported; and
`existing_objects_frozen`, for one stretch of work that makes many short-lived objects.

The cycle collector. CPython collects reference cycles in three generations; its oldest is
collected by a pass over every live container object, which after `import torch, transformers`
is a few hundred thousand of them: 0.1-0.13 s a pass here. With CPython's thresholds (a young
collection every 700 net allocations of containers) a process that imports those libraries,
builds a model and runs a few steps makes a dozen such passes: a tiny SFT flow's tasks spent
about 2 s in 22 of them. posttrain's code makes few reference cycles, so the young generation is
collected every 20,000 allocations instead; the older generations keep CPython's ratios, and
cycles are still collected, in larger batches (torchtitan and Megatron-LM take the collector
out of the training loop's way too). Set in the CLI, in every flow task and in each rank's
actor, it took tests/steps/test_train_grpo_algorithms.py with tests/flows/test_dpo_flow.py from
57.96 to 55.69 s and from 68.83 to 64.67 s (two interleaved pairs); set in every Python process,
Ray's own included, from 61.2 to 54.4 s. A rank's actor sets it only once its module has
imported torch, so that import's passes remain.

The interpreter's exit. After the exit handlers, CPython tears the modules down and runs the
cycle collector over everything still alive, more than once: 0.8-0.9 s for a process that has
imported torch, torch._dynamo and transformers (a flow's start, train and evaluate tasks), 0.4 s
with torch alone. The same processes therefore end with one last collection, which runs the
finalizers of what is already garbage, and then freeze what is left: the teardown then takes
0.3 s. Cycles still alive at that point are left to the operating system, which CPython never
promised to finalize anyway.

The heap's pages (`rank_environment`). A CPU rank gives its freed heap pages back to the system
where holding them would raise its peak (`posttrain.train.host_heap`), and the next step faults
them in again, 4 KiB at a time: on the SFT bench shape (tiny Qwen3, 4 x 2,048 tokens, 2 threads)
about 380,000 page faults a step, 0.2-0.4 s of a 2.4 s step, most of it in the matmuls whose
outputs land on fresh pages. glibc's `glibc.malloc.hugetlb=1` tunable (glibc 2.35+) asks for
transparent huge pages on the heap (`madvise`, which the kernel's default `madvise` mode
honours), so the same pages come back 2 MiB at a time: about 65,000 faults a step, the step
~9 % shorter, and the peak the same (2.099 GB against 2.096-2.100). glibc reads its tunables
when a process starts, so the ranks posttrain starts get it in their environment; a run with
`run.launcher: inline` trains in the process the user started, which has it only if that
process was started with it. Older glibc ignores the tunable, other C libraries the variable, a
kernel with huge pages `never` the request.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
from collections.abc import Iterator, Mapping

YOUNG_COLLECTION_EVERY = 20_000      # container allocations; CPython's default is 700
HUGE_PAGE_HEAP = "glibc.malloc.hugetlb=1"
_FREEZE_AT_EXIT = False              # collect_then_freeze is registered to run at exit


def tune_cycle_collector() -> None:
    """Collect the youngest generation every `YOUNG_COLLECTION_EVERY` allocations (a higher
    threshold already set is kept), and end the process with one collection and a freeze
    (`collect_then_freeze`, registered once: the exit handlers run last-in first-out, so it
    runs after those registered later)."""
    global _FREEZE_AT_EXIT
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG_COLLECTION_EVERY:
        gc.set_threshold(YOUNG_COLLECTION_EVERY, middle, old)
    if not _FREEZE_AT_EXIT:
        _FREEZE_AT_EXIT = True
        atexit.register(collect_then_freeze)


def rank_environment(parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables a CPU rank's process starts with besides its parent's
    (`parent`, default this process's): glibc's tunables with `HUGE_PAGE_HEAP` added to those
    the parent sets (a `glibc.malloc.hugetlb` the parent chose is kept)."""
    tunables = (os.environ if parent is None else parent).get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:
        return {"GLIBC_TUNABLES": tunables}
    return {"GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGE_HEAP}" if tunables else HUGE_PAGE_HEAP}


def collect_then_freeze() -> None:
    """One full collection (the finalizers of what is garbage now run), then every live object
    frozen, so the interpreter's teardown does not walk them again."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def existing_objects_frozen() -> Iterator[None]:
    """Leave the objects alive on entry (the imported libraries', a loaded tokenizer's) out of
    the cycle collector's passes until the block ends (`gc.freeze`, then `gc.unfreeze`): prepare
    made two full passes per 4,000 chat rows, 0.11-0.13 s each with torch and transformers
    loaded, and 0.01-0.02 s each this way."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
