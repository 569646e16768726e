"""Tensor parallelism inside one native block: the plan (`tp_plan`), read from what the block
holds, the parallel styles torch lacks (`LoRAParallel`, `PerHeadModule`,
`HeadShardedParameters`, `SumSharedGradient`), and the checks that refuse a block TP cannot
split (`check_tp_block`). `posttrain.distributed.parallelize.apply_tp` applies the plan to every
block, first in the fixed order of `parallelize`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from posttrain.config.parallel import UnsupportedParallelismError

_MLP_COLWISE, _MLP_ROWWISE = ("mlp.gate", "mlp.up"), ("mlp.down",)


@dataclass(frozen=True)
class _MixerSplit:
    """How a token mixer splits by heads; a mixer declares it with class attributes of these
    names (`models/layers.Attention`, `models/deltanet.GatedDeltaNet`); one that does not is
    taken for plain attention (q/k/v column-wise, o row-wise)."""

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    head_modules: tuple[str, ...]     # modules over per-head inputs (q_norm, k_norm)
    head_params: tuple[str, ...]      # own parameters [heads, ...] split on dim 0 (sinks)
    head_counts: tuple[str, ...]      # attributes that tp must divide
    # (replicated module, number of its last output features that every head reads: their
    # gradient on a rank is its heads' share only, so it is summed over "tp"; MLA's rope key)
    shared_features: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, attn: nn.Module) -> "_MixerSplit":
        counts = tuple(a for a in ("num_heads", "num_kv_heads", "n_heads", "n_kv_heads")
                       if isinstance(getattr(attn, a, None), int))
        shared = tuple((name, int(getattr(attn, attr)))
                       for name, attr in getattr(attn, "tp_shared_features", ()))
        return cls(getattr(attn, "tp_colwise", ("q", "k", "v")),
                   getattr(attn, "tp_rowwise", ("o",)),
                   getattr(attn, "tp_head_modules", ("q_norm", "k_norm")),
                   getattr(attn, "tp_head_params", ("sinks",)),
                   getattr(attn, "tp_head_counts", counts), shared)


def tp_plan(block: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan of one native block, read from what the block holds. The token
    mixer (`block.attn`) declares its own split by heads (class attributes `tp_colwise`,
    `tp_rowwise`, `tp_head_modules`, `tp_head_params`):

    | part | mixers / families | plan |
    |---|---|---|
    | attn.q/k/v (+ bias); DeltaNet's q/k/v/z/b/a | attention, gated DeltaNet | column-wise: this rank's heads |
    | attn.o (+ bias) | all | row-wise: partial sums all-reduced |
    | attn.q_norm/k_norm; DeltaNet's gated norm | per-head norms | weights replicated, inputs sharded on heads (`PerHeadModule`) |
    | attn.sinks; DeltaNet's conv_q/k/v, A_log, dt_bias | GPT-OSS; Qwen3.5 | sharded with the heads (dim 0) |
    | attn.q_b (or q), kv_b / o; q_a, kv_a and their norms | MLA (DeepSeek-V3) | column-wise / row-wise; replicated, kv_a's rope-key features' gradient summed over "tp" (`SumSharedGradient`) |
    | mlp.gate/up, mlp.down | dense MLPs | column-wise / row-wise |
    | MoE router + experts (+ shared expert) | Qwen3-MoE, GPT-OSS, Qwen3.5-MoE | replicated over "tp" (every rank routes and runs the experts on the full activations; FSDP still shards them over the data-parallel dims; experts get their own mesh dim with expert parallelism) |
    | norms (incl. Gemma's sandwich norms) | all | replicated: they act on full activations |

    A LoRA-wrapped projection gets the same split, its adapters following the base weight
    (`LoRAParallel`).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    attn = block.get_submodule("attn")
    split = _MixerSplit.of(attn)
    colwise = [f"attn.{n}" for n in split.colwise]
    rowwise = [f"attn.{n}" for n in split.rowwise]
    if _has_submodule(block, "mlp") and _is_dense_mlp(block.get_submodule("mlp")):
        colwise += list(_MLP_COLWISE)
        rowwise += list(_MLP_ROWWISE)
    plan: dict[str, Any] = {}
    for name in colwise + rowwise:
        layer = block.get_submodule(name)
        if type(layer) is nn.Linear:
            plan[name] = ColwiseParallel() if name in colwise else RowwiseParallel()
        elif _is_lora_linear(layer):
            plan[name] = LoRAParallel(colwise=name in colwise)
        else:
            raise UnsupportedParallelismError(
                f"tensor parallelism has no plan for {name} of type {type(layer).__name__}; "
                "set parallel.tp=1")
    # per-head modules see this rank's heads only ([B, T, H/tp, D]): their weights are
    # replicated DTensors and the inputs are sharded on the head dim, so each rank's weight
    # gradient (its heads' part) is summed over "tp"
    for name in split.head_modules:
        if getattr(attn, name, None) is not None:
            plan[f"attn.{name}"] = PerHeadModule(sequence_dim=2, use_local_output=True)
    params = tuple(n for n in split.head_params
                   if isinstance(getattr(attn, n, None), nn.Parameter))
    if params:
        plan["attn"] = HeadShardedParameters(params)
    for name, features in split.shared_features:
        plan[f"attn.{name}"] = SumSharedGradient(features)
    return plan


def _is_dense_mlp(mlp: nn.Module) -> bool:
    return all(_has_submodule(mlp, n) for n in ("gate", "up", "down"))


def _is_lora_linear(layer: nn.Module) -> bool:
    from posttrain.models.lora import LoRALinear
    return isinstance(layer, LoRALinear)


class LoRAParallel(ParallelStyle):
    """Column- or row-wise TP of a `LoRALinear` (torch's styles take only `nn.Linear`).

    Column-wise: W, bias and B split on the output dim, A replicated: y_r = x W_r^T + s x A^T
    B_r^T is this rank's slice of the output. Row-wise: W and A split on the input dim, B and
    bias replicated: x_r W_r^T and (x_r A_r^T) B^T are partial sums, all-reduced once the
    layer's output is formed. A merged update B A is split like W in both cases.
    """

    def __init__(self, colwise: bool):
        super().__init__()
        self.colwise = colwise

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute_lora(module, device_mesh, self.colwise)


def _distribute_lora(module: nn.Module, mesh: DeviceMesh, colwise: bool) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    layouts = ({"weight": Shard(0), "bias": Shard(0), "lora_A": Replicate(), "lora_B": Shard(0)}
               if colwise else
               {"weight": Shard(1), "bias": Replicate(), "lora_A": Shard(1),
                "lora_B": Replicate()})

    def partition(name: str, sub: nn.Module, device_mesh: DeviceMesh) -> None:
        if sub is not module:
            return
        for pname, p in list(sub.named_parameters(recurse=False)):
            sub.register_parameter(pname, nn.Parameter(
                distribute_tensor(p, device_mesh, [layouts[pname]]),
                requires_grad=p.requires_grad))

    def prepare_input(mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate() if colwise else Shard(-1)],
                                   run_check=False)
        return (x, *inputs[1:])

    def prepare_output(mod: nn.Module, out: Any, device_mesh: DeviceMesh) -> torch.Tensor:
        if not colwise:
            out = out.redistribute(placements=[Replicate()])
        return out.to_local()

    return distribute_module(module, mesh, partition, prepare_input, prepare_output)


class PerHeadModule(SequenceParallel):
    """`SequenceParallel` over the head dim for a module with several per-head inputs (q_norm,
    k_norm; DeltaNet's gated norm takes the heads' outputs and their gates): every tensor input
    becomes a DTensor sharded on `sequence_dim`, the weights replicated DTensors, the output a
    local tensor (with `use_local_output`)."""

    @staticmethod
    def _prepare_input_fn(sharding, mod, inputs, device_mesh):
        return tuple(DTensor.from_local(t, device_mesh, sharding, run_check=False)
                     if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
                     for t in inputs)


class HeadShardedParameters(ParallelStyle):
    """Shard a module's own per-head parameters (e.g. GPT-OSS's attention sinks [H]) on dim 0
    over "tp", as the column-wise q projection splits the heads. The module reads them as local
    tensors (`DTensor.to_local` in the op that uses them)."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor
        for name in self.names:
            p = getattr(module, name)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p, device_mesh, [Shard(0)]), requires_grad=p.requires_grad))
        return module


class _SumTrailingGradient(torch.autograd.Function):
    """Identity forward; backward sums the last `features` of the gradient over `group`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, features: int, group: Any) -> torch.Tensor:
        ctx.features, ctx.group = features, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        head, tail = grad.split([grad.shape[-1] - ctx.features, ctx.features], dim=-1)
        tail = tail.contiguous()
        dist.all_reduce(tail, group=ctx.group)
        return torch.cat([head, tail], dim=-1), None, None


class SumSharedGradient(ParallelStyle):
    """For a replicated projection whose last `features` outputs every attention head reads
    (MLA's shared rope key, from `kv_a`): each rank's heads give only their share of those
    outputs' gradient, so it is summed over "tp" on the way back (the rest of the output feeds
    column-wise layers, whose input gradients are already complete)."""

    def __init__(self, features: int):
        super().__init__()
        self.features = features

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        features, group = self.features, device_mesh.get_group()
        module.register_forward_hook(
            lambda mod, inputs, out: _SumTrailingGradient.apply(out, features, group))
        return module


def check_tp_block(block: nn.Module, index: int, tp: int) -> None:
    split = _MixerSplit.of(block.get_submodule("attn"))
    if _has_submodule(block, "mlp") and not _is_dense_mlp(block.get_submodule("mlp")) and not (
            _has_submodule(block, "mlp.router") and _has_submodule(block, "mlp.experts")):
        raise UnsupportedParallelismError(
            f"tensor parallelism needs block {index}.mlp to be a gated MLP (gate, up, down) or "
            f"a mixture of experts (router, experts), found "
            f"{type(block.get_submodule('mlp')).__name__}; set parallel.tp=1")
    names = [f"attn.{n}" for n in (*split.colwise, *split.rowwise,
                                   *(name for name, _ in split.shared_features))]
    if _has_submodule(block, "mlp") and _is_dense_mlp(block.get_submodule("mlp")):
        names += [*_MLP_COLWISE, *_MLP_ROWWISE]
    for name in names:
        if not _has_submodule(block, name):
            raise UnsupportedParallelismError(
                f"tensor parallelism needs block {index}.{name} (a Linear); found nothing; "
                "set parallel.tp=1")
        layer = block.get_submodule(name)
        if type(layer) is not nn.Linear and not _is_lora_linear(layer):
            raise UnsupportedParallelismError(
                f"tensor parallelism needs block {index}.{name} to be an nn.Linear (or "
                f"LoRA on one), found {type(layer).__name__}; set parallel.tp=1")
    for attr in split.head_counts:
        heads = getattr(block.get_submodule("attn"), attr)
        if heads % tp:
            raise UnsupportedParallelismError(
                f"block {index}: attn.{attr}={heads} is not divisible by parallel.tp={tp}; "
                "choose a tp that divides the number of (key/value) heads")
    colwise = [f"attn.{n}" for n in split.colwise]
    if _has_submodule(block, "mlp") and _is_dense_mlp(block.get_submodule("mlp")):
        colwise += list(_MLP_COLWISE)
    for name in colwise:
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
