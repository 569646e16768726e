"""Reward-model loss: Bradley-Terry on the scalar rewards of a chosen and a rejected response.

    loss = mean_b  -log s(r_c,b - r_r,b - m_b)

with s the logistic sigmoid. This is the negative log-likelihood of the preference under the
Bradley-Terry model (Bradley & Terry 1952) as used for RLHF reward models (Ouyang et al. 2022,
InstructGPT); the optional margin m_b (Touvron et al. 2023, Llama 2) asks for a larger reward gap
on pairs rated as clearly different. -log s(x) is computed as softplus(-x), stable for any x.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["bt_loss"]


def bt_loss(reward_chosen_B: torch.Tensor, reward_rejected_B: torch.Tensor,
            margin_B: torch.Tensor | None = None, *,
            reduction: Literal["mean", "sum"] = "mean",
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry loss over B pairs.

    Args:
        reward_chosen_B, reward_rejected_B: scalar rewards, [B].
        margin_B: optional required reward gap per pair, [B] (no gradient flows to it).
        reduction: "mean" over pairs, or "sum" (divide by the step's global pair count).

    Returns:
        (loss, metrics): loss is an fp32 scalar (fp64 for fp64 inputs); metrics are detached
        scalars:
        ``accuracy`` (fraction with r_c > r_r; a tie counts as wrong) and ``margin``
        (mean of r_c - r_r, without m).
    """
    if reward_chosen_B.shape != reward_rejected_B.shape or reward_chosen_B.dim() != 1:
        raise ValueError(f"reward_chosen_B {tuple(reward_chosen_B.shape)} and reward_rejected_B "
                         f"{tuple(reward_rejected_B.shape)} must both be [B]")
    if margin_B is not None and margin_B.shape != reward_chosen_B.shape:
        raise ValueError(f"margin_B {tuple(margin_B.shape)} must be [B] like the rewards "
                         f"{tuple(reward_chosen_B.shape)}")
    wide = torch.promote_types(reward_chosen_B.dtype, torch.float32)
    diff_B = reward_chosen_B.to(wide) - reward_rejected_B.to(wide)
    logits_B = diff_B if margin_B is None else diff_B - margin_B.to(wide).detach()
    losses_B = -F.logsigmoid(logits_B)
    if reduction == "mean":
        loss = losses_B.mean() if losses_B.numel() else losses_B.sum()
    elif reduction == "sum":
        loss = losses_B.sum()
    else:
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    with torch.no_grad():
        if diff_B.numel():
            metrics = {"accuracy": (diff_B > 0).float().mean(), "margin": diff_B.mean()}
        else:
            metrics = {"accuracy": diff_B.new_zeros(()), "margin": diff_B.new_zeros(())}
    return loss, metrics
