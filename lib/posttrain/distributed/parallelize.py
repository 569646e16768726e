"""Apply parallelism to a single-device model from outside, in one fixed order.

    parallelize(model, mesh, cfg, root=loss_wrapper)
      1. tensor parallel      (apply_tp; only when cfg.tp > 1)
      2. activation checkpointing, per block  (apply_activation_checkpointing)
      3. torch.compile, per block             (apply_compile)
      4. FSDP2: fully_shard every block, then the root  (apply_fsdp)

The order matters: TP turns block weights into DTensors on the "tp" mesh dim, which FSDP then
shards further along "dp_shard"; checkpointing and compile wrap a block *before* FSDP so that
FSDP's all-gather/free hooks sit outside the recomputed and compiled region.

The root is the module whose forward runs the whole step. Under FSDP2 the parameters outside
the blocks (embedding, final norm, LM head) are all-gathered only while the root's forward
runs, so a loss that reads `model.head.weight` directly (chunked cross-entropy) must be
computed inside that forward: pass the trainer's small loss wrapper as `root`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from posttrain.errors import ConfigError

ActivationCheckpointing = Literal["none", "full", "selective"]
MixedPrecision = Literal["fp32", "bf16"]


class UnsupportedParallelismError(ConfigError, NotImplementedError):
    """The requested parallel layout is valid in principle but not implemented for this model."""


@dataclass(frozen=True)
class ParallelConfig:
    """How to lay one model out over the devices.

    dp_shard: FSDP2 shard degree; -1 takes the rest of the world after `tp`.
    tp: tensor-parallel degree (attention heads and MLP columns split across ranks).
    activation_checkpointing: "full" recomputes every block's activations in backward;
        "selective" only every `ac_every`-th block's (blocks 0, k, 2k, ...), trading memory for
        less recompute.
    compile: torch.compile each block.
    mixed_precision: "bf16" computes in bf16 (params all-gathered in bf16, gradients reduced in
        fp32); the sharded master weights and optimizer state stay fp32.
    reshard_after_forward: free gathered block weights after forward (ZeRO-3); False keeps them
        until backward (ZeRO-2-like: more memory, one all-gather less per block).
    """

    dp_shard: int = -1
    tp: int = 1
    activation_checkpointing: ActivationCheckpointing = "none"
    ac_every: int = 2                   # selective: checkpoint every k-th block
    compile: bool = False
    mixed_precision: MixedPrecision = "fp32"
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for name, kind in (("activation_checkpointing", ActivationCheckpointing),
                           ("mixed_precision", MixedPrecision)):
            if getattr(self, name) not in get_args(kind):
                raise ConfigError(f"parallel.{name} must be one of {list(get_args(kind))}, "
                                  f"got {getattr(self, name)!r}")
        if self.tp < 1:
            raise ConfigError(f"parallel.tp must be >= 1, got {self.tp}")
        if self.ac_every < 1:
            raise ConfigError(f"parallel.ac_every must be >= 1, got {self.ac_every}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard must be >= 1 or -1, got {self.dp_shard}")


def _blocks(model: nn.Module, blocks_attr: str) -> nn.ModuleList:
    blocks = getattr(model, blocks_attr, None)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}.{blocks_attr} is not an nn.ModuleList of "
                          "blocks; pass blocks_attr= naming the model's list of blocks")
    return blocks


# ---------------------------------------------------------------------------------------- TP

_COLWISE = ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")
_ROWWISE = ("attn.o", "mlp.down")


def apply_tp(model: nn.Module, mesh: DeviceMesh, *, blocks_attr: str = "layers") -> None:
    """Megatron-style TP inside each block: q/k/v/gate/up column-wise, o/down row-wise.

    Each block takes and returns full (replicated) activations; the row-wise layers all-reduce.
    Embedding, final norm and LM head stay replicated across "tp" (FSDP still shards them).
    The attention must reshape with -1 heads (`view(B, T, -1, head_dim)`) so that it works
    with the local head count.
    """
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    tp_mesh = mesh["tp"]
    tp = tp_mesh.size()
    plan = {name: ColwiseParallel() for name in _COLWISE}
    plan.update({name: RowwiseParallel() for name in _ROWWISE})
    for i, block in enumerate(_blocks(model, blocks_attr)):
        _check_tp_block(block, i, tp)
        block_plan = dict(plan)
        if getattr(block.get_submodule("attn"), "q_norm", None) is not None:
            # per-head q/k norms (Qwen3, Gemma 3) see this rank's heads only ([B, T, H/tp, D]):
            # their weights are replicated DTensors and the input is sharded on the head dim,
            # so each rank's weight gradient (its heads' part) is summed over "tp"
            for name in ("attn.q_norm", "attn.k_norm"):
                block_plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, block_plan)


def _check_tp_block(block: nn.Module, index: int, tp: int) -> None:
    for name in _COLWISE + _ROWWISE:
        layer = block.get_submodule(name) if _has_submodule(block, name) else None
        if type(layer) is not nn.Linear:
            raise UnsupportedParallelismError(
                f"tensor parallelism needs block {index}.{name} to be an nn.Linear, found "
                f"{type(layer).__name__ if layer is not None else 'nothing'} (MoE and custom "
                "MLPs are not supported yet); set parallel.tp=1")
    attn = block.get_submodule("attn")
    for attr in ("num_heads", "num_kv_heads", "n_heads", "n_kv_heads"):
        heads = getattr(attn, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise UnsupportedParallelismError(
                f"block {index}: attn.{attr}={heads} is not divisible by parallel.tp={tp}; "
                "choose a tp that divides the number of (key/value) heads")
    for name in _COLWISE:
        out = block.get_submodule(name).out_features
        if out % tp:
            raise UnsupportedParallelismError(
                f"block {index}: {name} has {out} output features, not divisible by "
                f"parallel.tp={tp}")


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


# ------------------------------------------------------------------------- AC and compile

def apply_activation_checkpointing(model: nn.Module, mode: ActivationCheckpointing, *,
                                   blocks_attr: str = "layers", every: int = 1) -> None:
    """Wrap blocks so their activations are recomputed in backward: every block ("full"), or
    blocks 0, k, 2k, ... with k = `every` ("selective"); "none" is a no-op.

    The wrapper forwards attribute access to the block, and state-dict keys are unchanged
    when read through `torch.distributed.checkpoint.state_dict`.
    """
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ConfigError(f"activation_checkpointing must be 'none', 'full' or 'selective', "
                          f"got {mode!r}")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    blocks = _blocks(model, blocks_attr)
    step = every if mode == "selective" else 1
    for i, block in enumerate(blocks):
        if i % step:
            continue
        # preserve_rng_state: dropout in recompute draws the same mask as in forward
        blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)


def apply_compile(model: nn.Module, *, blocks_attr: str = "layers",
                  backend: str = "inductor") -> None:
    """torch.compile each block in place (`Module.compile`, so parameter names do not change).

    Per block rather than whole-model: blocks are identical, so one compiled graph is reused,
    and FSDP's per-block hooks stay outside the graphs.
    """
    for block in _blocks(model, blocks_attr):
        block.compile(backend=backend, fullgraph=False)


# ------------------------------------------------------------------------------------- FSDP

def _mp_policy(mixed_precision: MixedPrecision):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, *,
               blocks_attr: str = "layers", root: nn.Module | None = None) -> None:
    """fully_shard each block over the "dp_shard" mesh dim, then the root (`root` or `model`)."""
    from torch.distributed.fsdp import fully_shard
    root = model if root is None else root
    if not any(m is model for m in root.modules()):
        raise ConfigError("parallelize(root=...) must contain the model as a submodule "
                          "(the loss wrapper should hold the model it computes the loss of)")
    dp_mesh = mesh["dp_shard"]
    mp = _mp_policy(cfg.mixed_precision)
    blocks = _blocks(model, blocks_attr)
    for i, block in enumerate(blocks):
        # the last block's weights would be all-gathered again at once for backward: keep them
        last = i == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=cfg.reshard_after_forward and not last)
    fully_shard(root, mesh=dp_mesh, mp_policy=mp,
                reshard_after_forward=cfg.reshard_after_forward)


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, *,
                blocks_attr: str = "layers", root: nn.Module | None = None) -> nn.Module:
    """TP -> activation checkpointing -> compile -> FSDP2, in place; returns the root to call.

    `model` is the single-device model (its blocks in `model.<blocks_attr>`); `root`, if
    given, is a module containing `model` whose forward computes the loss (see module doc).
    The mesh must come from `build_mesh` with the same dp_shard/tp as `cfg`.
    """
    _check_mesh(mesh, cfg)
    if cfg.tp > 1:
        apply_tp(model, mesh, blocks_attr=blocks_attr)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, blocks_attr=blocks_attr,
                                   every=cfg.ac_every)
    if cfg.compile:
        apply_compile(model, blocks_attr=blocks_attr)
    apply_fsdp(model, mesh, cfg, blocks_attr=blocks_attr, root=root)
    return model if root is None else root


def shard_frozen(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, *,
                 blocks_attr: str = "layers") -> None:
    """Lay out a frozen model (a distillation teacher) that lives inside the trainer's root.

    Its parameters get `requires_grad=False` (no gradients, no optimizer state); TP as for the
    trained model, then `fully_shard` on each block, resharded after every forward (it has no
    backward). Its embedding, norm and head are left to the root's `fully_shard` (call this
    before `parallelize(..., root=...)`), so they are gathered for the whole root forward and
    a loss can read the head weight there, as it does the trained model's.
    """
    from torch.distributed.fsdp import fully_shard
    _check_mesh(mesh, cfg)
    model.requires_grad_(False)
    if cfg.tp > 1:
        apply_tp(model, mesh, blocks_attr=blocks_attr)
    for block in _blocks(model, blocks_attr):
        fully_shard(block, mesh=mesh["dp_shard"], mp_policy=_mp_policy(cfg.mixed_precision),
                    reshard_after_forward=True)


def parallelize_frozen(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, *,
                       blocks_attr: str = "layers", root: nn.Module | None = None) -> nn.Module:
    """`parallelize` for a model that only runs forward without gradients, in its own root (a
    KL reference policy): `shard_frozen` on the blocks, then `fully_shard` on the root, every
    part resharded after each forward, so a rank holds 1/dp_shard of it between calls. No
    activation checkpointing or compile; `cfg.mixed_precision` as for the trained model, so a
    reference equal to the starting policy computes exactly the policy's numbers."""
    from torch.distributed.fsdp import fully_shard
    shard_frozen(model, mesh, cfg, blocks_attr=blocks_attr)
    root = model if root is None else root
    root.requires_grad_(False)
    fully_shard(root, mesh=mesh["dp_shard"], mp_policy=_mp_policy(cfg.mixed_precision),
                reshard_after_forward=True)
    return root


def _check_mesh(mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    names = mesh.mesh_dim_names or ()
    if "dp_shard" not in names or "tp" not in names:
        raise ConfigError(f"the device mesh needs dims ('dp_shard', 'tp'), has {names}; "
                          "build it with posttrain.distributed.build_mesh")
    got = (mesh["dp_shard"].size(), mesh["tp"].size())
    want_dp = got[0] if cfg.dp_shard == -1 else cfg.dp_shard
    if got != (want_dp, cfg.tp):
        raise ConfigError(f"the device mesh is dp_shard={got[0]} x tp={got[1]} but the "
                          f"parallel config asks for dp_shard={cfg.dp_shard} x tp={cfg.tp}")


# ----------------------------------------------------------------------------- inspection

def count_params(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Global number of parameters (a DTensor counts its full shape; tied weights count once)."""
    params: Iterable[nn.Parameter] = model.parameters()
    return sum(p.numel() for p in params if p.requires_grad or not trainable_only)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict on CPU on rank 0 (for HF export); {} on other ranks.

    A collective: every rank must call it. Keys are the single-device model's names (the
    activation-checkpointing and compile wrappers are stripped).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
