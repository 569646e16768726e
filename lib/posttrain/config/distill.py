"""The distillation recipe's config (`DistillConfig`: the teacher, the divergence); the recipe
is `posttrain.train.distill`, the losses `posttrain.losses.distill`.

Recipe configs live in `posttrain.config` so that a config is read and checked without
importing torch; `posttrain.train.distill` imports them from here (the old import paths keep
working).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain.config.data import TokenizerConfig
from posttrain.config.model import ModelConfig, ModelInitConfig
from posttrain.config.recipes import DataConfig
from posttrain.config.sft import EvalConfig
from posttrain.config.train import (ExportConfig, RunConfig, TrainConfig, check_context_parallel,
                                    check_eval_tasks, check_export, check_step_split)


KINDS = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class TeacherConfig:
    """The teacher: an HF checkpoint directory (or a random one, for tests and the tiny run)."""

    hf_dir: str | None = None
    init: ModelInitConfig | None = None
    signal: Literal["online", "offline"] = "online"
    topk: int = 32                  # offline: teacher log-probs stored per label position

    def __post_init__(self) -> None:
        if (self.hf_dir is None) == (self.init is None):
            raise ValueError("teacher: set exactly one of hf_dir (a checkpoint) or init "
                             "(a random model from a config)")
        if self.topk < 1:
            raise ValueError(f"teacher.topk must be at least 1, got {self.topk}")


@dataclass(frozen=True)
class DistillLossConfig:
    kind: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = 0.5               # jsd mixture weight on the teacher
    temperature: float = 1.0
    ce_weight: float = 0.0          # loss = (1 - ce_weight) T^2 D + ce_weight CE

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind == "jsd" and not 0.0 < self.beta < 1.0:
            raise ValueError(f"loss.beta must be in (0, 1) for kind jsd, got {self.beta}")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise ValueError(f"loss.ce_weight must be in [0, 1], got {self.ce_weight}")


@dataclass(frozen=True)
class DistillConfig:
    tokenizer: TokenizerConfig
    data: DataConfig
    model: ModelConfig              # the student
    teacher: TeacherConfig
    train: TrainConfig
    loss: DistillLossConfig = DistillLossConfig()
    run: RunConfig = RunConfig(dir="runs/distill")
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self) -> None:
        if self.data.format not in ("chat", "sequence"):
            raise ValueError(f"distillation trains on chat or sequence data, not "
                             f"{self.data.format!r}")
        check_export(self.export, self.model.lora)
        check_eval_tasks(self.data.eval, self.eval.tasks)
        if self.teacher.signal == "offline":
            loader = self.train.loader
            if loader.weights:
                raise ValueError("train.loader.weights: the offline teacher's top-k rows are "
                                 "read as one stream over all train sources; remove the weights "
                                 "or use teacher.signal: online")
            if loader.mode != "packed":
                raise ValueError("train.loader.mode: the offline teacher's loader packs rows; "
                                 "use mode: packed")
            if loader.streams != 1:
                raise ValueError("train.loader.streams: the offline teacher's top-k rows are "
                                 "read as one stream; use streams: 1 or teacher.signal: online")
        check_step_split(self.train.micro_batches_per_step, self.run, self.train.engine.parallel,
                         self.train.loader.streams)
        check_context_parallel("distill", self.train.engine.parallel, self.train.loader)
