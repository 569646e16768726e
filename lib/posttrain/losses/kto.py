"""KTO: a preference loss on *unpaired* completions, each labelled desirable or undesirable.

Ethayarajh, Xu, Muennighoff, Jurafsky & Kiela 2024, "KTO: Model Alignment as Prospect
Theoretic Optimization". For a completion y of prompt x, with log-probs summed over its
response tokens under the policy pi and the frozen reference,

    r(x, y) = log pi(y|x) - log ref(y|x)                        (the implicit reward / beta)
    z_0     = the reference point, an estimate of KL(pi || ref), >= 0, no gradient
    v(x, y) = lambda_D s(beta (r - z_0))     if y is desirable
              lambda_U s(beta (z_0 - r))     if y is undesirable
    loss    = E_{x,y} [lambda_y - v(x, y)]    (lambda_y: lambda_D or lambda_U)

so each completion contributes lambda_y (1 - s(+-beta (r - z_0))), s the logistic sigmoid. The
paper recommends lambda_D n_D / (lambda_U n_U) in [1, 4/3] for n_D desirable and n_U
undesirable completions. TRL's KTOTrainer computes the same per-completion losses and takes
their mean over the batch.

The reference point z_0 (`kl_reference_point`). The paper, and TRL, estimate it on mismatched
pairs: the log-ratio of each prompt with *another* row's completion, averaged over the
micro-batch (TRL: also over the devices of one accumulation micro-step), clamped >= 0 and
detached; that costs a policy and a reference forward over the mismatched sequences. Here z_0
of optimizer step s is

    z_0(s) = max(0, mean over every completion of step s-1 of [log pi_{s-1}(y|x) - log ref(y|x)])

(every micro-batch on every data-parallel rank, under the weights step s-1 trained from, the
values its forward computed anyway), and z_0(1) = 0, where pi = ref. Why: the recipe kernel's
contract is that a step's gradient does not depend on how its completions fall into
micro-batches or ranks, which needs one z_0 per step, and the step's own mean is known only
after all its forwards (a second pass would cost one forward more); this one costs nothing,
is deterministic, and is checkpointed with the run, so a resumed run is bit-identical. What
it gives up: z_0 lags one optimizer step, and it is measured on the data's own (matched)
completions, which the policy pushes up (desirable) and down (undesirable) rather than on
unrelated ones; on balanced data the two movements roughly cancel.
"""

from __future__ import annotations

from typing import Literal

import torch

from posttrain.losses.dpo import mean_or_zero, reduce_losses, wide

__all__ = ["kl_reference_point", "kto_loss"]


def kl_reference_point(mean_log_ratio: float) -> float:
    """z_0 for the next step from the mean log pi - log ref over this step's completions."""
    return max(0.0, float(mean_log_ratio))


def kto_loss(policy_S: torch.Tensor, ref_S: torch.Tensor, desirable_S: torch.Tensor,
             kl_reference: float, *, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0, reduction: Literal["mean", "sum"] = "mean",
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO over S completions (module docstring).

    Args:
        policy_S: log pi(y|x) per completion (differentiable).
        ref_S: log ref(y|x) (no gradient flows).
        desirable_S: bool, the completion's label.
        kl_reference: z_0 >= 0, a constant of the step.
        beta: the implicit reward's scale (> 0).
        desirable_weight, undesirable_weight: lambda_D, lambda_U (> 0).
        reduction: "mean" over completions, or "sum" (divide by the step's global count).

    Returns:
        (loss, metrics): metrics are detached scalars: ``rewards_desirable`` and
        ``rewards_undesirable`` (the mean of beta r over each class, 0 for an empty class),
        ``num_desirable`` and ``num_undesirable``, ``log_ratio`` (the mean r over all, from
        which `kl_reference_point` makes the next z_0), ``kl`` (z_0 as used) and ``accuracy``
        (the fraction of completions on their label's side of the reference point, r > z_0
        for desirable and r < z_0 for undesirable; a tie counts as wrong).
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if desirable_weight <= 0 or undesirable_weight <= 0:
        raise ValueError(f"desirable_weight and undesirable_weight must be positive, got "
                         f"{desirable_weight} and {undesirable_weight}")
    if not kl_reference >= 0:
        raise ValueError(f"kl_reference must be >= 0 (clamped), got {kl_reference}")
    if not (policy_S.shape == ref_S.shape == desirable_S.shape) or policy_S.dim() != 1:
        raise ValueError(f"policy_S {tuple(policy_S.shape)}, ref_S {tuple(ref_S.shape)} and "
                         f"desirable_S {tuple(desirable_S.shape)} must all be [S]")
    good_S = desirable_S.bool()
    r_S = wide(policy_S) - wide(ref_S).detach()
    z = float(kl_reference)
    sign_S = torch.where(good_S, 1.0, -1.0).to(r_S)
    weight_S = torch.where(good_S, r_S.new_tensor(desirable_weight),
                           r_S.new_tensor(undesirable_weight))
    losses_S = weight_S * (1 - torch.sigmoid(beta * sign_S * (r_S - z)))
    with torch.no_grad():
        rewards_S = beta * r_S.detach()
        metrics = {"rewards_desirable": mean_or_zero(rewards_S[good_S]),
                   "rewards_undesirable": mean_or_zero(rewards_S[~good_S]),
                   "num_desirable": good_S.sum().to(r_S.dtype),
                   "num_undesirable": (~good_S).sum().to(r_S.dtype),
                   "log_ratio": mean_or_zero(r_S.detach()),
                   "kl": r_S.new_tensor(z),
                   "accuracy": mean_or_zero((sign_S * (r_S.detach() - z) > 0).to(r_S.dtype))}
    return reduce_losses(losses_S, reduction), metrics
