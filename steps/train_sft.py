"""Train SFT: Ray trainer actors (FSDP2 over gloo/NCCL) driven step by step from here.

    prepare (if needed) -> base HF checkpoint -> workers -> resume from the newest valid
    checkpoint -> for each step: train_step on every rank, log metrics, checkpoint every K
    steps -> evaluate -> export a Hugging Face checkpoint

The driver is the one of every recipe (`steps.common.run_recipe`); the recipe is
`posttrain.train.sft.SFT` and each rank runs the kernel's `RecipeWorker` (see its data rule in
`posttrain.train.recipe`). A run that is killed continues from its last complete checkpoint
when started again with the same run directory, and ends with the same weights as a run that
never stopped.

Run it without Metaflow:

    posttrain train-sft --config configs/sft/tiny.yaml
    python -m steps.train_sft --config configs/sft/tiny.yaml --launcher inline

`launcher: ray` starts a local Ray cluster when none is running (and stops it at the end), or
joins the one `@metaflow_ray` formed across nodes. `launcher: inline` runs one worker in this
process (no Ray): the quickest path on a laptop and in tests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from posttrain.train.sft import SFT, SFTConfig
from steps.common import main_for, run_recipe


def run(config: SFTConfig | str | Path, **kwargs: Any) -> dict[str, Any]:
    """Train, evaluate and export; returns paths and the final metrics. Arguments as
    `steps.common.run_recipe` (`overrides`, `prepared_dir`, `checkpoint_dir`, `show_progress`)."""
    return run_recipe(SFT, config, **kwargs)


RECIPE = SFT
main = main_for(RECIPE, run)

if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-sft", *sys.argv[1:]]))
