"""The SFT recipe's config (`SFTConfig`); the recipe is `posttrain.train.sft`.

Recipe configs live in `posttrain.config` so that a config is read and checked without
importing torch; `posttrain.train.sft` imports them from here (the old import paths keep
working).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.data import TokenizerConfig
from posttrain.config.eval import TaskConfig
from posttrain.config.model import ModelConfig
from posttrain.config.recipes import DataConfig
from posttrain.config.train import (ExportConfig, RunConfig, TrainConfig, check_context_parallel,
                                    check_eval_tasks, check_export, check_step_split)


@dataclass(frozen=True)
class GenerateConfig:
    num_samples: int = 4
    max_new_tokens: int = 48


@dataclass(frozen=True)
class EvalConfig:
    max_batches: int = 50                     # in training: held-out micro-batches
    max_samples: int | None = 500             # the evaluate step: rows of each eval source
    generate: GenerateConfig = GenerateConfig()
    tasks: tuple[TaskConfig, ...] = ()        # the evaluate step: more suite tasks (benchmarks)


@dataclass(frozen=True)
class SFTConfig:
    tokenizer: TokenizerConfig
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    run: RunConfig = RunConfig()
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self) -> None:
        check_export(self.export, self.model.lora)
        check_eval_tasks(self.data.eval, self.eval.tasks)
        if self.data.format not in ("chat", "sequence"):
            raise ValueError(f"SFT trains on chat or sequence data, not {self.data.format!r}")
        check_step_split(self.train.micro_batches_per_step, self.run, self.train.engine.parallel,
                         self.train.loader.streams)
        check_context_parallel("sft", self.train.engine.parallel, self.train.loader)
