"""How close a student is to its teacher on held-out rows: KL(teacher || student) per token.

Both models are plain single-process native models (the exported student, the teacher's HF
checkpoint); the divergence is the chunked forward KL of `posttrain.losses.distill` at
temperature 1 over the full vocabulary, so no [tokens, vocab] logits are held. Also reports
each model's held-out cross-entropy on the labels.
"""

from __future__ import annotations

import math

import torch

from posttrain.data.loader import LoaderConfig, TrainLoader
from posttrain.losses.distill import distill_loss
from posttrain.losses.sft import sft_loss_sum
from posttrain.models.transformer import Transformer


@torch.no_grad()
def teacher_student_kl(student: Transformer, teacher: Transformer,
                       sources: dict[str, list[str]], loader_cfg: LoaderConfig,
                       max_batches: int) -> dict[str, float]:
    """Token means over at most `max_batches` micro-batches of `sources` (one epoch, in order)."""
    student.eval()
    teacher.eval()
    cfg = LoaderConfig(packing=loader_cfg.packing, mode=loader_cfg.mode,
                       rows_per_batch=loader_cfg.rows_per_batch, epochs=1, background=False)
    kl = student_ce = teacher_ce = 0.0
    tokens = batches = 0
    real = student.head.real_vocab_size
    with TrainLoader(sources, cfg) as loader:
        for batch in loader:
            if batches >= max_batches:
                break
            args = (batch["input_ids"], batch["position_ids"], batch["document_lengths"])
            h_s, h_t = student(*args), teacher(*args)
            loss, _ = distill_loss(h_s, student.head.weight, h_t, teacher.head.weight,
                                   batch["labels"], kind="forward_kl", real_vocab_size=real,
                                   reduction="sum")
            kl += float(loss)
            student_ce += float(sft_loss_sum(h_s, student.head.weight, batch["labels"],
                                             real_vocab_size=real))
            teacher_ce += float(sft_loss_sum(h_t, teacher.head.weight, batch["labels"],
                                             real_vocab_size=real))
            tokens += batch["num_loss_tokens"]
            batches += 1
    n = max(tokens, 1)
    return {"kl_teacher_student": kl / n, "student_loss": student_ce / n,
            "student_perplexity": math.exp(min(student_ce / n, 50.0)),
            "teacher_loss": teacher_ce / n, "tokens": tokens, "batches": batches}
