"""`posttrain plan`: the memory plan of a config before launch (`posttrain.plan`).

    posttrain plan --config configs/sft/qwen3_0p6b_lora_1gpu.yaml --gpu h100-80g
    posttrain plan --config configs/grpo/tiny.yaml --set train.max_tokens_per_micro_batch=4096 --json

Prints per-rank memory by part (parameters, gradients, optimizer state, activations, the
loss's logits chunk, the rollout engine's weights and KV cache), the predicted peak per kind of
rank, tokens/step and FLOPs/step; `--json` prints the same as one JSON object. Exits 3 when the
plan does not fit the device (`--gpu`, the config's `run.gpu`, else this machine's RAM).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import yaml

RECIPES = {"sft": "posttrain.train.sft.SFTConfig", "dpo": "posttrain.train.dpo.DPOConfig",
           "reward": "posttrain.train.reward.RewardConfig",
           "distill": "posttrain.train.distill.DistillConfig",
           "sequence": "posttrain.train.sequence.SequenceConfig",
           "grpo": "posttrain.train.grpo.GRPOConfig",
           "sequence_rl": "posttrain.train.sequence_rl.SequenceRLConfig"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--recipe", choices=sorted(RECIPES),
                        help="the config's recipe (default: the config's directory name under "
                             "configs/, else grpo for a config with rewards, else sft)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, dotted; the value is read as YAML")
    parser.add_argument("--gpu", help="GPU kind of each rank (h100-80g, h200, a100-80g, ...); "
                                      "default the config's run.gpu, else this machine's CPU")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def recipe_of(path: str, explicit: str | None = None) -> str:
    if explicit:
        return explicit
    parent = Path(path).resolve().parent.name
    if parent in RECIPES:
        return parent
    data = yaml.safe_load(Path(path).read_text()) or {}
    return "grpo" if "rewards" in data else "sft"


def load(path: str, overrides: dict, recipe: str | None = None):
    from posttrain.config.recipes import load_recipe
    module, _, name = RECIPES[recipe_of(path, recipe)].rpartition(".")
    return load_recipe(path, getattr(importlib.import_module(module), name), overrides)


def main(args: argparse.Namespace) -> int:
    from posttrain.plan import check_fits, plan_run
    from steps.common import overrides_from
    cfg = load(args.config, overrides_from(argparse.Namespace(
        run_dir=None, launcher=None, num_workers=None, max_steps=None, set=args.set)),
        args.recipe)
    plan = plan_run(cfg, gpu=args.gpu)
    problems = check_fits(plan)
    if args.json:
        print(plan.dumps())
    else:
        print(plan.render())
        for p in problems:
            print(p, file=sys.stderr)
    return 3 if problems else 0
