"""Train with DPO: Ray trainer actors (FSDP2 over gloo/NCCL) driven step by step from here.

    prepare (if needed) -> base HF checkpoint (random tiny, or model.hf_dir: an SFT export) ->
    WorkerGroup(DPOWorker) -> reference log-probs of every pair, once (precomputed mode) ->
    resume from the newest valid checkpoint -> for each step: train_step on every rank, log
    loss / reward accuracy / rewards / margins / log-probs, checkpoint every K steps ->
    held-out DPO metrics -> export a Hugging Face checkpoint

The per-rank parts (loss module, reference modes, data rule) are in `posttrain.train.dpo` and
`posttrain.train.preference`. A killed run continues from its last complete checkpoint when
started again with the same run directory and ends with the same weights.

    posttrain train-dpo --config configs/dpo/tiny.yaml
    python -m steps.train_dpo --config configs/dpo/tiny.yaml --launcher inline --num-workers 1
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any


from posttrain.config.loader import to_dict
from posttrain.config.recipes import load_recipe
from posttrain.data.prepared import local_view
from posttrain.train.dpo import DPOConfig, DPOWorker
from posttrain.train.metrics import MetricsWriter
from steps.common import (base_model_dir, drop_metrics_after, ensure_prepared, launch_workers,
                          overrides_from, step_loop)

log = logging.getLogger("posttrain.train_dpo")


def run(config: DPOConfig | str | Path, *, overrides: dict | None = None,
        prepared_dir: str | None = None, checkpoint_dir: str | None = None,
        show_progress: bool = True, worker_cls: type = DPOWorker,
        config_cls: type = DPOConfig, name: str = "dpo") -> dict[str, Any]:
    """Train, evaluate and export; returns paths and the final metrics.

    `prepared_dir` skips the prepare step; `checkpoint_dir` (default `run.dir`) holds
    `checkpoints/` and the reference log-probs, so a retried task continues where it stopped.
    `worker_cls` / `config_cls` let the reward-model recipe (`steps/train_reward.py`) drive
    its own worker with this same loop.
    """
    cfg = config if isinstance(config, config_cls) else load_recipe(config, config_cls, overrides)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepared_dir = prepared_dir or ensure_prepared(cfg, str(run_dir / "prepared"), show_progress)
    hf_dir = base_model_dir(cfg, local_view(prepared_dir), run_dir)
    state_dir = checkpoint_dir or str(run_dir)
    writer = MetricsWriter(run_dir / "metrics.jsonl",
                           tensorboard_dir=cfg.run.tensorboard_dir)
    args = (to_dict(cfg), hf_dir, prepared_dir, state_dir)
    with launch_workers(cfg.run, worker_cls, args) as group:
        info = group.call("describe")[0]
        reference = group.call("prepare_reference")[0]     # before resume: starting weights
        start = group.call("resume")[0]
        drop_metrics_after(run_dir / "metrics.jsonl", start)
        log.info("%s: %s params (%s trainable) on %d worker(s), from step %d", name,
                 f"{info['params']:,}", f"{info['trainable_params']:,}", info["world_size"],
                 start)
        history = step_loop(group, name=name, start=start, max_steps=cfg.train.max_steps,
                             checkpoint_every=cfg.train.checkpoint_every_steps, writer=writer,
                             show_progress=show_progress, postfix=_postfix)
        evaluation = group.call("evaluate")[0]
        writer.write({"step": start + len(history), **evaluation})
        export_dir = str(run_dir / "hf")
        group.call("export", export_dir)
    writer.close()
    result = {"run_dir": str(run_dir), "hf_dir": export_dir, "prepared_dir": prepared_dir,
              "base_model_dir": hf_dir, "metrics_path": str(run_dir / "metrics.jsonl"),
              "checkpoint_dir": f"{state_dir.rstrip('/')}/checkpoints",
              "reference_pairs": reference, "started_at_step": start,
              "steps": start + len(history), "eval": evaluation, "model": info,
              "config": to_dict(cfg)}
    if history:
        last = history[-1]
        result.update({"final_loss": last["loss"], "final_accuracy": last["accuracy"],
                       "mean_pairs_per_s": sum(m["pairs_per_s"] for m in history) / len(history)})
    (run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return result






def summarize(result: dict, seconds: float) -> str:
    ev = result.get("eval", {})
    lines = [f"trained {result['steps']} steps in {seconds:.0f} s (from step "
             f"{result['started_at_step']})"]
    if "final_loss" in result:
        lines.append(f"final train loss {result['final_loss']:.4f}, reward accuracy "
                     f"{result['final_accuracy']:.2f}; {result['mean_pairs_per_s']:.1f} pairs/s")
    if ev:
        lines.append(f"held-out: loss {ev['eval_loss']:.4f}, accuracy {ev['eval_accuracy']:.2f}"
                     + (f", margin {ev['eval_margins']:.4f}" if "eval_margins" in ev else "")
                     + f" over {ev['eval_pairs']} pairs")
    lines += [f"Hugging Face checkpoint: {result['hf_dir']}",
              f"metrics: {result['metrics_path']}"]
    return "\n".join(lines)


def _postfix(m: dict) -> dict[str, str]:
    return {"loss": f"{m['loss']:.3f}", "acc": f"{m['accuracy']:.2f}",
            "pairs/s": f"{m['pairs_per_s']:.0f}"}

def main(args: argparse.Namespace) -> int:
    t0 = time.time()
    result = run(args.config, overrides=overrides_from(args), show_progress=not args.no_progress)
    print(summarize(result, time.time() - t0))
    return 0


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-dpo", *sys.argv[1:]]))
