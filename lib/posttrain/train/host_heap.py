"""Give the host heap's freed pages back to the system while a CPU trainer steps.

On a CPU, a step's tensors live in the process's heap. glibc serves allocations above its mmap
threshold with their own mappings, but the threshold is dynamic: the first free of a large
mapped block raises it (up to 32 MiB), and from then on a block's mid-size tensors (gathered
shards, projections, activations) come from heaps that fragment. Their freed pages stay
resident, so the process's peak grows past what is alive at any moment: the forward alone grew
a Qwen3-0.6B-shaped rank by ~36 MiB per block, 1.4 GiB over its 28 blocks, and the memory plan
(which counts live tensors) could not hold. A fixed threshold (`MALLOC_MMAP_THRESHOLD_`) is no
cure: 16 MiB left the growth as it was, 1 MiB removed it but cost ~40 % per step.

`release_free_heap` calls glibc's `malloc_trim(0)`, which returns every free page of every
arena (not only the heap's top) with `madvise`. The engine calls it where transients have just
been freed: after every block's forward while training (`release_after_blocks`: the forward,
and activation checkpointing's recompute just before that block's backward), before a step's
first forward, after each micro-batch's forward and backward, and after the optimizer step. A
call costs a walk over the free lists (~0.1 ms on a settled heap) plus ~0.1 s per GiB it
gives back. Accelerators, whose peak is device memory, do not call it; without glibc (musl,
macOS) it does nothing.

The pages given back are faulted in again when the next block reuses them (2 MiB at a time
in the ranks posttrain starts, whose heap asks for transparent huge pages:
`posttrain.process.rank_environment`; 4 KiB at a time without): on a tiny model
(hidden 256, 4 layers, 4 x 1,024 tokens per step, one thread) a step took 2.21 s against 2.14 s
(+3 %, medians of 5 interleaved runs) for a peak of 1.31 GB against 1.47 GB; on the
Qwen3-0.6B shape (two ranks, 256-token rows) the step time did not move (18-23 s) while rank
0's peak fell from 4.10-4.70 GB to 3.14 GB. `parallel.release_host_heap: false`
keeps glibc's default.

Giving pages back is only worth its faults where holding them would raise the peak. `HostHeap`
holds them while the rank stays within a budget: the memory plan's predicted trainer peak
(`posttrain.plan.host_budget`, made once by the driver; `posttrain plan` prints it). The first
optimizer step releases at every point and learns the most the resident set grows between two
points; from then on a point whose resident set plus that growth fits the budget keeps its
free pages (glibc reuses them for the next step's tensors of the same sizes), and any other
point releases as before. Keeping cannot take the interval after a point past the budget
unless that interval needs more new pages than the most any interval has needed (with every
release, its pages all come new), and the rule keeps learning that growth. On the GRPO bench
shape (tiny Qwen3, 4 x 4 x 32, a budget of 0.96 GiB) 32 of 40 points keep their pages and the
update takes 0.31 s against 0.40 s (medians of 10 interleaved runs) for a peak of 805 MB
against 777; the Qwen3-0.6B shape learns a growth of 1.3 GiB against a budget of 3.2 GiB, so
its rank keeps 3 points of 64 and peaks as before (3.16 GB). Without a budget (a worker built
outside a driver, a GPU config, `run.plan_check: off`) every point releases.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any, Callable

import torch
from torch import nn


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the host heap's free pages to the system; True when it could (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def resident_bytes() -> tuple[int, int]:
    """(resident set, its high-water mark) of this process in bytes: Linux's VmRSS and VmHWM;
    (0, 0) where /proc is not there."""
    rss = hwm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                    break                   # VmRSS follows VmHWM
    except OSError:
        pass
    return rss, hwm


class HostHeap:
    """Where a CPU trainer rank's step has just freed its transients (`phase_done`), give the
    heap's free pages back unless the rank can keep them within `budget` bytes (module doc).

    `budget` None releases at every point. `settle()` ends the learning step (the engine calls
    it after its first optimizer step). `released` and `kept` count the points."""

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.growth = 0                 # the most resident memory grew from one point to the next
        self.settled = False
        self.released = self.kept = 0
        self._after: int | None = None  # resident bytes left at the last point
        self._hwm = 0                   # the high-water mark read there

    def phase_done(self) -> None:
        rss, hwm = resident_bytes()
        if self._after is not None:
            # the interval's peak: exact where it raised the high-water mark, else at least
            # what is resident now
            self.growth = max(self.growth, (hwm if hwm > self._hwm else rss) - self._after)
        if (self.settled and self.budget is not None and rss  # 0: not readable, release
                and rss + self.growth <= self.budget):
            self.kept += 1
        else:
            release_free_heap()
            self.released += 1
            rss = resident_bytes()[0]
        self._after, self._hwm = rss, hwm

    def settle(self) -> None:
        self.settled = True


def release_after_blocks(model: nn.Module, release: Callable[[], Any]) -> None:
    """Call `release` (`HostHeap.phase_done`) after each of a native model's blocks
    (`model.layers`) runs forward with gradients on in training mode: the training forward
    and the checkpointed recompute, not generation or scoring (no gradients) nor evaluation."""
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            release()

    for block in getattr(model, "layers", ()):
        block.register_forward_hook(hook)
