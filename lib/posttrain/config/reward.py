"""The reward-model recipe's config (`RewardConfig`); the recipe is `posttrain.train.reward`.

Recipe configs live in `posttrain.config` so that a config is read and checked without
importing torch; `posttrain.train.reward` imports it from here (the old import path keeps
working). Not to be confused with `posttrain.rl.rewards.RewardConfig`, GRPO's reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.data import TokenizerConfig
from posttrain.config.dpo import PairEvalConfig, check_pair_recipe
from posttrain.config.model import ModelConfig
from posttrain.config.recipes import DataConfig
from posttrain.config.train import ExportConfig, RunConfig, TrainConfig


@dataclass(frozen=True)
class RewardConfig:
    tokenizer: TokenizerConfig
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    run: RunConfig = RunConfig(dir="runs/reward")
    eval: PairEvalConfig = PairEvalConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self) -> None:
        if self.model.lora is not None:
            raise ValueError("the reward model trains the full body: remove model.lora")
        check_pair_recipe(self, "the reward model")
