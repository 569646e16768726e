"""Evaluate a checkpoint against a baseline on a suite of tasks: the one evaluation step.

A suite (`posttrain.eval.suites`) lists tasks: held-out loss, generation graded by exact match,
number match, regex or GSM8K's answer (with pass@k), multiple choice by log-likelihood (MMLU,
ARC, HellaSwag: ``configs/eval/standard_tiny.yaml``), preference accuracy, RL rewards, KL to a
teacher, reward-model pair accuracy. The checkpoint and the baseline (optional) run every task
with the same rows and seeds; the printed table has one row per (task, metric) with the model's
value, the baseline's and the difference, and ``--out`` writes the whole result (the table and
every task's per-sample records) as JSON.

The suite is a YAML file (``--suite configs/eval/tiny.yaml``), or a recipe's own held-out
evaluation built from its config (``--recipe dpo --config configs/dpo/tiny.yaml``:
`Recipe.eval_suite`; SFT: held-out loss and a few answers, DPO: implicit-reward accuracy
against the starting model, reward model: pair accuracy of its scores, distillation: KL to
the teacher, GRPO: held-out rewards), followed by the tasks of its `eval.tasks`. The recipe
flows run their evaluate step through `run`.

    posttrain evaluate --suite configs/eval/tiny.yaml \\
        --model runs/sft_arithmetic/hf --baseline runs/sft_arithmetic/base_model --out eval.json
    posttrain evaluate --recipe dpo --config configs/dpo/tiny.yaml \\
        --model runs/dpo_tiny/hf --baseline runs/dpo_tiny/base_model
    posttrain evaluate --recipe distill --config configs/distill/tiny.yaml \\
        --model runs/distill_tiny/hf --baseline runs/distill_tiny/base_model \\
        --teacher runs/distill_tiny/teacher_model
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError
from posttrain.eval.suites import SuiteConfig, SuiteResult, load_suite, run_suite
from steps.arguments import EVAL_RECIPES


def recipe_suite(recipe: str, config: Any, models: dict[str, str] | None = None,
                 overrides: dict | None = None) -> SuiteConfig:
    """The held-out evaluation suite of `recipe` (one of EVAL_RECIPES) for its config (a
    config object or a YAML path); `models` are the run's other model directories (a teacher)."""
    from posttrain.config.recipes import load_recipe
    if recipe not in EVAL_RECIPES:
        raise ConfigError(f"--recipe {recipe!r}: one of {', '.join(EVAL_RECIPES)}")
    cls = importlib.import_module(f"steps.train_{recipe}").RECIPE
    cfg = config if isinstance(config, cls.config_cls) else \
        load_recipe(config, cls.config_cls, overrides)
    suite = cls.eval_suite(cfg, models or {})
    if suite is None:
        raise ConfigError(f"the {recipe} config has no held-out data (data.eval) to evaluate on")
    return suite


def run(suite: SuiteConfig | str, model_dir: str, baseline_dir: str | None = None, *,
        out: str | None = None) -> SuiteResult:
    """Run the suite on the checkpoint (and the baseline); write the result as JSON to `out`."""
    cfg = suite if isinstance(suite, SuiteConfig) else load_suite(suite)
    for what, path in (("model", model_dir), ("baseline", baseline_dir)):
        if path is not None and not (Path(path) / "config.json").is_file():
            raise ConfigError(f"--{what} {path}: not a Hugging Face checkpoint directory (no "
                              "config.json)")
    result = run_suite(cfg, model_dir, baseline_dir)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result.to_dict(), indent=2, default=str))
    return result


def summarize(result: SuiteResult) -> str:
    """The comparison table as aligned text."""
    lines = [f"model:    {result.model_dir}", f"baseline: {result.baseline_dir or '(none)'}",
             f"{'task':<26}{'metric':<30}{'model':>12}{'baseline':>12}{'delta':>12}"]
    for r in result.table():
        base = "" if r["baseline"] is None else f"{r['baseline']:.4g}"
        delta = "" if r["delta"] is None else f"{r['delta']:+.4g}"
        lines.append(f"{r['task']:<26}{r['metric']:<30}{r['model']:>12.4g}{base:>12}"
                     f"{delta:>12}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.recipe:
        if not args.config:
            raise ConfigError("--recipe needs --config (the recipe's YAML)")
        models = {"teacher": args.teacher} if args.teacher else {}
        suite: SuiteConfig | str = recipe_suite(args.recipe, args.config, models)
    else:
        suite = args.suite or "configs/eval/tiny.yaml"
    result = run(suite, args.model, args.baseline, out=args.out)
    print(summarize(result))
    if args.out:
        print(f"result: {args.out}")
    return 0


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["evaluate", *sys.argv[1:]]))
