"""The `posttrain` command's arguments, with no heavy import: `posttrain --help`, `posttrain
<command> --help` and a parse error cost only Python's start. Each command's step module is
imported when the command runs (`COMMANDS`: name -> module, help, arguments)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import yaml

from posttrain.config.registry import KINDS, TRAINING
from posttrain.errors import ConfigError

EVAL_RECIPES = ("sft", "dpo", "reward", "distill", "grpo")     # recipes with a held-out suite


def run_arguments(parser: argparse.ArgumentParser) -> None:
    """A training recipe's: the config and the overrides of its common keys."""
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--run-dir", help="override run.dir")
    parser.add_argument("--launcher", choices=["ray", "inline"], help="override run.launcher")
    parser.add_argument("--num-workers", type=int, help="override run.num_workers")
    parser.add_argument("--max-steps", type=int, help="override train.max_steps")
    _set_argument(parser, "dotted (rollout.max_staleness=1); the value is read as YAML; "
                          "repeatable")
    parser.add_argument("--no-progress", action="store_true")


def _set_argument(parser: argparse.ArgumentParser, how: str = "dotted; the value is read as "
                                                              "YAML") -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override any config key, {how}")


def overrides_from(args: argparse.Namespace) -> dict:
    """The dotted config overrides given on the command line."""
    out = {k: v for k, v in {"run.dir": getattr(args, "run_dir", None),
                             "run.launcher": getattr(args, "launcher", None),
                             "run.num_workers": getattr(args, "num_workers", None),
                             "train.max_steps": getattr(args, "max_steps", None)}.items()
           if v is not None}
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. "
                              "rollout.max_staleness=1")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not YAML: {e}") from None
    return out


def config_arguments(parser: argparse.ArgumentParser, kinds: tuple[str, ...] | list[str],
                     what: str = "recipe YAML") -> None:
    """--config, --recipe (one of `kinds`) and --set, as `plan` and `validate` read them."""
    parser.add_argument("--config", required=True, help=what)
    parser.add_argument("--recipe", choices=sorted(kinds),
                        help="the config's kind (default: its directory name under configs/, "
                             "else grpo for a config with rewards, else sft)")
    _set_argument(parser)


def prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="prepare recipe YAML")
    parser.add_argument("--output-dir", help="override output.dir (local path or s3:// URI)")
    parser.add_argument("--no-progress", action="store_true")


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser, TRAINING)
    parser.add_argument("--gpu", help="GPU kind of each rank (h100-80g, h200, a100-80g, ...); "
                                      "default the config's run.gpu, else this machine's CPU")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def validate_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser, list(KINDS), "a recipe, prepare, eval or retrain YAML")


def lineage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pathspec", help="a run, FlowName/RunID (e.g. SFTFlow/1733000000000000)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the tree as JSON")
    out.add_argument("--brief", action="store_true", help="one line per run, no details")


def evaluate_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("--suite", help="suite YAML (default configs/eval/tiny.yaml)")
    what.add_argument("--recipe", choices=EVAL_RECIPES,
                      help="evaluate as this recipe's flow does, from --config")
    p.add_argument("--config", help="the recipe config (with --recipe)")
    p.add_argument("--model", required=True, help="HF checkpoint directory to evaluate")
    p.add_argument("--baseline", help="HF checkpoint directory to compare with")
    p.add_argument("--teacher", help="the teacher's checkpoint (--recipe distill)")
    p.add_argument("--out", help="write the full result (table and records) as JSON here")


# name -> (step module with main(args), help, its arguments)
COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "prepare": ("steps.prepare", "tokenize raw data into Parquet shards", prepare_arguments),
    "train-sft": ("steps.train_sft", "supervised fine-tuning on Ray trainer workers",
                  run_arguments),
    "train-distill": ("steps.train_distill", "knowledge distillation from a frozen teacher",
                      run_arguments),
    "train-dpo": ("steps.train_dpo", "direct preference optimization on Ray trainer workers",
                  run_arguments),
    "train-reward": ("steps.train_reward", "a Bradley-Terry reward model on Ray trainer workers",
                     run_arguments),
    "train-grpo": ("steps.train_grpo", "on-policy RL (GRPO) with rollouts on Ray trainer "
                                       "workers", run_arguments),
    "train-sequence": ("steps.train_sequence", "pretraining from scratch on event sequences, "
                                               "with heads, on Ray trainer workers",
                       run_arguments),
    "train-sequence-rl": ("steps.train_sequence_rl", "RL (GRPO) on a sequence model: "
                                                     "histories in, items out", run_arguments),
    "validate": ("steps.validate", "read a config as its recipe would; check its inputs",
                 validate_arguments),
    "plan": ("steps.plan", "per-rank memory by part, predicted peak, FLOPs per step",
             plan_arguments),
    "lineage": ("steps.lineage", "the runs, datasets, configs and code behind a run",
                lineage_arguments),
    "evaluate": ("steps.evaluate", "a model against a baseline on an eval suite",
                 evaluate_arguments),
}
