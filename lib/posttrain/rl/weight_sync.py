"""Trainer -> rollout engine weight sync: tensors gathered one at a time from the sharded
trainer, packed into buckets and broadcast over a group of their own; LoRA sends adapters only.

The plan (`plan_sync`) is fixed once per run from the engine's parameters
(`RolloutEngine.parameter_shapes` and `.dtype`) and the trainer's: an ordered list of entries
(name, full shape, dtype as sent), cut into buckets of at most `bucket_bytes` (an entry larger
than that travels alone; a dtype change starts a new bucket). Every engine parameter and
persistent buffer (DeepSeek-V3's router score-correction bias, which bias balancing moves) is
sent in the engine's dtype, cast on the trainer before it travels, except what the model keeps
in fp32 (`Transformer.fp32_names`: that router's weight and bias), sent in fp32. With LoRA
the plan has a second part, the adapters A and B of every adapted weight in the trainer's
dtype: the first sync (``full``) sends the weights (the bases) and the adapters, every later
one the adapters and the buffers (a score-correction bias moves without training) only. The
engine
keeps each adapted weight's base as it first arrived and writes
`posttrain.models.lora.merged_weight(base, A, B, scaling)`, the trainer's folded weight
exactly, so a LoRA sync moves O(adapters) bytes and the base travels once. Trainable token
rows (`posttrain.models.trainable_tokens`) travel the same way: their delta D is an adapter of
the embedding (or untied head) weight, which the engine writes as `token_rows_weight(base,
ids, D)`; whole modules trained beside LoRA (`modules_to_save`) go with every sync.

Trainer side (`WeightSender`, one on every trainer rank): the plan's tensors are gathered in
plan order, one at a time (`DTensor.full_tensor()` is a collective over the FSDP / TP mesh, so
every rank walks the same plan); rank 0 casts each into its bucket's flat buffer and broadcasts
the bucket once it is full, then reuses the buffer. Rank 0's extra memory is one bucket plus
one full tensor, never the model, and no rank holds more than one full tensor at a time.

Engine side (`WeightReceiver`): each bucket arrives in a buffer of the same size, is viewed back
into tensors and written into the engine: at once for engines that take any subset of their
parameters (`NativeEngine`: copied in place by name), staged until the last bucket for engines
that reload whole (`VLLMEngine`, for which one copy of its weights is staged in host memory).

Colocated engines (in the trainer rank's own process) use the same plan without a group:
`WeightSender.copy_to` hands each gathered tensor straight to the rank's receiver.

    sender = WeightSender(model, rank, device)                        # every trainer rank
    plan = sender.make_plan(engine.parameter_shapes, engine.dtype, lora_scaling=...)
    address = sender.serve(num_engines, host)                         # rank 0; None elsewhere
    # concurrently: sender.join() on the trainers, on engine i
    receiver = WeightReceiver(engine, plan); receiver.join(address, 1 + i)
    # every sync, concurrently: sender.send(full) on the trainers, receiver.receive(full)

The group (`posttrain.distributed.sync_group`) is gloo on CPUs and NCCL when the trainers are
on GPUs (the engines then need GPUs too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.distributed.materialize import canonical_name, state_tensors_by_name
from posttrain.distributed.sync_group import GroupAddress, StoreGroup, serve_group
from posttrain.errors import ConfigError
from posttrain.models.lora import adapter_names, is_adapter_name, merged_weight
from posttrain.models.trainable_tokens import is_token_delta, token_rows, token_rows_weight

__all__ = ["DEFAULT_BUCKET_BYTES", "SyncEntry", "SyncPlan", "WeightReceiver", "WeightSender",
           "gather_full", "plan_sync"]

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class SyncEntry:
    """One tensor of a sync: its (trainer-side, canonical) name, full shape and dtype as sent."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class SyncPlan:
    """What travels, in which order and in which buckets (module docstring). `weights` are the
    engine's parameters in its order; `adapters` the LoRA A and B of the adapted ones (empty
    without LoRA), merged with `lora_scaling`."""

    weights: tuple[SyncEntry, ...]
    adapters: tuple[SyncEntry, ...] = ()
    lora_scaling: float | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    # the weights that are buffers on the trainer (DeepSeek-V3's score-correction bias): they
    # change without being trained (bias balancing), so the adapters-only syncs send them too;
    # so are the whole modules trained beside LoRA (model.lora.modules_to_save)
    buffers: tuple[SyncEntry, ...] = ()
    # (weight, its trainable-token delta among `adapters`, the token ids) of each weight with
    # trainable token rows
    token_rows: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.adapters and self.lora_scaling is None:
            raise ValueError("a plan with LoRA adapters needs lora_scaling (alpha / rank)")

    def entries(self, full: bool) -> tuple[SyncEntry, ...]:
        """One sync's tensors: every weight, or with LoRA after the first (`full`) sync only
        the adapters and the buffers."""
        if not self.adapters:
            return self.weights
        return self.weights + self.adapters if full else self.buffers + self.adapters

    def buckets(self, full: bool) -> list[tuple[SyncEntry, ...]]:
        """`entries(full)` cut into buckets of one dtype and at most `bucket_bytes` each (an
        entry larger than that alone)."""
        out: list[tuple[SyncEntry, ...]] = []
        current: list[SyncEntry] = []
        size = 0
        for entry in self.entries(full):
            if current and (entry.dtype != current[0].dtype
                            or size + entry.nbytes > self.bucket_bytes):
                out.append(tuple(current))
                current, size = [], 0
            current.append(entry)
            size += entry.nbytes
        if current:
            out.append(tuple(current))
        return out

    def nbytes(self, full: bool) -> int:
        """Bytes one sync moves to each engine."""
        return sum(e.nbytes for e in self.entries(full))

    def adapted(self) -> dict[str, tuple[str, str]]:
        """Adapted weight name -> its (A, B) adapter names."""
        sent = {e.name for e in self.adapters}
        return {e.name: adapter_names(e.name) for e in self.weights
                if adapter_names(e.name)[0] in sent}


def plan_sync(trainer_params: dict[str, torch.Tensor],
              engine_shapes: dict[str, tuple[int, ...]], engine_dtype: torch.dtype, *,
              lora_scaling: float | None = None,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              fp32_names: frozenset[str] = frozenset(),
              token_rows: dict[str, tuple[str, tuple[int, ...]]] | None = None) -> SyncPlan:
    """The plan that fills an engine with parameters `engine_shapes` (native name -> shape)
    held in `engine_dtype`, from a trainer whose (possibly sharded) parameters and persistent
    buffers by canonical name are `trainer_params` (`state_tensors_by_name`; a DTensor's shape
    is its full shape). `fp32_names` travel in fp32 whatever the engine dtype (tensors the
    model keeps in fp32: `Transformer.fp32_names`). `lora_scaling` (alpha / rank) is needed
    when the trainer's model has LoRA adapters. `token_rows` maps a weight with trainable
    token rows to (its delta's name, the ids)."""
    missing = [n for n in engine_shapes if n not in trainer_params]
    if missing:
        raise ConfigError(f"weight sync: the trainer has no tensors for the engine's "
                          f"parameters {missing[:5]}")
    wrong = [(n, tuple(trainer_params[n].shape), tuple(s)) for n, s in engine_shapes.items()
             if tuple(trainer_params[n].shape) != tuple(s)]
    if wrong:
        raise ConfigError(f"weight sync: trainer and engine shapes differ (name, trainer, "
                          f"engine): {wrong[:3]}")
    weights = tuple(SyncEntry(n, tuple(s), torch.float32 if n in fp32_names else engine_dtype)
                    for n, s in engine_shapes.items())
    adapters = [SyncEntry(x, tuple(trainer_params[x].shape), trainer_params[x].dtype)
                for n in engine_shapes if adapter_names(n)[0] in trainer_params
                for x in adapter_names(n)]
    rows = tuple((n, *token_rows[n]) for n in engine_shapes if n in (token_rows or {}))
    adapters += [SyncEntry(delta, tuple(trainer_params[delta].shape),
                           trainer_params[delta].dtype) for _, delta, _ in rows]
    unsent = sorted({n for n in trainer_params if is_adapter_name(n) or is_token_delta(n)}
                    - {e.name for e in adapters})
    if unsent:
        raise ConfigError(f"weight sync: LoRA adapters {unsent[:4]} adapt no parameter of the "
                          "rollout engine")
    buffers = tuple(e for e in weights if not isinstance(trainer_params[e.name], nn.Parameter)
                    or (adapters and trainer_params[e.name].requires_grad))
    return SyncPlan(weights, tuple(adapters), lora_scaling if adapters else None, bucket_bytes,
                    buffers, rows)


def gather_full(params: dict[str, torch.Tensor], entries: Iterable[SyncEntry]
                ) -> Iterator[tuple[SyncEntry, torch.Tensor]]:
    """Each entry's full tensor in the entry's dtype, one at a time. A collective over the
    trainer ranks when the parameters are DTensors: every rank iterates it to the end."""
    for entry in entries:
        p = params[entry.name].detach()
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out = full.to(entry.dtype)
        del full                  # an uncast gathered copy must not live on while `out` is used
        yield entry, out


def _buffers(buckets: Sequence[tuple[SyncEntry, ...]], device: torch.device
             ) -> dict[torch.dtype, torch.Tensor]:
    """One flat buffer per dtype, as large as that dtype's largest bucket."""
    sizes: dict[torch.dtype, int] = {}
    for bucket in buckets:
        dtype = bucket[0].dtype
        sizes[dtype] = max(sizes.get(dtype, 0), sum(e.numel for e in bucket))
    return {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}


def _packed(buckets: Sequence[tuple[SyncEntry, ...]]) -> list[tuple[SyncEntry, ...]]:
    """The buckets that are packed into a buffer: those of more than one tensor (a tensor
    alone in its bucket is broadcast as it is)."""
    return [b for b in buckets if len(b) > 1]


class WeightSender:
    """A trainer rank's side of the sync (module docstring); `model` is its native model,
    sharded or not. Rank 0 is the group's source; the other ranks only help gather."""

    def __init__(self, model: nn.Module, rank: int, device: torch.device | str):
        self.params = state_tensors_by_name(model)
        self.token_rows = {w: (f"{w.removesuffix('weight')}token_adapter.delta", rows.token_ids)
                           for w, rows in token_rows(model)}
        fp32 = getattr(model, "fp32_names", None)
        self.fp32_names = frozenset(canonical_name(n) for n in (fp32() if fp32 else ()))
        self.rank, self.device = rank, torch.device(device)
        self.plan: SyncPlan | None = None
        self.group: StoreGroup | None = None
        self._serving: tuple[GroupAddress, Any] | None = None
        self.timeout_s = 600.0

    def make_plan(self, engine_shapes: dict[str, tuple[int, ...]], engine_dtype: torch.dtype, *,
                  lora_scaling: float | None = None,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncPlan:
        """Fix the plan (`plan_sync`); every rank makes the same one."""
        self.plan = plan_sync(self.params, engine_shapes, engine_dtype,
                              lora_scaling=lora_scaling, bucket_bytes=bucket_bytes,
                              fp32_names=self.fp32_names, token_rows=self.token_rows)
        return self.plan

    def serve(self, num_engines: int, host: str) -> GroupAddress | None:
        """Rank 0: start the group's store for `num_engines` engines on `host` (an address the
        engines reach) and return its address; None on the other ranks."""
        if self.rank != 0:
            return None
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._serving = serve_group(1 + num_engines, backend, host, timeout_s=self.timeout_s)
        return self._serving[0]

    def join(self) -> None:
        """Rank 0: join the group served by `serve` (blocks until every engine joins)."""
        if self.rank != 0:
            return
        assert self._serving is not None, "serve() first"
        address, store = self._serving
        self.group = StoreGroup(address, 0, store=store, timeout_s=self.timeout_s)

    @torch.no_grad()
    def send(self, full: bool) -> int:
        """One sync to the group's engines, bucket by bucket; a collective over the trainer
        ranks. Returns the bytes each engine receives."""
        plan = self._plan()
        buckets = plan.buckets(full)
        if self.rank != 0:
            for bucket in buckets:
                for _ in gather_full(self.params, bucket):
                    pass
            return plan.nbytes(full)
        assert self.group is not None, "join() first"
        buffers = _buffers(_packed(buckets), self.device)
        for bucket in buckets:
            if len(bucket) == 1:
                (_, tensor), = gather_full(self.params, bucket)
                # offloaded shards (parallel.offload) gather into host memory
                self.group.broadcast(tensor.to(self.device).contiguous(), src=0)
                continue
            flat, offset = buffers[bucket[0].dtype], 0
            for entry, tensor in gather_full(self.params, bucket):
                flat[offset:offset + entry.numel].copy_(tensor.reshape(-1))
                offset += entry.numel
            self.group.broadcast(flat[:offset], src=0)
        return plan.nbytes(full)

    @torch.no_grad()
    def copy_to(self, receiver: WeightReceiver, full: bool) -> int:
        """One sync into a receiver in this process (a colocated engine), a tensor at a time;
        a collective over the trainer ranks. Returns the bytes written."""
        plan = self._plan()
        for entry, tensor in gather_full(self.params, plan.entries(full)):
            receiver.apply([(entry, tensor)])
        receiver.finish()
        return plan.nbytes(full)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = self._serving = None

    def _plan(self) -> SyncPlan:
        assert self.plan is not None, "make_plan() first"
        return self.plan


class WeightReceiver:
    """An engine's side of the sync (module docstring): writes what arrives into `engine`."""

    def __init__(self, engine: Any, plan: SyncPlan):
        sent = {e.name: e.shape for e in plan.weights}
        if sent != dict(engine.parameter_shapes):
            raise ValueError("the sync plan was made for an engine with other parameters")
        if any(e.dtype not in (engine.dtype, torch.float32) for e in plan.weights):
            raise ValueError(f"the sync plan sends weights in another dtype than the engine's "
                             f"{engine.dtype} (or fp32, for what the model keeps in fp32)")
        self.engine, self.plan = engine, plan
        self.group: StoreGroup | None = None
        self._adapted = plan.adapted()
        self._weight_of = {x: w for w, pair in self._adapted.items() for x in pair}
        self._rows = {delta: (w, ids) for w, delta, ids in plan.token_rows}
        self._row_weights = {w for w, _, _ in plan.token_rows}
        self._base: dict[str, torch.Tensor] = {}        # LoRA: each adapted weight's base
        self._adapters: dict[str, torch.Tensor] = {}    # this sync's adapters so far
        self._staged: dict[str, torch.Tensor] = {}      # engines that reload whole: all weights

    def join(self, address: GroupAddress, rank: int, *, timeout_s: float = 600.0) -> None:
        """Join the group at `address` as member `rank` (1 + the engine's index)."""
        self.group = StoreGroup(address, rank, timeout_s=timeout_s)

    @torch.no_grad()
    def receive(self, full: bool) -> int:
        """One sync from the group's source (every member calls it with the same `full`);
        returns the bytes received."""
        assert self.group is not None, "join() first"
        buckets = self.plan.buckets(full)
        buffers = _buffers(buckets, self.group.device)        # single tensors arrive here too
        for bucket in buckets:
            flat = buffers[bucket[0].dtype]
            views, offset = [], 0
            for entry in bucket:
                views.append((entry, flat[offset:offset + entry.numel].view(entry.shape)))
                offset += entry.numel
            self.group.broadcast(flat[:offset], src=0)
            self.apply(views)
        self.finish()
        return self.plan.nbytes(full)

    @torch.no_grad()
    def apply(self, items: Iterable[tuple[SyncEntry, torch.Tensor]]) -> None:
        """Take tensors of the plan (which may be views of a buffer that is reused afterwards):
        weights go into the engine, adapted weights' bases are kept, and an adapted weight is
        merged and written once both its adapters are in."""
        ready: list[tuple[str, torch.Tensor]] = []
        for entry, tensor in items:
            name = entry.name
            if name in self._weight_of:
                self._adapters[name] = self._keep(tensor)
                weight = self._weight_of[name]
                a, b = self._adapted[weight]
                if a in self._adapters and b in self._adapters:
                    if weight not in self._base:
                        raise RuntimeError(f"weight sync: the adapters of '{weight}' arrived "
                                           "before its base weight; the first sync must be full")
                    # written at once: a bucket of adapters merges into many whole weights
                    self._write([(weight, merged_weight(
                        self._base[weight], self._adapters[a], self._adapters[b],
                        self.plan.lora_scaling))])
            elif name in self._rows:
                weight, ids = self._rows[name]
                if weight not in self._base:
                    raise RuntimeError(f"weight sync: the token rows of '{weight}' arrived "
                                       "before its base weight; the first sync must be full")
                base = self._base[weight]
                self._write([(weight, token_rows_weight(
                    base, torch.tensor(ids, device=base.device), tensor))])
            elif name in self._adapted or name in self._row_weights:
                self._base[name] = self._keep(tensor)
            else:
                ready.append((name, tensor if self.engine.partial_updates else self._keep(tensor)))
        self._write(ready)

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy that outlives the bucket: on the engine's device for engines written in
        place, in host memory for those that reload whole (vLLM takes its weights from there,
        and its GPU memory is its KV cache's)."""
        return tensor.clone() if self.engine.partial_updates else tensor.to("cpu", copy=True)

    def _write(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if self.engine.partial_updates:
            self.engine.update_weights(named)
        else:
            self._staged.update(named)

    def finish(self) -> None:
        """End of a sync: every adapted weight must have been merged; an engine that reloads
        whole gets all its weights now."""
        missing = [w for w, (a, b) in self._adapted.items()
                   if a not in self._adapters or b not in self._adapters]
        self._adapters.clear()
        assert not missing, f"a sync ended without the adapters of {missing[:3]}"
        if not self.engine.partial_updates:
            self.engine.update_weights((e.name, self._staged[e.name]) for e in self.plan.weights)
