"""Fill a model that was built (and possibly sharded) on the meta device, tensor by tensor.

The sharded load path: build the model on the meta device, apply LoRA and `parallelize`
(FSDP2/TP turn parameters into DTensors that still have no storage), `to_empty` onto the
device, then stream the checkpoint one tensor at a time. Each rank reads the full tensor from
the memory-mapped safetensors file and keeps only its own shard (`distribute_tensor` with
``src_data_rank=None`` slices locally, no communication), so no rank ever holds the whole
model: at most one full tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from posttrain.errors import PosttrainError

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name without activation-checkpointing / compile wrapper components."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def parameters_by_name(module: nn.Module, prefix: str = "") -> dict[str, nn.Parameter]:
    """Canonical name (relative to `prefix`) -> parameter; tied parameters appear under each name."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        name = canonical_name(name)
        if name.startswith(prefix):
            out[name[len(prefix):]] = p
    return out


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> persistent buffer (state a checkpoint holds that no optimizer moves:
    DeepSeek-V3's router score-correction bias)."""
    out = {}
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for leaf, b in sub.named_buffers(prefix="", recurse=False):
            if b is not None and leaf not in sub._non_persistent_buffers_set:
                out[canonical_name(f"{module_name}.{leaf}" if module_name else leaf)] = b
    return out


def state_tensors_by_name(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """`parameters_by_name` plus the persistent buffers."""
    out: dict[str, torch.Tensor] = dict(parameters_by_name(module, prefix))
    out.update({name[len(prefix):]: b for name, b in persistent_buffers(module).items()
                if name.startswith(prefix)})
    return out


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into `param`, keeping only this rank's shard of it."""
    if tuple(full.shape) != tuple(param.shape):
        raise PosttrainError(f"tensor of shape {tuple(full.shape)} does not fit a parameter of "
                             f"shape {tuple(param.shape)}")
    full = full.to(dtype=param.dtype)
    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.to_local().device), param.device_mesh,
                                  param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(param.device))


def materialize(root: nn.Module, device: torch.device, tensors: Iterable[tuple[str, torch.Tensor]],
                *, prefix: str = "", rename: Callable[[str], str] = lambda n: n,
                init_missing: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                ) -> None:
    """`to_empty` the meta module `root`, then fill its parameters and persistent buffers.

    `tensors` yields (name, full tensor) with names relative to `prefix` (e.g. the native model
    inside a loss wrapper); `rename` maps them onto the current module tree (e.g. after LoRA
    moved `q.weight` to `q.base.weight`). Parameters not in `tensors` get
    `init_missing(name, param)` (a full tensor, e.g. LoRA A/B); without it they are an error.
    """
    root.to_empty(device=device)
    fill_parameters(root, tensors, prefix=prefix, rename=rename, init_missing=init_missing)


def fill_parameters(root: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], *,
                    prefix: str = "", rename: Callable[[str], str] = lambda n: n,
                    init_missing: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                    ) -> None:
    """Fill the parameters and persistent buffers of `root` under `prefix` (already on their
    device); see `materialize`.

    Used alone for a second model inside the same root (a frozen distillation teacher), after
    `materialize` has moved the whole root off the meta device.
    """
    params = state_tensors_by_name(root, prefix)
    filled: set[str] = set()
    for name, full in tensors:
        target = rename(name)
        if target not in params:
            raise PosttrainError(f"checkpoint tensor '{name}' has no parameter '{target}' in "
                                 "the model")
        copy_full_into(params[target], full)
        filled.add(target)
    tied = _tied_names(params)
    missing = [n for n in params if n not in filled and not (tied.get(n, set()) & filled)]
    if missing and init_missing is None:
        raise PosttrainError(f"no value for {len(missing)} parameter(s): {missing[:6]}")
    for name in missing:
        copy_full_into(params[name], init_missing(name, params[name]))


def _tied_names(params: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    by_id: dict[int, set[str]] = {}
    for name, p in params.items():
        by_id.setdefault(id(p), set()).add(name)
    return {name: by_id[id(p)] - {name} for name, p in params.items()}
