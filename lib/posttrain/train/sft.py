"""The SFT recipe: its config schema and what it adds to the recipe kernel (perplexity).

Everything else (worker, data rule, steps, checkpoints, export) is the kernel's
(`posttrain.train.recipe`); the loss root is the engine's `CausalLMLoss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.config.recipes import DataConfig
from posttrain.data.tokenizer import TokenizerConfig
from posttrain.eval.suites import TaskConfig
from posttrain.train.engine import ModelConfig
from posttrain.train.recipe import (ExportConfig, Recipe, RunConfig, TrainConfig,
                                    check_context_parallel, check_eval_tasks, check_export,
                                    check_step_split)


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


class SFT(Recipe):
    """Supervised fine-tuning: the kernel's defaults (causal-LM loss, mean over loss tokens),
    plus perplexity in the held-out metrics."""

    name = "sft"
    config_cls = SFTConfig

    def eval_metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        out = super().eval_metrics(sums, units)
        out["eval_perplexity"] = math.exp(min(out["eval_loss"], 50.0))
        return out

    @staticmethod
    def postfix(m: dict) -> dict[str, str]:
        return {**Recipe.postfix(m), "lr": f"{m['lr']:.2e}"}

    @staticmethod
    def summary(result: dict) -> list[str]:
        ev = result.get("eval") or {}
        return Recipe.summary(result) + ([
            f"held-out loss {ev['eval_loss']:.4f} (perplexity {ev['eval_perplexity']:.2f}) "
            f"over {ev['eval_tokens']} tokens"] if ev else [])
