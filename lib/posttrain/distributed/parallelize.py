"""Apply parallelism to a single-device model from outside, in one fixed order.

    parallelize(model, mesh, cfg, root=loss_wrapper)
      1. tensor parallel      (apply_tp; only when cfg.tp > 1)
      2. context parallel     (apply_context_parallel; the model takes rows cut over "cp")
      3. expert parallel      (apply_expert_parallel; experts sharded over "ep")
      4. activation checkpointing, per block  (apply_activation_checkpointing)
      5. torch.compile, per block             (apply_compile)
      6. FSDP2: fully_shard every block (its experts first, over "dp_outer"), then the root
         (apply_fsdp)

The order matters: TP turns block weights into DTensors on the "tp" mesh dim, which FSDP then
shards further along "dp_shard" (HSDP: sharded along "dp_shard", replicated along
"dp_replicate"); checkpointing and compile wrap a block *before* FSDP so that
FSDP's all-gather/free hooks sit outside the recomputed and compiled region.

The root is the module whose forward runs the whole step. Under FSDP2 the parameters outside
the blocks (embedding, final norm, LM head) are all-gathered only while the root's forward
runs, so a loss that reads `model.head.weight` directly (chunked cross-entropy) must be
computed inside that forward: pass the trainer's small loss wrapper as `root`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from posttrain.config.parallel import (ActivationCheckpointing, MixedPrecision,
                                       ParallelConfig, UnsupportedParallelismError)
from posttrain.errors import ConfigError


def _blocks(model: nn.Module, blocks_attr: str) -> nn.ModuleList:
    blocks = getattr(model, blocks_attr, None)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}.{blocks_attr} is not an nn.ModuleList of "
                          "blocks; pass blocks_attr= naming the model's list of blocks")
    return blocks


# ---------------------------------------------------------------------------------------- TP

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


def apply_tp(model: nn.Module, mesh: DeviceMesh, *, blocks_attr: str = "layers") -> None:
    """Megatron-style TP inside each block (`tp_plan`): q/k/v/gate/up column-wise, o/down
    row-wise, per-head parts with their heads.

    Each block takes and returns full (replicated) activations; the row-wise layers all-reduce.
    Embedding, final norm and LM head stay replicated across "tp" (FSDP still shards them).
    The attention must reshape with -1 heads (`view(B, T, -1, head_dim)`) so that it works
    with the local head count.
    """
    from torch.distributed.tensor.parallel import parallelize_module
    tp_mesh = mesh["tp"]
    for i, block in enumerate(_blocks(model, blocks_attr)):
        _check_tp_block(block, i, tp_mesh.size())
        frozen = {n for n, p in block.named_parameters() if not p.requires_grad}
        parallelize_module(block, tp_mesh, tp_plan(block))
        # some styles (SequenceParallel) re-create parameters as trainable: a frozen norm
        # under LoRA must stay frozen
        for n, p in block.named_parameters():
            if n in frozen:
                p.requires_grad_(False)


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


def _check_tp_block(block: nn.Module, index: int, tp: int) -> None:
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
    if hasattr(model, "compiled_blocks"):
        # tensor masks: a new packing of the same shape must not recompile the blocks
        model.compiled_blocks = True


# ------------------------------------------------------------------------------------- FSDP

def _offload_policy(cfg: ParallelConfig):
    """FSDP2's CPU offload when `cfg.offload`; pinned host memory only where there is CUDA to
    copy to (pinning needs it)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    if cfg.offload:
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return OffloadPolicy()


def param_device(cfg: ParallelConfig, device: torch.device) -> torch.device:
    """Where the sharded parameters live: the CPU under `cfg.offload`, else `device`."""
    return torch.device("cpu") if cfg.offload else device


def _mp_policy(mixed_precision: MixedPrecision):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _shard_fp32_owners(block: nn.Module, dp_mesh: DeviceMesh, cfg: ParallelConfig,
                      reshard: bool) -> None:
    """Under bf16 mixed precision, give each module that owns a parameter the model keeps in
    fp32 (a module's `keep_fp32`: DeepSeek-V3's router weight) an FSDP unit of its own with an
    fp32 policy, so that it computes in fp32 as transformers' bf16 models do; the block's
    policy would cast it to bf16 (and the router's choices with it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if cfg.mixed_precision == "fp32":
        return
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in list(block.modules()):
        for name in getattr(module, "keep_fp32", ()):
            owner, _, leaf = name.rpartition(".")
            # buffers are never cast; a parameter of the module itself would take its
            # siblings (the experts) into fp32 with it
            if leaf in module.get_submodule(owner)._parameters:
                assert owner, f"{type(module).__name__}.keep_fp32: {name} needs a submodule"
                fully_shard(module.get_submodule(owner), mesh=dp_mesh, mp_policy=fp32,
                            reshard_after_forward=reshard, offload_policy=_offload_policy(cfg))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, *,
               blocks_attr: str = "layers", root: nn.Module | None = None,
               expert_mesh: DeviceMesh | None = None) -> None:
    """fully_shard each block over the data-parallel mesh dims (`fsdp_mesh`), then the root
    (`root` or `model`); parameters the model keeps in fp32 get fp32 units of their own
    (`_shard_fp32_owners`); experts split by expert parallelism get units of their own over
    `expert_mesh` (`_shard_experts`)."""
    from torch.distributed.fsdp import fully_shard
    root = model if root is None else root
    if not any(m is model for m in root.modules()):
        raise ConfigError("parallelize(root=...) must contain the model as a submodule "
                          "(the loss wrapper should hold the model it computes the loss of)")
    dp_mesh = fsdp_mesh(mesh)
    mp = _mp_policy(cfg.mixed_precision)
    blocks = _blocks(model, blocks_attr)
    for i, block in enumerate(blocks):
        # the last block's weights would be all-gathered again at once for backward: keep them
        last = i == len(blocks) - 1
        _shard_fp32_owners(block, dp_mesh, cfg, cfg.reshard_after_forward and not last)
        if expert_mesh is not None:
            _shard_experts(block, expert_mesh, dp_mesh.size(), cfg,
                           cfg.reshard_after_forward and not last)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=_offload_policy(cfg),
                    reshard_after_forward=cfg.reshard_after_forward and not last)
    fully_shard(root, mesh=dp_mesh, mp_policy=mp, offload_policy=_offload_policy(cfg),
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
    apply_context_parallel(model, mesh)
    expert_mesh = apply_expert_parallel(model, mesh, cfg.ep)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, blocks_attr=blocks_attr,
                                   every=cfg.ac_every)
    if cfg.compile:
        apply_compile(model, blocks_attr=blocks_attr)
    apply_fsdp(model, mesh, cfg, blocks_attr=blocks_attr, root=root, expert_mesh=expert_mesh)
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
    apply_context_parallel(model, mesh)
    for block in _blocks(model, blocks_attr):
        _shard_fp32_owners(block, fsdp_mesh(mesh), cfg, True)
        fully_shard(block, mesh=fsdp_mesh(mesh), mp_policy=_mp_policy(cfg.mixed_precision),
                    reshard_after_forward=True, offload_policy=_offload_policy(cfg))


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
    fully_shard(root, mesh=fsdp_mesh(mesh), mp_policy=_mp_policy(cfg.mixed_precision),
                reshard_after_forward=True, offload_policy=_offload_policy(cfg))
    return root


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: "dp_shard" (with context parallelism "dp_shard" x "cp"
    flattened: the cp ranks hold different tokens of the same rows, so their gradients are
    summed too), preceded by "dp_replicate" for HSDP."""
    from posttrain.distributed.env import SHARD_CP_DIM
    shard = SHARD_CP_DIM if mesh["cp"].size() > 1 else "dp_shard"
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", shard]
    return mesh[shard]


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Let the model take rows cut over the mesh's "cp" dim (`Transformer.cp`): its forward then
    gets this rank's tokens and the whole rows' document lengths
    (`posttrain.ops.context_parallel`). A no-op with cp = 1."""
    cp_mesh = mesh["cp"]
    if cp_mesh.size() == 1:
        return
    if not hasattr(model, "cp"):
        raise UnsupportedParallelismError(f"{type(model).__name__} does not take context "
                                          "parallelism; set parallel.cp=1")
    model.cp = (cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group())


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, ep: int) -> DeviceMesh | None:
    """Split every MoE layer's experts over `ep` ranks (`posttrain.ops.expert_parallel`): the
    mesh's "dp_shard" dim is unflattened into ("dp_outer", "ep"); each `Experts` module's
    stacked parameters (weights, biases, LoRA adapters: all [E, ...]) become DTensors sharded
    on the expert dim over "ep", and the module dispatches its tokens to their owners. Returns
    the mesh FSDP shards the experts over ("dp_outer"), or None with ep = 1."""
    if ep == 1:
        return None
    from torch.distributed.tensor import Shard, distribute_tensor

    from posttrain.models.moe import Experts
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        raise UnsupportedParallelismError(f"parallel.ep={ep} needs a mixture-of-experts model; "
                                          f"{type(model).__name__} has no experts")
    dp_shard = mesh["dp_shard"].size()
    if dp_shard % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the FSDP shard degree dp_shard="
                          f"{dp_shard} (expert groups are carved out of it)")
    if experts[0].num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the number of experts "
                          f"({experts[0].num_experts})")
    split = mesh._unflatten("dp_shard", (dp_shard // ep, ep), ("dp_outer", "ep"))
    ep_mesh = split["ep"]
    for module in experts:
        for name, p in list(module.named_parameters(recurse=False)):
            assert p.shape[0] == module.num_experts, (name, tuple(p.shape))
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p, ep_mesh, [Shard(0)]), requires_grad=p.requires_grad))
        module.ep = (ep_mesh.get_local_rank(), ep, ep_mesh.get_group())
    return split["dp_outer"]


def _shard_experts(block: nn.Module, expert_mesh: DeviceMesh, dp_size: int,
                   cfg: ParallelConfig, reshard: bool) -> None:
    """An FSDP unit for each expert-parallel `Experts` module of `block`, over "dp_outer".
    Its gradients are divided by all `dp_size` data-parallel ranks, as the block's are: each
    rank's loss is scaled for that mean, and an expert's gradient already sums the tokens of
    its whole "ep" group (the all-to-all's backward), so averaging over "dp_outer" alone would
    count them ep times."""
    from torch.distributed.fsdp import fully_shard

    from posttrain.models.moe import Experts
    for module in list(block.modules()):
        if isinstance(module, Experts) and module.ep is not None:
            fully_shard(module, mesh=expert_mesh, mp_policy=_mp_policy(cfg.mixed_precision),
                        offload_policy=_offload_policy(cfg), reshard_after_forward=reshard)
            module.set_gradient_divide_factor(float(dp_size))
            # over several ranks: a sum, then the division (dividing by another number than
            # the group's size takes NCCL's PREMUL_SUM, which gloo lacks); over one rank FSDP
            # only divides, and forcing the sum would divide twice (torch 2.13)
            module.set_force_sum_reduction_for_comms(expert_mesh.size() > 1)


def _check_mesh(mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    names = mesh.mesh_dim_names or ()
    if not {"dp_replicate", "dp_shard", "cp", "tp"} <= set(names):
        raise ConfigError(f"the device mesh needs dims ('dp_replicate', 'dp_shard', 'cp', 'tp'), "
                          f"has {names}; build it with posttrain.distributed.build_mesh")
    got = (mesh["dp_replicate"].size(), mesh["dp_shard"].size(), mesh["cp"].size(),
           mesh["tp"].size())
    want_dp = got[1] if cfg.dp_shard == -1 else cfg.dp_shard
    if got != (cfg.dp_replicate, want_dp, cfg.cp, cfg.tp):
        raise ConfigError(f"the device mesh is dp_replicate={got[0]} x dp_shard={got[1]} x "
                          f"cp={got[2]} x tp={got[3]} but the parallel config asks for "
                          f"dp_replicate={cfg.dp_replicate} x dp_shard={cfg.dp_shard} x "
                          f"cp={cfg.cp} x tp={cfg.tp}")


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
