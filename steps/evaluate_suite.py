"""Evaluate a checkpoint against a baseline on a suite of tasks (`posttrain.eval.suites`).

The suite (YAML, e.g. ``configs/eval/tiny.yaml``) lists held-out loss, generation (graded by
exact match, number match or regex), preference accuracy and RL-reward tasks. Both Hugging Face
checkpoints run every task with the same rows and seeds; the printed table has one row per
(task, metric) with the model's value, the baseline's and the difference, and ``--out`` writes
the whole result (the table and every task's per-sample records) as JSON.

    python -m steps.evaluate_suite --suite configs/eval/tiny.yaml \\
        --model runs/sft_arithmetic/hf --baseline runs/sft_arithmetic/base_model --out eval.json
    posttrain evaluate --suite configs/eval/tiny.yaml --model ... --baseline ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posttrain.errors import ConfigError
from posttrain.eval.suites import SuiteConfig, SuiteResult, load_suite, run_suite


def run(suite: SuiteConfig | str, model_dir: str, baseline_dir: str, *,
        out: str | None = None) -> SuiteResult:
    """Run the suite on both checkpoints; write the result as JSON to `out` if given."""
    cfg = suite if isinstance(suite, SuiteConfig) else load_suite(suite)
    for what, path in (("model", model_dir), ("baseline", baseline_dir)):
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"--{what} {path}: not a Hugging Face checkpoint directory (no "
                              "config.json)")
    result = run_suite(cfg, model_dir, baseline_dir)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result.to_dict(), indent=2, default=str))
    return result


def summarize(result: SuiteResult) -> str:
    """The comparison table as aligned text."""
    lines = [f"model:    {result.model_dir}", f"baseline: {result.baseline_dir}",
             f"{'task':<26}{'metric':<30}{'model':>12}{'baseline':>12}{'delta':>12}"]
    for r in result.table():
        lines.append(f"{r['task']:<26}{r['metric']:<30}{r['model']:>12.4g}"
                     f"{r['baseline']:>12.4g}{r['delta']:>+12.4g}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default="configs/eval/tiny.yaml", help="suite YAML")
    p.add_argument("--model", required=True, help="HF checkpoint directory to evaluate")
    p.add_argument("--baseline", required=True, help="HF checkpoint directory to compare with")
    p.add_argument("--out", help="write the full result (table and records) as JSON here")


def main(args: argparse.Namespace) -> int:
    result = run(args.suite, args.model, args.baseline, out=args.out)
    print(summarize(result))
    if args.out:
        print(f"result: {args.out}")
    return 0


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["evaluate", *sys.argv[1:]]))
