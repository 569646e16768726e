"""The training parts' config slices: the optimizer and its schedule, the engine, a recipe's
``train:`` and ``run:`` sections, the export, and the cross-part checks every training recipe
makes (`check_export`, `check_step_split`, `check_context_parallel`, `check_eval_tasks`).

Kept apart from `posttrain.train` (the engine and the recipe kernel import torch) so that a
config is read and checked without importing torch; those modules import them from here (the
old import paths keep working).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from posttrain.config.data import LoaderConfig
from posttrain.config.loader import inline
from posttrain.config.model import check_peft_export
from posttrain.config.parallel import ParallelConfig, resolve_mesh_shape
from posttrain.train.trackers import TrackerConfig, check_trackers


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_embeddings: bool = True
    fused: bool = False                 # fused AdamW kernel (CUDA only)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError("optimizer.lr must be positive")
        if not (0 <= self.betas[0] < 1 and 0 <= self.betas[1] < 1):
            raise ValueError("optimizer.betas must be in [0, 1)")


@dataclass(frozen=True)
class SchedulerConfig:
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0           # final lr as a fraction of the peak

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError("scheduler.warmup_steps must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("scheduler.min_lr_ratio must be in [0, 1]")


@dataclass(frozen=True)
class EngineConfig:
    max_steps: int
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    grad_clip_norm: float = 1.0
    seed: int = 0
    checkpoint_every_steps: int = 50
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        if self.grad_clip_norm < 0:
            raise ValueError("grad_clip_norm must be >= 0 (0 disables clipping)")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A recipe's ``train:`` section: the engine's config (inline) and how a step is fed."""

    engine: EngineConfig = inline()
    tokens_per_step: int                      # global token slots per optimizer step
    loader: LoaderConfig = LoaderConfig()

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "dpo": "DPO's loss settings are the top-level `loss:` section (beta, loss_type, ...)",
        "reference": "DPO's reference is the top-level `reference:` section"}

    def __post_init__(self) -> None:
        micro_tokens = self.loader.rows_per_batch * self.loader.packing.max_tokens_per_pack
        if self.tokens_per_step % micro_tokens:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} must be a multiple of "
                             f"rows_per_batch x max_tokens_per_pack = {micro_tokens}")

    @property
    def micro_batches_per_step(self) -> int:
        return self.tokens_per_step // (self.loader.rows_per_batch *
                                        self.loader.packing.max_tokens_per_pack)


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/sft"
    num_workers: int = 1
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    launcher: Literal["ray", "inline"] = "ray"
    num_nodes: int = 1                        # machines (Metaflow @metaflow_ray num_parallel)
    tensorboard_dir: str | None = None        # also mirror metrics.jsonl as TensorBoard events
    # and to experiment trackers: MLflow, W&B (`posttrain.train.trackers`)
    trackers: tuple[TrackerConfig, ...] = ()
    # the GPU kind each worker gets (h100-80g, h200, a100-40g, ...: `posttrain.plan.devices`):
    # the memory plan is checked against it when a flow starts
    gpu: str | None = None
    # what a flow's start does when the memory plan does not fit (`posttrain.plan.check`):
    # error (stop, naming the part and the knobs), warn (log and go on), off (no plan)
    plan_check: Literal["error", "warn", "off"] = "error"

    def __post_init__(self) -> None:
        if self.gpu is not None:
            from posttrain.plan.devices import gpu_bytes
            gpu_bytes(self.gpu)
        check_trackers(self.trackers)
        if self.num_workers < 1:
            raise ValueError("run.num_workers must be at least 1")
        if self.num_nodes < 1:
            raise ValueError("run.num_nodes must be at least 1")
        if self.num_nodes > 1 and self.launcher != "ray":
            raise ValueError(f"run.num_nodes={self.num_nodes} needs run.launcher: ray (the "
                             "trainer actors are placed over the Ray cluster of all nodes)")
        if self.num_nodes > self.num_workers:
            raise ValueError(f"run.num_nodes={self.num_nodes} is more than run.num_workers="
                             f"{self.num_workers}: a node without a worker would sit idle")
        if self.launcher == "inline" and self.num_workers != 1:
            raise ValueError("run.launcher: inline runs one worker in the driver process; "
                             "use launcher: ray for num_workers > 1")


@dataclass(frozen=True)
class ExportConfig:
    format: Literal["full", "merged", "peft"] = "full"   # merged/peft need model.lora
    dtype: Literal["float32", "bfloat16"] | None = None


def check_export(export: ExportConfig, lora: Any) -> None:
    """export.format must match whether the model has LoRA adapters, and a PEFT adapter must
    be able to express them (`posttrain.config.model.check_peft_export`)."""
    if export.format in ("merged", "peft") and lora is None:
        raise ValueError(f"export.format: {export.format} needs model.lora")
    if export.format == "peft":
        check_peft_export(lora.targets, lora.dropout)
    if export.format == "full" and lora is not None:
        # else the run would train, then fail in export on the adapter parameters
        raise ValueError("export.format: full cannot write a LoRA model; set export.format "
                         "to merged (full weights, adapters folded in) or peft (the adapter)")


def check_step_split(micro_batches: int, run: RunConfig, parallel: Any, streams: int = 1
                     ) -> None:
    """A step's micro-batches must deal out evenly over the data-parallel ranks: run.num_workers
    processes over `parallel.tp`-wide tensor-parallel groups (ranks of a group share data);
    with `streams` S > 1, over the streams (G / S each), and the streams over the ranks."""
    dp_shard, tp = resolve_mesh_shape(run.num_workers, parallel.dp_shard, parallel.tp,
                                      parallel.dp_replicate, parallel.cp, parallel.ep)
    dp = parallel.dp_replicate * dp_shard
    split = " x ".join(f"parallel.{k}={v}" for k, v in (("tp", tp), ("cp", parallel.cp))
                       if v > 1)
    ranks = (f"run.num_workers={run.num_workers}" if not split else
             f"{dp} data-parallel ranks (run.num_workers={run.num_workers} / "
             + (f"({split}))" if " x " in split else f"{split})"))
    if micro_batches % dp:
        raise ValueError(f"{micro_batches} micro-batches per step (tokens_per_step / "
                         f"(rows_per_batch x max_tokens_per_pack)) do not split over {ranks}")
    if streams > 1 and (micro_batches % streams or streams % dp):
        raise ValueError(f"train.loader.streams={streams} must divide the {micro_batches} "
                         f"micro-batches per step and be a multiple of the {ranks}: each rank "
                         f"reads whole streams, each stream gives every step the same number "
                         f"of micro-batches")


def check_context_parallel(recipe: str, parallel: Any, loader: LoaderConfig) -> None:
    """`parallel.cp > 1` cuts every packed row into 2 cp chunks: the recipe must take it (its
    loss adds up over tokens) and its rows must have a fixed length that divides."""
    if parallel.cp == 1:
        return
    if recipe not in ("sft",):
        raise ValueError(f"parallel.cp={parallel.cp}: context parallelism is built for SFT "
                         f"and GRPO (losses that add up over tokens); the {recipe} recipe "
                         "needs parallel.cp=1")
    pack = loader.packing.max_tokens_per_pack
    if loader.mode != "packed" or pack % (2 * parallel.cp):
        raise ValueError(f"parallel.cp={parallel.cp} cuts rows into {2 * parallel.cp} chunks: "
                         f"use train.loader.mode: packed with max_tokens_per_pack a multiple "
                         f"of {2 * parallel.cp} (got {loader.mode}, {pack})")


def check_eval_tasks(sources: list, tasks: tuple) -> None:
    """`eval.tasks` are suite tasks the evaluate step runs after the held-out ones (the
    flows report the first held-out task's metrics): they need held-out `sources`, and no name
    may repeat, theirs or the sources' (``eval<i>`` when unnamed)."""
    if tasks and not sources:
        raise ValueError("eval.tasks run beside the held-out evaluation, and this config has "
                         "no held-out data (data.eval; KTO: eval.pairs): add some, or run the "
                         "tasks as a suite (posttrain evaluate --suite)")
    names = [src.name or f"eval{i}" for i, src in enumerate(sources)] + [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"eval.tasks: task names {repeated} repeat (the held-out data.eval "
                         "sources are tasks of the evaluation too); rename them")
