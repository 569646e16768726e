"""Train with DPO (or SimPO, ORPO, KTO): Ray trainer actors (FSDP2 over gloo/NCCL) driven step
by step from here.

    prepare (if needed) -> base HF checkpoint (random tiny, or model.hf_dir: an SFT export) ->
    workers -> reference log-probs of every pair, once (precomputed mode) -> resume from the
    newest valid checkpoint -> for each step: train_step on every rank, log loss / reward
    accuracy / rewards / margins / log-probs, checkpoint every K steps -> held-out DPO metrics
    -> export a Hugging Face checkpoint

`loss.loss_type` picks the loss: DPO and its variants, SimPO and ORPO (reference-free: no
reference pass), or KTO on unpaired completions labelled desirable or undesirable
(``data.format: unpaired``; its unit is the completion). The driver is the one of every recipe
(`steps.common.run_recipe`); the recipe (loss roots, reference modes) is
`posttrain.train.dpo.DPO`. A killed run continues from its last complete
checkpoint when started again with the same run directory and ends with the same weights.

    posttrain train-dpo --config configs/dpo/tiny.yaml          # simpo_tiny, orpo_tiny, kto_tiny
    python -m steps.train_dpo --config configs/dpo/tiny.yaml --launcher inline --num-workers 1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from posttrain.train.dpo import DPO, DPOConfig
from steps.common import main_for, run_recipe


def run(config: DPOConfig | str | Path, **kwargs: Any) -> dict[str, Any]:
    """Train, evaluate and export; returns paths and the final metrics. Arguments as
    `steps.common.run_recipe`; `checkpoint_dir` also holds the reference log-probs."""
    return run_recipe(DPO, config, **kwargs)


RECIPE = DPO
main = main_for(RECIPE, run)

if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-dpo", *sys.argv[1:]]))
