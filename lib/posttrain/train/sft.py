"""The SFT recipe's parts: its config schema and the per-rank worker the driver calls.

Data rule (documented contract): the data order is defined globally, independent of the number
of workers. Every rank reads the same global stream of packed micro-batches (packing runs at
tens of millions of tokens/s, so reading twice costs nothing next to training); optimizer step
s consumes global micro-batches [s*G, (s+1)*G), and rank r of W trains on those with index
≡ r (mod W). A checkpoint stores the global stream position at a step boundary, so a run
resumed on a different number of workers W' (any W' dividing G) continues with exactly the same
global batches; only the float summation order of the gradient changes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal


from posttrain.config.loader import build
from posttrain.config.recipes import DataConfig
from posttrain.data.loader import LoaderConfig, TrainLoader, sources_from_manifest
from posttrain.data.prepared import local_view
from posttrain.data.tokenizer import TokenizerConfig
from posttrain.errors import DataError
from posttrain.train.engine import Engine, EngineConfig, ModelConfig
from posttrain.train.metrics import device_peak_flops, peak_memory_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SFTTrainConfig(EngineConfig):
    tokens_per_step: int                      # global token slots per optimizer step
    loader: LoaderConfig = LoaderConfig()

    def __post_init__(self) -> None:
        super().__post_init__()
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

    def __post_init__(self) -> None:
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
class GenerateConfig:
    num_samples: int = 4
    max_new_tokens: int = 48


@dataclass(frozen=True)
class EvalConfig:
    max_batches: int = 50
    generate: GenerateConfig = GenerateConfig()


@dataclass(frozen=True)
class ExportConfig:
    format: Literal["full", "merged", "peft"] = "full"   # merged/peft need model.lora
    dtype: Literal["float32", "bfloat16"] | None = None


@dataclass(frozen=True)
class SFTConfig:
    tokenizer: TokenizerConfig
    data: DataConfig
    model: ModelConfig
    train: SFTTrainConfig
    run: RunConfig = RunConfig()
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self) -> None:
        if self.export.format in ("merged", "peft") and self.model.lora is None:
            raise ValueError(f"export.format: {self.export.format} needs model.lora")
        if self.export.format == "full" and self.model.lora is not None:
            # else the run would train, then fail in export on the adapter parameters
            raise ValueError("export.format: full cannot write a LoRA model; set export.format "
                             "to merged (full weights, adapters folded in) or peft (the adapter)")
        if self.data.format not in ("chat", "sequence"):
            raise ValueError(f"SFT trains on chat or sequence data, not {self.data.format!r}")
        check_step_split(self.train.micro_batches_per_step, self.run, self.train.parallel)


def check_step_split(micro_batches: int, run: RunConfig, parallel: Any) -> None:
    """A step's micro-batches must deal out evenly over the data-parallel ranks: run.num_workers
    processes over `parallel.tp`-wide tensor-parallel groups (ranks of a group share data)."""
    from posttrain.distributed.env import resolve_mesh_shape
    dp, tp = resolve_mesh_shape(run.num_workers, parallel.dp_shard, parallel.tp)
    if micro_batches % dp:
        ranks = (f"run.num_workers={run.num_workers}" if tp == 1 else
                 f"{dp} data-parallel ranks (run.num_workers={run.num_workers} / "
                 f"parallel.tp={tp})")
        raise ValueError(f"{micro_batches} micro-batches per step (tokens_per_step / "
                         f"(rows_per_batch x max_tokens_per_pack)) do not split over {ranks}")


class SFTWorker:
    """One rank of an SFT run: owns an `Engine` and a view of the global data stream."""

    def __init__(self, cfg: dict[str, Any], hf_dir: str, prepared_dir: str, run_dir: str):
        self.cfg = build(SFTConfig, cfg, where="sft config")
        self.prepared_dir = local_view(prepared_dir)   # shards stay remote; metadata local
        manifest_vocab = _tokenizer_vocab(prepared_dir)
        self.engine = Engine(self.cfg.model, self.cfg.train, hf_dir, run_dir,
                             vocab_size=manifest_vocab)
        self.rank, self.world = self.engine.rank, self.engine.world   # the engine joined the group
        self.loader = TrainLoader(sources_from_manifest(prepared_dir, "train"),
                                  self.cfg.train.loader)
        self._batches = None
        self.tokens_seen = 0
        self.peak_flops, self.peak_source = device_peak_flops(self.engine.device)

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world, "params": self.engine.num_params,
                "trainable_params": self.engine.num_trainable, "device": str(self.engine.device),
                "peak_flops": self.peak_flops, "peak_flops_source": self.peak_source,
                "micro_batches_per_step": self.cfg.train.micro_batches_per_step}

    def resume(self) -> int:
        """Load the newest valid checkpoint if any; returns the step to continue from."""
        extra = self.engine.load_checkpoint()
        if extra is not None:
            self.loader.load_state_dict(extra["loader"])
            self.tokens_seen = int(extra["tokens_seen"])
        return self.engine.step

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step; None when the data is exhausted before a full step."""
        if self._batches is None:
            self._batches = iter(self.loader)
        t0 = time.perf_counter()
        batches = [b for _, b in zip(range(self.cfg.train.micro_batches_per_step),
                                     self._batches)]
        if len(batches) < self.cfg.train.micro_batches_per_step:
            return None
        data_s = time.perf_counter() - t0
        mine = self.engine.dp.share(batches)
        loss_tokens = sum(b["num_loss_tokens"] for b in batches)
        metrics = self.engine.train_step(mine, loss_tokens)
        real = sum(b["num_real_tokens"] for b in batches)
        pad = sum(b["num_pad_tokens"] for b in batches)
        self.tokens_seen += real
        seconds = time.perf_counter() - t0
        step_flops = sum(self._row_flops(b) for b in batches)
        metrics.update({
            "real_tokens": real, "loss_tokens": loss_tokens, "tokens_seen": self.tokens_seen,
            "padding_fraction": pad / max(real + pad, 1),
            "real_tokens_per_s": real / seconds, "data_wait_s": data_s, "step_total_s": seconds,
            "mfu": step_flops / seconds / (self.peak_flops * self.world),
            "peak_memory_bytes": peak_memory_bytes(self.engine.device)})
        return metrics

    def _row_flops(self, batch: dict) -> float:
        """Model FLOPs of the real tokens of a batch (padding excluded, per-document attention)."""
        from posttrain.models.flops import flops_per_token
        lora = self.cfg.model.lora
        kw = {"lora_rank": lora.rank, "lora_targets": tuple(lora.targets)} if lora else {}
        total = 0.0
        for lengths, pad in zip(batch["document_lengths"], batch["row_num_pad"]):
            docs = list(lengths[:-1]) if pad else list(lengths)
            if docs:
                total += sum(docs) * flops_per_token(self.engine.args, sum(docs),
                                                     training=True, document_lengths=docs, **kw)
        return total

    def save_checkpoint(self) -> str:
        return self.engine.save_checkpoint({"loader": self.loader.state_dict(),
                                            "tokens_seen": self.tokens_seen})

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and perplexity over at most eval.max_batches micro-batches.

        Batches are split over the data-parallel ranks; under FSDP every rank must run the same
        number of forwards (the all-gathers are collective), so a rank with one batch fewer
        repeats its first batch without counting it.
        """
        try:
            sources = sources_from_manifest(self.prepared_dir, "eval")
        except DataError as e:
            log.warning("no eval split: %s", e)
            return {}
        cfg = self.cfg.train.loader
        eval_cfg = LoaderConfig(packing=cfg.packing, mode=cfg.mode,
                                rows_per_batch=cfg.rows_per_batch, epochs=1, background=False)
        with TrainLoader(sources, eval_cfg) as loader:
            batches = [b for _, b in zip(range(self.cfg.eval.max_batches), loader)]
        if not batches:
            return {}
        dp = self.engine.dp
        mine = dp.share(batches)
        loss_sum = sum(self.engine.eval_loss_sum(b) for b in mine)
        for _ in range(dp.rounds(len(batches)) - len(mine)):
            self.engine.eval_loss_sum(batches[0])
        total = dp.sum(loss_sum)
        tokens = sum(b["num_loss_tokens"] for b in batches)
        loss = total / max(tokens, 1)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)),
                "eval_tokens": tokens, "eval_batches": len(batches)}

    def export(self, out_dir: str) -> str | None:
        """Write the HF checkpoint (rank 0); a collective, every rank must call it."""
        from posttrain.train.export import export_worker
        return export_worker(self.engine, self.cfg, self.prepared_dir, out_dir)

    def close(self) -> None:
        self.loader.close()


def _tokenizer_vocab(prepared_dir: str) -> int | None:
    """The tokenizer's vocabulary size recorded by prepare (added tokens included)."""
    import json

    import fsspec
    fs, root = fsspec.core.url_to_fs(prepared_dir)
    with fs.open(f"{root.rstrip('/')}/manifest.json") as f:
        return json.load(f)["tokenizer"].get("vocab_size")
