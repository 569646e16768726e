"""Direct preference optimization and its variants, on per-sequence log-probs.

For a pair (x, y_c, y_r) of a chosen and a rejected response, with log-probs summed over the
response tokens under the policy pi and the frozen reference model,

    h = [log pi(y_c|x) - log ref(y_c|x)] - [log pi(y_r|x) - log ref(y_r|x)]

and the per-pair losses (beta > 0, eps = label_smoothing):

    sigmoid  -(1 - eps) log s(beta h) - eps log s(-beta h)          DPO, Rafailov et al. 2023
             (eps > 0: conservative DPO, Mitchell 2023, "A note on DPO with noisy preferences")
    robust   [-(1 - eps) log s(beta h) + eps log s(-beta h)] / (1 - 2 eps)
             (unbiased under preference flips with rate eps; Chowdhury et al. 2024, rDPO)
    ipo      (h - 1 / (2 beta))^2                                   IPO, Azar et al. 2023
    hinge    max(0, 1 - beta h)                                     SLiC, Zhao et al. 2023

with s the logistic sigmoid. The implicit rewards are r = beta (log pi - log ref) per response.
The reference-free pair losses are in `posttrain.losses.simpo` and `posttrain.losses.orpo`, the
loss on unpaired completions in `posttrain.losses.kto`; they share this module's log-probs
(`packed_sequence_logps`: every packed sequence's, which `dpo_pair_logps` pairs up).

Packed pairs (`dpo_pair_logps`). The chosen and rejected responses of a pair are two separate
*sequences* (documents) somewhere in the batch, packed or padded, written by the data layer with
the packing conventions (`posttrain.data.packing`: labels shifted, -100 on prompts, document ends
and padding). Two tensors tie them together:

* ``sequence_ids_BT`` int64 [B, T]: the batch-wide index s of the sequence each position belongs
  to (0 .. S-1, numbered in any order), or -1 for positions of no sequence (the pad tail). With
  one sequence per padded row it is simply ``arange(B)[:, None]`` broadcast (pad tail: -1 or the
  row's index, its labels are -100 either way). `sequence_ids` builds it from `collate`'s
  ``document_lengths`` / ``row_num_pad``, numbering documents row by row, left to right.
* ``pair_index_P2`` int64 [P, 2]: row p is (s_chosen, s_rejected), the sequence indices of pair
  p's chosen and rejected responses.

The log-probs come from `chunked_logprobs`, so no [tokens, vocab] logits are ever held.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from posttrain.ops.cross_entropy import IGNORE_INDEX, chunked_logprobs

__all__ = ["dpo_loss", "dpo_pair_logps", "packed_sequence_logps", "sequence_ids",
           "sequence_logps", "mean_or_zero", "reduce_losses", "reward_metrics", "wide"]

LossType = Literal["sigmoid", "ipo", "hinge", "robust"]


def sequence_logps(token_logp_BT: torch.Tensor, loss_mask_BT: torch.Tensor, *,
                   reduction: Literal["sum", "mean"] = "sum") -> torch.Tensor:
    """Per-row log-prob of the response: sum (or mean) of `token_logp_BT` where the mask is set.

    `loss_mask_BT` is bool or 0/1. "mean" divides by the row's number of response tokens (a row
    without any gives 0). Returns fp32 [B] (fp64 for fp64 input).
    """
    if token_logp_BT.shape != loss_mask_BT.shape:
        raise ValueError(f"token_logp_BT {tuple(token_logp_BT.shape)} and loss_mask_BT "
                         f"{tuple(loss_mask_BT.shape)} must have the same shape")
    mask_BT = loss_mask_BT.bool()
    # where, not multiply: a masked position may hold -inf or NaN (e.g. an unmasked pad logit).
    logp_B = wide(token_logp_BT).where(mask_BT, 0.0).sum(-1)
    if reduction == "mean":
        return logp_B / mask_BT.sum(-1).clamp(min=1)
    if reduction != "sum":
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    return logp_B


def dpo_loss(policy_chosen_B: torch.Tensor, policy_rejected_B: torch.Tensor,
             ref_chosen_B: torch.Tensor, ref_rejected_B: torch.Tensor, *, beta: float,
             loss_type: LossType = "sigmoid", label_smoothing: float = 0.0,
             reduction: Literal["mean", "sum"] = "mean",
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Preference loss over B pairs from per-sequence log-probs (formulas in the module docstring).

    Args:
        policy_chosen_B, policy_rejected_B: log pi(y|x) of the chosen / rejected responses
            (differentiable).
        ref_chosen_B, ref_rejected_B: the same under the frozen reference (no gradient flows).
        beta: inverse temperature of the implicit reward (the KL weight); for IPO it is the
            paper's tau, and the target log-ratio margin is 1 / (2 beta).
        loss_type: "sigmoid" (DPO / cDPO), "ipo", "hinge" (SLiC) or "robust" (rDPO).
        label_smoothing: eps, the assumed rate of flipped preference labels, for "sigmoid"
            (in [0, 0.5]) and "robust" (in [0, 0.5)); must be 0 for "ipo" and "hinge".
        reduction: "mean" over pairs, or "sum" (divide by the step's global pair count yourself,
            so that gradient accumulation matches one big batch).

    IPO and length: the IPO loss pulls h to a fixed 1 / (2 beta) whatever the response lengths,
    so with *summed* log-probs its strength depends on length. Like TRL, we recommend feeding IPO
    per-token *mean* log-probs (``reduction="mean"`` in `sequence_logps` / `dpo_pair_logps`);
    this function takes whatever it is given and does not average.

    Returns:
        (loss, metrics): loss is an fp32 scalar (fp64 for fp64 inputs); metrics are detached
        scalars, means over pairs: ``rewards_chosen`` and ``rewards_rejected``
        (beta (log pi - log ref)), ``margins`` (their difference) and ``accuracy`` (fraction
        with rewards_chosen > rewards_rejected; a tie counts as wrong).
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    shape = policy_chosen_B.shape
    for name, t in (("policy_rejected_B", policy_rejected_B), ("ref_chosen_B", ref_chosen_B),
                    ("ref_rejected_B", ref_rejected_B)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, policy_chosen_B "
                             f"{tuple(shape)}; all four must be [B]")
    eps = float(label_smoothing)
    if loss_type in ("ipo", "hinge") and eps != 0.0:
        raise ValueError(f"label_smoothing applies to loss_type 'sigmoid' and 'robust' only; "
                         f"got {eps} with {loss_type!r} (set it to 0)")
    if loss_type == "sigmoid" and not 0.0 <= eps <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5] for 'sigmoid', got {eps}")
    if loss_type == "robust" and not 0.0 <= eps < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) for 'robust' (it divides by "
                         f"1 - 2 eps), got {eps}")

    chosen_ratio_B = wide(policy_chosen_B) - wide(ref_chosen_B).detach()
    rejected_ratio_B = wide(policy_rejected_B) - wide(ref_rejected_B).detach()
    h_B = chosen_ratio_B - rejected_ratio_B
    if loss_type == "sigmoid":
        losses_B = -(1 - eps) * F.logsigmoid(beta * h_B) - eps * F.logsigmoid(-beta * h_B)
    elif loss_type == "robust":
        losses_B = ((1 - eps) * -F.logsigmoid(beta * h_B)
                    + eps * F.logsigmoid(-beta * h_B)) / (1 - 2 * eps)
    elif loss_type == "ipo":
        losses_B = (h_B - 1 / (2 * beta)).square()
    elif loss_type == "hinge":
        losses_B = torch.relu(1 - beta * h_B)
    else:
        raise ValueError(f"loss_type must be one of 'sigmoid', 'ipo', 'hinge', 'robust'; "
                         f"got {loss_type!r}")
    return reduce_losses(losses_B, reduction), reward_metrics(beta * chosen_ratio_B,
                                                             beta * rejected_ratio_B)


def dpo_pair_logps(hidden_BTH: torch.Tensor, head_weight_VH: torch.Tensor,
                   labels_BT: torch.Tensor, pair_index_P2: torch.Tensor,
                   sequence_ids_BT: torch.Tensor, *, real_vocab_size: int | None = None,
                   chunk_tokens: int = 1024, softcap: float | None = None,
                   temperature: float = 1.0, reduction: Literal["sum", "mean"] = "sum",
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair log-probs (chosen_P, rejected_P) of responses packed as separate sequences.

    Args:
        hidden_BTH: final hidden states ([N, H] with [N] ids also works).
        head_weight_VH: LM head [V_padded, H].
        labels_BT: shifted targets, -100 where no response token is predicted.
        pair_index_P2: (s_chosen, s_rejected) per pair; see the module docstring.
        sequence_ids_BT: sequence index per position, -1 outside any sequence.
        reduction: "sum" of the response tokens' log-probs, or their per-token "mean" (for IPO,
            and the length-normalised losses SimPO and ORPO).

    Run it under `torch.no_grad()` with the reference model's hidden states for ref log-probs.
    Raises ValueError if a paired sequence has no response token (truncated away?), if a
    labelled position belongs to no sequence, or if `pair_index_P2` names an unknown sequence.
    Returns two fp32 [P] tensors, differentiable in `hidden_BTH` and `head_weight_VH`.
    """
    if pair_index_P2.dim() != 2 or pair_index_P2.shape[1] != 2:
        raise ValueError(f"pair_index_P2 must be [P, 2] (chosen, rejected sequence index), got "
                         f"{tuple(pair_index_P2.shape)}")
    logp_S, count_S = packed_sequence_logps(
        hidden_BTH, head_weight_VH, labels_BT, sequence_ids_BT, real_vocab_size=real_vocab_size,
        chunk_tokens=chunk_tokens, softcap=softcap, temperature=temperature, reduction=reduction)
    num_seq = logp_S.shape[0]
    pairs = pair_index_P2.long().to(logp_S.device)
    if pairs.numel() and (int(pairs.min()) < 0 or int(pairs.max()) >= num_seq):
        raise ValueError(f"pair_index_P2 must hold sequence indices in [0, {num_seq}), found "
                         f"[{int(pairs.min())}, {int(pairs.max())}]")
    empty = (count_S.index_select(0, pairs.reshape(-1)) == 0).nonzero()
    if empty.numel():
        bad = pairs.reshape(-1)[empty.squeeze(1)][:5].tolist()
        raise ValueError(f"paired sequences {bad} have no response token (labels all -100); "
                         f"drop the pair or keep more of the response when truncating")
    return logp_S.index_select(0, pairs[:, 0]), logp_S.index_select(0, pairs[:, 1])


def packed_sequence_logps(hidden_BTH: torch.Tensor, head_weight_VH: torch.Tensor,
                          labels_BT: torch.Tensor, sequence_ids_BT: torch.Tensor, *,
                          real_vocab_size: int | None = None, chunk_tokens: int = 1024,
                          softcap: float | None = None, temperature: float = 1.0,
                          reduction: Literal["sum", "mean"] = "sum",
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_S, count_S): each packed sequence's response log-prob, summed (or the per-token
    "mean") over its labelled positions, and its number of response tokens, for the sequences
    0 .. S-1 that `sequence_ids_BT` numbers (S = its largest id + 1). A sequence without a
    response token gets log-prob 0 and count 0. Raises ValueError if a labelled position
    belongs to no sequence (id -1)."""
    if sequence_ids_BT.shape != labels_BT.shape:
        raise ValueError(f"sequence_ids_BT {tuple(sequence_ids_BT.shape)} must have the shape of "
                         f"labels_BT {tuple(labels_BT.shape)}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    token_logp_BT = chunked_logprobs(hidden_BTH, head_weight_VH, labels_BT,
                                     real_vocab_size=real_vocab_size, chunk_tokens=chunk_tokens,
                                     softcap=softcap, temperature=temperature)
    seq_N = sequence_ids_BT.reshape(-1).long()
    labelled_N = labels_BT.reshape(-1) != IGNORE_INDEX
    if bool((labelled_N & (seq_N < 0)).any()):
        raise ValueError("labels_BT has targets at positions whose sequence_ids_BT is -1; pad "
                         "positions must carry label -100")
    num_seq = max(int(seq_N.max()) + 1 if seq_N.numel() else 0, 0)
    kept = labelled_N.nonzero().squeeze(1)
    seq_K = seq_N.index_select(0, kept)
    logp_S = token_logp_BT.new_zeros(num_seq).index_add(
        0, seq_K, token_logp_BT.reshape(-1).index_select(0, kept))
    count_S = torch.zeros(num_seq, dtype=torch.int64, device=seq_N.device).index_add_(
        0, seq_K, torch.ones_like(seq_K))
    if reduction == "mean":
        logp_S = logp_S / count_S.clamp(min=1)
    return logp_S, count_S


def sequence_ids(document_lengths: list[list[int]], row_num_pad: list[int],
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """``sequence_ids_BT`` for a collated batch: documents numbered row by row, left to right,
    from 0; the pad tail of each row (its last segment when ``row_num_pad`` > 0) is -1."""
    rows, next_id = [], 0
    for lengths, num_pad in zip(document_lengths, row_num_pad, strict=True):
        docs = lengths[:-1] if num_pad else lengths
        ids = list(range(next_id, next_id + len(docs))) + ([-1] if num_pad else [])
        next_id += len(docs)
        rows.append(torch.repeat_interleave(torch.tensor(ids, dtype=torch.int64),
                                            torch.tensor(lengths, dtype=torch.int64)))
    if len({r.numel() for r in rows}) > 1:
        raise ValueError("document_lengths must sum to the same row length in every row")
    return torch.stack(rows).to(device)


def reduce_losses(losses_B: torch.Tensor, reduction: str) -> torch.Tensor:
    """The mean (0 when there are none) or the sum of per-pair (per-completion) losses."""
    if reduction == "mean":
        return losses_B.mean() if losses_B.numel() else losses_B.sum()
    if reduction != "sum":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return losses_B.sum()


@torch.no_grad()
def reward_metrics(rewards_chosen_B: torch.Tensor, rewards_rejected_B: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    """Detached means over pairs: ``rewards_chosen``, ``rewards_rejected``, ``margins`` (their
    difference) and ``accuracy`` (the fraction with margin > 0; a tie counts as wrong)."""
    margins_B = rewards_chosen_B - rewards_rejected_B
    return {"rewards_chosen": mean_or_zero(rewards_chosen_B),
            "rewards_rejected": mean_or_zero(rewards_rejected_B),
            "margins": mean_or_zero(margins_B),
            "accuracy": mean_or_zero((margins_B > 0).float())}


def wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 log-probs are too coarse to subtract); fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def mean_or_zero(x: torch.Tensor) -> torch.Tensor:
    return x.mean() if x.numel() else x.new_zeros(())
