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
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

YOUNG_COLLECTION_EVERY = 20_000      # container allocations; CPython's default is 700
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
