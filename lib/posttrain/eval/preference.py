"""Held-out preference metrics from per-pair response log-probs of a policy and its reference.

The DPO implicit reward of a response is r = beta (log pi(y|x) - log ref(y|x)); the metrics are
the fraction of pairs whose chosen response has the higher reward, the mean margin, and the
fraction where the policy alone prefers the chosen response. The evaluation suites' preference
task (`posttrain.eval.suites`) computes the log-probs with the chunked op, as in training.
"""

from __future__ import annotations


def preference_metrics(policy: list[dict[str, float]], reference: list[dict[str, float]],
                       beta: float) -> tuple[dict[str, float], list[float]]:
    """(metrics, per-pair reward margins) from per-pair response log-probs (`logp_chosen`,
    `logp_rejected`) of `policy` and of `reference`, the DPO reference.

    margin = beta ((pi_c - ref_c) - (pi_r - ref_r)); ``reward_accuracy`` is the fraction of
    margins > 0 (a tie is not a win, as in `dpo_loss`), ``reward_margin`` their mean, and
    ``logp_accuracy`` the fraction of pairs with pi_c > pi_r (no reference needed).
    """
    margins = [beta * ((p["logp_chosen"] - r["logp_chosen"])
                       - (p["logp_rejected"] - r["logp_rejected"]))
               for p, r in zip(policy, reference, strict=True)]
    n = len(margins)
    metrics = {"reward_accuracy": sum(m > 0 for m in margins) / n,
               "reward_margin": sum(margins) / n,
               "logp_accuracy": sum(p["logp_chosen"] > p["logp_rejected"] for p in policy) / n}
    return metrics, margins
