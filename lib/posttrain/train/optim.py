"""AdamW with decoupled weight decay and warmup + cosine/linear/constant learning-rate schedules.

Weight decay is applied to matrices only: norms, biases and 1-D parameters are excluded, as in
most LLM recipes (a decayed RMSNorm gain drifts toward zero for no benefit). Embeddings are
decayed like other matrices unless `decay_embeddings` is false.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from posttrain.config.train import OptimizerConfig, SchedulerConfig


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = "embed" in name.split(".")
        if p.ndim < 2 or (is_embedding and not cfg.decay_embeddings):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    kwargs = {"fused": True} if cfg.fused and torch.cuda.is_available() else {}
    return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             **kwargs)


def lr_factor(step: int, total_steps: int, cfg: SchedulerConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.kind == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                    cfg: SchedulerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg))
