"""The preference recipe's loss modules (FSDP roots): packed sequences -> log-probs -> a loss.

`DPOLoss` trains on pairs with any pair loss (DPO and its variants, SimPO, ORPO);
`KTOLoss` on unpaired completions, each labelled desirable or undesirable. Both return the
loss *summed* over their units (pairs, completions) and stats summed over them; the engine
divides by the step's global unit count (`posttrain.train.recipe`). The config is the recipe's
`DPOLossConfig` (`posttrain.train.dpo`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from posttrain.losses.dpo import dpo_loss, dpo_pair_logps, packed_sequence_logps
from posttrain.losses.kto import kto_loss
from posttrain.losses.orpo import orpo_loss
from posttrain.losses.simpo import simpo_loss
from posttrain.models.transformer import Transformer


def pair_loss(cfg: Any, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
              ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured pair loss summed over the pairs, and its metrics (means over pairs)."""
    if cfg.loss_type == "simpo":
        return simpo_loss(policy_chosen, policy_rejected, beta=cfg.beta,
                          gamma_beta_ratio=cfg.knob("gamma_beta_ratio"),
                          label_smoothing=cfg.label_smoothing, reduction="sum")
    if cfg.loss_type == "orpo":
        return orpo_loss(policy_chosen, policy_rejected,
                         odds_ratio_weight=cfg.knob("odds_ratio_weight"), beta=cfg.beta,
                         reduction="sum")
    return dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=cfg.beta,
                    loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
                    reduction="sum")


class _LogpsRoot(nn.Module):
    """The policy's forward and the chunked response log-probs; the reference too, for
    `reference` lora_base (the base model with its adapters disabled, no gradient)."""

    def __init__(self, model: Transformer, cfg: Any, reference: str, chunk_tokens: int = 1024):
        super().__init__()
        self.model, self.cfg, self.reference = model, cfg, reference
        self.chunk_tokens = chunk_tokens

    def _head_kwargs(self) -> dict[str, Any]:
        head = self.model.head
        return {"real_vocab_size": head.real_vocab_size, "chunk_tokens": self.chunk_tokens,
                "softcap": getattr(head, "softcap", None), "reduction": self.cfg.reduction}

    def _lora_reference(self, logps, *args):
        from posttrain.models.lora import disable_adapters
        with torch.no_grad(), disable_adapters(self.model):
            return logps(*args)


class DPOLoss(_LogpsRoot):
    """FSDP root: policy (and, for lora_base, reference) pair log-probs -> the summed pair
    loss (`pair_loss`; reference-free losses run no reference at all).

    Returns ``(loss_sum, stats)``: stats are sums over the batch's pairs of the loss's metrics
    (``accuracy``, ``rewards_chosen`` / ``rewards_rejected``, ``margins``; ORPO also
    ``log_odds_ratio``, ``odds_ratio_loss``, ``nll_chosen``) and the policy's
    ``logps_chosen`` / ``logps_rejected``. With ``logps_only=True`` (no loss, for the reference
    pass) it returns the policy's (chosen, rejected) log-probs.
    """

    input_keys = ("input_ids", "labels", "position_ids", "document_lengths", "sequence_ids",
                  "pair_index", "ref_chosen", "ref_rejected")

    def _pair_logps(self, input_ids, labels, position_ids, document_lengths, sequence_ids,
                    pair_index):
        hidden = self.model(input_ids, position_ids, document_lengths)
        return dpo_pair_logps(hidden, self.model.head.weight, labels, pair_index, sequence_ids,
                              **self._head_kwargs())

    def forward(self, input_ids, labels, position_ids, document_lengths, sequence_ids,
                pair_index, ref_chosen=None, ref_rejected=None, *, logps_only: bool = False):
        args = (input_ids, labels, position_ids, document_lengths, sequence_ids, pair_index)
        if logps_only:
            return self._pair_logps(*args)
        if self.reference == "lora_base" and not self.cfg.reference_free:
            ref_chosen, ref_rejected = self._lora_reference(self._pair_logps, *args)
        policy_chosen, policy_rejected = self._pair_logps(*args)
        loss, m = pair_loss(self.cfg, policy_chosen, policy_rejected, ref_chosen, ref_rejected)
        n = policy_chosen.shape[0]
        stats = {k: v * n for k, v in m.items()}
        stats["logps_chosen"] = policy_chosen.detach().sum()
        stats["logps_rejected"] = policy_rejected.detach().sum()
        return loss, stats


class KTOLoss(_LogpsRoot):
    """FSDP root: the log-prob of every packed completion (and, for lora_base, the
    reference's) -> the summed KTO loss at the step's reference point ``kl_reference``.

    Returns ``(loss_sum, stats)``; stats are sums over the batch's completions: ``accuracy``,
    ``log_ratio`` (log pi - log ref), ``logps`` (the policy's), ``rewards_desirable`` and
    ``desirable`` (the count), ``rewards_undesirable`` and ``undesirable``. With
    ``logps_only=True`` it returns the policy's log-probs [S] (the reference pass).
    """

    input_keys = ("input_ids", "labels", "position_ids", "document_lengths", "sequence_ids",
                  "desirable", "ref_logps", "kl_reference")

    def _logps(self, input_ids, labels, position_ids, document_lengths, sequence_ids):
        hidden = self.model(input_ids, position_ids, document_lengths)
        logp_S, count_S = packed_sequence_logps(hidden, self.model.head.weight, labels,
                                                sequence_ids, **self._head_kwargs())
        empty = (count_S == 0).nonzero().squeeze(1)
        if empty.numel():
            raise ValueError(f"completions {empty[:5].tolist()} have no response token "
                             f"(labels all -100)")
        return logp_S

    def forward(self, input_ids, labels, position_ids, document_lengths, sequence_ids,
                desirable, ref_logps=None, kl_reference=None, *, logps_only: bool = False):
        args = (input_ids, labels, position_ids, document_lengths, sequence_ids)
        if logps_only:
            return self._logps(*args)
        if self.reference == "lora_base":
            ref_logps = self._lora_reference(self._logps, *args)
        policy = self._logps(*args)
        if policy.shape != desirable.shape:
            raise ValueError(f"{policy.shape[0]} packed completions but {desirable.shape[0]} "
                             f"labels")
        cfg = self.cfg
        loss, m = kto_loss(policy, ref_logps.to(policy.device), desirable,
                           float(kl_reference), beta=cfg.beta,
                           desirable_weight=cfg.knob("desirable_weight"),
                           undesirable_weight=cfg.knob("undesirable_weight"), reduction="sum")
        n = policy.shape[0]
        n_good, n_bad = m["num_desirable"], m["num_undesirable"]
        return loss, {"accuracy": m["accuracy"] * n, "log_ratio": m["log_ratio"] * n,
                      "logps": policy.detach().sum(),
                      "rewards_desirable": m["rewards_desirable"] * n_good,
                      "desirable": n_good,
                      "rewards_undesirable": m["rewards_undesirable"] * n_bad,
                      "undesirable": n_bad}
