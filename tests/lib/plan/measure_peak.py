"""Run one recipe config for real in this (fresh) process and print its plan and measured peak.

    python tests/lib/plan/measure_peak.py RECIPE CONFIG.yaml RUN_DIR

RECIPE is ``sft`` or ``grpo``. The config runs inline (one rank in this process); the measured
peak is the largest `peak_memory_bytes` of its steps (ru_maxrss when the step ended, so model
build, checkpoint load and every step before it are included; the export after training is
not). It is Linux's VmHWM (`posttrain.train.metrics.peak_memory_bytes`): ru_maxrss would carry
the high-water mark of the pytest process that started this one. The plan is made first, in a child process of its own, so that its own tracing never
counts in this process's peak. Prints one JSON line: {"predicted": ..., "measured": ...,
"parts": ...}.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def plan_json(config: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "steps.cli", "plan", "--config", config,
                          "--json"], cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main(recipe: str, config: str, run_dir: str) -> None:
    plan = plan_json(config)
    from posttrain.train.metrics import read_metrics
    if recipe == "sft":
        from steps import train_sft as step
    else:
        from steps import train_grpo as step
    result = step.run(config, overrides={"run.dir": run_dir}, show_progress=False)
    steps = [r for r in read_metrics(result["metrics_path"]) if "peak_memory_bytes" in r]
    measured = max(int(r["peak_memory_bytes"]) for r in steps)
    trainer = plan["ranks"]["trainer"]
    print(json.dumps({"predicted": plan["peak_bytes"]["trainer"], "measured": measured,
                      "parts": trainer["parts"], "peak_phase": trainer["peak_phase"]}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
