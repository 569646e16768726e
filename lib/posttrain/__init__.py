"""posttrain: post-training for open-weight LLMs (SFT, DPO, GRPO, distillation).

The library holds the parts (data, models, ops, losses, distributed, train, rl, eval);
`steps/` holds the recipes and `flows/` the Metaflow DAGs. Nothing here imports Metaflow.
"""

__version__ = "0.1.0"
