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

Each block's TP plan and the styles it uses are `tensor_parallel.py`.

The root is the module whose forward runs the whole step. Under FSDP2 the parameters outside
the blocks (embedding, final norm, LM head) are all-gathered only while the root's forward
runs, so a loss that reads `model.head.weight` directly (chunked cross-entropy) must be
computed inside that forward: pass the trainer's small loss wrapper as `root`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from posttrain.config.parallel import (ActivationCheckpointing, MixedPrecision,
                                       ParallelConfig, UnsupportedParallelismError)
from posttrain.distributed.tensor_parallel import check_tp_block, tp_plan
from posttrain.errors import ConfigError


def _blocks(model: nn.Module, blocks_attr: str) -> nn.ModuleList:
    blocks = getattr(model, blocks_attr, None)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}.{blocks_attr} is not an nn.ModuleList of "
                          "blocks; pass blocks_attr= naming the model's list of blocks")
    return blocks


# ---------------------------------------------------------------------------------------- TP

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
        check_tp_block(block, i, tp_mesh.size())
        frozen = {n for n, p in block.named_parameters() if not p.requires_grad}
        parallelize_module(block, tp_mesh, tp_plan(block))
        # some styles (SequenceParallel) re-create parameters as trainable: a frozen norm
        # under LoRA must stay frozen
        for n, p in block.named_parameters():
            if n in frozen:
                p.requires_grad_(False)


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
        # masks that keep a new packing of the same shape from recompiling the blocks
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
