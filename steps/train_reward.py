"""Train a reward model: the LM body with a scalar head, Bradley-Terry loss on preference pairs.

    prepare (if needed) -> base HF checkpoint -> WorkerGroup(RewardWorker) -> resume ->
    steps (loss, pair accuracy, reward margin) with checkpoints -> held-out accuracy ->
    export: HF body + reward_head.safetensors + reward_head.json

The driver loop is the DPO one (`steps.train_dpo.run`) with the reward worker; the parts are in
`posttrain.train.reward`. Load the result as a GRPO reward with
`posttrain.train.reward.load_reward_model(dir)`.

    posttrain train-reward --config configs/reward/tiny.yaml
    python -m steps.train_reward --config configs/reward/tiny.yaml --launcher inline --num-workers 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from posttrain.train.reward import RewardConfig, RewardWorker
from steps import train_dpo
from steps.common import overrides_from


def run(config: RewardConfig | str | Path, **kwargs: Any) -> dict[str, Any]:
    """Train, evaluate and export a reward model; arguments as `steps.train_dpo.run`."""
    return train_dpo.run(config, worker_cls=RewardWorker, config_cls=RewardConfig,
                         name="reward", **kwargs)


def main(args: argparse.Namespace) -> int:
    t0 = time.time()
    result = run(args.config, overrides=overrides_from(args),
                 show_progress=not args.no_progress)
    print(train_dpo.summarize(result, time.time() - t0))
    return 0


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-reward", *sys.argv[1:]]))
