"""Code that compiled graphs must not trace, marked without importing the compiler.

`torch.compiler.disable` imports `torch._dynamo` where it decorates: about 1.1 s in every
process that imports the model stack. A training rank loads it anyway (torch's own FSDP DTensors
and optimizer steps are disabled functions, and the memory plan's fake tensors need it), but an
evaluate task, a rollout engine or a script that only runs the models need not.
`outside_graphs(fn)` marks `fn` for the compiler and leaves that import to the processes that
load it:

- until `torch._dynamo` is imported nothing can trace, so the wrapper calls `fn` as it is;
- once it is, the wrapper calls `torch.compiler.disable(fn)` (made once), so `fn`'s own frames
  run eagerly even when a compiled graph's resumed code calls it;
- the wrapper carries dynamo's `_torchdynamo_disable` mark, so a graph being traced breaks at
  the call instead of inlining the wrapper.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def outside_graphs(fn: F) -> F:
    """`torch.compiler.disable(fn)`, with `torch._dynamo` imported only where it is loaded."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]

