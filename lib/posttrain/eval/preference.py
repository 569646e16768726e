"""Held-out preference metrics of an exported policy against its starting model (single process).

For each held-out pair the DPO implicit rewards r = beta (log pi(y|x) - log ref(y|x)) of the
chosen and the rejected response are computed from two native models loaded from Hugging Face
checkpoints (the exported policy and the model training started from); the table reports
preference accuracy (r_chosen > r_rejected), the mean margin, the mean rewards, the sigmoid DPO
loss and the mean log-probs under both models. Sequence log-probs use the chunked op, as in
training. Used after training on the artifact users deploy, not on the trainer's state.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.data.loader import LoaderConfig, TrainLoader
from posttrain.losses.dpo import dpo_loss, dpo_pair_logps
from posttrain.models.transformer import Transformer


@torch.no_grad()
def pair_logps(model: Transformer, batch: dict, reduction: str = "sum"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_P, rejected_P) response log-probs of a preference batch under `model`."""
    model.eval()
    hidden = model(batch["input_ids"], batch["position_ids"], batch["document_lengths"])
    head = model.head
    return dpo_pair_logps(hidden, head.weight, batch["labels"], batch["pair_index"],
                          batch["sequence_ids"], real_vocab_size=head.real_vocab_size,
                          softcap=getattr(head, "softcap", None), reduction=reduction)


def preference_eval(policy: Transformer, reference: Transformer,
                    sources: dict[str, list[str]], loader_cfg: LoaderConfig, *, beta: float,
                    max_batches: int, reduction: str = "sum") -> dict[str, Any]:
    """Means over at most `max_batches` held-out pair batches (see the module docstring)."""
    cfg = LoaderConfig(packing=loader_cfg.packing, mode=loader_cfg.mode, format="preference",
                       rows_per_batch=loader_cfg.rows_per_batch, epochs=1, background=False)
    parts: dict[str, list[torch.Tensor]] = {"pc": [], "pr": [], "rc": [], "rr": []}
    with TrainLoader(sources, cfg) as loader:
        for i, batch in enumerate(loader):
            if i >= max_batches:
                break
            pc, pr = pair_logps(policy, batch, reduction)
            rc, rr = pair_logps(reference, batch, reduction)
            for k, v in zip(("pc", "pr", "rc", "rr"), (pc, pr, rc, rr)):
                parts[k].append(v)
    if not parts["pc"]:
        return {}
    pc, pr, rc, rr = (torch.cat(parts[k]) for k in ("pc", "pr", "rc", "rr"))
    loss, m = dpo_loss(pc, pr, rc, rr, beta=beta)
    return {"pairs": int(pc.numel()), "accuracy": float(m["accuracy"]),
            "margin": float(m["margins"]), "rewards_chosen": float(m["rewards_chosen"]),
            "rewards_rejected": float(m["rewards_rejected"]), "loss": float(loss),
            "policy_logps_chosen": float(pc.mean()), "policy_logps_rejected": float(pr.mean()),
            "reference_logps_chosen": float(rc.mean()),
            "reference_logps_rejected": float(rr.mean())}


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
