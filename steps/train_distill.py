"""Train distill: a student learns a frozen teacher's token distributions (knowledge distillation).

    prepare (if needed) -> student HF checkpoint, teacher HF checkpoint -> check that they share
    the data's tokenizer -> [offline: teacher top-k pass, `steps/teacher_topk.py`] ->
    WorkerGroup(DistillWorker) -> resume from the newest valid checkpoint -> for each step:
    train_step on every rank, log, checkpoint every K steps -> evaluate -> export the student

The loss (`posttrain.losses.distill`) is forward KL, reverse KL or generalized JSD at a
temperature, optionally mixed with cross-entropy on the labels, computed in chunks so that
neither model's [tokens, vocab] logits exist at once. With `teacher.signal: online` the teacher
runs on the same workers, sharded with FSDP2 like the student and frozen; with `offline` its
top-k log-probs are computed once and stored beside the prepared shards
(`posttrain.data.topk`). Driver, data rule, checkpoints and resume are SFT's
(`steps/train_sft.py`, `posttrain.train.sft`): a killed run continues from its last complete
checkpoint and ends with the same student weights.

    python -m steps.train_distill --config configs/distill/tiny.yaml
    python -m steps.train_distill --config configs/distill/tiny.yaml --launcher inline
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
from posttrain.train.distill import DistillConfig, DistillWorker, check_teacher
from posttrain.train.engine import write_random_hf_model
from posttrain.train.metrics import MetricsWriter
from steps.common import (base_model_dir, drop_metrics_after, ensure_prepared, launch_workers,
                          overrides_from, step_loop)

log = logging.getLogger("posttrain.train_distill")


def run(config: DistillConfig | str | Path, *, overrides: dict | None = None,
        prepared_dir: str | None = None, checkpoint_dir: str | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    """Distill, evaluate and export the student; returns paths and the final metrics.

    `prepared_dir` and `checkpoint_dir` as in `steps.train_sft.run`.
    """
    cfg = (config if isinstance(config, DistillConfig)
           else load_recipe(config, DistillConfig, overrides))
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepared_dir = prepared_dir or ensure_prepared(cfg, str(run_dir / "prepared"), show_progress)
    local = local_view(prepared_dir)
    student_dir = base_model_dir(cfg, local, run_dir)
    teacher_dir = teacher_model_dir(cfg, local, run_dir)
    check_teacher(teacher_dir, student_dir, f"{local}/tokenizer")
    if cfg.teacher.signal == "offline":
        from steps import teacher_topk
        teacher_topk.run(teacher_dir, prepared_dir, k=cfg.teacher.topk)
    writer = MetricsWriter(run_dir / "metrics.jsonl",
                           tensorboard_dir=cfg.run.tensorboard_dir)
    args = (to_dict(cfg), student_dir, teacher_dir, prepared_dir, checkpoint_dir or str(run_dir))
    with launch_workers(cfg.run, DistillWorker, args) as group:
        info = group.call("describe")[0]
        start = group.call("resume")[0]
        drop_metrics_after(run_dir / "metrics.jsonl", start)
        log.info("distilling into %s student params (teacher %s, %s) on %d worker(s), from "
                 "step %d", f"{info['params']:,}", f"{info.get('teacher_params', 0):,}",
                 cfg.teacher.signal, info["world_size"], start)
        history = step_loop(group, name="distill", start=start, max_steps=cfg.train.max_steps,
                             checkpoint_every=cfg.train.checkpoint_every_steps, writer=writer,
                             show_progress=show_progress, postfix=_postfix)
        evaluation = group.call("evaluate")[0]
        writer.write({"step": start + len(history), **evaluation})
        export_dir = str(run_dir / "hf")
        group.call("export", export_dir)
    writer.close()
    result = {"run_dir": str(run_dir), "hf_dir": export_dir, "prepared_dir": prepared_dir,
              "base_model_dir": student_dir, "teacher_dir": teacher_dir,
              "metrics_path": str(run_dir / "metrics.jsonl"),
              "checkpoint_dir": f"{(checkpoint_dir or str(run_dir)).rstrip('/')}/checkpoints",
              "started_at_step": start, "steps": start + len(history), "eval": evaluation,
              "model": info, "config": to_dict(cfg)}
    if history:
        result["final_loss"] = history[-1]["loss"]
        result["mean_real_tokens_per_s"] = (sum(m["real_tokens_per_s"] for m in history)
                                            / len(history))
    (run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def teacher_model_dir(cfg: DistillConfig, prepared_dir: str, run_dir: Path) -> str:
    """teacher.hf_dir, or a random teacher made from teacher.init with the data's tokenizer."""
    if cfg.teacher.hf_dir:
        return cfg.teacher.hf_dir
    manifest = json.loads((Path(prepared_dir) / "manifest.json").read_text())
    return write_random_hf_model(cfg.teacher.init, int(manifest["tokenizer"]["vocab_size"]),
                                 run_dir / "teacher_model",
                                 tokenizer_dir=f"{prepared_dir}/tokenizer")




def _postfix(m: dict) -> dict[str, str]:
    return {"loss": f"{m['loss']:.3f}", "tok/s": f"{m['real_tokens_per_s']:.0f}"}

def main(args: argparse.Namespace) -> int:
    t0 = time.time()
    result = run(args.config, overrides=overrides_from(args), show_progress=not args.no_progress)
    print(summarize(result, time.time() - t0))
    return 0


def summarize(result: dict, seconds: float) -> str:
    lines = [f"distilled {result['steps']} steps in {seconds:.0f} s"
             + (f" (resumed at step {result['started_at_step']})"
                if result["started_at_step"] else "")]
    if "final_loss" in result:
        lines.append(f"final train loss {result['final_loss']:.4f}; "
                     f"{result['mean_real_tokens_per_s']:.0f} real tokens/s")
    if result.get("eval"):
        lines.append(f"held-out distillation loss {result['eval']['eval_loss']:.4f} over "
                     f"{result['eval']['eval_tokens']} tokens")
    lines += [f"student Hugging Face checkpoint: {result['hf_dir']}",
              f"metrics: {result['metrics_path']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-distill", *sys.argv[1:]]))
