"""The model's config slices: where the weights come from (`ModelConfig`, `ModelInitConfig`),
LoRA (`LoraSettings`) and per-position heads (`HeadConfig`), with the config-time checks they
need from the model code (`check_modules_to_save`, `check_peft_export`).

Kept apart from `posttrain.models` and `posttrain.train.engine` so that a config is read and
checked without importing torch; those modules import them from here (the old import paths
keep working).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, Sequence

from posttrain.config.data import TargetKind, check_kind
from posttrain.errors import ConfigError


VOCAB_MODULES = ("embed", "head")


def check_modules_to_save(modules_to_save: Sequence[str]) -> None:
    unknown = sorted(set(modules_to_save) - set(VOCAB_MODULES))
    if unknown:
        peft_names = {"embed_tokens": "embed", "lm_head": "head"}
        hint = [peft_names[u] for u in unknown if u in peft_names]
        raise ConfigError(f"model.lora.modules_to_save: {unknown} are not vocabulary modules; "
                          f"it takes {list(VOCAB_MODULES)} (the native names"
                          + (f", e.g. {hint} for PEFT's {[u for u in unknown if u in peft_names]}"
                             if hint else "") + ")")


def names_experts(target: str) -> bool:
    """Whether `target` names stacked expert weights: its second-to-last part is `experts`."""
    return target.rpartition(".")[0].rpartition(".")[2] == "experts"


def check_peft_export(targets: tuple[str, ...] | list[str], dropout: float) -> None:
    """Raise a ConfigError where a PEFT adapter cannot express LoRA on `targets` with
    `dropout` (checked at config time by `posttrain.config.train.check_export`)."""
    stacked = [t for t in targets if names_experts(t)]
    if stacked and dropout > 0:
        raise ConfigError(
            f"lora.targets {stacked} adapt MoE expert weights, which PEFT adapts through "
            f"target_parameters without dropout (it refuses to load them with lora_dropout="
            f"{dropout}); set lora.dropout: 0, or export merged weights (export.format: merged)")


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    # embedding and LM-head rows trained beside the adapters (PEFT's trainable_token_indices;
    # `posttrain.models.trainable_tokens`): "added" (the tokens the tokenizer added:
    # tokenizer.added_tokens, semantic_ids), "none", or a list of token ids. A run whose
    # tokenizer added tokens that would stay frozen is refused.
    trainable_tokens: str | tuple[int, ...] = "added"
    # whole vocabulary modules trained beside the adapters (PEFT's modules_to_save): embed, head
    modules_to_save: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.trainable_tokens, str) and self.trainable_tokens not in ("added",
                                                                                    "none"):
            raise ConfigError(f"model.lora.trainable_tokens: {self.trainable_tokens!r} is not "
                              "'added', 'none' or a list of token ids")
        check_modules_to_save(self.modules_to_save)

    def token_ids(self, added: Sequence[int]) -> tuple[int, ...]:
        """The ids whose rows train, given the ids the tokenizer `added`."""
        if self.trainable_tokens == "added":
            return tuple(added)
        return () if self.trainable_tokens == "none" else tuple(self.trainable_tokens)


@dataclass(frozen=True)
class ModelInitConfig:
    """A random model from a config (tests and the bundled tiny run): never downloads."""

    family: str
    overrides: dict[str, Any] = field(default_factory=dict)   # HF config fields
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    hf_dir: str | None = None                 # local HF checkpoint directory
    init: ModelInitConfig | None = None       # or a random init from a config
    # the SFT recipe config whose export hf_dir is (e.g. configs/sft/arithmetic_tiny.yaml):
    # when hf_dir does not exist, a flow starts from the newest successful SFTFlow run of that
    # config, or trains it first; the CLI names the command that makes it
    produced_by: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"     # master weights
    vocab_multiple: int = 64
    lora: LoraSettings | None = None
    loss_chunk_tokens: int = 1024
    # MoE models: the router's load-balancing loss (None: the checkpoint config's
    # router_aux_loss_coef) and z-loss, added to the training loss with these weights
    moe_aux_loss_coef: float | None = None
    moe_z_loss_coef: float = 0.0
    # routers with a score-correction bias (DeepSeek-V3): auxiliary-loss-free balancing moves
    # the bias by this much per optimizer step (the paper's gamma, 0.001 in its pretraining;
    # `posttrain.models.moe_balance.update_score_bias`); 0 keeps the checkpoint's bias, as
    # transformers' training does
    moe_bias_update_speed: float = 0.0

    def __post_init__(self) -> None:
        if (self.hf_dir is None) == (self.init is None):
            raise ValueError("model: set exactly one of hf_dir (a checkpoint) or init "
                             "(a random model from a config)")
        if (self.moe_aux_loss_coef or 0.0) < 0 or self.moe_z_loss_coef < 0:
            raise ValueError("model.moe_aux_loss_coef and model.moe_z_loss_coef must be >= 0")
        if self.moe_bias_update_speed < 0:
            raise ValueError("model.moe_bias_update_speed must be >= 0")

    def starting_from(self, hf_dir: str) -> ModelConfig:
        """This model config, started from the checkpoint in `hf_dir` instead of its own
        `hf_dir` or random `init` (a flow's `--sft-run` export, the driver's written base)."""
        return replace(self, hf_dir=hf_dir, init=None)


@dataclass(frozen=True)
class HeadConfig:
    """One per-position head: its kind, classes, target position and loss weight."""

    kind: TargetKind
    num_classes: int | None = None
    weight: float = 1.0                         # of its loss in the training objective
    target: Literal["next", "current"] = "next"  # whose label position t predicts

    def __post_init__(self) -> None:
        check_kind(self.kind, self.num_classes, "a head")
        if self.weight < 0:
            raise ConfigError(f"a head's loss weight must be >= 0, got {self.weight}")

    @property
    def out_features(self) -> int:
        return self.num_classes if self.kind == "classification" else 1
