"""Train a reward model: the LM body with a scalar head, Bradley-Terry loss on preference pairs.

    prepare (if needed) -> base HF checkpoint -> workers -> resume -> steps (loss, pair
    accuracy, reward margin) with checkpoints -> held-out accuracy ->
    export: HF body + reward_head.safetensors + reward_head.json

The driver is the one of every recipe (`steps.common.run_recipe`); the recipe is
`posttrain.train.reward.Reward`. Load the result as a GRPO reward with
`posttrain.train.reward.load_reward_model(dir)`.

    posttrain train-reward --config configs/reward/tiny.yaml
    python -m steps.train_reward --config configs/reward/tiny.yaml --launcher inline --num-workers 1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from posttrain.train.reward import Reward, RewardConfig
from steps.common import main_for, run_recipe


def run(config: RewardConfig | str | Path, **kwargs: Any) -> dict[str, Any]:
    """Train, evaluate and export a reward model; arguments as `steps.common.run_recipe`."""
    return run_recipe(Reward, config, **kwargs)


RECIPE = Reward
main = main_for(RECIPE, run)

if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-reward", *sys.argv[1:]]))
