"""Pretrain a model from scratch on event sequences: next item plus per-position heads.

    prepare (if needed: rows of item ids -> ids of the config's vocabulary, labels of the heads
    as columns) -> base HF checkpoint (random, from model.init) -> workers -> resume -> steps
    (next-item cross-entropy + weighted head losses) with checkpoints -> held-out next-item
    and head accuracies -> export: HF causal LM + event_vocab.json + heads.safetensors/.json

The driver is the one of every recipe (`steps.common.run_recipe`); the recipe is
`posttrain.train.sequence.Sequence` (its docstring has the objective, the metrics and the
export), the row format and the vocabulary layout are `posttrain.data.events`'. Load the result
with `transformers.AutoModelForCausalLM.from_pretrained(dir)` (the next-item model) and
`posttrain.models.heads.load_heads(dir)` (the heads over its last hidden state).

    posttrain train-sequence --config configs/sequence/tiny.yaml
    python -m steps.train_sequence --config configs/sequence/tiny.yaml --launcher inline

The bundled data (``assets/data/events``) is `posttrain.data.synthetic`'s: users walking a
sparse random item graph, with item-dependent event types and dwell times.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from posttrain.train.sequence import Sequence, SequenceConfig
from steps.common import main_for, run_recipe


def run(config: SequenceConfig | str | Path, **kwargs: Any) -> dict[str, Any]:
    """Train, evaluate and export; arguments as `steps.common.run_recipe`."""
    return run_recipe(Sequence, config, **kwargs)


RECIPE = Sequence
main = main_for(RECIPE, run)

if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-sequence", *sys.argv[1:]]))
