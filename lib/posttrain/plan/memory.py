"""The memory plan of a run: per-rank bytes by part, the predicted peak, tokens and FLOPs/step.

    plan = plan_run(cfg, gpu="h100-80g")     # a recipe config (SFTConfig, GRPOConfig, ...)
    print(plan.render()); plan.to_json()

A trainer rank holds, for the whole run (`resident`):

    parameters      its FSDP shard of the master weights: (root + blocks / tp) / (dp_shard x cp)
                    elements x model.dtype, counted on a meta build with LoRA applied (exact)
    gradients       the shard of the trainable ones, in the master dtype
    optimizer       AdamW's two moments of the trainable shard, in the master dtype
    rollout engine  GRPO with a colocated engine: its weights (the whole model in the engine's
                    dtype; vLLM: gpu_memory_utilization of the device, which it reserves)

`parallel.offload` moves parameters, gradients and optimizer state to host memory (counted
there, not on the device). Expert parallelism (`parallel.ep`) is carved out of `dp_shard`,
so it does not change a rank's shard; it shrinks the gathered expert weights (1 / ep of the
experts per rank).

On top of that, one phase at a time (the peak is the largest):

    load            the checkpoint streamed in: on a CPU, the memory-mapped safetensors file
                    being read (its pages count as resident), the largest tensor as read (in
                    the dtype the checkpoint stores it in; twice when stacked or padded) and
                    one copy of it in the master dtype (converted, or the rank's shard cut
                    from it); on a GPU one tensor's shard (tensors are read and cut on the
                    host)
    step            a micro-batch's forward + backward, measured on fake tensors
                    (`posttrain.plan.trace`): activations (with the activation checkpointing
                    mode, the pack length, the cp split), the loss's logits chunks and the
                    gradients in flight; plus FSDP's gathered weights, the root's (embedding,
                    final norm, head) and two blocks' (the one running and the one prefetched)
                    in the compute dtype; plus, under cp, the gathered keys and values of one
                    layer (2 x T x kv_heads x head_dim); on a CPU with more than one shard,
                    gloo's staging copy of the largest gathered unit
    optimizer step  AdamW's foreach temporaries: one trainable shard in the master dtype
    generate        (GRPO) the engine's KV cache, exact from `KVCache.allocate` on the meta
                    device, twice (dropping finished rows copies the cache), and the fp32
                    logits of the decoding rows (three [rows, vocab] blocks: logits, softmax,
                    log-softmax)

A CPU rank's peak process memory also holds what the process is before any of this (Python,
torch, transformers, pyarrow, the tokenizer, data loader threads): `CPU_BASELINE_BYTES`,
measured per process kind (`posttrain.plan.devices`). A GPU rank's peak is the allocator's
(`torch.cuda.max_memory_allocated`), without the CUDA context, which the fit check adds.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.models.args import DTYPES, ModelArgs
from posttrain.models.families import args_from_hf_config
from posttrain.plan import devices
from posttrain.plan.trace import count_params, kv_cache_bytes, rank_args, trace_step

GiB = 1 << 30


@dataclass
class RankPlan:
    """One kind of rank: bytes per part on its device, the host-side parts (offload), the phase
    of each transient, and the predicted peak (baseline + resident + the largest phase)."""

    kind: str                                     # "trainer" | "rollout_engine"
    resident: dict[str, int]
    phases: dict[str, dict[str, int]]
    baseline: int = 0
    host: dict[str, int] = field(default_factory=dict)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    @property
    def peak_bytes(self) -> int:
        top = max((sum(p.values()) for p in self.phases.values()), default=0)
        return self.baseline + sum(self.resident.values()) + top

    def parts(self) -> dict[str, int]:
        """Every part at the peak: baseline, resident parts, the peak phase's parts."""
        out = {"baseline": self.baseline} if self.baseline else {}
        out.update(self.resident)
        if self.phases:
            out.update(self.phases[self.peak_phase])
        return out


@dataclass
class MemoryPlan:
    recipe: str
    device: str                                   # "cpu" or a GPU kind
    capacity_bytes: int                           # per rank
    layout: dict[str, Any]
    ranks: dict[str, RankPlan]
    tokens_per_step: int
    flops_per_step: float
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> dict[str, int]:
        return {k: r.peak_bytes for k, r in self.ranks.items()}

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "device": self.device,
                "capacity_bytes": self.capacity_bytes, "layout": self.layout,
                "peak_bytes": self.peak_bytes,
                "ranks": {k: {"parts": r.parts(), "peak_phase": r.peak_phase,
                              "resident": r.resident, "phases": r.phases, "host": r.host,
                              "baseline": r.baseline} for k, r in self.ranks.items()},
                "tokens_per_step": self.tokens_per_step, "flops_per_step": self.flops_per_step,
                "notes": self.notes}

    def render(self) -> str:
        lines = [f"{self.recipe} on {self.device}: "
                 + ", ".join(f"{k}={v}" for k, v in self.layout.items())]
        for kind, r in self.ranks.items():
            lines.append(f"\n{kind} rank (peak in phase '{r.peak_phase}'):")
            for name, n in r.parts().items():
                lines.append(f"  {name:<28}{n / GiB:>9.3f} GiB")
            for name, n in r.host.items():
                lines.append(f"  {name + ' (host)':<28}{n / GiB:>9.3f} GiB")
            lines.append(f"  {'predicted peak':<28}{r.peak_bytes / GiB:>9.3f} GiB of "
                         f"{self.capacity_bytes / GiB:.1f} GiB")
        lines.append(f"\ntokens/step {self.tokens_per_step:,}   FLOPs/step "
                     f"{self.flops_per_step:.3e} (the MFU denominator's numerator)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


# --------------------------------------------------------------------------- the config's facts


def model_args(cfg: Any, vocab_size: int | None = None) -> ModelArgs:
    """The native model args of the run: from `model.hf_dir`'s config.json, or `model.init`
    (a random model of the tokenizer's vocabulary); the vocabulary grows to the tokenizer's
    when it has added tokens, as in training. `vocab_size` is the tokenizer's (added tokens
    included) where it is known, as prepare records it; else the tokenizer is loaded."""
    from posttrain.models.hf_io import read_hf_config
    m = cfg.model
    vocab = vocab_size if vocab_size is not None else _tokenizer_vocab(cfg)
    if m.hf_dir:
        args = args_from_hf_config(read_hf_config(m.hf_dir), vocab_multiple=m.vocab_multiple)
    else:
        from posttrain.models.verify import tiny_hf_config
        hf = tiny_hf_config(m.init.family, **{"vocab_size": vocab or 256, **m.init.overrides})
        args = args_from_hf_config(hf.to_dict(), vocab_multiple=m.vocab_multiple)
    if vocab and vocab > args.vocab_size:
        args = args.replace(vocab_size=vocab)
    return args


def _tokenizer_vocab(cfg: Any) -> int | None:
    tok = getattr(cfg, "tokenizer", None)
    path = getattr(tok, "path", None)
    if not path or not (Path(path) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer
    return len(AutoTokenizer.from_pretrained(path))


def micro_batch_shape(cfg: Any) -> tuple[int, int]:
    """(rows, tokens per row) of one micro-batch: the packed rows of a loader recipe, or
    GRPO's one row of at most `max_tokens_per_micro_batch` (and at most a mini-batch's
    sequences at their longest)."""
    train = cfg.train
    if hasattr(train, "loader"):
        return train.loader.rows_per_batch, train.loader.packing.max_tokens_per_pack
    seqs = train.prompts_per_step // train.mini_batches * train.samples_per_prompt
    longest = cfg.data.max_tokens_per_sample + cfg.episode_tokens
    return 1, min(train.max_tokens_per_micro_batch, seqs * longest)


def _loss_kernel(cfg: Any) -> str:
    """The head kernel the recipe's loss runs: GRPO's token-ratio loss forms its gradients in
    the forward like SFT's cross-entropy, except under context parallelism
    (`posttrain.train.grpo_loss_root.GRPOLoss`); DPO, distillation and GSPO recompute."""
    name = type(cfg).__name__
    if name in ("GRPOConfig", "SequenceRLConfig"):
        from posttrain.losses.grpo import head_gradients_in_forward
        fused = head_gradients_in_forward(cfg.algorithm.ratio, cfg.train.engine.parallel.cp > 1)
        return "cross_entropy" if fused else "logprobs"
    return "logprobs" if name in ("DPOConfig", "DistillConfig") else "cross_entropy"


# --------------------------------------------------------------------------- the plan


def plan_run(cfg: Any, *, gpu: str | None = None, process: str | None = None,
             vocab_size: int | None = None) -> MemoryPlan:
    """The memory plan of recipe config `cfg` on `gpu` (a kind in `devices.GPU_MEMORY_BYTES`;
    None: the config's `run.gpu`, else this machine's CPU). `process` names the CPU process
    kind for the baseline (default: ``inline`` for `run.launcher: inline`, else ``ray_worker``).
    `vocab_size`: the tokenizer's, where prepare has recorded it (`model_args`).
    """
    run, engine_cfg = cfg.run, cfg.train.engine
    par = engine_cfg.parallel
    gpu = gpu or getattr(run, "gpu", None)
    from posttrain.config.parallel import resolve_mesh_shape
    world = run.num_workers
    dp_shard, tp = resolve_mesh_shape(world, par.dp_shard, par.tp, par.dp_replicate, par.cp)
    cp, ep = par.cp, getattr(par, "ep", 1)
    offload = bool(getattr(par, "offload", False))
    args = model_args(cfg, vocab_size)
    lora = cfg.model.lora
    counts = count_params(args, lora)
    master = DTYPES[cfg.model.dtype]
    compute = torch.bfloat16 if par.mixed_precision == "bf16" else master
    mb, cb = master.itemsize, compute.itemsize
    shard = dp_shard * cp
    sharded = (counts.root + counts.blocks / tp) / shard
    trainable = counts.trainable / (tp if lora is None else 1) / shard
    if lora is not None:   # adapters sit on block linears: split with their base over tp
        trainable = counts.trainable / tp / shard

    on_gpu = gpu is not None
    process = process or ("ray_worker" if run.launcher != "inline" else
                          "inline_rl" if hasattr(cfg, "rollout") else "inline")
    baseline = 0 if on_gpu else devices.cpu_baseline(process)
    resident = {"parameters": int(sharded * mb), "gradients": int(trainable * mb),
                "optimizer_state": int(2 * trainable * mb)}
    host: dict[str, int] = {}
    if offload:
        host = dict(resident)
        resident = {k: 0 for k in resident}

    rows, seq = micro_batch_shape(cfg)
    local_seq = seq // cp
    trace = trace_step(rank_args(args, tp, ep), rows=rows, seq_len=local_seq,
                       compute_dtype=compute, lora=lora,
                       activation_checkpointing=par.activation_checkpointing,
                       ac_every=par.ac_every, chunk_tokens=cfg.model.loss_chunk_tokens,
                       loss=_loss_kernel(cfg))
    block_gathered = (counts.block_max - counts.block_max_expert
                      + counts.block_max_expert / ep) / tp
    step = {"activations": trace.saved,
            "logits_chunk": trace.loss_peak,
            "backward_transient": max(0, trace.peak - trace.saved - trace.loss_peak),
            "fsdp_gathered_weights": int((counts.root + 2 * block_gathered) * cb)}
    if not on_gpu and shard > 1:
        # gloo's all_gather_into_tensor stages the whole output in a flat buffer of its own
        # before copying it out: one more copy of the largest unit FSDP gathers (measured: a
        # 0.58 GiB gather of two ranks raised the peak by 1.16 GiB)
        step["gloo_gather_staging"] = int(max(counts.root, block_gathered) * cb)
    if cp > 1:
        step["cp_gathered_kv"] = int(2 * rows * seq * args.num_kv_heads // tp * args.head_dim
                                     * cb)
    # on a CPU the largest tensor as read from its file (in the checkpoint's dtype), a copy of
    # it in the master dtype (converted, or the rank's shard cut from it), and the mapped
    # file's pages; a GPU receives one shard
    largest_numel = _largest_tensor(args)
    largest = largest_numel * mb
    load = ({"checkpoint_read": int(largest / shard)} if on_gpu else
            {"checkpoint_read": int(largest + _largest_read(cfg, largest_numel, mb)
                                    + _largest_file(cfg, counts.total))})
    phases = {"load": load, "step": step,
              "optimizer_step": {"optimizer_temporaries": 0 if offload else int(trainable * mb)}}
    notes = [f"logits_chunk: the loss kernel's peak over {rows * local_seq} target positions "
             f"in chunks of {min(cfg.model.loss_chunk_tokens, rows * local_seq)} x "
             f"{args.vocab_size} fp32 logits (its gradient buffers included)"]
    if not on_gpu and not par.release_host_heap:
        notes.append("parallel.release_host_heap is off: the heap keeps freed tensors resident "
                     "(glibc), which this plan does not count; the measured peak can exceed it")

    ranks: dict[str, RankPlan] = {}
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None:
        eng = _engine_parts(cfg, args, rollout, gpu)
        if rollout.placement == "colocated":
            resident["rollout_engine_weights"] = eng["weights"]
            phases["generate"] = {k: v for k, v in eng.items() if k != "weights"}
        else:
            ranks["rollout_engine"] = RankPlan(
                "rollout_engine", {"weights": eng["weights"]},
                {"generate": {k: v for k, v in eng.items() if k != "weights"}},
                baseline=0 if on_gpu else devices.cpu_baseline("ray_worker"))
        if cfg.algorithm.reference == "copy":
            resident["reference_parameters"] = int((counts.root + counts.blocks / tp) / shard * mb)
        if getattr(cfg, "critic", None) is not None:
            # PPO's critic (train/critic.py): a second model, fully trained (no LoRA), with its
            # gradients and Adam's two moments, sharded like the policy; its scalar head is
            # counted as the LM head it replaces (an upper bound); the policy's shape, also
            # when critic.hf_dir names another model
            full = count_params(args, None)
            (host if offload else resident)["critic_parameters_and_optimizer"] = int(
                4 * (full.root + full.blocks / tp) / shard * mb)
    ranks = {"trainer": RankPlan("trainer", resident, phases, baseline, host), **ranks}

    tokens, flops = _tokens_and_flops(cfg, args, rows, seq, world // tp // cp)
    layout = {"world": world, "dp_shard": dp_shard, "dp_replicate": par.dp_replicate, "tp": tp,
              "cp": cp, "ep": ep, "offload": offload,
              "activation_checkpointing": par.activation_checkpointing,
              "mixed_precision": par.mixed_precision, "micro_batch": f"{rows} x {seq}",
              "lora_rank": lora.rank if lora else 0}
    capacity = (devices.gpu_bytes(gpu) if on_gpu
                else devices.cpu_bytes_per_process(processes_per_node(cfg)))
    return MemoryPlan(type(cfg).__name__.removesuffix("Config").lower(),
                      gpu or "cpu", capacity, layout, ranks, tokens, flops, notes)


def processes_per_node(cfg: Any) -> int:
    """Trainer processes (and separately placed engines) sharing one machine's memory."""
    run = cfg.run
    n = math.ceil(run.num_workers / run.num_nodes)
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None and rollout.placement == "separate":
        n += math.ceil(rollout.num_engines / run.num_nodes)
    return n


def _engine_parts(cfg: Any, args: ModelArgs, rollout: Any, gpu: str | None) -> dict[str, int]:
    """A rollout engine's weights, KV cache and decode logits (module docstring)."""
    n = cfg.train.samples_per_prompt
    rows = min(cfg.train.prompts_per_step * n, max(n, rollout.max_batch_sequences // n * n))
    capacity = cfg.data.max_tokens_per_sample + cfg.episode_tokens
    if rollout.kind == "vllm":
        dtype = DTYPES[rollout.vllm.get("dtype", cfg.model.dtype)]
        util = float(rollout.vllm.get("gpu_memory_utilization", 0.9))
        reserved = int(util * devices.gpu_bytes(gpu)) if gpu else int(
            rollout.vllm.get("kv_cache_memory_bytes", 0))
        weights = count_params(args).total * dtype.itemsize
        return {"weights": max(reserved, weights) if gpu else weights,
                "kv_cache": 0 if gpu else reserved, "decode_logits": 0}
    dtype = DTYPES[cfg.model.dtype]
    return {"weights": count_params(args).total * dtype.itemsize,
            "kv_cache": 2 * kv_cache_bytes(args, rows, capacity, dtype),
            "decode_logits": 3 * rows * args.vocab_size * 4}


def _largest_tensor(args: ModelArgs) -> int:
    """Elements of the largest single weight (the embedding, or a stacked expert weight)."""
    from posttrain.plan.trace import meta_model
    return max(p.numel() for p in meta_model(args).parameters())


def _largest_read(cfg: Any, numel: int, master_bytes_per_element: float) -> float:
    """Bytes the loader holds of the largest native tensor (`numel` elements) as read, in the
    dtype its checkpoint stores it in (the safetensors headers: a bf16 checkpoint reads half of
    what the fp32 master weight takes). Twice that where the native tensor is larger than
    any stored one: stacked from per-expert tensors, which are held until the stack is made,
    or a vocabulary padded with a copy. The master dtype for a random init (the run writes the
    file in fp32) or a checkpoint not readable here."""
    fallback = numel * master_bytes_per_element
    hf_dir = cfg.model.hf_dir
    if not hf_dir or not os.path.isdir(hf_dir):
        return fallback
    stored_bytes, stored_numel = 0, 0
    for path in Path(hf_dir).glob("*.safetensors"):
        try:
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for entry in (e for name, e in header.items() if name != "__metadata__"):
                start, end = entry["data_offsets"]
                if end - start > stored_bytes:
                    stored_bytes, stored_numel = end - start, math.prod(entry["shape"])
        except (OSError, ValueError, KeyError, TypeError):
            return fallback
    if not stored_numel:
        return fallback
    read = numel * stored_bytes / stored_numel
    return 2 * read if stored_numel < numel else read


def _largest_file(cfg: Any, params: int) -> int:
    """The largest safetensors file of the checkpoint; for a random init the one file the run
    writes (the model in fp32, `write_random_hf_model`)."""
    hf_dir = cfg.model.hf_dir
    if not hf_dir:
        return params * 4
    if not os.path.isdir(hf_dir):
        return 0
    return max((f.stat().st_size for f in Path(hf_dir).glob("*.safetensors")), default=0)


def _tokens_and_flops(cfg: Any, args: ModelArgs, rows: int, seq: int, dp: int
                      ) -> tuple[int, float]:
    """Tokens and model FLOPs (`posttrain.models.flops`) of one optimizer step, every row
    one document (the most attention can cost); GRPO: every sequence at its longest."""
    from posttrain.models.flops import flops_per_token
    lora = cfg.model.lora
    kw = {"lora_rank": lora.rank, "lora_targets": tuple(lora.targets)} if lora else {}
    if hasattr(cfg.train, "tokens_per_step"):
        tokens = cfg.train.tokens_per_step
        return tokens, tokens * flops_per_token(args, seq, **kw)
    train = cfg.train
    seqs = train.prompts_per_step * train.samples_per_prompt // train.mini_batches
    length = cfg.data.max_tokens_per_sample + cfg.episode_tokens
    tokens = seqs * length
    return tokens, tokens * flops_per_token(args, length, **kw)


def plan_dict(plan: MemoryPlan) -> dict[str, Any]:
    return asdict(plan)
