"""Does a plan fit the declared devices? The check every flow's start step runs.

A rank kind whose predicted peak exceeds its device (a GPU of `run.gpu`, less
`GPU_RESERVE_BYTES`; on a CPU run, this machine's RAM shared by the processes of a node) stops
the run with a `PlanError` naming the largest part and the knobs that shrink it. `run.plan_check`
says what happens: ``error`` (default) stops, ``warn`` logs and goes on, ``off`` skips the plan.
A GPU config without `run.gpu` (the kind is unknown) is not checked, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError
from posttrain.plan.devices import GPU_RESERVE_BYTES, GiB
from posttrain.plan.memory import MemoryPlan, RankPlan, plan_run

log = logging.getLogger(__name__)

# the knobs that shrink each part, as config keys
KNOBS: dict[str, str] = {
    "parameters": "shard wider (parallel.dp_shard, run.num_workers), parallel.tp, "
                  "parallel.offload: true, model.lora, model.dtype: bfloat16",
    "gradients": "parallel.offload: true, model.lora, more ranks (parallel.dp_shard)",
    "optimizer_state": "parallel.offload: true, model.lora, more ranks (parallel.dp_shard)",
    "optimizer_temporaries": "parallel.offload: true, model.lora",
    "activations": "parallel.activation_checkpointing: full, a shorter pack "
                   "(train.loader.packing.max_tokens_per_pack / "
                   "train.max_tokens_per_micro_batch), fewer rows (train.loader.rows_per_batch), "
                   "parallel.cp, parallel.tp, parallel.mixed_precision: bf16",
    "logits_chunk": "model.loss_chunk_tokens, a shorter pack, parallel.cp",
    "backward_transient": "parallel.activation_checkpointing: full, a shorter pack, "
                          "parallel.cp, parallel.tp",
    "fsdp_gathered_weights": "parallel.tp, parallel.mixed_precision: bf16",
    "cp_gathered_kv": "a shorter pack",
    "checkpoint_read": "a checkpoint in smaller safetensors shards",
    "rollout_engine_weights": "rollout.placement: separate, rollout.vllm.gpu_memory_utilization",
    "weights": "rollout.vllm.tensor_parallel_size, model.dtype: bfloat16",
    "kv_cache": "rollout.max_batch_sequences, sampling.max_new_tokens, "
                "rollout.vllm.gpu_memory_utilization",
    "decode_logits": "rollout.max_batch_sequences",
    "reference_parameters": "algorithm.reference: lora_base (with model.lora), or none",
    "critic_parameters_and_optimizer": "shard wider (parallel.dp_shard, run.num_workers), "
                                       "parallel.offload: true",
    "baseline": "fewer processes per machine (run.num_workers / run.num_nodes)",
}


class PlanError(ConfigError):
    """The run's memory plan does not fit its devices."""


def check_fits(plan: MemoryPlan) -> list[str]:
    """One message per rank kind whose predicted peak exceeds its device (empty: it fits)."""
    limit = plan.capacity_bytes - (GPU_RESERVE_BYTES if plan.device != "cpu" else 0)
    return [_message(kind, r, plan, limit) for kind, r in plan.ranks.items()
            if r.peak_bytes > limit]


def _message(kind: str, rank: RankPlan, plan: MemoryPlan, limit: int) -> str:
    parts = sorted(rank.parts().items(), key=lambda kv: -kv[1])
    top = [name for name, n in parts if n and name != "baseline"][:2] or [parts[0][0]]
    over = rank.peak_bytes - limit
    lines = [f"{kind} rank: predicted peak {rank.peak_bytes / GiB:.2f} GiB does not fit "
             f"{limit / GiB:.2f} GiB of {plan.device} (over by {over / GiB:.2f} GiB; "
             f"peak in phase '{rank.peak_phase}')"]
    for name in top:
        n = dict(parts)[name]
        lines.append(f"  {name}: {n / GiB:.2f} GiB -> {KNOBS.get(name, 'see posttrain plan')}")
    return "\n".join(lines)


def check_run(cfg: Any, *, gpu: str | None = None, mode: str | None = None) -> MemoryPlan | None:
    """The start-of-run check: plan `cfg` and compare it with its devices (module docstring).
    `mode` overrides `run.plan_check`. Returns the plan (None when not checked)."""
    mode = mode or getattr(cfg.run, "plan_check", "error")
    if mode == "off":
        return None
    gpu = gpu or getattr(cfg.run, "gpu", None)
    if gpu is None and _asks_for_gpus(cfg):
        log.warning("memory plan not checked: the config asks for GPUs but does not say which; "
                    "set run.gpu (e.g. h100-80g) to check it before launch")
        return None
    hf_dir = cfg.model.hf_dir
    if not _base_readable(cfg):
        log.warning("memory plan not checked: model.hf_dir %s is not readable here (made by an "
                    "earlier step, or remote); `posttrain plan` once it exists", hf_dir)
        return None
    plan = plan_run(cfg, gpu=gpu)
    problems = check_fits(plan)
    if problems:
        text = ("the memory plan does not fit (`posttrain plan --config ...` shows every "
                "part; run.plan_check: warn or off launches anyway):\n" + "\n".join(problems))
        if mode == "error":
            raise PlanError(text)
        log.warning("%s", text)
    else:
        log.info("memory plan: %s", ", ".join(f"{k} {v / GiB:.2f} GiB"
                                               for k, v in plan.peak_bytes.items()))
    return plan


def host_budget(cfg: Any, *, hf_dir: str | None = None,
                vocab_size: int | None = None) -> int | None:
    """What a trainer rank of CPU run `cfg` may keep resident before its heap gives freed pages
    back (`posttrain.train.host_heap.HostHeap`): the plan's predicted trainer peak. None where
    that does not apply or no plan is made here: a GPU run, `release_host_heap` off,
    `run.plan_check: off`, a base model not readable here, or a config the plan cannot trace
    (then every release point releases, as without a budget).

    The driver passes what the ranks will build from: `hf_dir`, the checkpoint the run starts
    from (a `model.init` run's random one, once written), and `vocab_size`, the tokenizer's as
    prepare recorded it; so the plan reads a config.json and loads no tokenizer."""
    if hf_dir is not None:
        cfg = dataclasses.replace(cfg, model=cfg.model.starting_from(hf_dir))
    if (_asks_for_gpus(cfg) or getattr(cfg.run, "gpu", None)
            or not cfg.train.engine.parallel.release_host_heap
            or getattr(cfg.run, "plan_check", "error") == "off" or not _base_readable(cfg)):
        return None
    try:
        plan = plan_run(cfg, vocab_size=vocab_size)
    except (ConfigError, NotImplementedError, ValueError, RuntimeError) as e:
        log.warning("memory plan not made (%s): the trainer gives freed host memory back at "
                    "every phase", e)
        return None
    return plan.peak_bytes["trainer"]


def _asks_for_gpus(cfg: Any) -> bool:
    return float(dict(cfg.run.resources_per_worker or {}).get("GPU", 0)) > 0


def _base_readable(cfg: Any) -> bool:
    hf_dir = cfg.model.hf_dir
    return not hf_dir or (Path(hf_dir) / "config.json").is_file()
