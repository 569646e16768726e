"""What the model itself costs, counted on the meta device and with fake tensors.

Nothing here allocates real storage: parameters are counted on a model built on the meta
device (LoRA applied as in training), and the memory of one micro-batch's forward and backward
is measured by running it under `FakeTensorMode` with torch's `MemTracker`, which follows every
tensor the step creates and frees (saved activations, temporaries, the chunked loss's
[chunk, vocab] logits blocks, gradients) and reports the high-water mark. The traced model is
the one a rank runs: compute dtype (bf16 under `parallel.mixed_precision: bf16`), LoRA,
activation checkpointing applied by `posttrain.distributed.parallelize`, its heads and MLP
width divided by `tp` (a tensor-parallel rank holds that share of each block), its rows cut
to T / cp tokens (a context-parallel rank holds that share of each row). Parameter gradients
are dropped as soon as they are accumulated, as FSDP2 does after its reduce-scatter, so what
the trace reports above the parameters is the step's transient memory; the resident sharded
gradients are counted from the parameter counts (`posttrain.plan.memory`).

What the trace does not model exactly: under context parallelism each attention layer also
gathers the group's keys and values (2 x T x kv_heads x head_dim per layer call, added by
`posttrain.plan.memory`), and the attention kernel is the CPU one (per-document SDPA), whose
saved tensors (q, k, v, output, log-sum-exp) are those of GPU flash kernels too.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from posttrain.models.args import ModelArgs


@dataclass(frozen=True)
class ParamCounts:
    """Parameter elements of a model as a rank sees them before sharding.

    `root` are those outside the blocks (embedding, final norm, LM head, Gemma 4's per-layer
    tables), `block_max` the largest block's, `expert` the stacked MoE expert weights (split
    over `ep`); `trainable` those that get gradients and optimizer state (all, or LoRA's
    adapters)."""

    total: int
    trainable: int
    root: int
    blocks: int
    block_max: int
    expert: int
    block_max_expert: int

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


def meta_model(args: ModelArgs, lora: Any = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The native model on the meta device, with `lora` (a `LoraSettings`) applied."""
    from posttrain.models.transformer import build_model
    model = build_model(args, device="meta", dtype=dtype)
    if lora is not None:
        from posttrain.models.lora import apply_lora_settings
        # the tokenizer's added tokens are not known here: their rows are a vocabulary sliver
        apply_lora_settings(model, lora, lora.token_ids(()))
    return model


def count_params(args: ModelArgs, lora: Any = None) -> ParamCounts:
    """Exact parameter counts of the model (tied weights once), from a meta build."""
    model = meta_model(args, lora)
    seen: set[int] = set()
    total = trainable = root = expert = 0
    per_block = [0] * len(model.layers)
    per_block_expert = [0] * len(model.layers)
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        total += n
        trainable += n if p.requires_grad else 0
        is_expert = ".experts." in f".{name}."
        expert += n if is_expert else 0
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            per_block[i] += n
            per_block_expert[i] += n if is_expert else 0
        else:
            root += n
    top = max(range(len(per_block)), key=per_block.__getitem__) if per_block else 0
    return ParamCounts(total, trainable, root, sum(per_block), per_block[top] if per_block else 0,
                       expert, per_block_expert[top] if per_block else 0)


def rank_args(args: ModelArgs, tp: int, ep: int = 1) -> ModelArgs:
    """The block shapes one tensor-parallel (and expert-parallel) rank computes: heads, kv
    heads and MLP width divided by `tp`, routed experts by `ep`."""
    if tp == 1 and ep == 1:
        return args
    changes: dict[str, Any] = {}
    if tp > 1:
        changes.update(num_heads=max(1, args.num_heads // tp),
                       num_kv_heads=max(1, args.num_kv_heads // tp),
                       intermediate_size=max(1, args.intermediate_size // tp))
    if ep > 1 and args.num_experts:
        changes["num_experts"] = max(args.num_experts_per_tok, args.num_experts // ep)
    return dataclasses.replace(args, **changes)


@dataclass(frozen=True)
class StepTrace:
    """Bytes measured on one fake micro-batch (above the parameters).

    saved: held for backward at the end of forward (activations, the loss's saved inputs).
    peak: the high-water mark of forward + backward.
    loss_peak: the chunked loss kernel alone (its [chunk, vocab] logits blocks and the gradient
        buffers it forms), on the same hidden states."""

    saved: int
    peak: int
    loss_peak: int


def trace_step(args: ModelArgs, *, rows: int, seq_len: int, compute_dtype: torch.dtype,
               lora: Any, activation_checkpointing: str, ac_every: int, chunk_tokens: int,
               loss: str = "cross_entropy") -> StepTrace:
    """Run one micro-batch of `rows` x `seq_len` tokens (one document per row) forward and
    backward on fake tensors and measure it (`StepTrace`). `loss`: ``cross_entropy`` (the
    kernel of SFT and of GRPO's token-ratio loss, gradients formed in forward) or ``logprobs``
    (the log-prob kernel of DPO, distillation and GSPO, which recomputes the logits in
    backward)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from posttrain.distributed.parallelize import apply_activation_checkpointing
    from posttrain.models.transformer import build_model
    from posttrain.ops.head_kernels import ChunkedObjective, ChunkedTargetLogProb

    def loss_fn(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the kernels themselves, every position a target (the most the loss can cost): the
        # public functions pick the kept positions with `nonzero`, which fake tensors refuse
        hidden_NH = hidden.reshape(-1, hidden.shape[-1])
        targets = labels.reshape(-1)
        real, softcap = args.vocab_size, args.final_logit_softcapping
        if loss == "cross_entropy":
            return ChunkedObjective.apply(hidden_NH, weight, None, targets, real, chunk_tokens,
                                           softcap, 1.0, None, False)[0]
        return ChunkedTargetLogProb.apply(hidden_NH, weight, None, targets, real, chunk_tokens,
                                           softcap, 1.0).sum()

    with FakeTensorMode(allow_non_fake_inputs=True):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(compute_dtype)     # `.to(dtype)` cannot swap fake parameters
        try:
            model = build_model(args, device="cpu")
        finally:
            torch.set_default_dtype(previous)
        if lora is not None:
            from posttrain.models.lora import apply_lora_settings
            apply_lora_settings(model, lora, lora.token_ids(()))
        apply_activation_checkpointing(model, activation_checkpointing, every=ac_every)
        for p in model.parameters():
            if p.requires_grad:    # FSDP frees the unsharded gradient after reduce-scatter
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        ids = torch.zeros(rows, seq_len, dtype=torch.long)
        labels = torch.zeros(rows, seq_len, dtype=torch.long)
        lengths = [[seq_len]] * rows
        live = _LiveBytes()
        for t in [*model.parameters(), *model.buffers()]:
            live.track(t)
        with live:
            base = live.live
            hidden = model(ids, None, lengths)
            out = loss_fn(hidden, model.head.weight, labels)
            saved = live.live - base
            out.backward()
            del hidden, out
        peak = live.peak - base
        h = torch.zeros(rows * seq_len, args.hidden_size, dtype=compute_dtype,
                        requires_grad=True)
        weight = torch.zeros(args.padded_vocab_size, args.hidden_size, dtype=compute_dtype,
                             requires_grad=lora is None)
        live = _LiveBytes()
        for t in (h, weight):
            live.track(t)
        with live:
            base = live.live
            loss_fn(h, weight, labels).backward()
        loss_peak = live.peak - base
    return StepTrace(saved=int(saved), peak=int(peak), loss_peak=int(loss_peak))


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their high-water mark, over the ops run inside
    it (fake tensors included: their storages have sizes but no data). A storage counts from
    the op that made it until its last reference goes."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: Any = WeakIdKeyDictionary()

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._seen:
            return
        n = st.nbytes()
        self._seen[st] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.track, out)
        return out


def kv_cache_bytes(args: ModelArgs, rows: int, capacity: int, dtype: torch.dtype) -> int:
    """The native engine's decode cache for `rows` sequences of `capacity` slots, exactly as
    `posttrain.models.kv_cache.KVCache.allocate` makes it (on the meta device)."""
    from posttrain.models.kv_cache import KVCache
    model = meta_model(args, dtype=dtype)
    cache = KVCache.allocate(model, torch.zeros(rows, dtype=torch.long, device="meta"), capacity)
    total = 0
    for state in cache.layers:
        if state is None:
            continue
        fields = (dataclasses.astuple(state) if dataclasses.is_dataclass(state)
                  else tuple(vars(state).values()))
        total += sum(t.numel() * t.element_size() for t in _tensors(fields))
    return total


def _tensors(values: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(_tensors(v))
    return out
