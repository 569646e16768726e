"""SimPO: a reference-free preference loss on length-normalised log-probs.

Meng, Xia & Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward".
With a_c and a_r the per-token *mean* log-probs of the chosen and rejected responses under the
policy pi (a = 1/|y| sum_t log pi(y_t | x, y_<t)), the implicit reward is

    r(x, y) = beta / |y| log pi(y|x) = beta a

and the per-pair loss asks the chosen reward to beat the rejected one by a margin gamma:

    h    = a_c - a_r - gamma / beta               (gamma / beta: `gamma_beta_ratio`)
    loss = -(1 - eps) log s(beta h) - eps log s(-beta h)

with s the logistic sigmoid and eps the label smoothing of conservative DPO (eps = 0 is the
paper's loss; the official SimPO code and TRL's CPOTrainer take eps the same way). There is no
reference model: no reference log-probs are computed or stored. Fed summed log-probs instead
of means it is the paper's "SimPO w/o LN" ablation.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from posttrain.losses.dpo import reduce_losses, reward_metrics, wide

__all__ = ["simpo_loss"]


def simpo_loss(policy_chosen_B: torch.Tensor, policy_rejected_B: torch.Tensor, *, beta: float,
               gamma_beta_ratio: float = 0.5, label_smoothing: float = 0.0,
               reduction: Literal["mean", "sum"] = "mean",
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO over B pairs from the policy's per-token mean log-probs (module docstring).

    Args:
        policy_chosen_B, policy_rejected_B: a_c, a_r, differentiable.
        beta: the reward scale (the paper uses 2 to 10).
        gamma_beta_ratio: gamma / beta, the target margin in log-prob units (paper: 0.3 to 1.6
            in practice, 0.5 a common choice); >= 0.
        label_smoothing: eps in [0, 0.5].
        reduction: "mean" over pairs, or "sum" (divide by the step's global pair count).

    Returns:
        (loss, metrics): metrics are detached means over pairs: ``rewards_chosen`` and
        ``rewards_rejected`` (beta a), ``margins`` (their difference) and ``accuracy`` (the
        fraction with margin > 0; a tie counts as wrong).
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if gamma_beta_ratio < 0:
        raise ValueError(f"gamma_beta_ratio must be >= 0, got {gamma_beta_ratio}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if policy_chosen_B.shape != policy_rejected_B.shape or policy_chosen_B.dim() != 1:
        raise ValueError(f"policy_chosen_B {tuple(policy_chosen_B.shape)} and policy_rejected_B "
                         f"{tuple(policy_rejected_B.shape)} must both be [B]")
    a_c, a_r = wide(policy_chosen_B), wide(policy_rejected_B)
    h_B = a_c - a_r - gamma_beta_ratio
    eps = float(label_smoothing)
    losses_B = -(1 - eps) * F.logsigmoid(beta * h_B) - eps * F.logsigmoid(-beta * h_B)
    return reduce_losses(losses_B, reduction), reward_metrics(beta * a_c, beta * a_r)
