"""The DPO recipe's parts: config schema, the loss module (FSDP root) and the per-rank worker.

    loss module:  hidden = model(packed pairs) -> per-pair response log-probs (chunked, never
                  full logits; `posttrain.losses.dpo.dpo_pair_logps`) -> dpo_loss (sum over
                  pairs; the engine divides by the step's global pair count)

Reference log-probs, `reference.kind`:

* ``precomputed`` (default): before the first step the workers run the starting model once
  over every train and eval pair (each rank its share of the batches) and rank 0 writes
  ``reference/ref_logps_<split>.parquet`` (pair_key, chosen, rejected) under the run's
  checkpoint directory; training looks the values up by `pair_key`. No second model is held,
  and a resumed run reads the same file (it is written before the first checkpoint).
* ``lora_base``: with LoRA, the reference is the base model itself, adapters disabled
  (`posttrain.models.lora.disable_adapters`), run without gradients inside the same forward;
  no second copy of the weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from posttrain.config.recipes import DataConfig
from posttrain.data.tokenizer import TokenizerConfig
from posttrain.losses.dpo import LossType, dpo_loss, dpo_pair_logps
from posttrain.models.transformer import Transformer
from posttrain.train.engine import ModelConfig
from posttrain.train.recipe import (ExportConfig, Recipe, RunConfig, TrainConfig, check_export,
                                    check_context_parallel, check_step_split, eval_suite, policy_flops)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DPOLossConfig:
    beta: float = 0.1
    loss_type: LossType = "sigmoid"
    label_smoothing: float = 0.0
    logp_reduction: Literal["sum", "mean"] = "sum"    # "mean" (per token) suits ipo

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"loss.beta must be positive, got {self.beta}")
        if self.loss_type not in ("sigmoid", "ipo", "hinge", "robust"):
            raise ValueError(f"loss.loss_type must be sigmoid, ipo, hinge or robust, got "
                             f"{self.loss_type!r}")
        if self.loss_type in ("ipo", "hinge") and self.label_smoothing:
            raise ValueError(f"loss.label_smoothing applies to sigmoid and robust only, not "
                             f"{self.loss_type}")
        eps = self.label_smoothing
        if eps < 0 or eps > 0.5 or (self.loss_type == "robust" and eps == 0.5):
            raise ValueError(f"loss.label_smoothing={eps} is outside [0, 0.5] for sigmoid, "
                             f"[0, 0.5) for robust")


@dataclass(frozen=True)
class ReferenceConfig:
    kind: Literal["precomputed", "lora_base"] = "precomputed"


@dataclass(frozen=True)
class PairEvalConfig:
    max_batches: int = 50                     # in training: held-out micro-batches
    max_samples: int | None = 500             # the evaluate step: pairs of each eval source


@dataclass(frozen=True)
class DPOConfig:
    tokenizer: TokenizerConfig
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    loss: DPOLossConfig = DPOLossConfig()
    reference: ReferenceConfig = ReferenceConfig()
    run: RunConfig = RunConfig(dir="runs/dpo")
    eval: PairEvalConfig = PairEvalConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self) -> None:
        check_pair_recipe(self, "DPO")
        if self.reference.kind == "lora_base" and self.model.lora is None:
            raise ValueError("reference.kind: lora_base needs model.lora (the reference "
                             "is the base model with the adapters disabled); use precomputed")


def check_pair_recipe(cfg: Any, name: str) -> None:
    """Constraints every pair-trained recipe (DPO, reward model) shares."""
    if cfg.data.format != "preference":
        raise ValueError(f"{name} trains on preference data: set data.format: preference, not "
                         f"{cfg.data.format!r}")
    if cfg.train.loader.format != "preference":
        raise ValueError(f"{name} reads pairs: set train.loader.format: preference")
    pack = cfg.train.loader.packing.max_tokens_per_pack
    if pack < 2 * cfg.data.max_tokens_per_sample:
        # a pair is one unit, kept whole or dropped (both modes); this bound makes dropping
        # impossible
        raise ValueError(f"train.loader.packing.max_tokens_per_pack={pack} must hold a whole "
                         f"pair: at least 2 x data.max_tokens_per_sample = "
                         f"{2 * cfg.data.max_tokens_per_sample}")
    check_export(cfg.export, cfg.model.lora)
    check_step_split(cfg.train.micro_batches_per_step, cfg.run, cfg.train.engine.parallel,
                     cfg.train.loader.streams)
    check_context_parallel(name, cfg.train.engine.parallel, cfg.train.loader)


class DPOLoss(nn.Module):
    """FSDP root: policy (and, for lora_base, reference) pair log-probs -> summed DPO loss.

    Returns ``(loss_sum, stats)``: stats are sums over the batch's pairs of ``accuracy``,
    implicit ``rewards_chosen`` / ``rewards_rejected``, ``margins`` and the policy's
    ``logps_chosen`` / ``logps_rejected``. With ``logps_only=True`` (no loss, for the reference
    pass) it returns the policy's (chosen, rejected) log-probs.
    """

    input_keys = ("input_ids", "labels", "position_ids", "document_lengths", "sequence_ids",
                  "pair_index", "ref_chosen", "ref_rejected")

    def __init__(self, model: Transformer, cfg: DPOLossConfig, reference: str,
                 chunk_tokens: int = 1024):
        super().__init__()
        self.model, self.cfg, self.reference = model, cfg, reference
        self.chunk_tokens = chunk_tokens

    def _pair_logps(self, input_ids, labels, position_ids, document_lengths, sequence_ids,
                    pair_index):
        head = self.model.head
        hidden = self.model(input_ids, position_ids, document_lengths)
        return dpo_pair_logps(hidden, head.weight, labels, pair_index, sequence_ids,
                              real_vocab_size=head.real_vocab_size,
                              chunk_tokens=self.chunk_tokens,
                              softcap=getattr(head, "softcap", None),
                              reduction=self.cfg.logp_reduction)

    def forward(self, input_ids, labels, position_ids, document_lengths, sequence_ids,
                pair_index, ref_chosen=None, ref_rejected=None, *, logps_only: bool = False):
        args = (input_ids, labels, position_ids, document_lengths, sequence_ids, pair_index)
        if logps_only:
            return self._pair_logps(*args)
        if self.reference == "lora_base":
            from posttrain.models.lora import disable_adapters
            with torch.no_grad(), disable_adapters(self.model):
                ref_chosen, ref_rejected = self._pair_logps(*args)
        policy_chosen, policy_rejected = self._pair_logps(*args)
        cfg = self.cfg
        loss, m = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                           beta=cfg.beta, loss_type=cfg.loss_type,
                           label_smoothing=cfg.label_smoothing, reduction="sum")
        n = policy_chosen.shape[0]
        stats = {k: m[k] * n for k in ("accuracy", "rewards_chosen", "rewards_rejected",
                                       "margins")}
        stats["logps_chosen"] = policy_chosen.detach().sum()
        stats["logps_rejected"] = policy_rejected.detach().sum()
        return loss, stats


def pair_postfix(m: dict) -> dict[str, str]:
    return {"loss": f"{m['loss']:.3f}", "acc": f"{m['accuracy']:.2f}",
            "pairs/s": f"{m['pairs_per_s']:.0f}", "mfu": f"{m['mfu']:.1%}"}


def pair_result(history: list[dict]) -> dict[str, Any]:
    if not history:
        return {}
    n = len(history)
    return {"final_loss": history[-1]["loss"], "final_accuracy": history[-1]["accuracy"],
            "mean_pairs_per_s": sum(m["pairs_per_s"] for m in history) / n,
            "mean_real_tokens_per_s": sum(m["real_tokens_per_s"] for m in history) / n,
            "mean_mfu": sum(m["mfu"] for m in history) / n}


def pair_summary(result: dict) -> list[str]:
    ev = result.get("eval") or {}
    lines = []
    if "final_loss" in result:
        lines.append(f"final train loss {result['final_loss']:.4f}, reward accuracy "
                     f"{result['final_accuracy']:.2f}; {result['mean_pairs_per_s']:.1f} pairs/s; "
                     f"MFU {result['mean_mfu']:.1%}")
    if ev:
        lines.append(f"held-out: loss {ev['eval_loss']:.4f}, accuracy {ev['eval_accuracy']:.2f}"
                     + (f", margin {ev['eval_margins']:.4f}" if "eval_margins" in ev else "")
                     + f" over {ev['eval_pairs']} pairs")
    return lines


class DPO(Recipe):
    """Direct preference optimization: the loss over pairs, the reference log-probs."""

    name = "dpo"
    config_cls = DPOConfig
    unit_field, unit_name = "num_pairs", "pairs"

    def __init__(self, worker: Any):
        super().__init__(worker)
        self._ref: dict[str, dict[int, tuple[float, float]]] = {}

    def loss_root(self, model: Transformer) -> nn.Module:
        return DPOLoss(model, self.cfg.loss, self.cfg.reference.kind,
                       self.cfg.model.loss_chunk_tokens)

    def inputs(self, batch: dict, split: str) -> dict:
        if self.cfg.reference.kind != "precomputed":
            return {**batch, "ref_chosen": None, "ref_rejected": None}
        table = self._ref[split]
        try:
            values = torch.tensor([table[k] for k in batch["pair_keys"]], dtype=torch.float64)
        except KeyError as e:
            raise RuntimeError(f"no reference log-prob for pair {e.args[0]} of the {split} "
                               f"split: {self._ref_path(split)} was computed from other "
                               f"data; delete it to recompute") from None
        values = values.reshape(-1, 2)
        return {**batch, "ref_chosen": values[:, 0], "ref_rejected": values[:, 1]}

    def flops(self, batch: dict) -> float:
        """The policy's, plus the reference's forward inside the step (lora_base: the base
        model with the adapters off; precomputed: none, the reference pass ran once)."""
        model, lora = self.worker.engine.model, self.cfg.model.lora
        total = policy_flops(model, batch, lora=lora)
        if self.cfg.reference.kind == "lora_base":
            total += policy_flops(model, batch, training=False)
        return total

    # ------------------------------------------------------------------ reference
    def _ref_path(self, split: str) -> str:
        return f"{self.worker.run_dir.rstrip('/')}/reference/ref_logps_{split}.parquet"

    def before_training(self) -> dict[str, Any]:
        """Compute (if missing) and load the reference log-probs of every train / eval pair.

        Runs before `resume`: the weights are then still the starting model's. A run with
        checkpoints but no reference file cannot recreate it and fails.
        """
        if self.cfg.reference.kind != "precomputed":
            return {}
        import fsspec
        counts = {}
        for split in ("train", "eval"):
            path = self._ref_path(split)
            fs, local = fsspec.core.url_to_fs(path)
            if not fs.exists(local):
                if self.worker.engine.checkpoints.list():
                    raise RuntimeError(f"{path} is missing but checkpoints exist: the "
                                       f"reference (the starting model) cannot be recomputed")
                self._compute_reference(split, path)
            self._ref[split] = _read_ref(path)
            counts[split] = len(self._ref[split])
        return {"reference_pairs": counts}

    @torch.no_grad()
    def _compute_reference(self, split: str, path: str) -> None:
        engine = self.worker.engine
        # the held-out pairs the evaluation uses; every train pair once, whatever the epochs
        batches = self.eval_batches() if split == "eval" else self.split_batches("train")
        dp = engine.dp
        mine = dp.share(batches)
        rows: list[tuple[int, float, float]] = []
        engine.root.eval()
        for i in range(dp.rounds(len(batches))):
            b = mine[i] if i < len(mine) else batches[0]      # equal forwards on every rank
            c, r = self._logps(b)
            if i < len(mine):
                rows += zip(b["pair_keys"], c.tolist(), r.tolist())
        rows = [x for part in dp.gather(rows) for x in part]
        if engine.rank == 0:
            _write_ref(rows, path)
        if dist.is_initialized() and engine.world > 1:
            dist.barrier()
        log.info("reference log-probs of %d %s pairs -> %s", len(rows), split, path)

    def _logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self.worker.engine
        dev = engine.device
        return engine.root(batch["input_ids"].to(dev), batch["labels"].to(dev),
                           batch["position_ids"].to(dev), batch["document_lengths"],
                           batch["sequence_ids"].to(dev), batch["pair_index"].to(dev),
                           logps_only=True)

    # ------------------------------------------------------------------ driver side
    @staticmethod
    def eval_suite(cfg: DPOConfig, models: dict[str, str]) -> Any:
        """Held-out pairs: the implicit rewards' accuracy and margin of the export against the
        starting model (the DPO reference), at the run's beta and log-prob reduction."""
        return eval_suite(cfg, "preference", lambda i: {
            "beta": cfg.loss.beta, "logp_reduction": cfg.loss.logp_reduction})

    postfix = staticmethod(pair_postfix)
    result = staticmethod(pair_result)
    summary = staticmethod(pair_summary)


def _write_ref(rows: list[tuple[int, float, float]], path: str) -> None:
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = sorted(rows)
    keys = [k for k, _, _ in rows]
    if len(set(keys)) != len(keys):
        raise RuntimeError("a pair appeared twice in the reference pass")
    table = pa.table({"pair_key": pa.array(keys, pa.int64()),
                      "chosen": pa.array([c for _, c, _ in rows], pa.float64()),
                      "rejected": pa.array([r for _, _, r in rows], pa.float64())})
    fs, local = fsspec.core.url_to_fs(path)
    fs.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = f"{local}.tmp"
    with fs.open(tmp, "wb") as f:
        pq.write_table(table, f)
    fs.mv(tmp, local)                                   # complete file or none


def _read_ref(path: str) -> dict[int, tuple[float, float]]:
    import fsspec
    import pyarrow.parquet as pq
    fs, local = fsspec.core.url_to_fs(path)
    with fs.open(local, "rb") as f:
        t = pq.read_table(f).to_pydict()
    return {k: (c, r) for k, c, r in zip(t["pair_key"], t["chosen"], t["rejected"])}
