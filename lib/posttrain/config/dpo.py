"""The DPO recipe's config (`DPOConfig`: the preference loss, the reference, KTO's held-out
pairs) and the checks every pair-trained recipe shares (`check_pair_recipe`, also the reward
model's); the recipe and the losses' formulas are `posttrain.train.dpo`.

Recipe configs live in `posttrain.config` so that a config is read and checked without
importing torch; `posttrain.train.dpo` imports them from here (the old import paths keep
working).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from posttrain.config.data import SourceConfig, TokenizerConfig
from posttrain.config.eval import TaskConfig
from posttrain.config.model import ModelConfig
from posttrain.config.recipes import DataConfig
from posttrain.config.train import (ExportConfig, RunConfig, TrainConfig, check_context_parallel,
                                    check_eval_tasks, check_export, check_step_split)


LossKind = Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "kto"]


REFERENCE_FREE = ("simpo", "orpo")


# the knobs of one loss each: (loss_type, default)
LOSS_KNOBS = {"gamma_beta_ratio": ("simpo", 0.5), "odds_ratio_weight": ("orpo", 0.1),
              "desirable_weight": ("kto", 1.0), "undesirable_weight": ("kto", 1.0)}


@dataclass(frozen=True)
class DPOLossConfig:
    """The preference loss (`posttrain.train.dpo`); a knob of another loss than `loss_type` is an
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
