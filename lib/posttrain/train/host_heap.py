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

The pages given back are faulted in again when the next block reuses them: on a tiny model
(hidden 256, 4 layers, 4 x 1,024 tokens per step, one thread) a step took 2.21 s against 2.14 s
(+3 %, medians of 5 interleaved runs) for a peak of 1.31 GB against 1.47 GB; on the
Qwen3-0.6B shape (two ranks, 256-token rows) the step time did not move (18-23 s) while rank
0's peak fell from 4.10-4.70 GB to 3.14 GB. `parallel.release_host_heap: false`
keeps glibc's default.
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


def release_after_blocks(model: nn.Module) -> None:
    """Release the free heap after each of a native model's blocks (`model.layers`) runs
    forward with gradients on in training mode: the training forward and the checkpointed
    recompute, not generation or scoring (no gradients) nor evaluation."""
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            release_free_heap()

    for block in getattr(model, "layers", ()):
        block.register_forward_hook(hook)
