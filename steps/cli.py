"""The `posttrain` command: run a step without Metaflow.

    posttrain prepare --config configs/prepare/sample_chat.yaml
    posttrain train-sft --config configs/sft/tiny.yaml
    posttrain train-distill --config configs/distill/tiny.yaml
    posttrain train-dpo --config configs/dpo/tiny.yaml
    posttrain train-reward --config configs/reward/tiny.yaml
    posttrain train-grpo --config configs/grpo/tiny.yaml
    posttrain train-sequence --config configs/sequence/tiny.yaml
    posttrain train-sequence-rl --config configs/sequence_rl/tiny.yaml
    posttrain verify-model --hf-dir path/to/model
    posttrain validate --config configs/grpo/tools_tiny.yaml
    posttrain plan --config configs/sft/qwen3_0p6b_lora_1gpu.yaml --gpu h100-80g [--json]
    posttrain evaluate --suite configs/eval/tiny.yaml --model DIR --baseline DIR
    posttrain evaluate --recipe dpo --config configs/dpo/tiny.yaml --model DIR --baseline DIR
    posttrain lineage GRPOFlow/1733000000000000

User mistakes (bad config, bad data, missing files) print one clear line and exit 2; a stack
trace is only shown with POSTTRAIN_DEBUG=1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from posttrain.errors import PosttrainError


def _prepare(args: argparse.Namespace) -> int:
    from steps import prepare
    return prepare.main(args)


def _train_sft(args: argparse.Namespace) -> int:
    from steps import train_sft
    return train_sft.main(args)


def _train_distill(args: argparse.Namespace) -> int:
    from steps import train_distill
    return train_distill.main(args)


def _train_dpo(args: argparse.Namespace) -> int:
    from steps import train_dpo
    return train_dpo.main(args)


def _train_reward(args: argparse.Namespace) -> int:
    from steps import train_reward
    return train_reward.main(args)


def _train_grpo(args: argparse.Namespace) -> int:
    from steps import train_grpo
    return train_grpo.main(args)


def _train_sequence(args: argparse.Namespace) -> int:
    from steps import train_sequence
    return train_sequence.main(args)


def _train_sequence_rl(args: argparse.Namespace) -> int:
    from steps import train_sequence_rl
    return train_sequence_rl.main(args)


def _plan(args: argparse.Namespace) -> int:
    from steps import plan
    return plan.main(args)


def _validate(args: argparse.Namespace) -> int:
    from steps import validate
    return validate.main(args)


def _lineage(args: argparse.Namespace) -> int:
    from steps import lineage
    return lineage.main(args)


def _evaluate(args: argparse.Namespace) -> int:
    from steps import evaluate
    return evaluate.main(args)


def build_parser() -> argparse.ArgumentParser:
    from steps import prepare
    from steps.common import add_arguments
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize raw data into Parquet shards")
    prepare.add_arguments(p)
    p.set_defaults(func=_prepare)
    t = sub.add_parser("train-sft", help="supervised fine-tuning on Ray trainer workers")
    add_arguments(t)
    t.set_defaults(func=_train_sft)
    d = sub.add_parser("train-distill", help="knowledge distillation from a frozen teacher")
    add_arguments(d)
    d.set_defaults(func=_train_distill)
    for name, func, text in (("train-dpo", _train_dpo, "direct preference optimization"),
                             ("train-reward", _train_reward, "a Bradley-Terry reward model"),
                             ("train-grpo", _train_grpo, "on-policy RL (GRPO) with rollouts"),
                             ("train-sequence", _train_sequence,
                              "pretraining from scratch on event sequences, with heads"),
                             ("train-sequence-rl", _train_sequence_rl,
                              "RL (GRPO) on a sequence model: histories in, items out")):
        r = sub.add_parser(name, help=f"{text} on Ray trainer workers")
        add_arguments(r)
        r.set_defaults(func=func)
    from steps import plan
    m = sub.add_parser("plan", help="per-rank memory by part, predicted peak, FLOPs per step")
    plan.add_arguments(m)
    m.set_defaults(func=_plan)
    from steps import validate
    v = sub.add_parser("validate", help="read a config as its recipe would; check its inputs")
    validate.add_arguments(v)
    v.set_defaults(func=_validate)
    from steps import lineage
    g = sub.add_parser("lineage", help="the runs, datasets, configs and code behind a run")
    lineage.add_arguments(g)
    g.set_defaults(func=_lineage)
    from steps import evaluate
    e = sub.add_parser("evaluate", help="a model against a baseline on an eval suite")
    evaluate.add_arguments(e)
    e.set_defaults(func=_evaluate)
    sub.add_parser("verify-model", add_help=False,
                   help="compare a native model's logits with transformers'")
    return parser


def configure_logging() -> None:
    """INFO lines with a time stamp on stderr, for the entry points (this CLI, a flow's task);
    library and step code only log, so that importing them configures nothing."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    if argv and argv[0] == "verify-model":
        from posttrain.models.verify import main as verify_main
        command, run = "verify-model", lambda: verify_main(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        command, run = args.command, lambda: args.func(args)
    try:
        return run()
    except PosttrainError as e:
        if os.environ.get("POSTTRAIN_DEBUG"):
            raise
        print(f"posttrain {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
