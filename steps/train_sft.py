"""Train SFT: Ray trainer actors (FSDP2 over gloo/NCCL) driven step by step from here.

    prepare (if needed) -> base HF checkpoint -> WorkerGroup(SFTWorker) ->
    resume from the newest valid checkpoint -> for each step: train_step on every rank,
    log metrics, checkpoint every K steps -> evaluate -> export a Hugging Face checkpoint

The driver is a single controller: it holds no weights, decides when to checkpoint, logs and
shows progress; each rank runs `posttrain.train.sft.SFTWorker` (see its data rule). A run that
is killed continues from its last complete checkpoint when started again with the same run
directory, and ends with the same weights as a run that never stopped.

Run it without Metaflow:

    posttrain train-sft --config configs/sft/tiny.yaml
    python -m steps.train_sft --config configs/sft/tiny.yaml --launcher inline

`launcher: ray` starts a local Ray cluster when none is running (and stops it at the end), or
joins the one `@metaflow_ray` formed across nodes. `launcher: inline` runs one worker in this
process (no Ray): the quickest path on a laptop and in tests.
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
from posttrain.train.metrics import MetricsWriter
from posttrain.train.sft import SFTConfig, SFTWorker
from steps.common import (base_model_dir, drop_metrics_after, ensure_prepared, launch_workers,
                          overrides_from, step_loop)

log = logging.getLogger("posttrain.train_sft")


def run(config: SFTConfig | str | Path, *, overrides: dict | None = None,
        prepared_dir: str | None = None, checkpoint_dir: str | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    """Train, evaluate and export; returns paths and the final metrics.

    `prepared_dir` (local or ``s3://``) skips the prepare step; `checkpoint_dir` (local or
    ``s3://``, default `run.dir`) is where `checkpoints/` live, so a retried or resumed
    orchestrator task that passes the same value continues from the last checkpoint.
    """
    cfg = config if isinstance(config, SFTConfig) else load_recipe(config, SFTConfig, overrides)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepared_dir = prepared_dir or ensure_prepared(cfg, str(run_dir / "prepared"), show_progress)
    hf_dir = base_model_dir(cfg, local_view(prepared_dir), run_dir)
    writer = MetricsWriter(run_dir / "metrics.jsonl",
                           tensorboard_dir=cfg.run.tensorboard_dir)
    args = (to_dict(cfg), hf_dir, prepared_dir, checkpoint_dir or str(run_dir))
    with launch_workers(cfg.run, SFTWorker, args) as group:
        info = group.call("describe")[0]
        start = group.call("resume")[0]
        drop_metrics_after(run_dir / "metrics.jsonl", start)
        log.info("training %s params (%s trainable) on %d worker(s), from step %d",
                 f"{info['params']:,}", f"{info['trainable_params']:,}", info["world_size"],
                 start)
        history = step_loop(group, name="sft", start=start, max_steps=cfg.train.max_steps,
                             checkpoint_every=cfg.train.checkpoint_every_steps, writer=writer,
                             show_progress=show_progress, postfix=_postfix)
        evaluation = group.call("evaluate")[0]
        writer.write({"step": start + len(history), **evaluation})
        export_dir = str(run_dir / "hf")
        group.call("export", export_dir)
    writer.close()
    result = {"run_dir": str(run_dir), "hf_dir": export_dir, "prepared_dir": prepared_dir,
              "base_model_dir": hf_dir, "metrics_path": str(run_dir / "metrics.jsonl"),
              "checkpoint_dir": f"{(checkpoint_dir or str(run_dir)).rstrip('/')}/checkpoints",
              "started_at_step": start, "steps": start + len(history), "eval": evaluation,
              "model": info, "config": to_dict(cfg)}
    if history:
        result["final_loss"] = history[-1]["loss"]
        result["mean_real_tokens_per_s"] = sum(m["real_tokens_per_s"] for m in history) / len(history)
        result["mean_mfu"] = sum(m["mfu"] for m in history) / len(history)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _postfix(m: dict) -> dict[str, str]:
    return {"loss": f"{m['loss']:.3f}", "tok/s": f"{m['real_tokens_per_s']:.0f}",
            "mfu": f"{m['mfu']:.1%}", "lr": f"{m['lr']:.2e}"}

def main(args: argparse.Namespace) -> int:
    t0 = time.time()
    result = run(args.config, overrides=overrides_from(args), show_progress=not args.no_progress)
    print(summarize(result, time.time() - t0))
    return 0


def summarize(result: dict, seconds: float) -> str:
    ev = result.get("eval", {})
    lines = [f"trained {result['steps']} steps in {seconds:.0f} s "
             f"(resumed at step {result['started_at_step']})" if result["started_at_step"]
             else f"trained {result['steps']} steps in {seconds:.0f} s"]
    if "final_loss" in result:
        lines.append(f"final train loss {result['final_loss']:.4f}; "
                     f"{result['mean_real_tokens_per_s']:.0f} real tokens/s; "
                     f"MFU {result['mean_mfu']:.1%}")
    if ev:
        lines.append(f"held-out loss {ev['eval_loss']:.4f} (perplexity "
                     f"{ev['eval_perplexity']:.2f}) over {ev['eval_tokens']} tokens")
    lines += [f"Hugging Face checkpoint: {result['hf_dir']}",
              f"metrics: {result['metrics_path']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-sft", *sys.argv[1:]]))
