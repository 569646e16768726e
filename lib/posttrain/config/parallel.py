"""The parallel layout's config slice (`ParallelConfig`) and the check that a layout fits a
world size (`resolve_mesh_shape`), apart from `posttrain.distributed` so that a config is read
and checked without importing torch; `posttrain.distributed.parallelize` and `.env` import
them from here (the old import paths keep working)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from posttrain.errors import ConfigError

ActivationCheckpointing = Literal["none", "full", "selective"]
MixedPrecision = Literal["fp32", "bf16"]


class UnsupportedParallelismError(ConfigError, NotImplementedError):
    """The requested parallel layout is valid in principle but not implemented for this model."""


@dataclass(frozen=True)
class ParallelConfig:
    """How to lay one model out over the devices.

    dp_shard: FSDP2 shard degree; -1 takes the rest of the world after `dp_replicate` x `tp`.
    dp_replicate: HSDP replica count: the model is sharded over `dp_shard` ranks (within a
        node) and that sharded copy replicated `dp_replicate` times (across nodes), gradients
        all-reduced between replicas; 1 is plain FSDP.
    tp: tensor-parallel degree (attention heads and MLP columns split across ranks).
    cp: context-parallel degree (each packed row's tokens split across ranks).
    ep: expert-parallel degree, carved out of dp_shard (dp_shard = dp_outer x ep): each MoE
        layer's experts split across ep ranks, tokens sent to them and back with all-to-alls
        (`apply_expert_parallel`); FSDP shards the experts over dp_outer only.
    activation_checkpointing: "full" recomputes every block's activations in backward;
        "selective" only every `ac_every`-th block's (blocks 0, k, 2k, ...), trading memory for
        less recompute.
    compile: torch.compile each block (on a CPU, around its per-document attention, which
        stays eager: 1.1-1.2x eager's speed on packed rows here, after 8-9 s of compiling).
    mixed_precision: "bf16" computes in bf16 (params all-gathered in bf16, gradients reduced in
        fp32); the sharded master weights and optimizer state stay fp32.
    reshard_after_forward: free gathered block weights after forward (ZeRO-3); False keeps them
        until backward (ZeRO-2-like: more memory, one all-gather less per block).
    offload: keep the sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
        `CPUOffloadPolicy`); each unit's shards are copied to the device for its all-gather
        and the optimizer steps on the CPU.
    release_host_heap: on a CPU, give the heap's freed pages back to the system where a step's
        phase (forward, backward, optimizer step) has just freed its transients
        (`posttrain.train.host_heap`), so the process's peak follows its live tensors, which
        is what the memory plan predicts. After the first optimizer step a rank keeps freed
        pages for reuse where they fit its planned peak (the driver plans the run once), so
        only ranks near their plan pay for the release. False keeps glibc's default, which
        holds ~0.9 GiB more per rank for the Qwen3-0.6B shape. Ignored on accelerators.
    """

    dp_shard: int = -1
    dp_replicate: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    activation_checkpointing: ActivationCheckpointing = "none"
    ac_every: int = 2                   # selective: checkpoint every k-th block
    compile: bool = False
    mixed_precision: MixedPrecision = "fp32"
    reshard_after_forward: bool = True
    offload: bool = False
    release_host_heap: bool = True

    def __post_init__(self) -> None:
        for name, kind in (("activation_checkpointing", ActivationCheckpointing),
                           ("mixed_precision", MixedPrecision)):
            if getattr(self, name) not in get_args(kind):
                raise ConfigError(f"parallel.{name} must be one of {list(get_args(kind))}, "
                                  f"got {getattr(self, name)!r}")
        if self.cp < 1:
            raise ConfigError(f"parallel.cp must be >= 1, got {self.cp}")
        if self.tp < 1:
            raise ConfigError(f"parallel.tp must be >= 1, got {self.tp}")
        if self.ep < 1:
            raise ConfigError(f"parallel.ep must be >= 1, got {self.ep}")
        if self.ep > 1 and (self.tp > 1 or self.cp > 1 or self.dp_replicate > 1):
            raise UnsupportedParallelismError(
                f"parallel.ep={self.ep} is built beside FSDP (dp_shard) only, not with "
                f"parallel.tp={self.tp}, cp={self.cp} or dp_replicate={self.dp_replicate}; "
                "set those to 1 or parallel.ep=1")
        if self.dp_replicate < 1:
            raise ConfigError(f"parallel.dp_replicate must be >= 1, got {self.dp_replicate}")
        if self.ac_every < 1:
            raise ConfigError(f"parallel.ac_every must be >= 1, got {self.ac_every}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard must be >= 1 or -1, got {self.dp_shard}")


def resolve_mesh_shape(world: int, dp_shard: int = -1, tp: int = 1,
                       dp_replicate: int = 1, cp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dp_shard, tp) with `dp_shard=-1` filled in (the world over dp_replicate x cp x tp);
    raises ConfigError if the layout cannot fit `world` or `ep` (carved out of dp_shard)
    does not divide dp_shard."""
    if tp < 1:
        raise ConfigError(f"parallel.tp must be >= 1, got {tp}")
    if dp_replicate < 1:
        raise ConfigError(f"parallel.dp_replicate must be >= 1, got {dp_replicate}")
    if cp < 1:
        raise ConfigError(f"parallel.cp must be >= 1, got {cp}")
    outer = tp * dp_replicate * cp
    if dp_shard == -1:
        if world % outer:
            others = " x ".join(f"parallel.{k}={v}" for k, v in (("dp_replicate", dp_replicate),
                                                                  ("cp", cp), ("tp", tp))
                                if v > 1 or k == "tp")
            raise ConfigError(f"{others} does not divide the world size {world}; choose "
                              f"values whose product divides {world}")
        dp_shard = world // outer
    elif dp_shard < 1:
        raise ConfigError(f"parallel.dp_shard must be >= 1 or -1 (the rest), got {dp_shard}")
    if dp_shard * outer != world:
        layout = f"parallel.dp_shard={dp_shard} x parallel.tp={tp}"
        if cp > 1:
            layout = f"parallel.cp={cp} x " + layout
        if dp_replicate > 1:
            layout = f"parallel.dp_replicate={dp_replicate} x " + layout
        raise ConfigError(
            f"{layout} = {dp_shard * outer} processes, but the world size is {world}; make "
            f"the product equal {world} (or set dp_shard=-1)")
    if ep < 1 or dp_shard % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the FSDP shard degree dp_shard="
                          f"{dp_shard} (expert groups are carved out of it; dp_shard is "
                          f"run.num_workers / (dp_replicate x cp x tp) when -1)")
    return dp_shard, tp
