"""Train distill: a student learns a frozen teacher's token distributions (knowledge distillation).

    prepare (if needed) -> student HF checkpoint, teacher HF checkpoint -> check that they share
    the data's tokenizer -> [offline: teacher top-k pass, `steps/teacher_topk.py`] ->
    workers -> resume from the newest valid checkpoint -> for each step:
    train_step on every rank, log, checkpoint every K steps -> evaluate -> export the student

The loss (`posttrain.losses.distill`) is forward KL, reverse KL or generalized JSD at a
temperature, optionally mixed with cross-entropy on the labels, computed in chunks so that
neither model's [tokens, vocab] logits exist at once. With `teacher.signal: online` the teacher
runs on the same workers, sharded with FSDP2 like the student and frozen; with `offline` its
top-k log-probs are computed once and stored beside the prepared shards
(`posttrain.data.topk`). The driver is the one of every recipe (`steps.common.run_recipe`), the recipe
`posttrain.train.distill.Distill`: a killed run continues from its last complete checkpoint and
ends with the same student weights.

    python -m steps.train_distill --config configs/distill/tiny.yaml
    python -m steps.train_distill --config configs/distill/tiny.yaml --launcher inline
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from posttrain.models.random_init import write_random_hf_model
from posttrain.train.distill import Distill, DistillConfig, check_teacher
from posttrain.train.recipe import tokenizer_vocab
from steps.common import main_for, run_recipe


def run(config: DistillConfig | str | Path, **kwargs: Any) -> dict[str, Any]:
    """Distill, evaluate and export the student; arguments as `steps.common.run_recipe`."""
    return run_recipe(Distill, config, models=teacher, **kwargs)


def teacher(cfg: DistillConfig, prepared_dir: str, run_dir: Path) -> dict[str, str]:
    """The teacher's directory, checked against the data's tokenizer and the student; for an
    offline teacher, its top-k pass over the train rows (once, beside the prepared shards)."""
    teacher_dir = teacher_model_dir(cfg, prepared_dir, run_dir)
    student_dir = cfg.model.hf_dir or str(run_dir / "base_model")
    check_teacher(teacher_dir, student_dir, f"{prepared_dir}/tokenizer")
    if cfg.teacher.signal == "offline":
        from steps import teacher_topk
        teacher_topk.run(teacher_dir, prepared_dir, k=cfg.teacher.topk)
    return {"teacher": teacher_dir}


def teacher_model_dir(cfg: DistillConfig, prepared_dir: str, run_dir: Path) -> str:
    """teacher.hf_dir, or a random teacher made from teacher.init with the data's tokenizer."""
    if cfg.teacher.hf_dir:
        return cfg.teacher.hf_dir
    return write_random_hf_model(cfg.teacher.init, tokenizer_vocab(prepared_dir),
                                 run_dir / "teacher_model",
                                 tokenizer_dir=f"{prepared_dir}/tokenizer")


RECIPE = Distill
main = main_for(RECIPE, run)

if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-distill", *sys.argv[1:]]))
