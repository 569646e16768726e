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

from posttrain.config.registry import TRAINING, kind_of, schema


def add_config_arguments(parser: argparse.ArgumentParser, kinds: tuple[str, ...] | list[str],
                         what: str = "recipe YAML") -> None:
    """--config, --recipe (one of `kinds`) and --set, as `plan` and `validate` read them."""
    parser.add_argument("--config", required=True, help=what)
    parser.add_argument("--recipe", choices=sorted(kinds),
                        help="the config's kind (default: its directory name under configs/, "
                             "else grpo for a config with rewards, else sft)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, dotted; the value is read as YAML")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TRAINING)
    parser.add_argument("--gpu", help="GPU kind of each rank (h100-80g, h200, a100-80g, ...); "
                                      "default the config's run.gpu, else this machine's CPU")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def load(path: str, overrides: dict, recipe: str | None = None):
    """The recipe config at `path`, read with its kind's schema (`posttrain.config.registry`)."""
    from posttrain.config.recipes import load_recipe
    return load_recipe(path, schema(kind_of(path, recipe)), overrides)


def main(args: argparse.Namespace) -> int:
    from posttrain.plan import check_fits, plan_run
    from steps.common import check_base_model, overrides_from
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
