"""The preference recipe's parts: config schema, the loss modules (FSDP roots), the recipe.

    loss module:  hidden = model(packed pairs) -> per-pair response log-probs (chunked, never
                  full logits; `posttrain.losses.dpo.dpo_pair_logps`) -> the pair loss (sum
                  over pairs; the engine divides by the step's global pair count)

`loss.loss_type` picks the loss (one recipe, one driver, one data path):

* on pairs, with a reference: ``sigmoid`` (DPO, cDPO), ``robust``, ``ipo``, ``hinge``
  (`posttrain.losses.dpo`);
* on pairs, reference-free: ``simpo`` (`posttrain.losses.simpo`) and ``orpo``
  (`posttrain.losses.orpo`), on per-token mean log-probs; no reference log-probs are computed,
  stored or held;
* on unpaired completions labelled desirable or undesirable (``data.format: unpaired``, loader
  ``format: unpaired``), with a reference: ``kto`` (`posttrain.losses.kto`); its unit is the
  completion, and its reference point z_0 is recipe state (the previous step's mean log-ratio,
  checkpointed; see `posttrain.losses.kto`).

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
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn

from posttrain.config.recipes import DataConfig
from posttrain.data.tokenizer import TokenizerConfig
from posttrain.data.sources import SourceConfig
from posttrain.eval.suites import TaskConfig
from posttrain.losses.kto import kl_reference_point
from posttrain.models.transformer import Transformer
from posttrain.train.engine import ModelConfig
from posttrain.train.preference_loss import DPOLoss, KTOLoss
from posttrain.train.recipe import (ExportConfig, Recipe, RunConfig, TrainConfig, check_export,
                                    check_context_parallel, check_step_split, eval_suite, policy_flops,
                                    check_eval_tasks)

log = logging.getLogger(__name__)


LossKind = Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "kto"]
REFERENCE_FREE = ("simpo", "orpo")
# the knobs of one loss each: (loss_type, default)
LOSS_KNOBS = {"gamma_beta_ratio": ("simpo", 0.5), "odds_ratio_weight": ("orpo", 0.1),
              "desirable_weight": ("kto", 1.0), "undesirable_weight": ("kto", 1.0)}


@dataclass(frozen=True)
class DPOLossConfig:
    """The preference loss (module docstring); a knob of another loss than `loss_type` is an
    error, an unset one takes its default (`LOSS_KNOBS`)."""

    beta: float = 0.1                 # the implicit reward's scale (ipo: tau; orpo: rewards only)
    loss_type: LossKind = "sigmoid"
    label_smoothing: float = 0.0      # sigmoid, robust, simpo
    # log-probs summed or averaged per response token; null: mean for simpo and orpo (their
    # definition), sum for the others ("mean" suits ipo; simpo with "sum" is its w/o-LN ablation)
    logp_reduction: Literal["sum", "mean"] | None = None
    gamma_beta_ratio: float | None = None      # simpo: gamma / beta, the target margin (0.5)
    odds_ratio_weight: float | None = None     # orpo: lambda, weight of the odds-ratio term (0.1)
    desirable_weight: float | None = None      # kto: lambda_D (1.0)
    undesirable_weight: float | None = None    # kto: lambda_U (1.0)

    def __post_init__(self) -> None:
        kinds = get_args(LossKind)
        if self.loss_type not in kinds:
            raise ValueError(f"loss.loss_type must be one of {', '.join(kinds)}, got "
                             f"{self.loss_type!r}")
        if self.beta <= 0:
            raise ValueError(f"loss.beta must be positive, got {self.beta}")
        eps = self.label_smoothing
        if eps and self.loss_type not in ("sigmoid", "robust", "simpo"):
            raise ValueError(f"loss.label_smoothing applies to sigmoid, robust and simpo, not "
                             f"{self.loss_type}")
        if eps < 0 or eps > 0.5 or (self.loss_type == "robust" and eps == 0.5):
            raise ValueError(f"loss.label_smoothing={eps} is outside [0, 0.5] for sigmoid and "
                             f"simpo, [0, 0.5) for robust")
        for key, (kind, _) in LOSS_KNOBS.items():
            value = getattr(self, key)
            if value is not None and self.loss_type != kind:
                raise ValueError(f"loss.{key} applies to loss_type {kind}, not "
                                 f"{self.loss_type}")
            if value is not None and (value < 0 if key == "gamma_beta_ratio" else value <= 0):
                raise ValueError(f"loss.{key} must be "
                                 f"{'>= 0' if key == 'gamma_beta_ratio' else 'positive'}, "
                                 f"got {value}")
        if self.loss_type == "orpo" and self.logp_reduction == "sum":
            raise ValueError("loss.logp_reduction: sum does not suit orpo, whose odds are of "
                             "P = exp(per-token mean log-prob); remove it (or set mean)")

    def knob(self, key: str) -> float:
        """A loss knob's value, or its default."""
        value = getattr(self, key)
        return LOSS_KNOBS[key][1] if value is None else value

    @property
    def reduction(self) -> Literal["sum", "mean"]:
        """The log-prob reduction in effect."""
        if self.logp_reduction is not None:
            return self.logp_reduction
        return "mean" if self.loss_type in REFERENCE_FREE else "sum"

    @property
    def reference_free(self) -> bool:
        return self.loss_type in REFERENCE_FREE

    @property
    def unpaired(self) -> bool:
        return self.loss_type == "kto"


@dataclass(frozen=True)
class ReferenceConfig:
    kind: Literal["precomputed", "lora_base"] = "precomputed"


@dataclass(frozen=True)
class PairEvalConfig:
    max_batches: int = 50                     # in training: held-out micro-batches
    max_samples: int | None = 500             # the evaluate step: pairs of each eval source


@dataclass(frozen=True)
class DPOEvalConfig(PairEvalConfig):
    # kto: held-out preference *pairs* for the evaluate step's suite (implicit-reward accuracy
    # of the export against the starting model); KTO's own data.eval rows are unpaired
    pairs: list[SourceConfig] = field(default_factory=list)
    tasks: tuple[TaskConfig, ...] = ()        # the evaluate step: more suite tasks (benchmarks)


@dataclass(frozen=True)
class DPOConfig:
    tokenizer: TokenizerConfig
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    loss: DPOLossConfig = DPOLossConfig()
    reference: ReferenceConfig = ReferenceConfig()
    run: RunConfig = RunConfig(dir="runs/dpo")
    eval: DPOEvalConfig = DPOEvalConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self) -> None:
        loss = self.loss.loss_type
        check_pair_recipe(self, "DPO" if not self.loss.unpaired else "KTO",
                          "unpaired" if self.loss.unpaired else "preference")
        if self.reference.kind == "lora_base" and self.loss.reference_free:
            raise ValueError(f"reference.kind: lora_base: loss_type {loss} is reference-free "
                             f"and runs no reference; remove the reference section")
        if self.reference.kind == "lora_base" and self.model.lora is None:
            raise ValueError("reference.kind: lora_base needs model.lora (the reference "
                             "is the base model with the adapters disabled); use precomputed")
        check_eval_tasks(self.eval.pairs if self.loss.unpaired else self.data.eval,
                         self.eval.tasks)
        if self.eval.pairs and not self.loss.unpaired:
            raise ValueError(f"eval.pairs is for loss_type kto (trained on unpaired rows); "
                             f"{loss} is evaluated on its data.eval pairs")


def check_pair_recipe(cfg: Any, name: str, data_format: str = "preference") -> None:
    """Constraints every pair-trained recipe (DPO, reward model) shares; KTO's unpaired
    completions (`data_format` unpaired) are single documents."""
    if cfg.data.format != data_format:
        what = "preference" if data_format == "preference" else "unpaired (labelled) completion"
        raise ValueError(f"{name} trains on {what} data: set data.format: {data_format}, not "
                         f"{cfg.data.format!r}")
    if cfg.train.loader.format != data_format:
        units = "pairs" if data_format == "preference" else "labelled completions"
        raise ValueError(f"{name} reads {units}: set train.loader.format: {data_format}")
    pack = cfg.train.loader.packing.max_tokens_per_pack
    per_unit = 2 if data_format == "preference" else 1
    if pack < per_unit * cfg.data.max_tokens_per_sample:
        # a pair is one unit, kept whole or dropped (both modes); this bound makes dropping
        # (and, for a completion, truncating) impossible
        raise ValueError(f"train.loader.packing.max_tokens_per_pack={pack} must hold a whole "
                         f"{'pair' if per_unit == 2 else 'completion'}: at least "
                         f"{per_unit} x data.max_tokens_per_sample = "
                         f"{per_unit * cfg.data.max_tokens_per_sample}")
    check_export(cfg.export, cfg.model.lora)
    check_step_split(cfg.train.micro_batches_per_step, cfg.run, cfg.train.engine.parallel,
                     cfg.train.loader.streams)
    check_context_parallel(name, cfg.train.engine.parallel, cfg.train.loader)


def _unit(m: dict) -> str:
    """The unit a pair recipe's metrics count: pairs, or KTO's completions."""
    return "completions" if "completions_per_s" in m or "mean_completions_per_s" in m \
        else "pairs"


def pair_postfix(m: dict) -> dict[str, str]:
    unit = _unit(m)
    return {"loss": f"{m['loss']:.3f}", "acc": f"{m['accuracy']:.2f}",
            f"{unit}/s": f"{m[f'{unit}_per_s']:.0f}", "mfu": f"{m['mfu']:.1%}"}


def pair_result(history: list[dict]) -> dict[str, Any]:
    if not history:
        return {}
    n, unit = len(history), _unit(history[0])
    return {"final_loss": history[-1]["loss"], "final_accuracy": history[-1]["accuracy"],
            f"mean_{unit}_per_s": sum(m[f"{unit}_per_s"] for m in history) / n,
            "mean_real_tokens_per_s": sum(m["real_tokens_per_s"] for m in history) / n,
            "mean_mfu": sum(m["mfu"] for m in history) / n}


def pair_summary(result: dict) -> list[str]:
    ev = result.get("eval") or {}
    unit = _unit(result)
    lines = []
    if "final_loss" in result:
        lines.append(f"final train loss {result['final_loss']:.4f}, reward accuracy "
                     f"{result['final_accuracy']:.2f}; {result[f'mean_{unit}_per_s']:.1f} "
                     f"{unit}/s; MFU {result['mean_mfu']:.1%}")
    if ev:
        held = "eval_completions" if "eval_completions" in ev else "eval_pairs"
        lines.append(f"held-out: loss {ev['eval_loss']:.4f}, accuracy {ev['eval_accuracy']:.2f}"
                     + (f", margin {ev['eval_margins']:.4f}" if "eval_margins" in ev else "")
                     + f" over {ev[held]} {held[5:]}")
    return lines


class DPO(Recipe):
    """Preference optimization: a loss over pairs (or KTO's labelled completions) and, for the
    losses that have one, the reference log-probs."""

    name = "dpo"
    config_cls = DPOConfig
    unit_field, unit_name = "num_pairs", "pairs"

    def __init__(self, worker: Any):
        super().__init__(worker)
        self._ref: dict[str, dict[int, tuple[float, ...]]] = {}
        self.kto = self.cfg.loss.unpaired
        if self.kto:
            self.unit_field, self.unit_name = "num_completions", "completions"
        self._kl_reference = 0.0              # KTO's z_0 for the next step (recipe state)

    @property
    def _keys(self) -> str:
        return "completion_keys" if self.kto else "pair_keys"

    @property
    def _precomputed(self) -> bool:
        return self.cfg.reference.kind == "precomputed" and not self.cfg.loss.reference_free

    def loss_root(self, model: Transformer) -> nn.Module:
        root = KTOLoss if self.kto else DPOLoss
        return root(model, self.cfg.loss, self.cfg.reference.kind,
                    self.cfg.model.loss_chunk_tokens)

    def inputs(self, batch: dict, split: str) -> dict:
        extra: dict[str, Any] = (
            {"ref_logps": None, "kl_reference": torch.tensor(self._kl_reference,
                                                             dtype=torch.float64)}
            if self.kto else {"ref_chosen": None, "ref_rejected": None})
        if not self._precomputed:
            return {**batch, **extra}
        table = self._ref[split]
        try:
            values = torch.tensor([table[k] for k in batch[self._keys]], dtype=torch.float64)
        except KeyError as e:
            raise RuntimeError(f"no reference log-prob for {self.unit_name[:-1]} {e.args[0]} of "
                               f"the {split} split: {self._ref_path(split)} was computed from "
                               f"other data; delete it to recompute") from None
        if self.kto:
            return {**batch, **extra, "ref_logps": values.reshape(-1)}
        values = values.reshape(-1, 2)
        return {**batch, "ref_chosen": values[:, 0], "ref_rejected": values[:, 1]}

    def train_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """KTO: class means of the rewards, the reference point this step used, and the next
        one (from this step's mean log-ratio over every completion of every rank)."""
        if not self.kto:
            return metrics
        out = _kto_means(metrics, "", self._kl_reference)
        self._kl_reference = kl_reference_point(metrics["log_ratio"])
        return out

    def eval_metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        out = super().eval_metrics(sums, units)
        return _kto_means(out, "eval_", self._kl_reference) if self.kto else out

    def state_dict(self) -> dict[str, Any]:
        return {"kl_reference": self._kl_reference} if self.kto else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kto:
            self._kl_reference = float(state["kl_reference"])

    def flops(self, batch: dict) -> float:
        """The policy's, plus the reference's forward inside the step (lora_base: the base
        model with the adapters off; precomputed: none, the reference pass ran once;
        reference-free losses: none at all)."""
        model, lora = self.worker.engine.model, self.cfg.model.lora
        total = policy_flops(model, batch, lora=lora)
        if self.cfg.reference.kind == "lora_base" and not self.cfg.loss.reference_free:
            total += policy_flops(model, batch, training=False)
        return total

    # ------------------------------------------------------------------ reference
    def _ref_path(self, split: str) -> str:
        return f"{self.worker.run_dir.rstrip('/')}/reference/ref_logps_{split}.parquet"

    def before_training(self) -> dict[str, Any]:
        """Compute (if missing) and load the reference log-probs of every train / eval pair
        (KTO: completion); nothing for a reference-free loss.

        Runs before `resume`: the weights are then still the starting model's. A run with
        checkpoints but no reference file cannot recreate it and fails.
        """
        if not self._precomputed:
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
        return {f"reference_{self.unit_name}": counts}

    @torch.no_grad()
    def _compute_reference(self, split: str, path: str) -> None:
        engine = self.worker.engine
        # the held-out units the evaluation uses; every train unit once, whatever the epochs
        batches = self.eval_batches() if split == "eval" else self.split_batches("train")
        dp = engine.dp
        mine = dp.share(batches)
        rows: list[tuple] = []
        engine.root.eval()
        for i in range(dp.rounds(len(batches))):
            b = mine[i] if i < len(mine) else batches[0]      # equal forwards on every rank
            logps = self._logps(b)
            if i < len(mine):
                rows += zip(b[self._keys], *(x.tolist() for x in logps))
        rows = [x for part in dp.gather(rows) for x in part]
        if engine.rank == 0:
            _write_ref(rows, path, _COMPLETION_COLUMNS if self.kto else _PAIR_COLUMNS)
        if dist.is_initialized() and engine.world > 1:
            dist.barrier()
        log.info("reference log-probs of %d %s %s -> %s", len(rows), split, self.unit_name,
                 path)

    def _logps(self, batch: dict) -> tuple[torch.Tensor, ...]:
        engine = self.worker.engine
        dev = engine.device
        args = [batch["input_ids"].to(dev), batch["labels"].to(dev),
                batch["position_ids"].to(dev), batch["document_lengths"],
                batch["sequence_ids"].to(dev)]
        if self.kto:
            return (engine.root(*args, batch["desirable"].to(dev), logps_only=True),)
        return engine.root(*args, batch["pair_index"].to(dev), logps_only=True)

    # ------------------------------------------------------------------ driver side
    @staticmethod
    def eval_suite(cfg: DPOConfig, models: dict[str, str]) -> Any:
        """Held-out pairs: the implicit rewards' accuracy and margin of the export against the
        starting model (the DPO reference), at the run's beta and log-prob reduction. KTO's
        own held-out rows are unpaired: its suite scores the pairs of `eval.pairs` (None
        without them)."""
        options = lambda i: {"beta": cfg.loss.beta, "logp_reduction": cfg.loss.reduction}
        if cfg.loss.unpaired:
            return eval_suite(cfg, "preference", options, sources=cfg.eval.pairs) \
                if cfg.eval.pairs else None
        return eval_suite(cfg, "preference", options)

    postfix = staticmethod(pair_postfix)
    result = staticmethod(pair_result)
    summary = staticmethod(pair_summary)


def _kto_means(m: dict[str, Any], prefix: str, kl_reference: float) -> dict[str, Any]:
    """KTO's metrics from the per-completion stats: the class means of the rewards (stats
    summed over a class, over the class's count), their margin, the desirable fraction and
    the reference point z_0 in use."""
    out = dict(m)
    for side in ("desirable", "undesirable"):
        count = out.pop(f"{prefix}{side}")
        total = out[f"{prefix}rewards_{side}"]
        out[f"{prefix}rewards_{side}"] = total / count if count else 0.0
        if side == "desirable":
            out[f"{prefix}desirable_fraction"] = count
    out[f"{prefix}margins"] = out[f"{prefix}rewards_desirable"] - \
        out[f"{prefix}rewards_undesirable"]
    out[f"{prefix}kl"] = kl_reference
    return out


_PAIR_COLUMNS = ("pair_key", "chosen", "rejected")
_COMPLETION_COLUMNS = ("completion_key", "logp")


def _write_ref(rows: list[tuple], path: str, columns: tuple[str, ...]) -> None:
    """(key, log-prob, ...) rows as a Parquet table of `columns`, sorted by key."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = sorted(rows)
    keys = [r[0] for r in rows]
    if len(set(keys)) != len(keys):
        raise RuntimeError("a pair (or completion) appeared twice in the reference pass")
    table = pa.table({columns[0]: pa.array(keys, pa.int64()),
                      **{name: pa.array([r[i] for r in rows], pa.float64())
                         for i, name in enumerate(columns[1:], start=1)}})
    fs, local = fsspec.core.url_to_fs(path)
    fs.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = f"{local}.tmp"
    with fs.open(tmp, "wb") as f:
        pq.write_table(table, f)
    fs.mv(tmp, local)                                   # complete file or none


def _read_ref(path: str) -> dict[int, tuple[float, ...]]:
    import fsspec
    import pyarrow.parquet as pq
    fs, local = fsspec.core.url_to_fs(path)
    with fs.open(local, "rb") as f:
        t = pq.read_table(f).to_pydict()
    key, *values = t
    return {k: tuple(v) for k, *v in zip(t[key], *(t[c] for c in values))}
