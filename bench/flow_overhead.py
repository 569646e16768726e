"""Flow overhead: the tiny SFT flow end to end, and how much of it is not training.

Runs ``python flows/sft_flow.py --config config <configs/sft/tiny.yaml, max_steps 6> run`` as a
user does (a fresh Metaflow home and local datastore in a temporary directory, the repo's
venv), then reads each task's start and end from Metaflow's own metadata and the driver's
parts from the train step's `train_result` artifact (`steps.common.Seconds`: workers =
Ray start + actors + model build, training = the step loop, export, ...). Prints one JSON line:

    {"bench": "flow_overhead", "total_s", "training_s", "outside_training_s",
     "steps": {step: seconds}, "train_parts": {part: seconds}, "runs": N, ...}

with medians over `--runs` runs (the machine is shared: run it quiet).
Run: ``python bench/flow_overhead.py [--runs 3] [--max-steps 6] [--flow sft]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
FLOWS = {"sft": ("flows/sft_flow.py", "configs/sft/tiny.yaml", "SFTFlow")}

_READ = """
import json, sys
from metaflow import Flow, namespace
namespace(None)
run = Flow(sys.argv[1]).latest_run
steps = {}
for step in run:
    tasks = list(step)
    start = min(t.created_at for t in tasks)
    end = max(t.finished_at for t in tasks)
    steps[step.id] = (end - start).total_seconds()
train = run["train"].task.data.train_result if "train" in [s.id for s in run] else {}
print(json.dumps({"steps": steps, "train_parts": (train or {}).get("seconds") or {},
                  "successful": run.successful}))
"""


def one_run(flow: str, max_steps: int) -> dict:
    flow_file, config, name = FLOWS[flow]
    with tempfile.TemporaryDirectory(prefix="flowbench") as tmp:
        data = yaml.safe_load((REPO / config).read_text())
        data["run"]["dir"] = f"{tmp}/runs"
        data["train"]["max_steps"] = max_steps
        cfg = Path(tmp) / "config.yaml"
        cfg.write_text(yaml.safe_dump(data, sort_keys=False))
        # this checkout's lib/ and steps/ first: an editable install may point elsewhere
        path = os.pathsep.join([str(REPO / "lib"), str(REPO),
                                *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "METAFLOW_HOME": f"{tmp}/mfhome", "USERNAME": "bench",
               "METAFLOW_DATASTORE_SYSROOT_LOCAL": f"{tmp}/datastore", "PYTHONPATH": path,
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, flow_file, "--config", "config", str(cfg), "run"],
                              cwd=REPO, env=env, capture_output=True, text=True)
        total = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"the flow failed:\n{done.stderr[-4000:]}")
        read = subprocess.run([sys.executable, "-c", _READ, name], cwd=tmp, env=env,
                              capture_output=True, text=True, check=True)
        parts = json.loads(read.stdout.strip().splitlines()[-1])
    training = float(parts["train_parts"].get("training", 0.0))
    return {"total_s": total, "training_s": training, "outside_training_s": total - training,
            "steps": parts["steps"], "train_parts": parts["train_parts"]}


def median_of(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--flow", choices=sorted(FLOWS), default="sft")
    args = p.parse_args()
    runs = [one_run(args.flow, args.max_steps) for _ in range(args.runs)]
    steps = {s: round(statistics.median(r["steps"].get(s, 0.0) for r in runs), 2)
             for s in runs[0]["steps"]}
    parts = {k: round(statistics.median(r["train_parts"].get(k, 0.0) for r in runs), 2)
             for k in runs[0]["train_parts"]}
    print(json.dumps({"bench": "flow_overhead", "flow": args.flow, "max_steps": args.max_steps,
                      "runs": args.runs, "total_s": median_of(runs, "total_s"),
                      "training_s": median_of(runs, "training_s"),
                      "outside_training_s": median_of(runs, "outside_training_s"),
                      "steps": steps, "train_parts": parts,
                      "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
