"""Settings of the processes posttrain starts (a CLI command, a flow's task, a Ray worker of a
run), applied where such a process starts, never when a module is imported.

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
"""

from __future__ import annotations

import gc

YOUNG_COLLECTION_EVERY = 20_000      # container allocations; CPython's default is 700


def tune_cycle_collector() -> None:
    """Collect the youngest generation every `YOUNG_COLLECTION_EVERY` allocations (a higher
    threshold already set is kept)."""
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG_COLLECTION_EVERY:
        gc.set_threshold(YOUNG_COLLECTION_EVERY, middle, old)
