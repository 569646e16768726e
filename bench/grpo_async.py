"""Asynchronous rollouts: GRPO step time with `rollout.max_staleness` 1 against 0.

The real recipe (`steps.train_grpo.run`, configs/grpo/tiny.yaml's prompts and rewards) with
placement ``separate``: one Ray trainer rank and one Ray engine actor, different processes.
Two workloads (``--workload``):

- ``long`` (default): rollouts as long as reasoning RL's are, relative to their prompts: a random
  Qwen3-shaped model of the tiny shape (it rarely stops, so every rollout runs to the budget),
  16 prompts x 4 samples x 128 new tokens, one optimizer step per batch;
- ``arithmetic``: the bundled task from the committed SFT checkpoint
  (tests/fixtures/arithmetic_sft, rollouts of about 27 tokens), 16 prompts x 16 samples, two
  optimizer steps per batch (tiny.yaml as it is): the update takes three quarters of a
  synchronous step, so overlapping the generation can save at most a quarter.

Three runs per workload on one Ray cluster, the same prompts, seeds and sample counts:

- ``k0_split``: max_staleness 0, trainer and engine one torch thread each (one core each);
- ``k1_split``: max_staleness 1, the same split: the engine generates batch s+1 while the
  trainer updates on batch s;
- ``k0_shared``: max_staleness 0 with two threads each: each phase, running alone, has both
  cores (what the synchronous loop would use on this machine).

The step time is the median of `time/step_s` over the steps after the first two (the first
step of an asynchronous run has nothing made ahead). The ratio asked for is k1_split /
k0_split; k1_split / k0_shared is reported too.

Prints ONE JSON line. Run: ``python bench/grpo_async.py [--steps 8] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SFT_MODEL = ROOT / "tests" / "fixtures" / "arithmetic_sft"
WARMUP = 2


RANDOM_TINY = {"family": "qwen3", "seed": 0,
               "overrides": {"hidden_size": 128, "intermediate_size": 384,
                             "num_hidden_layers": 4, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "head_dim": 32,
                             "tie_word_embeddings": True}}
WORKLOADS = {
    "long": {"model.hf_dir": None, "model.init": RANDOM_TINY, "train.prompts_per_step": 16,
             "train.samples_per_prompt": 4, "sampling.max_new_tokens": 128,
             "train.mini_batches": 1},
    "arithmetic": {"model.hf_dir": str(SFT_MODEL)},
}


def one_run(name: str, workdir: Path, workload: dict, prepared: str | None, steps: int,
            staleness: int, threads: int) -> tuple[dict, str]:
    from steps import train_grpo
    result = train_grpo.run(ROOT / "configs/grpo/tiny.yaml", overrides={
        "run.dir": str(workdir / name), **workload,
        "run.launcher": "ray", "run.resources_per_worker": {"CPU": threads},
        "rollout.placement": "separate", "rollout.num_engines": 1,
        "rollout.resources_per_engine": {"num_cpus": threads},
        "rollout.max_staleness": staleness, "train.max_steps": steps,
        "train.checkpoint_every_steps": steps, "eval.max_prompts": 0},
        prepared_dir=prepared, show_progress=False)
    rows = [json.loads(x) for x in Path(result["metrics_path"]).read_text().splitlines()]
    rows = [m for m in rows if "loss" in m]
    timed = rows[WARMUP:]

    def median(key: str) -> float:
        return round(statistics.median(m[key] for m in timed), 4)

    return ({"step_s": median("time/step_s"), "generate_s": median("time/generate_s"),
             "logprobs_s": median("time/logprobs_s"),
             "update_s": median("time/update_s"), "sync_s": median("time/sync_s"),
             "rollout_wait_s": median("time/rollout_wait_s"),
             "staleness_mean": statistics.mean(m["rollout/staleness"] for m in timed),
             "rollout_tokens_mean": statistics.mean(m["rollout_tokens"] for m in timed),
             "samples_per_step": (result["config"]["train"]["prompts_per_step"]
                                  * result["config"]["train"]["samples_per_prompt"]),
             "reward_mean": round(statistics.mean(m["reward/total/mean"] for m in rows), 4)},
            result["prepared_dir"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="long")
    parser.add_argument("--out", help="also append the JSON line to this file")
    args = parser.parse_args()
    import ray
    import torch
    torch.set_num_threads(1)                 # the driver: scoring and packing only
    tmp = tempfile.mkdtemp(prefix="pta", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False)
    workdir = Path(tempfile.mkdtemp(prefix="grpo_async_bench"))
    runs, prepared = {}, None
    try:
        for name, staleness, threads in (("k0_split", 0, 1), ("k1_split", 1, 1),
                                         ("k0_shared", 0, 2)):
            runs[name], prepared = one_run(name, workdir, WORKLOADS[args.workload], prepared,
                                           args.steps, staleness, threads)
    finally:
        ray.shutdown()
    model = ("random qwen3 hidden 128 x 4 layers, fp32" if args.workload == "long"
             else "arithmetic SFT (1.2 M params, fp32)")
    line = {"bench": "grpo_async", "workload": args.workload, "model": model,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "steps": args.steps, "timed_steps": args.steps - WARMUP, **runs,
            "ratio_k1_split_over_k0_split": round(runs["k1_split"]["step_s"]
                                                  / runs["k0_split"]["step_s"], 3),
            "ratio_k1_split_over_k0_shared": round(runs["k1_split"]["step_s"]
                                                   / runs["k0_shared"]["step_s"], 3)}
    text = json.dumps(line)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
