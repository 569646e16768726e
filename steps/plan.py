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
import sys

from posttrain.config.registry import kind_of, schema


def load(path: str, overrides: dict, recipe: str | None = None):
    """The recipe config at `path`, read with its kind's schema (`posttrain.config.registry`)."""
    from posttrain.config.recipes import load_recipe
    return load_recipe(path, schema(kind_of(path, recipe)), overrides)


def main(args: argparse.Namespace) -> int:
    from posttrain.plan import check_fits, plan_run
    from steps.arguments import overrides_from
    from steps.common import check_base_model
    cfg = load(args.config, overrides_from(argparse.Namespace(
        run_dir=None, launcher=None, num_workers=None, max_steps=None, set=args.set)),
        args.recipe)
    if getattr(cfg.model, "hf_dir", None):
        check_base_model(cfg.model)        # a missing checkpoint names what makes it
    plan = plan_run(cfg, gpu=args.gpu)
    problems = check_fits(plan)
    if args.json:
        print(plan.dumps())
    else:
        print(plan.render())
        for p in problems:
            print(p, file=sys.stderr)
    return 3 if problems else 0
