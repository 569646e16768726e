"""Which schema reads a config, and which command runs it: one table for the CLI and the flows.

A bundled config's kind is the name of its directory under ``configs/`` (``configs/sft/...``
is an SFT recipe); a config elsewhere names it with ``--recipe``, or is read as GRPO when it
has ``rewards`` and as SFT otherwise. This module imports nothing heavy: it only names the
schema classes, which `schema` imports on demand.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml

# kind -> (dotted schema class, the command that runs such a config)
KINDS: dict[str, tuple[str, str]] = {
    "sft": ("posttrain.train.sft.SFTConfig", "posttrain train-sft --config {}"),
    "dpo": ("posttrain.train.dpo.DPOConfig", "posttrain train-dpo --config {}"),
    "reward": ("posttrain.train.reward.RewardConfig", "posttrain train-reward --config {}"),
    "distill": ("posttrain.train.distill.DistillConfig", "posttrain train-distill --config {}"),
    "sequence": ("posttrain.train.sequence.SequenceConfig",
                 "posttrain train-sequence --config {}"),
    "grpo": ("posttrain.train.grpo.GRPOConfig", "posttrain train-grpo --config {}"),
    "sequence_rl": ("posttrain.train.sequence_rl.SequenceRLConfig",
                    "posttrain train-sequence-rl --config {}"),
    "prepare": ("posttrain.config.recipes.PrepareConfig", "posttrain prepare --config {}"),
    "eval": ("posttrain.eval.suites.SuiteConfig",
             "posttrain evaluate --suite {} --model DIR --baseline DIR"),
    "retrain": ("posttrain.retrain.RetrainConfig", "python flows/retrain_flow.py --config "
                                                    "config {} run"),
}
ALIASES = {"ppo": "grpo"}            # configs/ppo/: PPO runs through the GRPO recipe
TRAINING = ("sft", "dpo", "reward", "distill", "sequence", "grpo", "sequence_rl")


def kind_of(path: str | Path, explicit: str | None = None) -> str:
    """The config's kind (module docstring)."""
    if explicit:
        if explicit not in KINDS:
            from posttrain.errors import ConfigError
            raise ConfigError(f"--recipe {explicit!r}: one of {', '.join(sorted(KINDS))}")
        return explicit
    parent = Path(path).resolve().parent.name
    parent = ALIASES.get(parent, parent)
    if parent in KINDS:
        return parent
    data = yaml.safe_load(Path(path).read_text()) or {}
    return "grpo" if isinstance(data, dict) and "rewards" in data else "sft"


def schema(kind: str) -> type:
    """The config class of `kind` (imports its module)."""
    module, _, name = KINDS[kind][0].rpartition(".")
    return getattr(importlib.import_module(module), name)


def command(path: str | Path, kind: str | None = None) -> str:
    """The command line that runs the config at `path`."""
    return KINDS[kind or kind_of(path)][1].format(path)


def export_dir(config: Any) -> str | None:
    """Where a training recipe's Hugging Face export lands: ``<run.dir>/hf``."""
    run = getattr(config, "run", None)
    return f"{run.dir}/hf" if run is not None and getattr(run, "dir", None) else None
