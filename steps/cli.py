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
import importlib
import logging
import os
import sys

from posttrain.errors import PosttrainError
from posttrain.process import tune_cycle_collector


def build_parser() -> argparse.ArgumentParser:
    from steps.arguments import COMMANDS
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, text, arguments) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        arguments(p)
        p.set_defaults(module=module)
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
    tune_cycle_collector()
    if argv and argv[0] == "verify-model":
        from posttrain.models.verify import main as verify_main
        command, run = "verify-model", lambda: verify_main(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        command, run = args.command, lambda: importlib.import_module(args.module).main(args)
    try:
        return run()
    except PosttrainError as e:
        if os.environ.get("POSTTRAIN_DEBUG"):
            raise
        print(f"posttrain {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
