"""Evaluate an exported reward model on held-out preference pairs.

Loads the exported model the way GRPO will (`posttrain.train.reward.load_reward_model`), scores
the chosen and the rejected response of every held-out pair, and reports pair accuracy
(chosen scored higher) and the mean score margin: numbers about the artifact, not the trainer.

    python -m steps.evaluate_reward --model-dir runs/reward_tiny/hf \
        --pairs assets/data/preference/eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from posttrain.data.formats import FormatConfig, parse_row
from posttrain.data.sources import RowStream, expand_paths
from posttrain.train.reward import load_reward_model


def run(model_dir: str, pairs_path: str, *, max_pairs: int = 200) -> dict[str, Any]:
    score = load_reward_model(model_dir)
    fmt = FormatConfig("preference")
    correct, margins, rows = 0, [], []
    with RowStream(expand_paths(pairs_path)) as stream:
        for raw in stream:
            if len(margins) >= max_pairs:
                break
            if raw.error is not None:
                continue
            pair = parse_row(raw.data, fmt, file=raw.file, line=raw.line)
            chosen = score(pair.prompt, pair.chosen[-1]["content"])
            rejected = score(pair.prompt, pair.rejected[-1]["content"])
            correct += chosen > rejected
            margins.append(chosen - rejected)
            if len(rows) < 5:
                rows.append({"prompt": pair.prompt[-1]["content"],
                             "chosen": pair.chosen[-1]["content"], "chosen_score": chosen,
                             "rejected": pair.rejected[-1]["content"],
                             "rejected_score": rejected})
    n = max(len(margins), 1)
    return {"model_dir": model_dir, "pairs": len(margins), "accuracy": correct / n,
            "mean_margin": sum(margins) / n, "examples": rows}


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"metric": "held-out pair accuracy", "value": round(result["accuracy"], 4)},
            {"metric": "mean score margin", "value": round(result["mean_margin"], 4)},
            {"metric": "held-out pairs", "value": result["pairs"]}]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m steps.evaluate_reward", description=__doc__)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--pairs", required=True, help="preference JSONL/Parquet (path or glob)")
    p.add_argument("--max-pairs", type=int, default=200)
    a = p.parse_args(argv)
    print(json.dumps(run(a.model_dir, a.pairs, max_pairs=a.max_pairs), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
