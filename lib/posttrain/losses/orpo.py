"""ORPO: supervised fine-tuning on the chosen response plus an odds-ratio preference term.

Hong, Lee & Thorne 2024, "ORPO: Monolithic Preference Optimization without Reference Model".
With a the per-token *mean* log-prob of a response under the policy (a = 1/|y| sum_t
log pi(y_t | x, y_<t)), the paper's length-normalised likelihood P(y|x) = exp(a) and its odds

    odds(y|x) = P(y|x) / (1 - P(y|x)),     log odds = a - log(1 - exp(a))

the per-pair loss is (lambda: `odds_ratio_weight`)

    L_SFT = -a_c                                   (the chosen response's token-mean NLL)
    L_OR  = -log s(log odds(y_c|x) - log odds(y_r|x))
    loss  = L_SFT + lambda L_OR

with s the logistic sigmoid. There is no reference model. log(1 - exp(a)) is computed as
log(-expm1(a)) for a > -log 2 and log1p(-exp(a)) below (stable for a -> 0 and a -> -inf).

Normalisation against TRL's ORPOTrainer (trl.experimental.orpo): the odds-ratio term is the
same (per-token mean log-probs of the response, `log1mexp`; TRL's `beta` is this lambda, and
TRL adds `-beta * logsigmoid(.)`, i.e. lambda L_OR). The NLL term differs in two ways: TRL's is
one cross-entropy over *all* tokens of the batch's chosen sequences, prompt tokens included
(a token mean over the batch), while here it is each pair's mean over its chosen *response*
tokens, averaged over the step's pairs, as the paper writes it (eq. 1 and 6). Ours does not
depend on how pairs fall into micro-batches or ranks (the recipe kernel's normalisation) and
does not train the prompt; the two agree when the prompts are empty and all chosen responses
have one length.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from posttrain.losses.dpo import mean_or_zero, reduce_losses, reward_metrics, wide

__all__ = ["log_odds", "orpo_loss"]


def log_odds(a_B: torch.Tensor) -> torch.Tensor:
    """log(P / (1 - P)) of P = exp(a), for per-token mean log-probs a <= 0."""
    log1m = torch.where(a_B > -math.log(2), torch.log(-torch.expm1(a_B)),
                        torch.log1p(-torch.exp(a_B)))
    return a_B - log1m


def orpo_loss(policy_chosen_B: torch.Tensor, policy_rejected_B: torch.Tensor, *,
              odds_ratio_weight: float, beta: float = 0.1,
              reduction: Literal["mean", "sum"] = "mean",
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO over B pairs from the policy's per-token mean log-probs (module docstring).

    Args:
        policy_chosen_B, policy_rejected_B: a_c, a_r (<= 0), differentiable.
        odds_ratio_weight: lambda, the weight of the odds-ratio term (paper: 0.1 to 1); > 0.
        beta: scales the reported rewards only (beta a, as SimPO's reward), not the loss.
        reduction: "mean" over pairs, or "sum" (divide by the step's global pair count).

    Returns:
        (loss, metrics): detached means over pairs of ``rewards_chosen`` /
        ``rewards_rejected`` (beta a), ``margins``, ``accuracy`` (a_c > a_r, which is also
        log odds ratio > 0), ``log_odds_ratio``, ``odds_ratio_loss`` (L_OR) and
        ``nll_chosen`` (L_SFT).
    """
    if odds_ratio_weight <= 0:
        raise ValueError(f"odds_ratio_weight must be positive, got {odds_ratio_weight}")
    if policy_chosen_B.shape != policy_rejected_B.shape or policy_chosen_B.dim() != 1:
        raise ValueError(f"policy_chosen_B {tuple(policy_chosen_B.shape)} and policy_rejected_B "
                         f"{tuple(policy_rejected_B.shape)} must both be [B]")
    a_c, a_r = wide(policy_chosen_B), wide(policy_rejected_B)
    ratio_B = log_odds(a_c) - log_odds(a_r)
    or_B = -F.logsigmoid(ratio_B)
    nll_B = -a_c
    loss = reduce_losses(nll_B + odds_ratio_weight * or_B, reduction)
    metrics = reward_metrics(beta * a_c.detach(), beta * a_r.detach())
    metrics.update(log_odds_ratio=mean_or_zero(ratio_B.detach()),
                   odds_ratio_loss=mean_or_zero(or_B.detach()),
                   nll_chosen=mean_or_zero(nll_B.detach()))
    return loss, metrics
